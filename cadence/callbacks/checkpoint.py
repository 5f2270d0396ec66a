"""Checkpoint: atomic, optionally asynchronous saves with retention, and the launch modes.

Names in the checkpoint folder (default `engine.run_dir / "checkpoints"`):
`latest` (every save), `best` (`save_best`: the monitored evaluation score
improved), and history snapshots `ckpt-e{epoch:06d}` (epoch mode) or
`ckpt-s{step:012d}` (step mode), of which `keep_latest_k` are kept. See
docs/checkpoints.md for atomicity, async saves, launch modes and DDP.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs
import torch

from cadence.checkpoint.payload import build_payload, load_checkpoint, load_pretrained, restore
from cadence.checkpoint.store import CheckpointError, CheckpointStore
from cadence.checkpoint.writer import AsyncWriter, Job
from cadence.engine import config as config_module
from cadence.engine.callback import Callback
from cadence.engine.events import Event
from cadence.engine.order import Order

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

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
        score_split: the evaluation split of the score (`engine.evaluate(split=...)`).
        score_name: the metric's name within the split (`loss` for `val.loss`).
        mode: "min" or "max": which way the score improves.
        async_mode: "disabled" (the loop waits for the durable write) or "async"
            (it waits only for a copy into CPU staging buffers).
        save_on_fit_end: save `latest` when fit ends.
        resume: a checkpoint (or a checkpoint folder) to restore in full.
        auto_resume: restore this run's `latest` if it exists (falling back to the newest complete snapshot).
        pretrained: a checkpoint, or a file saved with torch.save, to load model weights from.
        pretrained_exclude: fnmatch patterns of model keys not loaded from `pretrained`.
        strict: missing/unexpected model keys and callback states, and an incompatible config, are errors.
        drain_timeout: seconds teardown waits for background writes.
        barrier_timeout: seconds the other ranks wait for the main process to write.
    """

    dir: str | None = attrs.field(default=None, validator=attrs.validators.optional(_folder))
    interval: int | None = attrs.field(default=None, validator=_optional_ge0)
    unit: Literal["auto", "step", "epoch"] = "auto"
    keep_latest_k: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    save_best: bool = False
    score_split: str = "val"
    score_name: str = "loss"
    mode: Literal["min", "max"] = "min"
    async_mode: Literal["disabled", "async"] = "disabled"
    save_on_fit_end: bool = True
    resume: str | None = None
    auto_resume: bool = False
    pretrained: str | None = None
    pretrained_exclude: list[str] = attrs.field(factory=list)
    strict: bool = True
    drain_timeout: float = attrs.field(default=600.0, validator=attrs.validators.gt(0))
    barrier_timeout: float = attrs.field(default=1800.0, validator=attrs.validators.gt(0))


@attrs.frozen
class SavedCheckpoint:
    """What the last committed save was: its names, folder, step and epoch."""

    names: tuple[str, ...]
    path: Path
    step: int
    epoch: int
    reason: str


class Checkpoint(Callback):
    """Saves checkpoints and applies the launch modes (resume > auto_resume > pretrained).

    Saves `latest` every `interval` (with a history snapshot), when a `save`
    (or `preempt`) request is agreed, and when fit ends; `best` when
    `save_best` is set and the score improves. The launch mode is applied in
    `on_setup`, once, before the first run; `on_load` fires after a restore
    and `on_save` after each commit (for async saves: on the loop thread, at
    the first step end after the commit, or at teardown).

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
    """

    order = Order.CHECKPOINT

    def __init__(self, config: CheckpointConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(CheckpointConfig, config, kwargs, "checkpoint")
        self.best_score: float | None = None
        self.best_step: int | None = None
        self.store: CheckpointStore = None  # type: ignore[assignment]  # set in on_setup
        self.last_saved: SavedCheckpoint | None = None
        self._writer: AsyncWriter | None = None
        self._writes = False
        self._fitting = False
        self._last_key: tuple[int, int, int] | None = None
        self._step_interval = 0
        self._epoch_interval = 0
        self._save_slot = 2
        self._preempt_slot: int | None = None
        self._undeletable: set[str] = set()

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"best_score": self.best_score, "best_step": self.best_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_score = None if state.get("best_score") is None else float(state["best_score"])
        self.best_step = state.get("best_step")

    # -- launch ---------------------------------------------------------------------------

    def _bind(self, engine: Engine) -> None:
        directory = Path(self.config.dir) if self.config.dir else engine.run_dir / "checkpoints"
        self.store = engine.backend.checkpoint_store(engine).at(directory)
        self._writes = self.store.all_ranks_write or engine.backend.is_main
        if self._writes:
            removed = self.store.sweep()
            if removed:
                logger.info("checkpoint: removed leftovers of interrupted writes in %s: %s", directory, removed)

    def on_setup(self, engine: Engine) -> None:
        self._bind(engine)
        config = self.config
        if engine.restored_from is not None:
            logger.info(
                "checkpoint: state already restored from %s; resume/auto_resume/pretrained not applied",
                engine.restored_from,
            )
        elif config.resume:
            load_checkpoint(engine, config.resume, strict=config.strict)
        elif config.auto_resume and self._auto_resume(engine):
            pass  # this run's latest was restored: a pretrained model does not apply
        elif config.pretrained:
            self._load_pretrained(engine)

    def _auto_resume(self, engine: Engine) -> bool:
        """Restore the newest complete checkpoint of this run; False if there is none."""
        backend, store = engine.backend, self.store
        picked, payload, problems = None, None, []
        if backend.is_main:
            for name in self._candidates():
                try:
                    payload = store.read(name)
                except CheckpointError as exc:
                    problems.append(str(exc))
                    continue
                picked = name
                break
        picked, problems = backend.broadcast_object((picked, problems))
        if picked is None:
            if problems:
                raise CheckpointError(
                    "auto_resume: no complete checkpoint to resume from: "
                    + " | ".join(problems)
                    + "; delete the damaged checkpoints to start from scratch",
                    path=store.directory,
                )
            logger.info("auto_resume: no checkpoint in %s; starting from scratch", store.directory)
            return False
        if problems:
            logger.warning(
                "auto_resume: falling back to the previous complete checkpoint %r: %s", picked, " | ".join(problems)
            )
        if payload is None:
            payload = store.read(picked)
        restore(engine, payload, strict=self.config.strict, source=str(store.path(picked)))
        return True

    def _candidates(self) -> list[str]:
        """`latest`, then history snapshots newest first (present even when damaged)."""
        directory = self.store.directory
        if directory is None or not directory.is_dir():
            return []
        history = []
        for path in directory.iterdir():
            if path.is_dir() and path.name.startswith(("ckpt-s", "ckpt-e")):
                try:
                    step = self.store.manifest(path.name).get("step") or 0
                except CheckpointError:
                    step = -1
                history.append((step, path.name))
        history.sort(reverse=True)
        return (["latest"] if (directory / "latest").exists() else []) + [name for _, name in history]

    def _load_pretrained(self, engine: Engine) -> None:
        config, path = self.config, Path(str(self.config.pretrained)).expanduser()
        if path.is_file():  # weights saved with torch.save
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise CheckpointError(f"cannot load pretrained weights: {exc}", path=path) from exc
            state = obj.get("model", obj.get("state_dict", obj)) if isinstance(obj, Mapping) else obj
            step = None
        else:
            store, name = self.store.locate(path)
            payload = store.read(name, keys=["model"])
            state, step = payload["model"], payload.get("meta", {}).get("step")
        if not isinstance(state, Mapping):
            raise CheckpointError(f"pretrained weights must be a state dict, got {type(state).__name__}", path=path)
        load_pretrained(
            engine, state, strict=config.strict, exclude=config.pretrained_exclude, source=str(path), step=step
        )

    # -- when to save ---------------------------------------------------------------------

    def on_fit_start(self, engine: Engine) -> None:
        if self.store is None:  # registered after the engine's first run: on_setup has passed
            self._bind(engine)
            if self.config.resume or self.config.auto_resume or self.config.pretrained:
                logger.warning(
                    "checkpoint: registered after the engine's first run; resume, auto_resume and "
                    "pretrained apply only in on_setup (use Engine.from_checkpoint)"
                )
        self._fitting = True
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
        if config.async_mode == "async" and self._writes:
            if self._writer is None:
                self._writer = AsyncWriter(self._commit)
            self._writer.start()

    def on_step_end(self, engine: Engine) -> None:
        writer = self._writer
        if writer is not None and (writer.done or writer.error is not None):
            self._collect(engine)
        agreed = engine.requests.agreed
        forced = agreed[self._save_slot]
        slot = self._preempt_slot
        if slot is None:  # Preemption may register its request after this callback started
            slot = self._preempt_slot = engine.requests.index.get("preempt")
        if slot is not None and agreed[slot]:
            forced = 1
        interval, step = self._step_interval, engine.state.step
        if interval and step % interval == 0:
            self._save(engine, history=f"ckpt-s{step:012d}", reason="interval")
        elif forced:
            self._save(engine, reason="requested")

    def on_epoch_start(self, engine: Engine) -> None:
        # A save or preemption agreed at the last epoch end (after on_epoch_end) is seen here.
        slot = self._preempt_slot
        if engine.requests.agreed[self._save_slot] or (slot is not None and engine.requests.agreed[slot]):
            self._save(engine, reason="requested")

    def on_epoch_end(self, engine: Engine) -> None:
        epoch, interval = engine.state.epoch, self._epoch_interval
        history = f"ckpt-e{epoch:06d}" if interval and epoch % interval == 0 else None
        if history:
            self._save(engine, history=history, reason="interval")

    def on_eval_end(self, engine: Engine) -> None:
        config = self.config
        if not (self._fitting and config.save_best):
            return
        prefix = f"{config.score_split}."
        name = config.score_name if config.score_name.startswith(prefix) else prefix + config.score_name
        if not any(key.startswith(prefix) for key in engine.logged):
            return  # another split was evaluated
        if name not in engine.logged:
            raise KeyError(
                f"Checkpoint(save_best=True): no metric {name!r} in the evaluation results "
                f"(got {sorted(engine.logged)}); set score_split / score_name"
            )
        score = float(engine.logged[name])
        best = self.best_score
        improved = not math.isnan(score) and (best is None or (score < best if config.mode == "min" else score > best))
        if not improved:
            return
        self.best_score, self.best_step = score, engine.state.step
        self._save(engine, best=True, reason="best")

    def on_fit_end(self, engine: Engine) -> None:
        if self.config.save_on_fit_end:
            self._save(engine, reason="end of fit")
        self._fitting = False

    def on_teardown(self, engine: Engine) -> None:
        self._fitting = False
        writer, drained = self._writer, True
        if writer is not None:
            drained = writer.close(self.config.drain_timeout)
            if not drained:
                logger.error(
                    "checkpoint: background writes still running after %.0f s (drain_timeout); the newest "
                    "checkpoint may be missing",
                    self.config.drain_timeout,
                )
        if drained and self.store is not None:
            self.store.wait()  # superseded checkpoints are removed in the background
        if writer is not None:
            self._collect(engine, raise_errors=engine.exception is None)

    def save(self, engine: Engine, reason: str = "manual") -> None:
        """Save `latest` now (under DDP every rank must call it); in async mode, returns once staged."""
        if self.store is None:
            self._bind(engine)
        self._save(engine, reason=reason)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for background writes to be committed; False on timeout (sync mode: True)."""
        return self._writer.drain(timeout) if self._writer is not None else True

    # -- saving ---------------------------------------------------------------------------

    def _save(self, engine: Engine, *, history: str | None = None, best: bool = False, reason: str) -> None:
        state = engine.state
        key = (state.step, state.epoch, state.batch_in_epoch)
        ema = _ema_for_best(engine) if best else None
        links = tuple(n for n in (history, "best" if best and ema is None else None) if n)
        fresh = key != self._last_key  # a save at the same state only adds names to `latest`
        if not fresh and not links and ema is None:
            return
        backend = engine.backend
        done: list[Job] = []
        error: BaseException | None = None
        with engine.long_operation("checkpoint save"):
            try:
                if fresh or links:
                    payload = build_payload(engine) if fresh else None
                    job = Job(payload, "latest" if fresh else None, links, state.step, state.epoch, reason)
                    self._dispatch(job, done)
                if ema is not None:
                    with ema.swapped(engine):  # `best` holds the averaged weights; written before they go back
                        self._dispatch(Job(build_payload(engine), "best", (), state.step, state.epoch, reason), done)
            except Exception as exc:
                error = exc
            if self._writer is None and backend.world_size > 1:
                backend.barrier(self.config.barrier_timeout)  # the others wait for the main process
                status = backend.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
                if status is not None and error is None:
                    error = CheckpointError(f"the main process failed to save: {status}", step=state.step)
        if error is not None:
            raise error
        self._last_key = key
        for job in done:
            self._committed(engine, job)

    def _dispatch(self, job: Job, done: list[Job]) -> None:
        """Hand a job to the background writer, or commit it now (sync mode, writing ranks only)."""
        if self._writer is not None:
            self._writer.submit(job)
        elif self._writes:
            self._commit(job)
            done.append(job)

    def _commit(self, job: Job) -> None:
        """Write and name one job (in the loop, or in the writer thread)."""
        store = self.store
        if job.payload is not None and job.primary is not None:
            store.write(job.primary, job.payload)
        for name in job.links:
            store.link("latest", name)
        if any(name.startswith("ckpt-") for name in job.links):
            self._prune()

    def _prune(self) -> None:
        keep = self.config.keep_latest_k
        if not keep:
            return
        names = self.store.names()
        for prefix in ("ckpt-s", "ckpt-e"):
            history = sorted(n for n in names if n.startswith(prefix))  # zero-padded: name order is age
            for name in history[:-keep]:
                try:
                    self.store.delete(name)
                except OSError as exc:
                    if name not in self._undeletable:  # warn once per snapshot; retried at each prune
                        self._undeletable.add(name)
                        logger.warning("checkpoint retention: cannot delete %s: %s; training goes on", name, exc)

    def _collect(self, engine: Engine, raise_errors: bool = True) -> None:
        """Fire on_save for background commits; raise a background error in the loop."""
        assert self._writer is not None
        done, error, failed = self._writer.take()
        for job in done:
            self._committed(engine, job)
        if error is None:
            return
        where = failed.names if failed is not None else ()
        wrapped = CheckpointError(
            f"the background write of {list(where)} failed: {type(error).__name__}: {error}",
            path=self.store.directory,
            step=failed.step if failed else None,
        )
        if not raise_errors:
            logger.error("%s", wrapped)
            return
        raise wrapped from error

    def _committed(self, engine: Engine, job: Job) -> None:
        primary = job.primary or (job.links[0] if job.links else "latest")
        self.last_saved = SavedCheckpoint(job.names, self.store.path(primary), job.step, job.epoch, job.reason)
        engine.fire(Event.ON_SAVE)


def _ema_for_best(engine: Engine) -> Any:
    for callback in engine.callbacks:
        if getattr(callback, "best_with_ema", False) and callable(getattr(callback, "swapped", None)):
            return callback
    return None
