"""The engine's data by split: `engine.data["train"]`, `engine.data["val"]`, ...

Each split is a `DataSource` built for this process's data shard (the
backend's `data_shard(split)`), seeded with the run's seed, with the loader
settings of its split (`EngineConfig.train`, `.predict`, `.eval`, or an
evaluation set's own `eval_sets[split].data`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from cadence.engine import checks
from cadence.engine.data import DataConfig, DataSource
from cadence.engine.evaluator import split_name

if TYPE_CHECKING:
    from cadence.engine.config import EngineConfig
    from cadence.engine.engine import Engine


def eval_sets(eval_data: Any) -> dict[str, Any]:
    """`{split: data}` from `Engine(eval_data=...)`: data alone is the `val` split."""
    if eval_data is None:
        return {}
    if isinstance(eval_data, Mapping):
        sets = {split_name(split): data for split, data in eval_data.items()}
        missing = [split for split, data in sets.items() if data is None]
        if missing:
            raise ValueError(f"eval_data: no data for split(s) {missing}")
        return sets
    return {"val": eval_data}


def check_eval_sets(config: EngineConfig, sets: Mapping[str, Any]) -> None:
    """Every set's data, and the config's `eval_sets` naming only sets there are (before any process group starts)."""
    for data in sets.values():
        checks.check_data("eval", data, config.eval)
    unknown = sorted(set(config.eval_sets) - set(sets))
    if unknown:
        raise ValueError(
            f"config eval_sets.{unknown[0]}: eval_data has no split {unknown[0]!r} (it has {sorted(sets)}); "
            "name the sets alike in eval_data={...} and the config"
        )


class DataSources(dict[str, DataSource]):
    """The engine's `DataSource`s by split, and the ones a call's own data needs.

    Args:
        engine: the engine whose config, seed and backend each source is built with (read when it is built:
            a restore may replace a drawn seed).
    """

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        #: The evaluation sets' split names, in the order they are evaluated.
        self.eval_splits: tuple[str, ...] = ()

    def add(self, split: str, data: Any) -> None:
        """Build `split`'s source from `data` (an evaluation set's when `split` is not train or predict)."""
        self[split] = self.build(data, split)
        if split not in ("train", "predict"):
            self.eval_splits += (split,)

    def build(self, data: Any, split: str) -> DataSource:
        """A source of `data` for `split`, with that split's loader settings, on this process's data shard."""
        config = self.loader_config(split)
        if split == "train" and config.shuffle is None:
            config = attrs.evolve(config, shuffle=True)
        engine = self.engine
        device = engine.backend.device
        data_rank, data_size = engine.backend.data_shard(split)
        checks.warn_unsharded(split, data, data_size)
        return DataSource(
            data,
            config,
            split=split,
            seed=engine.seed,
            data_rank=data_rank,
            data_size=data_size,
            pin_memory_device=device.type if device.type != "cpu" else "",
        )

    def loader_config(self, split: str) -> DataConfig:
        """The loader settings of `split`: train, predict, or an evaluation set's own (else `eval`'s)."""
        config = self.engine.config
        if split in ("train", "predict"):
            settings: DataConfig = getattr(config, split)
            return settings
        own = config.eval_sets.get(split)
        return own.data if own is not None and own.data is not None else config.eval

    def train(self) -> DataSource:
        """The training source of a fit, checked: there is one, and a one-shot iterable is not asked for two epochs."""
        engine = self.engine
        if "train" not in self:
            raise ValueError("fit() needs train_data: pass it to Engine(...)")
        if not engine.optimizers:
            raise ValueError("fit() needs an optimizer: pass it to Engine(...)")
        source = self["train"]
        checks.check_one_shot(source.loader, engine.fit_target[1] - engine.state.epoch)
        return source

    def predict(self, data: Any) -> DataSource:
        """The source `predict(data)` runs over: `data`'s, or the predict data's."""
        if data is not None:
            return self.build(data, "predict")
        if "predict" not in self:
            raise ValueError("no predict data: pass predict_data to Engine(...) or data to this call")
        return self["predict"]

    def evaluation(self, data: Any, split: str) -> DataSource:
        """The source `evaluate(data, split)` runs over: `data`'s, the set `split`, or the only set."""
        if data is not None:
            return self.build(data, split)
        if split in self.eval_splits:
            return self[split]
        if not self.eval_splits:
            raise ValueError("no eval data: pass eval_data to Engine(...) or data to this call")
        if len(self.eval_splits) == 1:  # the one set, its results named `split`
            return self[self.eval_splits[0]]
        raise ValueError(f"no evaluation set {split!r}: the engine has {list(self.eval_splits)}")
