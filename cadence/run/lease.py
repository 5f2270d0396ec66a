"""The run directory's lease: one live launch per run directory.

Two launches of one configuration resolve to one run directory; without a
lease both would write its `checkpoints/latest` and `attempts.jsonl`, and the
second would resume from the first's checkpoints mid-run. The main process
that opens a run directory therefore holds a POSIX record lock
(`fcntl.lockf`) on `metadata/lease`, which also says who holds it (host, pid,
attempt, since when). The kernel releases the lock when the process ends, by
any death, SIGKILL included: a requeued or restarted job (SLURM, torchrun)
takes it again by itself. A record lock, rather than `flock`, is not inherited
by forked children (DataLoader workers), so a dead holder's lingering workers
do not keep it, and it works on NFS.

Record locks belong to a process: a second engine of the same run in the same
process (a notebook, a test) shares the lease, so the process keeps one open
file per directory and closes it when the last engine holding it is closed or
collected. The price of record locks: closing any descriptor of the file drops
the process's lock, so the holder reads `metadata/lease` only through the
descriptor it holds (`holder`), and code in the holding process should not open
that file itself (copying a live run directory from inside its own training
process would release the lease).

A second live launch fails at once naming the holder; with
`CADENCE_RUN_LEASE_WAIT=<seconds>` (or `inf`) it waits that long for the holder
to end first. See docs/run-directory.md.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import math
import os
import socket
import time
import weakref
from pathlib import Path
from typing import Any

LEASE_FILE = "lease"
WAIT_ENV = "CADENCE_RUN_LEASE_WAIT"
"""Environment variable: seconds a launch waits for a live holder of its run directory (default 0, `inf`: forever)."""
POLL_SECONDS = 0.2

# real path -> (descriptor, {id(engine): its finalizer}); one descriptor per directory (see the module docstring).
_held: dict[str, tuple[int, dict[int, weakref.finalize]]] = {}
# A forked child holds no record lock of its parent's: it starts with none (its copies of the files stay open).
os.register_at_fork(after_in_child=_held.clear)


class RunDirectoryBusy(RuntimeError):
    """Another live process holds the run directory's lease."""


def lease_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "metadata" / LEASE_FILE


def wait_seconds() -> float:
    """`$CADENCE_RUN_LEASE_WAIT` as seconds (0 when unset)."""
    value = os.environ.get(WAIT_ENV, "").strip()
    if not value:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise ValueError(f"{WAIT_ENV}={value!r} in the environment: expected seconds >= 0 or 'inf'")
    return seconds


def acquire(run_dir: Path, owner: object, attempt: str, wait: float | None = None) -> None:
    """Take the lease of `run_dir` until `release_all(owner)`, `owner` (an engine) is collected,
    or this process ends.

    Raises:
        RunDirectoryBusy: another live process holds it, and it was not freed within `wait`
            seconds (default `$CADENCE_RUN_LEASE_WAIT`, else 0).
    """
    path = lease_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(path)
    entry = _held.get(key)
    if entry is None:
        fd = _lock(path, wait_seconds() if wait is None else wait)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "attempt": attempt, "since": _now()}
        data = (json.dumps(record) + "\n").encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        entry = _held[key] = (fd, {})
    if id(owner) not in entry[1]:
        entry[1][id(owner)] = weakref.finalize(owner, _drop, key, id(owner))


def release_all(owner: object) -> None:
    """`owner` no longer holds any lease; the last holder of one in this process unlocks it."""
    for _, owners in list(_held.values()):
        finalizer = owners.get(id(owner))
        if finalizer is not None:
            finalizer()  # runs _drop once


def _lock(path: Path, wait: float) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait if math.isfinite(wait) else math.inf
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_SECONDS)
    os.close(fd)
    who = holder(path.parent.parent) or {}
    raise RunDirectoryBusy(
        f"run directory {path.parent.parent} is in use by pid {who.get('pid', '?')} on host "
        f"{who.get('host', '?')} (attempt {who.get('attempt', '?')}, since {who.get('since', '?')}): "
        "two live launches of one run would share its checkpoints. Stop that launch, let this one wait "
        f"for it ({WAIT_ENV}=<seconds>), or give this one another run (EngineConfig.run_id)"
        + (f"; waited {wait:g} s" if wait else "")
    )


def _drop(key: str, owner: int) -> None:
    entry = _held.get(key)
    if entry is None:
        return
    entry[1].pop(owner, None)
    if not entry[1]:
        del _held[key]
        os.close(entry[0])  # the kernel releases the lock


def holder(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Who holds the run directory's lease (`host`, `pid`, `attempt`, `since`), or None when no live process does."""
    path = lease_path(run_dir)
    key = os.path.realpath(path)
    if key in _held:  # this process: reading through another descriptor and closing it would drop the lock
        return _record(os.pread(_held[key][0], 4096, 0))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # held: the record says by whom
            return _record(os.pread(fd, 4096, 0)) or {}
        return None
    finally:
        os.close(fd)


def _record(data: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(data.decode("utf-8"))
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
