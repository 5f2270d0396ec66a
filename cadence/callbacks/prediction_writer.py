"""Per-rank prediction shards, for outputs too big to gather on one process."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from cadence.engine.backend import move_to
from cadence.engine.callback import Callback
from cadence.engine.evaluation import concat_outputs
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine


@attrs.define(kw_only=True)
class PredictionWriterConfig:
    """Where and how often `PredictionWriter` writes.

    Attributes:
        dir: the folder of the shards; None: `engine.run_dir / "predictions"`.
        batches_per_file: batches kept in memory before they are written as one shard file.
    """

    dir: str | None = None
    batches_per_file: int = attrs.field(default=100, validator=attrs.validators.ge(1))


class PredictionWriter(Callback):
    """Writes each rank's `predict()` outputs to its own shard files as they come.

    Every `batches_per_file` batches (and at the end of `predict()`), each
    rank writes `rank{rank:05d}-{part:05d}.pt` holding
    `{"outputs": [...], "indices": [...]}`: the batches' outputs on the CPU and
    their samples' dataset indices (`engine.batch_indices`, None when
    unknown). A file is written under a temporary name and renamed, so a
    shard is complete or absent; a new `predict()` first removes the rank's
    previous shards. `read_predictions(dir)` joins them in dataset order.
    Nothing is gathered: memory stays at one shard per rank.

    Order: `Order.LOGGER` (90).

    Example:
        >>> import torch, cadence
        >>> from cadence.callbacks.prediction_writer import PredictionWriter, read_predictions
        >>> model = torch.nn.Linear(4, 2)
        >>> data = torch.utils.data.TensorDataset(torch.randn(10, 4))
        >>> writer = PredictionWriter(dir="preds", batches_per_file=2)
        >>> engine = cadence.Engine(model, callbacks=[writer], predict={"batch_size": 3}, seed=0)
        >>> _ = engine.predict(data)
        >>> sorted(p.name for p in writer.directory.iterdir())
        ['rank00000-00000.pt', 'rank00000-00001.pt']
        >>> read_predictions("preds").shape
        torch.Size([10, 2])
    """

    order = Order.LOGGER
    raises_requests = False

    def __init__(self, config: PredictionWriterConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(PredictionWriterConfig, config, kwargs, "prediction_writer")
        self.directory: Path | None = None
        self._outputs: list[Any] = []
        self._indices: list[list[int] | None] = []
        self._part = 0
        self._rank = 0

    def on_predict_start(self, engine: Engine) -> None:
        self.directory = Path(self.config.dir) if self.config.dir else engine.run_dir / "predictions"
        self.directory.mkdir(parents=True, exist_ok=True)
        self._rank = engine.backend.rank
        for old in self.directory.glob(f"rank{self._rank:05d}-*.pt"):
            old.unlink()
        self._outputs, self._indices, self._part = [], [], 0

    def on_predict_batch(self, engine: Engine) -> None:
        self._outputs.append(move_to(_detached(engine.outputs), torch.device("cpu")))
        self._indices.append(engine.batch_indices)
        if len(self._outputs) >= self.config.batches_per_file:
            self._write()

    def on_predict_end(self, engine: Engine) -> None:
        self._write()

    def _write(self) -> None:
        if not self._outputs or self.directory is None:
            return
        path = self.directory / f"rank{self._rank:05d}-{self._part:05d}.pt"
        temporary = path.with_name(path.name + ".tmp")
        torch.save({"outputs": self._outputs, "indices": self._indices}, temporary)
        os.replace(temporary, path)
        self._outputs, self._indices = [], []
        self._part += 1


def read_predictions(directory: str | os.PathLike[str]) -> Any:
    """Every shard under `directory` joined along the first dimension, in dataset order when known.

    Dataset order needs every batch's indices; without them the shards are
    joined in rank order, then part order.
    """
    paths = sorted(Path(directory).glob("rank*-*.pt"))
    if not paths:
        raise FileNotFoundError(f"no prediction shards (rank*-*.pt) in {directory}")
    outputs: list[Any] = []
    indices: list[list[int] | None] = []
    for path in paths:
        shard = torch.load(path, weights_only=True)
        outputs.extend(shard["outputs"])
        indices.extend(shard["indices"])
    joined = concat_outputs(outputs, "read_predictions")
    if any(batch is None for batch in indices):
        return joined
    order = torch.tensor([i for batch in indices for i in batch]).argsort()  # type: ignore[union-attr]
    return _take(joined, order)


def _take(tree: Any, order: torch.Tensor) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree[order]
    if isinstance(tree, Mapping):
        return type(tree)((key, _take(value, order)) for key, value in tree.items())  # type: ignore[call-arg]
    items = [_take(item, order) for item in tree]
    return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)


def _detached(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach()
    if isinstance(tree, Mapping):
        return type(tree)((key, _detached(value)) for key, value in tree.items())  # type: ignore[call-arg]
    if isinstance(tree, (tuple, list)):
        items = [_detached(item) for item in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree
