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

from cadence.checkpoint.device_copy import CopyFence, optimizer_written
from cadence.checkpoint.launch_modes import auto_resume, load_checkpoint, load_pretrained_weights
from cadence.checkpoint.payload import build_payload
from cadence.checkpoint.staging import staged_size
from cadence.checkpoint.store import AsyncCheckpointStore, CheckpointError, CheckpointStore, store_errors
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

    Saves at the loop's save point (`on_save_point`: after each step's
    logging and evaluation, and after each epoch's evaluation and
    `on_epoch_end`), so a checkpoint holds everything that evaluation changed:
    `latest` every `interval` (with a history snapshot), when a `save` (or
    `preempt`) request is agreed, and when fit ends; `best` (at the next save
    point) when `save_best` is set and the score improved. The launch mode is
    applied in `on_setup`, once, before the first run; `on_load` fires after a
    restore and `on_save` after each commit (for async saves: on the loop
    thread, at the first save point after the commit, or at teardown).

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
    raises_requests = False  # saves on its schedule and on an agreed `save`; requests nothing

    def __init__(self, config: CheckpointConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(CheckpointConfig, config, kwargs, "checkpoint")
        self.best_score: float | None = None
        self.best_step: int | None = None
        self.store: CheckpointStore = None  # type: ignore[assignment]  # set in on_setup
        self.last_saved: SavedCheckpoint | None = None
        self._writer: AsyncWriter | None = None
        self._fence = CopyFence()  # async saves on GPUs: the copies the loop must wait for before writing
        self._reserving: Any = None  # the handle of `_reserve_staging` until it runs
        self._writes = False  # this rank calls the store's write (the main rank; every rank for collective stores)
        self._main = True
        self._collective = False  # a collective store on more than one rank
        # An AsyncCheckpointStore (DCP) saves asynchronously through `write_async`: one handle per save, in order.
        self._store_async = False
        self._handles: list[tuple[Any, Job]] = []
        self._fitting = False
        self._last_key: tuple[int, int, int, int] | None = None
        self._evaluations = 0  # evaluations seen: part of the key that tells a new state from a saved one
        self._best_due = False  # the score improved since the last save point
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
        backend = engine.backend
        self.store = backend.checkpoint_store(engine).at(directory)
        if self.config.async_mode == "async" and not self.store.background_safe:
            raise ValueError(
                f"Checkpoint(async_mode='async'): the {type(self.store).__name__} writes with collectives on the "
                "training process group, which a background thread cannot do; use async_mode='disabled'"
            )
        self._main = backend.is_main
        self._collective = self.store.collective and backend.world_size > 1
        self._writes = self.store.collective or self._main

        def sweep() -> None:
            with store_errors("sweeping leftovers of interrupted writes", directory):
                removed = self.store.sweep()
            if removed:
                logger.info("checkpoint: removed leftovers of interrupted writes in %s: %s", directory, removed)

        self._main_only(sweep)

    def _main_only(self, work: Any) -> None:
        """Run `work` on the main rank; for a collective store every rank then waits at the store's barrier.

        The main rank's error is raised after the barrier, so the other ranks are not left waiting.
        """
        error: BaseException | None = None
        if self._main:
            try:
                work()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                error = exc
        if self._collective:
            self.store.barrier()
        if error is not None:
            raise error

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
        elif config.auto_resume and auto_resume(engine, self.store, strict=config.strict):
            pass  # this run's latest was restored: a pretrained model does not apply
        elif config.pretrained:
            load_pretrained_weights(
                engine, self.store, config.pretrained, exclude=config.pretrained_exclude, strict=config.strict
            )

    # -- when to save ---------------------------------------------------------------------

    def on_fit_start(self, engine: Engine) -> None:
        if self.store is None:  # registered after the engine's first run: on_setup has passed
            self._bind(engine)
            if self.config.resume or self.config.auto_resume or self.config.pretrained:
                logger.warning(
                    "checkpoint: registered after the engine's first run; resume, auto_resume and "
                    "pretrained apply only in on_setup (use cadence.checkpoint.from_checkpoint)"
                )
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
        self._store_async = config.async_mode == "async" and isinstance(self.store, AsyncCheckpointStore)
        if config.async_mode == "async" and self._writes and not self._store_async:
            if self._writer is None:
                # Ranks of a collective store must enter the same writes: nothing is superseded by timing.
                self._writer = AsyncWriter(self._commit, supersede=not self._collective, share=config.async_write_share)
            self._writer.start()
            if self._reserving is None and not self._writer.staged:
                self._reserving = engine.add_handler(Event.ON_STEP_END, self._reserve_staging)

    def _reserve_staging(self, engine: Engine) -> None:
        """Once, at the first step's end (the optimizers' state exists then): the first async save's staging
        buffer, sized from the model and optimizer state and faulted in by a low-priority thread, so that
        the first save does not pay for fresh memory in the loop (docs/checkpoints.md, "Async saves")."""
        if self._reserving is not None:
            self._reserving.remove()
            self._reserving = None
        model = engine.model
        like = {
            "model": [*model.parameters(), *model.buffers()],
            "optimizers": [list(optimizer.state.values()) for optimizer in engine.optimizers],
        }
        if self._writer is not None:
            self._writer.reserve(staged_size(like), pin=any(p.is_cuda for p in model.parameters()))

    def on_save_point(self, engine: Engine) -> None:
        # Fired after the step's (or the epoch's) evaluation and agreement: what
        # is saved here is the state an uninterrupted run goes on from.
        writer = self._writer
        if writer is not None and (writer.done or writer.error is not None):
            self._collect(engine)
        if self._handles and self._handles[0][0].done():
            self._collect_handles(engine)
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
        if config.monitor is not None:
            prefix, name = config.monitor.partition(".")[0] + ".", config.monitor
        else:
            prefix = f"{config.score_split}."
            name = config.score_name if config.score_name.startswith(prefix) else prefix + config.score_name
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
        writer, drained = self._writer, True
        if writer is not None:
            drained = writer.close(self.config.drain_timeout)
            if not drained:
                logger.error(
                    "checkpoint: background writes still running after %.0f s (drain_timeout); the newest "
                    "checkpoint may be missing",
                    self.config.drain_timeout,
                )
        for handle, _ in self._handles:
            if not handle.wait(self.config.drain_timeout):
                drained = False
                logger.error(
                    "checkpoint: background save of %r still running after %.0f s (drain_timeout)",
                    handle.name,
                    self.config.drain_timeout,
                )
                break
        if drained and self.store is not None:
            self.store.wait()  # superseded checkpoints are removed in the background
        if writer is not None:
            self._collect(engine, raise_errors=engine.exception is None)
        if self._handles and drained:
            self._collect_handles(engine, raise_errors=engine.exception is None)

    def save(self, engine: Engine, reason: str = "manual") -> None:
        """Save `latest` now (under DDP every rank must call it); in async mode, returns once staged."""
        if self.store is None:
            self._bind(engine)
        self._save(engine, reason=reason)

    def release_copies(self) -> None:
        """Make the GPU's current stream wait for the last async save's copies of parameters and optimizer state.

        Called for you before the next optimizer step (and before evaluation, an epoch's end,
        the end of fit); a callback that writes parameters or optimizer state in place earlier
        in the step after a save calls it first. A wait on the GPU: the host goes on. Nothing
        to do without CUDA tensors or async saves.
        """
        self._fence.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for background writes to be committed; False on timeout (sync mode: True)."""
        if self._handles:
            return all(handle.wait(timeout) for handle, _ in self._handles)
        return self._writer.drain(timeout) if self._writer is not None else True

    # -- saving ---------------------------------------------------------------------------

    def _save(self, engine: Engine, *, history: str | None = None, best: bool = False, reason: str) -> None:
        state = engine.state
        key = (state.step, state.epoch, state.batch_in_epoch, self._evaluations)
        ema = _ema_for_best(engine) if best else None
        links = tuple(n for n in (history, "best" if best and ema is None else None) if n)
        fresh = key != self._last_key  # a save at the same state only adds names to `latest`
        if not fresh and not links and ema is None:
            return
        backend = engine.backend
        done: list[Job] = []
        error: BaseException | None = None
        full = True
        with engine.long_operation("checkpoint save"):
            try:
                # Decided at each save: under TorchFT the writing replica group can change.
                full = backend.writes_checkpoint
                if fresh or links:
                    payload = build_payload(engine, model=not self.store.restores_model) if fresh else None
                    job = Job(payload, "latest" if fresh else None, links, state.step, state.epoch, reason, full=full)
                    self._dispatch(engine, job, done)
                if ema is not None and full:
                    self._fence.release()  # the swaps write the parameters: after their copies
                    with ema.swapped(engine):  # `best` holds the averaged weights; written before they go back
                        best_payload = build_payload(engine, model=not self.store.restores_model)
                        self._dispatch(engine, Job(best_payload, "best", (), state.step, state.epoch, reason), done)
                        self._fence.release()
            except Exception as exc:
                error = exc
            # Written in the loop: sync saves, and under TorchFT a group's own data state when the
            # store stages its async saves itself (`_submit_to_store`): every rank learns the outcome.
            in_loop = self._writer is None and (not self._store_async or not full)
            if in_loop and backend.world_size > 1:
                backend.barrier(self.config.barrier_timeout)  # the others wait for the main process
                status = None if error is None else f"{type(error).__name__}: {error}"
                if self._collective:  # every rank wrote: any of them may have failed
                    failed = [(r, s) for r, s in enumerate(backend.all_gather_object(status, domain="optimizer")) if s]
                    status = f"rank {failed[0][0]}: {failed[0][1]}" if failed else None
                else:
                    status = backend.broadcast_object(status)
                if status is not None and error is None:
                    who = "a rank" if self._collective else "the main process"
                    error = CheckpointError(
                        f"{who} failed to save: {status}", path=self.store.directory, step=state.step
                    )
        if error is not None:
            raise error
        self._last_key = key
        if best:
            self._best_due = False
        for job in done:
            self._committed(engine, job)

    def _dispatch(self, engine: Engine, job: Job, done: list[Job]) -> None:
        """Hand a job to the background writer, or commit it now (sync mode, writing ranks only)."""
        if self._store_async:
            self._submit_to_store(job, done)
        elif self._writer is not None:
            late = optimizer_written(engine) if job.payload is not None else set()
            staging = self._writer.submit(job, late)
            if staging is not None and staging.copies is not None and staging.copies.pending:
                if (
                    self._fitting
                ):  # released before the next optimizer step (docs/checkpoints.md, "Async saves on GPUs")
                    self._fence.arm(engine, staging)
                else:
                    staging.release()  # outside a fit nothing tells when the user writes the parameters
        elif self._writes:
            self._commit(job)
            if job.full:
                done.append(job)

    def _commit(self, job: Job) -> None:
        """Write and name one job (in the loop, or in the writer thread); store errors become `CheckpointError`.

        A collective store's `write` runs on every rank; naming and retention
        on the main rank, then every rank waits at the store's barrier.
        """
        store = self.store
        if not job.full:  # another replica group writes the checkpoint: only this group's data state
            if job.payload is not None and job.primary == "latest":
                with store_errors("saving this replica group's data state", store.path("replicas"), job.step):
                    store.write_replica(job.primary, job.payload)
            return
        with store_errors(f"saving {list(job.names)}", store.path(job.names[0] if job.names else "latest"), job.step):
            if job.payload is not None and job.primary is not None:
                store.write(job.primary, job.payload)
            if job.links:
                self._main_only(lambda: self._name(job))

    def _name(self, job: Job) -> None:
        for name in job.links:
            self.store.link("latest", name)
        if any(name.startswith("ckpt-") for name in job.links):
            self._prune()

    def _submit_to_store(self, job: Job, done: list[Job]) -> None:
        """Async mode with a store that stages itself (DCP): every rank calls `write_async` in the loop.

        The store waits for its previous save before staging the next one, on
        every rank (no save is dropped, so every rank enters the same
        collectives); the main rank names the checkpoint right after its
        commit (no collective there), before the next one can commit.
        """
        if not job.full:  # TorchFT: another replica group writes the checkpoint; this group's data state now
            self._commit(job)
            return
        if job.payload is None:  # only new names for the state last saved: after its commit
            for handle, _ in self._handles:
                handle.wait()
            self._commit(job)
            done.append(job)
            return
        after = (lambda manifest: self._name(job)) if job.links else None
        assert isinstance(self.store, AsyncCheckpointStore) and job.primary is not None
        handle = self.store.write_async(job.primary, job.payload, after_commit=after)
        self._handles.append((handle, job))

    def _collect_handles(self, engine: Engine, raise_errors: bool = True) -> None:
        """Fire on_save for the store's committed async saves, in order; raise the first error."""
        while self._handles and self._handles[0][0].done():
            handle, job = self._handles.pop(0)
            error = handle.exception()
            if error is None:
                self._committed(engine, job)
                continue
            if not raise_errors:
                logger.error("%s", error)
                continue
            raise error

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
            if job.full:
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
