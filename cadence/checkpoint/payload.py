"""Building a checkpoint's payload and restoring an engine from one.

`build_payload` assembles what a resume needs and `restore` puts it back,
validating everything before it changes the engine. Reading a checkpoint from
a path (`load_checkpoint`, `from_checkpoint`) is in `cadence.checkpoint.launch_modes`.

Payload (a dict): `format`, `version`, `meta` (step, epoch, world size...),
`engine` (State), `model`, `optimizers`, `schedulers`, `data` (the train
position per data rank), `rng` (per rank), `callbacks` (by `state_key`) and
`config` (the engine config and the run config). See docs/checkpoints.md.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from cadence.checkpoint.params import recorded, select
from cadence.checkpoint.store import FORMAT, VERSION, CheckpointError
from cadence.engine.events import Event
from cadence.engine.state import State, capture_rng, restore_rng
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.checkpoint")

#: Payload key a store sets when its `read` already restored model and optimizer
#: (DeepSpeed's engine loads its own checkpoint): `restore` then leaves them alone.
RESTORED_BY_STORE = "restored_by_store"

#: Engine config fields that give the saved data position its meaning.
DATA_FIELDS = ("grad_accum", "train.batch_size", "train.drop_last")


def stateful_callbacks(engine: Engine) -> dict[str, Any]:
    """Registered callbacks that have state, by `state_key`."""
    found = {}
    for callback in engine.callbacks:
        has_state = getattr(callback, "has_state", None)
        if callable(has_state):
            if not has_state():
                continue
        elif not callable(getattr(callback, "state_dict", None)):
            continue
        found[callback.state_key] = callback
    return found


def build_payload(engine: Engine, *, model: bool = True, params: str = "all") -> dict[str, Any]:
    """Everything a bitwise resume needs, as references (no copies).

    `model=False` leaves model and optimizer states out (empty) for a store
    that saves them itself (`CheckpointStore.restores_model`); `params="trainable"`
    keeps only trainable parameters (`cadence.checkpoint.params`).

    A collective: every rank must call it. The train position is gathered
    over the data domain (one entry per data rank, indexed by `data_rank` on
    restore; ranks of one data rank, e.g. tensor-parallel peers, hold the same
    position), the RNG over the optimizer domain (one entry per rank, which is
    every rank on DDP and a mesh). What a rank saves of its train data is
    `DataSource.position`.
    """
    backend, state = engine.backend, engine.state_dict()
    rng = _portable_rng(capture_rng())
    train = engine.data.get("train")
    position = train.position(state["batch_in_epoch"]) if train is not None else None
    positions = backend.all_gather_object(position, domain="data") if backend.data_size > 1 else [position]
    rngs = backend.all_gather_object(rng, domain="optimizer") if backend.world_size > 1 else [rng]
    run_config = engine.run_config
    weights = backend.model_state_dict(engine) if model else {n: None for n, _ in engine.model.named_parameters()}
    return {
        "format": FORMAT,
        "version": VERSION,
        "meta": {
            "step": state["step"],
            "epoch": state["epoch"],
            "batch_in_epoch": state["batch_in_epoch"],
            "world_size": backend.world_size,
            "data_size": backend.data_size,
            "backend": backend.name,
            "time": time.time(),
            "params": params,
            "trainable": recorded(engine, weights),
        },
        "engine": state,
        "model": select(engine, weights, params) if model else {},
        "optimizers": backend.optimizer_state_dicts(engine) if model else [],
        "schedulers": [scheduler.state_dict() for scheduler in engine.schedulers],
        "data": {"train": positions} if any(p is not None for p in positions) else {},
        "rng": rngs,
        "callbacks": {key: cb.state_dict() for key, cb in stateful_callbacks(engine).items()},
        "config": {
            "engine": config_module.unstructure(engine.config),
            "run": config_module.unstructure(run_config)
            if attrs.has(type(run_config)) or isinstance(run_config, dict)
            else None,
        },
    }


def _portable_rng(snapshot: dict[str, Any]) -> dict[str, Any]:
    # numpy's state holds an ndarray, which a weights-only load refuses: keep plain ints.
    if "numpy" in snapshot:
        name, keys, pos, has_gauss, gauss = snapshot["numpy"]
        snapshot = {**snapshot, "numpy": (name, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss))}
    return snapshot


def _native_rng(snapshot: dict[str, Any]) -> dict[str, Any]:
    if "numpy" in snapshot and isinstance(snapshot["numpy"][1], list):
        import numpy as np

        name, keys, pos, has_gauss, gauss = snapshot["numpy"]
        snapshot = {**snapshot, "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss)}
    return snapshot


# -- restore ----------------------------------------------------------------------------


def restore(engine: Engine, payload: Mapping[str, Any], *, strict: bool = True, source: str = "") -> None:
    """Put a full payload back into `engine`, then fire `on_load`.

    Order: model, callbacks with `restore_with_model = True` (EMA),
    optimizers, schedulers, engine counters and the train position, RNG, the
    other callbacks. Everything is validated first (keys, shapes, counts,
    config, callback states); a problem raises `CheckpointError` naming
    `source` and the step, with the engine untouched. `strict=False` turns
    unexpected model keys, missing/unexpected callback states, and config
    changes that void the data position, into warnings; model keys missing
    from the checkpoint are always an error (those weights would stay at
    their initialization). A payload marked
    `restored_by_store` (the DeepSpeed store's `read` loaded model and
    optimizer through DeepSpeed's engine, after its own checks) skips the
    model and optimizer checks and loads.
    """
    step = _step_of(payload)

    def fail(message: str) -> CheckpointError:
        return CheckpointError(message, path=source, step=step)

    if payload.get("format") != FORMAT or not isinstance(payload.get("version"), int):
        raise fail("not a cadence checkpoint payload (no 'format': 'cadence-checkpoint')")
    if payload["version"] > VERSION:
        raise fail(f"format version {payload['version']} is newer than this cadence reads ({VERSION}); upgrade cadence")
    for key in ("engine", "model", "optimizers", "schedulers", "rng", "callbacks"):
        if key not in payload:
            raise fail(f"the payload has no {key!r} entry")
    backend, warnings = engine.backend, list[str]()
    # A store that restored model and optimizer itself (DeepSpeed) marks the payload: they are not touched here.
    by_store = bool(payload.get(RESTORED_BY_STORE))
    optimizers: list[Any] = []
    adapter = (payload.get("meta") or {}).get("params") == "trainable"  # frozen weights stay as they are
    if not by_store:
        _check_model(engine, payload["model"], strict, (), fail, warnings, only_trainable=adapter)
        optimizers = _check_optimizers(engine, payload["optimizers"], fail, warnings)
    if len(payload["schedulers"]) != len(engine.schedulers):
        raise fail(
            f"it holds {len(payload['schedulers'])} scheduler state(s), the engine has {len(engine.schedulers)} "
            "scheduler(s); pass the same schedulers as the saved run"
        )
    unknown = set(payload["engine"]) - {f.name for f in attrs.fields(State)}
    if unknown:
        raise fail(f"engine state has unknown keys {sorted(unknown)}")
    saved_config = (payload.get("config") or {}).get("engine") or {}
    keep_position = _check_config(engine, saved_config, strict, fail, warnings)
    positions = (payload.get("data") or {}).get("train")
    train = engine.data.get("train")
    moved = positions is not None and len(positions) != backend.data_size  # a map-style Dataset's epoch: re-split
    resharded = train.reshard(positions, payload["engine"]) if moved and keep_position and train is not None else None
    if moved and resharded is None:
        keep_position = False
        warnings.append(
            f"it was saved on {len(positions or ())} data rank(s), this run has {backend.data_size}: the train position "
            f"cannot be resharded (only a map-style Dataset's can), so epoch {payload['engine'].get('epoch')} restarts "
            f"from its first batch ({payload['engine'].get('batch_in_epoch')} batches per rank are seen again)"
        )
    positions = resharded or positions
    mine = positions[backend.data_rank] if keep_position and positions is not None else None
    problem = train.position_problem(mine) if mine is not None and train is not None else None
    if problem is not None:
        if strict:
            raise fail(problem + "; or pass strict=False (the interrupted epoch then restarts)")
        keep_position = False
        warnings.append(problem + ": the interrupted epoch restarts from its first batch")
    callbacks = stateful_callbacks(engine)
    saved_states = payload["callbacks"]
    missing = sorted(set(callbacks) - set(saved_states))
    unexpected = sorted(set(saved_states) - set(callbacks))
    if missing or unexpected:
        text = (
            f"callback states do not match the registered callbacks: missing {missing} (registered, not in the "
            f"checkpoint), unexpected {unexpected} (in the checkpoint, no callback with that state_key)"
        )
        if strict:
            raise fail(text + "; register the same callbacks (state_key) or pass strict=False")
        warnings.append(text)
    for text in warnings:
        logger.warning("checkpoint %s (step %s): %s", source, step, text)

    # Validated: from here on the engine changes.
    part = "model"
    try:
        if not by_store:
            backend.load_model_state_dict(engine, payload["model"], strict=strict and not adapter)
        ordered = sorted(callbacks.items(), key=lambda kv: not getattr(kv[1], "restore_with_model", False))
        early = [(k, cb) for k, cb in ordered if getattr(cb, "restore_with_model", False)]
        for key, callback in early:
            part = f"callback {key!r}"
            if key in saved_states:
                callback.load_state_dict(saved_states[key])
        part = "optimizers"
        if optimizers:
            backend.load_optimizer_state_dicts(engine, optimizers)
        part = "schedulers"
        for scheduler, state in zip(engine.schedulers, payload["schedulers"]):
            scheduler.load_state_dict(state)
        part = "engine state and train position"
        _restore_position(engine, payload, positions if keep_position else None)
        part = "rng"
        rngs = payload["rng"]
        if backend.rank < len(rngs):
            restore_rng(_native_rng(rngs[backend.rank]))
        for key, callback in ordered[len(early) :]:
            part = f"callback {key!r}"
            if key in saved_states:
                callback.load_state_dict(saved_states[key])
    except Exception as exc:
        raise fail(
            f"restoring {part} failed after validation: {type(exc).__name__}: {exc}; the engine is partially "
            "restored, build a new one"
        ) from exc
    engine.restored_from = source
    logger.info("restored checkpoint %s (step %s)", source, step)
    engine.fire(Event.ON_LOAD)


def load_pretrained(
    engine: Engine,
    model_state: Mapping[str, Any],
    *,
    strict: bool = True,
    exclude: Iterable[str] = (),
    source: str = "",
    step: int | None = None,
) -> None:
    """Load only model weights (`exclude`: fnmatch patterns of keys to leave as they are), then fire `on_load`."""
    patterns = tuple(exclude)

    def fail(message: str) -> CheckpointError:
        return CheckpointError(message, path=source, step=step)

    kept = {k: v for k, v in model_state.items() if not any(fnmatch.fnmatchcase(k, p) for p in patterns)}
    warnings: list[str] = []
    _check_model(engine, kept, strict, patterns, fail, warnings, pretrained=True)
    for text in warnings:
        logger.warning("pretrained %s: %s", source, text)
    engine.backend.load_model_state_dict(engine, kept, strict=False)
    logger.info("loaded pretrained weights from %s (%d tensors)", source, len(kept))
    engine.fire(Event.ON_LOAD)


def _step_of(payload: Mapping[str, Any]) -> int | None:
    meta = payload.get("meta")
    return meta.get("step") if isinstance(meta, Mapping) else None


def _listing(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(keys[:limit])
    return f"{shown}, ... ({len(keys)} in all)" if len(keys) > limit else shown


def _check_model(
    engine: Engine,
    saved: Mapping[str, Any],
    strict: bool,
    exclude: tuple[str, ...],
    fail: Any,
    warnings: list[str],
    pretrained: bool = False,
    only_trainable: bool = False,
) -> None:
    current = engine.backend.model_state_dict(engine)
    if only_trainable:
        current = select(engine, current, "trainable")
    missing = [k for k in current if k not in saved and not any(fnmatch.fnmatchcase(k, p) for p in exclude)]
    unexpected = [k for k in saved if k not in current]
    shapes = [
        f"{k}: checkpoint {tuple(v.shape)}, model {tuple(current[k].shape)}"
        for k, v in saved.items()
        if k in current
        and hasattr(v, "shape")
        and hasattr(current[k], "shape")
        and tuple(v.shape) != tuple(current[k].shape)
    ]
    if shapes:
        raise fail(f"model tensors differ in shape: {_listing(shapes)}")
    text = f"model keys do not match: missing from the checkpoint [{_listing(missing)}], unexpected [{_listing(unexpected)}]"
    if missing:  # never a warning: those weights would silently stay at their initialization
        remedy = (
            "exclude them explicitly (Checkpoint(pretrained_exclude=[...]) with fnmatch patterns) to keep them as "
            "initialized"
            if pretrained
            else "load a checkpoint of this model, or load its weights with Checkpoint(pretrained=..., "
            "pretrained_exclude=[...])"
        )
        raise fail(f"{text}; {len(missing)} tensor(s) of this model would stay at their initialization: {remedy}")
    if unexpected:
        if strict:
            raise fail(
                text + "; load a checkpoint of this model, or pass strict=False to leave the unexpected keys out"
            )
        warnings.append(text + " (left out)")


def _check_optimizers(engine: Engine, saved: list[Any], fail: Any, warnings: list[str]) -> list[Any]:
    if not engine.optimizers:
        if saved:
            warnings.append(f"the engine has no optimizer: {len(saved)} saved optimizer state(s) not loaded")
        return []
    if len(saved) != len(engine.optimizers):
        raise fail(f"it holds {len(saved)} optimizer state(s), the engine has {len(engine.optimizers)} optimizer(s)")
    for i, (optimizer, state) in enumerate(zip(engine.optimizers, saved)):
        groups, saved_groups = optimizer.param_groups, state.get("param_groups", [])
        sizes, saved_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in saved_groups]
        if sizes != saved_sizes:
            raise fail(f"optimizer {i}: parameters per group {saved_sizes} in the checkpoint, {sizes} in the engine")
        params = [p for g in groups for p in g["params"]]
        index = {pid: params[n] for n, pid in enumerate(pid for g in saved_groups for pid in g["params"])}
        for pid, entry in state.get("state", {}).items():
            param = index.get(pid)
            if param is None:
                continue
            for name, value in entry.items():
                if getattr(value, "dim", lambda: 0)() and tuple(value.shape) != tuple(param.shape):
                    raise fail(
                        f"optimizer {i}: state {name!r} of parameter {pid} has shape {tuple(value.shape)}, "
                        f"the parameter {tuple(param.shape)}"
                    )
    return saved


def _dotted(data: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return None
        data = data[part]
    return data


def _check_config(engine: Engine, saved: Mapping[str, Any], strict: bool, fail: Any, warnings: list[str]) -> bool:
    """Compare what gives the data position its meaning; True if the position can be kept."""
    if not saved:
        return True
    current = config_module.unstructure(engine.config)
    changed = [
        f"{name}: checkpoint {_dotted(saved, name)!r}, this run {_dotted(current, name)!r}"
        for name in DATA_FIELDS
        if _dotted(saved, name) != _dotted(current, name)
    ]
    saved_seed, seed_given = saved.get("seed"), None if engine.seed_was_drawn else engine.config.seed
    if saved_seed is not None and seed_given is not None and saved_seed != seed_given:
        changed.append(f"seed: checkpoint {saved_seed!r}, this run {seed_given!r}")
    if not changed:
        return True
    text = "the run's config is incompatible with the checkpoint's: " + "; ".join(changed)
    if strict:
        raise fail(text + "; use the saved values, or pass strict=False (the interrupted epoch then restarts)")
    warnings.append(text + ": the interrupted epoch restarts from its first batch")
    return False


def _restore_position(engine: Engine, payload: Mapping[str, Any], positions: list[Any] | None) -> None:
    state = dict(payload["engine"])
    saved_seed = ((payload.get("config") or {}).get("engine") or {}).get("seed")
    drawn = engine.seed_was_drawn
    if drawn and saved_seed is not None and saved_seed != engine.seed:
        # No seed was given and the engine drew one: continue with the saved run's shuffling.
        engine.seed = saved_seed
        engine.config = attrs.evolve(engine.config, seed=saved_seed)
        for source in engine.data.values():
            source.seed = saved_seed
            if getattr(source.sampler, "seed", None) is not None:
                source.sampler.seed = saved_seed
    mine = positions[engine.backend.data_rank] if positions is not None else None
    train = engine.data.get("train")
    restored = False
    if mine is not None and train is not None:
        restored = train.load_position(mine, state["epoch"])
    elif state.get("batch_in_epoch") and positions is None and payload.get("data", {}).get("train") is not None:
        state["batch_in_epoch"] = 0  # a position that cannot be used: the epoch restarts
    engine.state.load_state_dict(state)
    engine.feed.restart(train if engine.optimizers else None, engine.state, position_restored=restored)
