"""Checkpoint: when to save, under which names, how many to keep, the best score, and the launch modes.

Names in the checkpoint folder (default `engine.run_dir / "checkpoints"`):
`latest` (every save), `best` (`save_best`: the monitored evaluation score
improved), and history snapshots `ckpt-e{epoch:06d}` (epoch mode) or
`ckpt-s{step:012d}` (step mode), of which `keep_latest_k` are kept. The
callback holds this policy; the saver (`cadence.checkpoint.saver`) writes.
See docs/checkpoints.md for atomicity, async saves, launch modes and DDP.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs

from cadence.checkpoint.launch_modes import auto_resume, load_checkpoint, load_pretrained_weights
from cadence.checkpoint.saver import BestWeights, Collected, SavedCheckpoint, Saver
from cadence.checkpoint.store import CheckpointStore, for_location
from cadence.engine.callback import Callback
from cadence.engine.events import Event
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

__all__ = ["Checkpoint", "CheckpointConfig", "SavedCheckpoint"]

logger = logging.getLogger("cadence.checkpoint")

_optional_ge0 = attrs.validators.optional(attrs.validators.ge(0))


def _folder(instance: Any, attribute: Any, value: str) -> None:
    # Found here, not at the first save after a training step.
    if Path(value).exists() and not Path(value).is_dir():
        raise ValueError(f"{value!r} is an existing file, not a folder; name a folder (it is created if missing)")


@attrs.define(kw_only=True)
class CheckpointConfig:
    """When and where checkpoints are saved, and how a run starts from one.

    Attributes:
        dir: the checkpoint folder; None: `engine.run_dir / "checkpoints"`.
        interval: periodic saves every N epochs (epoch mode) or N steps (step mode);
            None: every epoch, or total steps // 20; 0: no periodic saves.
        unit: "auto" (epoch mode when fit trains to an epoch target only), "step" or "epoch".
        keep_latest_k: history snapshots kept (latest and best are never deleted); 0 keeps all.
        save_best: also save `best` when the monitored evaluation score improves.
        monitor: the score, dotted as `split.name` (`val.loss`, `test.f1`), as EarlyStopping's
            and LRScheduler's `monitor`; None: `score_split` + `score_name`.
        score_split: the evaluation split of the score (`engine.evaluate(split=...)`), when no `monitor`.
        score_name: the metric's name within the split (`loss` for `val.loss`), when no `monitor`.
        mode: "min" or "max": which way the score improves.
        async_mode: "disabled" (the loop waits for the durable write) or "async"
            (it waits only for a copy into CPU staging buffers; CUDA tensors are copied
            on a side stream, which the loop's stream waits for on the GPU: see
            docs/checkpoints.md, "Async saves on GPUs").
        async_write_share: in async mode, the share of the time the background
            write keeps the disk busy while training runs (it rests between
            32 MB writes; 1: full speed). At the default 0.2 a write takes about
            5 times a sync save's write and slows the steps it overlaps far less;
            whenever the loop waits for it (the next save with no free staging
            buffer, fit end, `wait()`), it goes at full speed.
        save_on_fit_end: save `latest` when fit ends.
        resume: a checkpoint (or a checkpoint folder) to restore in full.
        auto_resume: restore this run's `latest` if it exists (falling back to the newest complete snapshot).
        pretrained: a checkpoint, a file saved with torch.save, a safetensors file or folder, or a
            Hugging Face folder, to load model weights from.
        pretrained_exclude: fnmatch patterns of model keys not loaded from `pretrained`.
        pretrained_mapping: a key mapping for safetensors names (`module:NAME` or `file.py:NAME`, see
            `cadence.checkpoint.hf`; e.g. `examples/lm.py:HFLlama`).
        params: "all", or "trainable": save and restore only the parameters with `requires_grad` (and their
            optimizer state): an adapter. `pretrained` then applies first, and a resume loads the adapter over it.
        strict: unexpected model keys, missing/unexpected callback states and an incompatible config are errors
            (model keys missing from the checkpoint always are: exclude them with `pretrained_exclude`).
        drain_timeout: seconds teardown waits for background writes.
        barrier_timeout: seconds the other ranks wait for the main process to write.
    """

    dir: str | None = attrs.field(default=None, validator=attrs.validators.optional(_folder))
    interval: int | None = attrs.field(default=None, validator=_optional_ge0)
    unit: Literal["auto", "step", "epoch"] = "auto"
    keep_latest_k: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    save_best: bool = False
    monitor: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.matches_re(r"[^.]+\..+"))
    )
    score_split: str = "val"
    score_name: str = "loss"
    mode: Literal["min", "max"] = "min"
    async_mode: Literal["disabled", "async"] = "disabled"
    async_write_share: float = attrs.field(default=0.2, validator=[attrs.validators.gt(0), attrs.validators.le(1)])
    save_on_fit_end: bool = True
    resume: str | None = None
    auto_resume: bool = False
    pretrained: str | None = None
    pretrained_exclude: list[str] = attrs.field(factory=list)
    pretrained_mapping: str | None = None
    params: Literal["all", "trainable"] = "all"
    strict: bool = True
    drain_timeout: float = attrs.field(default=600.0, validator=attrs.validators.gt(0))
    barrier_timeout: float = attrs.field(default=1800.0, validator=attrs.validators.gt(0))


class Checkpoint(Callback):
    """Saves checkpoints and applies the launch modes (resume > auto_resume > pretrained).

    Saves at the loop's save point (`on_save_point`: after each step's
    logging and evaluation, and after each epoch's evaluation and
    `on_epoch_end`), so a checkpoint holds everything that evaluation changed:
    `latest` every `interval` (with a history snapshot), when a `save` (or
    `preempt`) request is agreed, and when fit ends; `best` (at the next save
    point) when `save_best` is set and the score improved. The launch mode is
    applied in `on_setup`, once, before the first run; `on_load` fires after a
    restore and `on_save` after each commit (for async saves: on the loop
    thread, at the first save point after the commit, or at teardown).

    The best-score protocol (read by the run record): `best_score`, the best
    value of `best_metric` (the monitored metric, e.g. `val.loss`) so far,
    and `best_step`, the step it was reached at (None before any).

    Order: `Order.CHECKPOINT` (100): after every state-changing callback, so
    a checkpoint holds the step's final state; before `Preemption`.

    Example:
        >>> import torch, cadence
        >>> from cadence.callbacks import Checkpoint
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 4
        >>> ckpt = Checkpoint(dir="/tmp/cadence-doc-ckpt", interval=2, keep_latest_k=1)
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...     loss_fn=torch.nn.functional.mse_loss, callbacks=[ckpt], seed=0)
        >>> engine.fit(steps=4)
        >>> ckpt.store.names()
        ['ckpt-s000000000004', 'latest']
        >>> ckpt.best_metric
        'val.loss'
    """

    order = Order.CHECKPOINT
    raises_requests = False  # saves on its schedule and on an agreed `save`; requests nothing

    def __init__(self, config: CheckpointConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(CheckpointConfig, config, kwargs, "checkpoint")
        self.best_score: float | None = None
        self.best_step: int | None = None
        self.store: CheckpointStore = None  # type: ignore[assignment]  # set in on_setup
        self.saver: Saver | None = None  # writes the saves (set with the store)
        self.last_saved: SavedCheckpoint | None = None
        self._fitting = False
        self._last_key: tuple[int, int, int, int] | None = None
        self._evaluations = 0  # evaluations seen: part of the key that tells a new state from a saved one
        self._best_due = False  # the score improved since the last save point
        self._step_interval = 0
        self._epoch_interval = 0
        self._save_slot = 2
        self._preempt_slot: int | None = None

    @property
    def best_metric(self) -> str:
        """The monitored metric's name, as `engine.logged` holds it: `monitor`, else `score_split.score_name`."""
        config = self.config
        if config.monitor is not None:
            return config.monitor
        prefix = f"{config.score_split}."
        return config.score_name if config.score_name.startswith(prefix) else prefix + config.score_name

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"best_score": self.best_score, "best_step": self.best_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_score = None if state.get("best_score") is None else float(state["best_score"])
        self.best_step = state.get("best_step")

    # -- launch ---------------------------------------------------------------------------

    def _bind(self, engine: Engine) -> None:
        config = self.config
        directory = config.dir or engine.run_dir / "checkpoints"
        backend = engine.backend
        self.store = for_location(backend.checkpoint_store(engine), directory).at(directory)  # a URL: object storage
        if config.async_mode == "async" and not self.store.background_safe:
            raise ValueError(
                f"Checkpoint(async_mode='async'): the {type(self.store).__name__} writes with collectives on the "
                "training process group, which a background thread cannot do; use async_mode='disabled'"
            )
        self.saver = Saver(
            self.store, backend, keep_latest_k=config.keep_latest_k, barrier_timeout=config.barrier_timeout
        )
        self.saver.params = config.params
        self.saver.sweep()

    def on_setup(self, engine: Engine) -> None:
        self._bind(engine)
        config = self.config
        if engine.restored_from is not None:
            logger.info(
                "checkpoint: state already restored from %s; resume/auto_resume/pretrained not applied",
                engine.restored_from,
            )
            self._saved_if_latest(engine)
            return
        base_first = config.params == "trainable" and bool(config.pretrained) and (config.resume or config.auto_resume)
        if base_first:
            self._load_pretrained(engine)  # the frozen base weights; the adapter loads over them
        if config.resume:
            load_checkpoint(engine, config.resume, strict=config.strict)
        elif config.auto_resume and auto_resume(engine, self.store, strict=config.strict):
            pass  # this run's latest was restored: a pretrained model does not apply
        elif config.pretrained and not base_first:
            self._load_pretrained(engine)
        self._saved_if_latest(engine)

    def _saved_if_latest(self, engine: Engine) -> None:
        restored = engine.restored_from
        if restored is not None and Path(restored).absolute() == self.store.path("latest").absolute():
            # The state is this folder's `latest` already: a fit that trains nothing does not write it
            # again (a TorchFT group restored at the job's step would replace the writer's checkpoint).
            self._last_key = self._key(engine)

    def _load_pretrained(self, engine: Engine) -> None:
        config = self.config
        load_pretrained_weights(
            engine,
            self.store,
            config.pretrained or "",
            exclude=config.pretrained_exclude,
            strict=config.strict,
            mapping=config.pretrained_mapping,
        )

    # -- when to save ---------------------------------------------------------------------

    def on_fit_start(self, engine: Engine) -> None:
        if self.saver is None:  # registered after the engine's first run: on_setup has passed
            self._bind(engine)
            if self.config.resume or self.config.auto_resume or self.config.pretrained:
                logger.warning(
                    "checkpoint: registered after the engine's first run; resume, auto_resume and "
                    "pretrained apply only in on_setup (use cadence.checkpoint.from_checkpoint)"
                )
        assert self.saver is not None
        self._fitting, self._best_due = True, False
        config, (target_step, target_epoch) = self.config, engine.fit_target
        unit = config.unit
        if unit == "auto":
            unit = "epoch" if math.isinf(target_step) and not math.isinf(target_epoch) else "step"
        interval = config.interval
        if interval is None:
            total = engine.config.steps if engine.config.steps is not None else target_step
            interval = 1 if unit == "epoch" else (max(1, int(total) // 20) if math.isfinite(total) else 0)
        self._step_interval = interval if unit == "step" else 0
        self._epoch_interval = interval if unit == "epoch" else 0
        self._save_slot = engine.requests.index["save"]
        self._preempt_slot = engine.requests.index.get("preempt")
        self.saver.start(engine, asynchronous=config.async_mode == "async", share=config.async_write_share)

    def on_save_point(self, engine: Engine) -> None:
        # Fired after the step's (or the epoch's) evaluation and agreement: what
        # is saved here is the state an uninterrupted run goes on from.
        if self.saver is not None:
            self._report(engine, self.saver.collect())
        state, agreed = engine.state, engine.requests.agreed
        forced = agreed[self._save_slot]
        slot = self._preempt_slot
        if slot is None:  # Preemption may register its request after this callback started
            slot = self._preempt_slot = engine.requests.index.get("preempt")
        if slot is not None and agreed[slot]:
            forced = 1
        if state.batch_in_epoch:  # a step's save point
            interval, count, history = self._step_interval, state.step, f"ckpt-s{state.step:012d}"
        else:  # the epoch's (batch_in_epoch was reset when the epoch ended)
            interval, count, history = self._epoch_interval, state.epoch, f"ckpt-e{state.epoch:06d}"
        periodic = bool(interval) and count % interval == 0
        if periodic or forced or self._best_due:
            reason = "interval" if periodic else "requested" if forced else "best"
            self._save(engine, history=history if periodic else None, best=self._best_due, reason=reason)

    def on_eval_end(self, engine: Engine) -> None:
        self._evaluations += 1  # an evaluation changes state (best, schedulers, early stopping): a new save
        config = self.config
        if not (self._fitting and config.save_best):
            return
        name = self.best_metric
        prefix = name.partition(".")[0] + "."
        if not any(key.startswith(prefix) for key in engine.logged):
            return  # another split was evaluated
        if name not in engine.logged:
            raise KeyError(
                f"Checkpoint(save_best=True): no metric {name!r} in the evaluation results "
                f"(got {sorted(engine.logged)}); set monitor='split.name'"
            )
        score = float(engine.logged[name])
        best = self.best_score
        improved = not math.isnan(score) and (best is None or (score < best if config.mode == "min" else score > best))
        if not improved:
            return
        self.best_score, self.best_step = score, engine.state.step
        self._best_due = True  # saved at the save point, with what the rest of the step changes

    def on_fit_end(self, engine: Engine) -> None:
        if self.config.save_on_fit_end or self._best_due:
            self._save(engine, best=self._best_due, reason="end of fit")
        self._fitting = False

    def on_teardown(self, engine: Engine) -> None:
        self._fitting = False
        if self.saver is not None:
            collected = self.saver.close(self.config.drain_timeout, raise_errors=engine.exception is None)
            self._report(engine, collected)

    def save(self, engine: Engine, reason: str = "manual") -> None:
        """Save `latest` now (under DDP every rank must call it); in async mode, returns once staged."""
        if self.saver is None:
            self._bind(engine)
        self._save(engine, reason=reason)

    def release_copies(self) -> None:
        """Make the GPU's current stream wait for the last async save's copies of parameters and optimizer state.

        Called for you before the next optimizer step (and before evaluation, an epoch's end,
        the end of fit); a callback that writes parameters or optimizer state in place earlier
        in the step after a save calls it first. A wait on the GPU: the host goes on. Nothing
        to do without CUDA tensors or async saves.
        """
        if self.saver is not None:
            self.saver.fence.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for background writes to be committed; False on timeout (sync mode: True)."""
        return self.saver.wait(timeout) if self.saver is not None else True

    # -- saving ---------------------------------------------------------------------------

    def _save(self, engine: Engine, *, history: str | None = None, best: bool = False, reason: str) -> None:
        """Which names this save gives (`latest` when the state is new, history, best), then one call to the saver."""
        saver = self.saver
        assert saver is not None
        key = self._key(engine)
        averaged = _best_weights(engine) if best else None  # `best` then holds those weights: a save of its own
        links = tuple(n for n in (history, "best" if best and averaged is None else None) if n)
        fresh = key != self._last_key  # a save at the same state only adds names to `latest`
        if not fresh and not links and averaged is None:
            return
        saved = saver.save(
            engine, latest=fresh, links=links, best_weights=averaged, reason=reason, fitting=self._fitting
        )
        self._last_key = key
        if best:
            self._best_due = False
        self._report(engine, (saved, None))

    def _key(self, engine: Engine) -> tuple[int, int, int, int]:
        """What tells a new state from the one last saved (or restored from `latest`)."""
        state = engine.state
        return (state.step, state.epoch, state.batch_in_epoch, self._evaluations)

    def _report(self, engine: Engine, collected: Collected) -> None:
        """Fire `on_save` for each committed save, in order; then raise the saver's error, if any."""
        saved, error = collected
        for checkpoint in saved:
            self.last_saved = checkpoint
            engine.fire(Event.ON_SAVE)
        if error is not None:
            raise error


def _best_weights(engine: Engine) -> BestWeights | None:
    """The callback whose weights `best` holds (EMA with `best_with_ema`), by its declared contract."""
    for callback in engine.callbacks:
        if isinstance(callback, BestWeights) and callback.best_with_ema:
            return callback
    return None
