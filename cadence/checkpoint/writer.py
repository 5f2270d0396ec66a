"""The Checkpoint callback's background writer: reused CPU staging buffers, one write in flight.

The loop only waits for the payload's tensors to be copied into staging
buffers (`staging.Staging`, reused from save to save; CUDA tensors are copied
on a side stream, which the thread waits for); a thread commits them. At most
one job is written while at most one waits: a newer `latest`-only job replaces
a waiting one, a job that makes `best` or a history snapshot is never dropped
(the loop waits for the writer to take it instead). Whether a job still waits
depends on the thread's timing, so for a collective store, whose ranks must
enter the same writes, nothing is superseded (`supersede=False`): every rank
writes every job, in submission order. Errors are kept for the loop to raise
at its next step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from typing import Any

import attrs

from cadence.checkpoint import direct_io
from cadence.checkpoint.staging import Staging


@attrs.define
class Job:
    """One commit: write `payload` as `primary` (None: no write), then give it the names in `links`.

    `full` False: this rank's replica group does not write the run's checkpoint
    at this save (TorchFT: another group does); only its own data state is
    written (`CheckpointStore.write_replica`), and no name is linked.
    """

    payload: Any
    primary: str | None
    links: tuple[str, ...]
    step: int
    epoch: int
    reason: str
    staging: Staging | None = None
    full: bool = True

    @property
    def droppable(self) -> bool:
        """Only `latest` would change: a newer job may replace it."""
        return self.primary == "latest" and not self.links

    @property
    def names(self) -> tuple[str, ...]:
        return ((self.primary,) if self.primary else ()) + self.links


class AsyncWriter:
    """A thread that runs `commit(job)` for submitted jobs, one at a time.

    Args:
        commit: writes one job (in the thread).
        supersede: a newer `latest`-only job replaces a waiting one, and a job
            that only adds names joins the waiting job. False: every job is
            committed as submitted, so the jobs do not depend on the thread's
            timing (the same on every rank of a collective store).
        share: the share of the time the thread's direct writes keep the disk
            busy while nobody waits for them (`direct_io.Pace`); 1: full speed.
            Whoever waits for the thread (`drain`, `close`, a `submit` that
            must wait for a job to be taken) makes it write at full speed.
    """

    def __init__(self, commit: Callable[[Job], None], supersede: bool = True, share: float = 1.0) -> None:
        self._commit = commit
        self.supersede = supersede
        self._pace = direct_io.Pace(share)
        self._waiters = 0  # threads waiting for the writer: it writes at full speed meanwhile
        self._cond = threading.Condition()
        self._queued: Job | None = None
        self._inflight: Job | None = None
        self._stagings = [Staging(), Staging()]
        self._thread: threading.Thread | None = None
        self._closing = False
        self.error: BaseException | None = None
        self.failed: Job | None = None
        self.done: list[Job] = []

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="cadence-checkpoint-writer", daemon=True)
        self._thread.start()

    @property
    def staged(self) -> bool:
        """Whether a staging buffer is allocated (by a save or `reserve`)."""
        return any(s.nbytes for s in self._stagings)

    def reserve(self, nbytes: int, pin: bool = False) -> None:
        """Allocate a staging buffer of `nbytes` ahead of the first save, faulted in from a background thread."""
        with self._cond:
            staging = next((s for s in self._stagings if not s.busy), None)
        if staging is not None and not self.staged:
            staging.reserve(nbytes, pin)

    def submit(self, job: Job, late: Collection[int] = ()) -> Staging | None:
        """Stage `job.payload` and queue the job (waits while a job it may not replace is waiting).

        Returns the staging its tensors were copied into (None without a payload): its
        CUDA copies of the tensors in `late` (`Staging.stage`) may still run; the caller
        calls its `release()` before anything writes them in place (`device_copy.CopyFence`).
        """
        with self._cond:
            staging = None
            queued = self._queued
            if queued is not None and job.payload is None and self.supersede:
                # Only new names for the state last submitted, which is the waiting job: add them to it.
                queued.links = tuple(dict.fromkeys(queued.links + job.links))
                return None
            if queued is not None and queued.droppable and job.primary == "latest" and self.supersede:
                staging, self._queued = queued.staging, None  # superseded by a newer save
            if self._queued is not None:
                self._wait_for(lambda: self._queued is None, None)
            if staging is None and job.payload is not None:
                free = [s for s in self._stagings if not s.busy]
                staging = max(free, key=lambda s: s.nbytes)  # the one with buffers already allocated
            if staging is not None:
                staging.busy = True
        try:
            if job.payload is not None and staging is not None:
                job.payload, job.staging = staging.stage(job.payload, late), staging
            elif staging is not None:
                staging.busy = False
        except BaseException:
            if staging is not None:
                staging.busy = False
            raise
        with self._cond:
            self._queued = job
            self._cond.notify_all()
        return job.staging

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._queued is None and not self._closing:
                    self._cond.wait()
                if self._queued is None:
                    return
                job, self._queued = self._queued, None
                self._inflight = job
                if not self._waiters:
                    self._pace.hurry.clear()
                self._cond.notify_all()
            error: BaseException | None = None
            try:
                if job.staging is not None:
                    job.staging.wait_copied()  # the CUDA copies are in the buffers before a byte is read
                with direct_io.paced(self._pace):
                    self._commit(job)
            except BaseException as exc:
                error = exc
            with self._cond:
                self._inflight = None
                if job.staging is not None:
                    job.staging.busy = False
                    job.payload = None
                if error is None:
                    self.done.append(job)
                elif self.error is None:
                    self.error, self.failed = error, job
                self._cond.notify_all()

    def pending(self) -> bool:
        with self._cond:
            return self._queued is not None or self._inflight is not None

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job is committed (or failed); False on timeout."""
        with self._cond:
            return self._wait_for(lambda: self._queued is None and self._inflight is None, timeout)

    def _wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """`self._cond.wait_for`, held: the write in flight goes at full speed while someone waits."""
        if timeout is not None and timeout <= 0:  # a look, not a wait
            return predicate()
        self._waiters += 1
        self._pace.hurry.set()
        try:
            return self._cond.wait_for(predicate, timeout)
        finally:
            self._waiters -= 1

    def close(self, timeout: float | None = None) -> bool:
        """Drain, then stop the thread; False if writes were still running after `timeout` s."""
        drained = self.drain(timeout)
        for staging in self._stagings:
            staging.close()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if drained and self._thread is not None:
            self._thread.join()
            self._thread = None
        return drained

    def take(self) -> tuple[list[Job], BaseException | None, Job | None]:
        """Committed jobs since the last call, and the first error (each reported once)."""
        with self._cond:
            done, self.done = self.done, []
            error, failed, self.error, self.failed = self.error, self.failed, None, None
        return done, error, failed
