"""Checks of what a user hands the engine, made before anything starts.

`Engine()` runs the argument checks before its backend starts (under DDP, the
process group) and `fit()` runs the rest before the first step, so a wrong
argument is one clear error naming it, never a torch error deep in the loop
or a process group left behind. Input that is legal but almost surely a
mistake is one warning.
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from cadence.engine.data import DataConfig

#: Engine's own arguments, for the hint on an unknown keyword.
ENGINE_ARGUMENTS = (
    "model",
    "optimizer",
    "train_data",
    "loss_fn",
    "step_fn",
    "eval_fn",
    "scheduler",
    "eval_data",
    "predict_data",
    "callbacks",
    "backend",
    "config",
    "run_config",
)


def check_keywords(overrides: Mapping[str, Any], config_fields: Sequence[str]) -> None:
    """Keywords that are neither Engine arguments nor EngineConfig fields: a TypeError with the closest names."""
    for key in overrides:
        if key in config_fields:
            continue
        if "data" in key or "loader" in key:
            hint = "pass training data as train_data= (the third positional argument), and eval_data= / predict_data="
        else:
            close = difflib.get_close_matches(key, [*ENGINE_ARGUMENTS, *config_fields], n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}=?" if close else f"EngineConfig fields are: {', '.join(config_fields)}"
        raise TypeError(f"Engine() got an unexpected keyword argument {key!r}: {hint}")


def check_model(model: Any, optimizers: Sequence[Any], loss_fn: Any, step_fn: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and step_fn is not None:
        raise ValueError("give loss_fn or step_fn, not both")
    for name, fn in (("loss_fn", loss_fn), ("step_fn", step_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__} {fn!r}")
    for optimizer in optimizers:
        if not callable(getattr(optimizer, "step", None)) or isinstance(optimizer, (str, type)):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer instance, got {_describe(optimizer)}")
    if optimizers and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"model {type(model).__name__} has no parameter that requires a gradient, so there is nothing to train; "
            "check the model was built (lazy modules: run one forward first) and not frozen, or drop the optimizer "
            "to only evaluate"
        )


def check_schedulers(schedulers: Sequence[Any]) -> None:
    for scheduler in schedulers:
        if isinstance(scheduler, (str, type)) or not callable(getattr(scheduler, "step", None)):
            raise TypeError(
                f"scheduler must be an LR scheduler instance with a step() method, e.g. "
                f"torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=...); got {_describe(scheduler)}"
            )


def check_data(split: str, data: Any, config: DataConfig) -> None:
    """The data of `split` (train, eval, predict) is usable: a Dataset or an iterable, not empty, its settings used."""
    argument = f"{split}_data"
    if not isinstance(data, (torch.utils.data.Dataset, Iterable)) or isinstance(data, (str, bytes, Mapping)):
        raise TypeError(
            f"{argument} must be a torch Dataset, a DataLoader or an iterable of batches; got {_describe(data)}"
        )
    if not isinstance(data, torch.utils.data.Dataset) and config != DataConfig():
        changed = {k: v for k, v in _fields(config).items() if _fields(DataConfig()).get(k) != v}
        raise ValueError(
            f"{split}={changed} is set, but {argument} is a {type(data).__name__}, which is used as given and "
            f"ignores it: pass the Dataset itself so the engine builds the loader, or set these on your loader"
        )
    try:
        size = len(data)  # type: ignore[arg-type]
    except TypeError:  # an iterable without a length: found out when iterated
        return
    if size == 0:
        raise ValueError(f"{argument} is empty ({type(data).__name__} of length 0): there is nothing to iterate")


def is_one_shot(data: Any) -> bool:
    """A generator or other iterator: iterating it again yields nothing."""
    return isinstance(data, Iterator)


def check_one_shot(data: Any, epochs_left: float) -> None:
    if is_one_shot(data) and math.isfinite(epochs_left) and epochs_left > 1:
        raise ValueError(
            f"train_data is a one-shot iterator ({type(data).__name__}): it is exhausted after one epoch, and this "
            f"fit trains {epochs_left:g} epochs; pass a Dataset, a DataLoader or a list, or fit(steps=...) within "
            "one pass"
        )


def warn_unsharded(split: str, data: Any, data_size: int) -> None:
    """A DataLoader of a map-style dataset without a distributed sampler gives every rank all the data."""
    if data_size <= 1 or not isinstance(data, torch.utils.data.DataLoader):
        return
    if isinstance(data.dataset, torch.utils.data.IterableDataset) or hasattr(data.sampler, "num_replicas"):
        return
    warnings.warn(
        f"{split}_data is a DataLoader without a distributed sampler: each of the {data_size} data ranks iterates "
        "the whole dataset. Pass the Dataset itself (the engine shards it) or give the loader a "
        "DistributedSampler",
        UserWarning,
        stacklevel=4,
    )


def check_order_targets(callbacks: Sequence[Any], key: Any) -> None:
    """Every `after` / `before` name is a registered callback's state_key (checked when a run starts)."""
    from cadence.engine.bus import OrderError, order_constraints

    keys = [key(c) for c in callbacks]
    for callback in callbacks:
        for attribute in ("after", "before"):
            for name in order_constraints(callback, attribute):
                if name not in keys:
                    close = difflib.get_close_matches(str(name), keys, n=1)
                    hint = f"did you mean {close[0]!r}?" if close else f"registered: {', '.join(keys)}"
                    raise OrderError(
                        f"callback {key(callback)!r} has {attribute}=({name!r},), but no registered callback has "
                        f"state_key {name!r}; {hint}"
                    )


def explain(engine: Any, error: BaseException) -> BaseException | None:
    """A clearer error for a torch error whose cause is the user's input (None: keep `error`)."""
    loss = engine.loss
    if (
        isinstance(error, RuntimeError)
        and "only for scalar outputs" in str(error)
        and isinstance(loss, torch.Tensor)
        and loss.ndim
    ):
        where = "loss_fn" if engine.loss_fn is not None else "step_fn" if engine.step_fn is not None else "the model"
        return TypeError(
            f"{where} returned a loss of shape {tuple(loss.shape)}; the loss must be a scalar tensor: reduce it "
            "(e.g. .mean(), or reduction='mean' for torch losses)"
        )
    return None


def _fields(config: DataConfig) -> dict[str, Any]:
    import attrs

    return attrs.asdict(config)


def _describe(value: Any) -> str:
    if isinstance(value, type):
        return f"the class {value.__qualname__} (pass an instance)"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) < 60 else text[:57] + '...'}"
