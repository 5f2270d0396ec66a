"""The saver: every way the `Checkpoint` callback's saves are written, named and reported.

The callback decides when to save, which names a save gets and how many
history snapshots are kept; it calls `Saver.save` once per save. The saver
owns how:

- in the loop (sync): the store's `write` on the writing ranks, then the
  names (`link`) and the retention (`names`, `delete`) on the main rank
  (`main_only`: for a collective store every rank then waits at the store's
  barrier), then the ranks exchange the outcome (a barrier, and a broadcast
  or, for a collective store, an all-gather of the error), so every rank
  raises or none does;
- asynchronously, through the `AsyncWriter` (the payload is staged into
  reused CPU buffers; on GPUs copied on a side stream, which a `CopyFence`
  makes the loop wait for before anything writes those tensors again);
- asynchronously, through a store that stages its own saves
  (`AsyncCheckpointStore.write_async`: DCP's `async_save`), naming the
  checkpoint right after its commit (`after_commit`);
- under TorchFT, when this rank's replica group does not write the run's
  checkpoint at this save (`backend.writes_checkpoint`), only the group's own
  data state (`CheckpointStore.write_replica`).

A save never calls the callback back: `save` returns what it committed in
the loop, `collect` and `close` what was committed in the background, as
`SavedCheckpoint`s; the callback fires `on_save` for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from cadence.checkpoint.device_copy import CopyFence, optimizer_written
from cadence.checkpoint.payload import build_payload
from cadence.checkpoint.staging import staged_size
from cadence.checkpoint.store import AsyncCheckpointStore, CheckpointError, CheckpointStore, PendingSave, store_errors
from cadence.checkpoint.writer import AsyncWriter, Job
from cadence.engine.events import Event

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.checkpoint")

#: What `collect` and `close` return: the saves committed in the background, and the error the caller raises.
Collected = tuple[list["SavedCheckpoint"], BaseException | None]


@attrs.frozen
class SavedCheckpoint:
    """What a committed save was: its names, folder, step and epoch, and why it was saved."""

    names: tuple[str, ...]
    path: Path
    step: int
    epoch: int
    reason: str


@runtime_checkable
class BestWeights(Protocol):
    """A callback whose weights the `best` checkpoint holds instead of the live ones (EMA's average).

    The contract the `Checkpoint` callback finds it by (among `engine.callbacks`):
    `best_with_ema` is true, and `swapped(engine)` is a context manager that puts
    those weights into the model and the live ones back at its exit. `best` is
    then written inside it (`Saver.save(best_weights=...)`).
    """

    @property
    def best_with_ema(self) -> bool: ...

    def swapped(self, engine: Engine) -> AbstractContextManager[Any]: ...


def _payload(engine: Engine, store: CheckpointStore, params: str) -> dict[str, Any]:
    """What a save writes: the model and optimizers left to a store that saves them itself; `params`
    ("all", or "trainable": `cadence.checkpoint.params`) chosen by the `Checkpoint` callback (`Saver.params`)."""
    return build_payload(engine, model=not store.restores_model, params=params)


class Saver:
    """Writes, names and prunes the `Checkpoint` callback's saves (see the module docstring).

    Args:
        store: the store, at its folder.
        backend: the engine's backend (ranks, the status exchange, `writes_checkpoint`).
        keep_latest_k: history snapshots (`ckpt-*`) kept after each one saved; 0 keeps all.
        barrier_timeout: seconds the other ranks wait for the main process's sync save.
    """

    def __init__(
        self, store: CheckpointStore, backend: Any, *, keep_latest_k: int = 0, barrier_timeout: float = 1800.0
    ) -> None:
        self.store, self.backend, self.params = store, backend, "all"
        self.keep_latest_k, self.barrier_timeout = keep_latest_k, barrier_timeout
        self.main = bool(backend.is_main)
        self.collective = store.collective and backend.world_size > 1  # a collective store on more than one rank
        self.writes = store.collective or self.main  # this rank calls the store's write
        self.writer: AsyncWriter | None = None
        self.fence = CopyFence()  # async saves on GPUs: the copies the loop must wait for before writing
        self._async_store: AsyncCheckpointStore | None = None  # async saves through the store's own staging
        self._pending: list[tuple[PendingSave, Job]] = []  # its saves in flight, in order
        self._reserving: Any = None  # the handle of `_reserve_staging` until it runs
        self._undeletable: set[str] = set()

    def main_only(self, work: Callable[[], Any]) -> None:
        """Run `work` on the main rank; for a collective store every rank then waits at the store's barrier.

        The main rank's error is raised after the barrier, so the other ranks are not left waiting.
        """
        error: BaseException | None = None
        if self.main:
            try:
                work()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                error = exc
        if self.collective:
            self.store.barrier()
        if error is not None:
            raise error

    def sweep(self) -> None:
        """Remove what interrupted writes left in the folder (main rank; every rank calls it)."""

        def sweep() -> None:
            with store_errors("sweeping leftovers of interrupted writes", self.store.directory):
                removed = self.store.sweep()
            if removed:
                logger.info(
                    "checkpoint: removed leftovers of interrupted writes in %s: %s", self.store.directory, removed
                )

        self.main_only(sweep)

    def start(self, engine: Engine, *, asynchronous: bool, share: float) -> None:
        """At each fit's start: how async saves go (the store's own staging, or the writer thread, started)."""
        store = self.store
        self._async_store = store if asynchronous and isinstance(store, AsyncCheckpointStore) else None
        if asynchronous and self.writes and self._async_store is None:
            if self.writer is None:
                # Ranks of a collective store must enter the same writes: nothing is superseded by timing.
                self.writer = AsyncWriter(self._commit, supersede=not self.collective, share=share)
            self.writer.start()
            if self._reserving is None and not self.writer.staged:
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
        if self.writer is not None:
            self.writer.reserve(staged_size(like), pin=any(p.is_cuda for p in model.parameters()))

    # -- saving ---------------------------------------------------------------------------

    def save(
        self,
        engine: Engine,
        *,
        latest: bool,
        links: tuple[str, ...] = (),
        best_weights: BestWeights | None = None,
        reason: str,
        fitting: bool = False,
    ) -> list[SavedCheckpoint]:
        """Every rank: save the engine as `latest` (`latest=False`: its last save) and give it `links`.

        With `best_weights`, `best` is also saved, holding those weights. Returns
        the saves committed before it returns (sync saves; async ones: `collect`).
        An error on any rank is raised on every rank (sync saves).
        """
        state, backend = engine.state, self.backend
        done: list[Job] = []
        error: BaseException | None = None
        full = True
        with engine.long_operation("checkpoint save"):
            try:
                # Decided at each save: under TorchFT the writing replica group can change.
                full = backend.writes_checkpoint
                if latest or links:
                    payload = _payload(engine, self.store, self.params) if latest else None
                    job = Job(payload, "latest" if latest else None, links, state.step, state.epoch, reason, full=full)
                    self._dispatch(engine, job, done, fitting)
                if best_weights is not None and full:
                    self.fence.release()  # the swaps write the parameters: after their copies
                    with best_weights.swapped(engine):  # `best` holds those weights; written before they go back
                        best = _payload(engine, self.store, self.params)
                        self._dispatch(engine, Job(best, "best", (), state.step, state.epoch, reason), done, fitting)
                        self.fence.release()
            except Exception as exc:
                error = exc
            # Written in the loop: sync saves, and under TorchFT a group's own data state when the
            # store stages its async saves itself: every rank learns the outcome.
            in_loop = self.writer is None and (self._async_store is None or not full)
            if in_loop and backend.world_size > 1:
                error = self._exchange(error, state.step)
        if error is not None:
            raise error
        return [self._saved(job) for job in done]

    def _exchange(self, error: BaseException | None, step: int) -> BaseException | None:
        """After a save in the loop: every rank learns whether the writing ranks failed."""
        backend = self.backend
        backend.barrier(self.barrier_timeout)  # the others wait for the main process
        status = None if error is None else f"{type(error).__name__}: {error}"
        if self.collective:  # every rank wrote: any of them may have failed
            failed = [(r, s) for r, s in enumerate(backend.all_gather_object(status, domain="optimizer")) if s]
            status = f"rank {failed[0][0]}: {failed[0][1]}" if failed else None
        else:
            status = backend.broadcast_object(status)
        if status is not None and error is None:
            who = "a rank" if self.collective else "the main process"
            error = CheckpointError(f"{who} failed to save: {status}", path=self.store.directory, step=step)
        return error

    def _dispatch(self, engine: Engine, job: Job, done: list[Job], fitting: bool) -> None:
        """Hand a job to the store's async save or the writer thread, or commit it now (writing ranks)."""
        store = self._async_store
        if store is not None and job.full and job.payload is not None:
            # Every rank calls write_async in the loop, in order; the main rank names the
            # checkpoint right after its commit, before the next one can commit.
            after = (lambda manifest: self._name(job)) if job.links else None
            self._pending.append((store.write_async(job.primary or "latest", job.payload, after_commit=after), job))
        elif store is not None:
            # TorchFT: another replica group writes the checkpoint, this group's data state now; or
            # only new names for the state last saved: after its commit.
            for pending, _ in self._pending if job.full else ():
                pending.wait()
            self._commit(job)
            if job.full:
                done.append(job)
        elif self.writer is not None:
            late = optimizer_written(engine) if job.payload is not None else set()
            staging = self.writer.submit(job, late)
            if staging is not None and staging.copies is not None and staging.copies.pending:
                if fitting:  # released before the next optimizer step (docs/checkpoints.md, "Async saves on GPUs")
                    self.fence.arm(engine, staging)
                else:
                    staging.release()  # outside a fit nothing tells when the user writes the parameters
        elif self.writes:
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
                self.main_only(lambda: self._name(job))

    def _name(self, job: Job) -> None:
        for name in job.links:
            self.store.link("latest", name)
        if any(name.startswith("ckpt-") for name in job.links):
            self._prune()

    def _prune(self) -> None:
        """Keep the newest `keep_latest_k` history snapshots of each kind (step, epoch); latest and best stay."""
        keep = self.keep_latest_k
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

    def _saved(self, job: Job) -> SavedCheckpoint:
        primary = job.primary or (job.links[0] if job.links else "latest")
        return SavedCheckpoint(job.names, self.store.path(primary), job.step, job.epoch, job.reason)

    # -- background saves -----------------------------------------------------------------

    def collect(self, raise_errors: bool = True) -> Collected:
        """The saves committed in the background since the last call, and the first error (each reported once).

        With `raise_errors=False` errors are logged, not returned.
        """
        writer = self.writer
        saved: list[SavedCheckpoint] = []
        error: BaseException | None = None
        if writer is not None and (writer.done or writer.error is not None):
            saved, error = self._take_written(raise_errors)
        if error is None and self._pending and self._pending[0][0].done():
            more, error = self._take_pending(raise_errors)
            saved += more
        return saved, error

    def _take_written(self, raise_errors: bool) -> Collected:
        assert self.writer is not None
        done, error, failed = self.writer.take()
        saved = [self._saved(job) for job in done if job.full]
        if error is None:
            return saved, None
        where = failed.names if failed is not None else ()
        wrapped = CheckpointError(
            f"the background write of {list(where)} failed: {type(error).__name__}: {error}",
            path=self.store.directory,
            step=failed.step if failed else None,
        )
        wrapped.__cause__, wrapped.__suppress_context__ = error, True  # as `raise wrapped from error`
        if not raise_errors:
            logger.error("%s", wrapped)
            return saved, None
        return saved, wrapped

    def _take_pending(self, raise_errors: bool) -> Collected:
        saved: list[SavedCheckpoint] = []
        while self._pending and self._pending[0][0].done():
            pending, job = self._pending.pop(0)
            error = pending.exception()
            if error is None:
                saved.append(self._saved(job))
            elif raise_errors:
                return saved, error
            else:
                logger.error("%s", error)
        return saved, None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for background saves to be committed; False on timeout (sync saves: True)."""
        if self._pending:
            return all(pending.wait(timeout) for pending, _ in self._pending)
        return self.writer.drain(timeout) if self.writer is not None else True

    def close(self, timeout: float, raise_errors: bool = True) -> Collected:
        """Wait up to `timeout` s for background saves (and removals), stop the writer; what `collect` returns."""
        writer, drained = self.writer, True
        if writer is not None:
            drained = writer.close(timeout)
            if not drained:
                logger.error(
                    "checkpoint: background writes still running after %.0f s (drain_timeout); the newest "
                    "checkpoint may be missing",
                    timeout,
                )
        for pending, _ in self._pending:
            if not pending.wait(timeout):
                drained = False
                logger.error(
                    "checkpoint: background save of %r still running after %.0f s (drain_timeout)",
                    pending.name,
                    timeout,
                )
                break
        if drained:
            self.store.wait()  # superseded checkpoints are removed in the background
        saved, error = self._take_written(raise_errors) if writer is not None else ([], None)
        if error is None and self._pending and drained:
            more, error = self._take_pending(raise_errors)
            saved += more
        return saved, error
