"""TensorBoard scalars and hyperparameters (the `[tensorboard]` extra)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from cadence.callbacks.metrics import flat_config, is_main
from cadence.engine.callback import Callback
from cadence.engine.order import Order
from cadence.run import config as config_module
from cadence.run.registry import require

if TYPE_CHECKING:
    from cadence.engine.engine import Engine


@attrs.define(kw_only=True)
class TensorBoardConfig:
    """Where and how `TensorBoard` writes.

    Attributes:
        log_dir: the event file folder; None: `run_dir/tensorboard/{timestamp}/`,
            the timestamp of the run's first start (kept across resumes).
        hparams: record the flattened run config once as hyperparameters
            (HPARAMS tab) and as YAML text (TEXT tab).
        flush_secs: how often the writer flushes on its own (it always flushes at teardown).
    """

    log_dir: str | None = None
    hparams: bool = True
    flush_secs: int = attrs.field(default=30, validator=attrs.validators.ge(1))


def tag(name: str) -> str:
    """The TensorBoard / W&B tag of a metric: dots become slashes (`val.loss` -> `val/loss`), which groups them."""
    return name.replace(".", "/")


class TensorBoard(Callback):
    """Writes `engine.logged` at every `on_log` as scalars at `state.step` (main process only).

    The folder is fixed when a fit starts (after any checkpoint restore) and
    kept in the callback state, so a resumed run continues the same TensorBoard
    run even from a checkpoint older than its first log. The writer opens at the
    first `on_log` and closes, flushed, at teardown; it reopens with
    `purge_step` = the restored step + 1, so readers drop the events the
    stopped run wrote after its checkpoint: steps strictly increase, no duplicates.
    The hyperparameters are one session per folder: written at the first log
    unless the state says so or the folder's event files already hold them.

    Order: `Order.LOGGER` (90).

    Example:
        >>> import torch, cadence
        >>> from cadence.callbacks.tensorboard import TensorBoard
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 4
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...                         loss_fn=torch.nn.functional.mse_loss, log_interval=2,
        ...                         callbacks=[TensorBoard(log_dir="/tmp/doc-tb")], seed=0)
        >>> engine.fit(steps=4)  # doctest: +SKIP
    """

    order = Order.LOGGER
    raises_requests = False

    def __init__(self, config: TensorBoardConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(TensorBoardConfig, config, kwargs, "TensorBoard")
        require("tensorboard", "tensorboard")
        self.log_dir: Path | None = Path(self.config.log_dir) if self.config.log_dir else None
        self.writer: Any = None
        self._hparams_written = False
        self._start_step: int | None = None  # the step of a (re)start: events after it are purged

    # -- state --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"log_dir": str(self.log_dir) if self.log_dir else None, "hparams_written": self._hparams_written}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.config.log_dir is None and state.get("log_dir"):
            self.log_dir = Path(state["log_dir"])
        self._hparams_written = bool(state.get("hparams_written", False))

    # -- events -------------------------------------------------------------------

    def on_fit_start(self, engine: Engine) -> None:
        if self.writer is None:
            self._start_step = engine.state.step
        if self.log_dir is None and is_main(engine):
            # Fixed now, not at the first log, so a checkpoint saved before it
            # still names the folder the resumed run must continue.
            self.log_dir = engine.run_dir / "tensorboard" / engine.attempt_timestamp

    def on_load(self, engine: Engine) -> None:
        self._close()  # reopen with a purge at the restored step
        self._start_step = engine.state.step

    def on_log(self, engine: Engine) -> None:
        if not is_main(engine) or not engine.logged:
            return
        writer = self.writer or self._open(engine)
        step = engine.state.step
        for name, value in engine.logged.items():
            writer.add_scalar(tag(name), value, step)

    def on_teardown(self, engine: Engine) -> None:
        self._close()

    # -- the writer ---------------------------------------------------------------

    def _open(self, engine: Engine) -> Any:
        require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        if self.log_dir is None:
            self.log_dir = engine.run_dir / "tensorboard" / engine.attempt_timestamp
        start = self._start_step if self._start_step is not None else engine.state.step
        continuing = self.log_dir.exists() and any(self.log_dir.iterdir())
        self.writer = SummaryWriter(
            log_dir=str(self.log_dir),
            purge_step=start + 1 if continuing else None,
            flush_secs=self.config.flush_secs,
        )
        self._start_step = None
        if continuing and not self._hparams_written:
            # Restored from a checkpoint saved before the first log: the stopped run may have written them.
            self._hparams_written = hparams_on_disk(self.log_dir)
        if self.config.hparams and not self._hparams_written:
            self._write_hparams(engine)
        return self.writer

    def _write_hparams(self, engine: Engine) -> None:
        from torch.utils.tensorboard.summary import hparams

        from cadence.run.config import canonical_yaml

        flat = flat_config(engine.run_config)
        experiment, start, end = hparams(flat, {tag(name): 0.0 for name in engine.logged})
        file_writer = self.writer._get_file_writer()
        for summary in (experiment, start, end):
            file_writer.add_summary(summary, engine.state.step)
        try:
            text = canonical_yaml(engine.run_config)
        except Exception:  # a run config the YAML writer cannot render: the HPARAMS tab has it
            text = "\n".join(f"{k}: {v}" for k, v in flat.items())
        self.writer.add_text("config", "```\n" + text + "\n```", engine.state.step)
        self._hparams_written = True

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None


def hparams_on_disk(log_dir: Path, head: int = 8) -> bool:
    """Whether an event file in `log_dir` starts with an hparams session (`TensorBoard` writes it on open)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    for path in sorted(log_dir.glob("*tfevents*")):
        try:
            for i, event in enumerate(EventFileLoader(str(path)).Load()):
                if i >= head:  # file version, purge marker, the hparams: they come first or not at all
                    break
                if any(value.metadata.plugin_data.plugin_name == "hparams" for value in event.summary.value):
                    return True
        except Exception:  # a torn file from a crash: what it holds is unreadable, so not a session
            continue
    return False


__all__ = ["TensorBoard", "TensorBoardConfig", "tag"]
