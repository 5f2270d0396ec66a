"""Run a function on several processes: locally (fork/spawn) or on SLURM (submitit).

`launch(fn, nprocs=N)` starts N local workers with `torch.multiprocessing`'s
`start_processes`, each with the environment `torchrun` would set (MASTER_ADDR,
MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE), so code that
builds `Engine(..., backend="auto")` inside `fn` trains with DDP unchanged. It
returns rank 0's return value and re-raises a worker's failure as
`WorkerError` naming the rank, with its traceback. With `slurm=SlurmConfig(...)`
the same function runs as a submitit job, one task per GPU. See docs/launching.md.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cadence.launch_slurm import SlurmConfig, slurm_requeue, submit_slurm

__all__ = ["Preempted", "SlurmConfig", "WorkerError", "launch", "slurm_requeue"]

# The exit code of a clean preemption (Preemption's default: 128 + SIGTERM).
_PREEMPTED_EXIT = 143
# After SIGTERM, how long a worker gets to exit before SIGKILL.
_TERMINATE_GRACE_S = 5.0


class WorkerError(RuntimeError):
    """A worker process failed; names its rank and carries its traceback.

    Attributes:
        rank: the global rank that failed first.
        exitcode: the worker's exit code (negative: killed by that signal).
        traceback: the formatted traceback from the worker ("" if it died without one).
        exc_type: the name of the exception the worker raised ("" if none).
        original: the worker's exception object when it could be pickled back, else None.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exitcode: int | None = None,
        traceback: str = "",
        exc_type: str = "",
        original: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.traceback = traceback
        self.exc_type = exc_type
        self.original = original

    def __reduce__(self) -> Any:
        kwargs = {"rank": self.rank, "exitcode": self.exitcode, "traceback": self.traceback, "exc_type": self.exc_type}
        return (_rebuild_worker_error, (str(self), kwargs))


def _rebuild_worker_error(message: str, kwargs: dict[str, Any]) -> WorkerError:
    return WorkerError(message, **kwargs)


class Preempted(WorkerError):
    """The workers were preempted and stopped cleanly: `Preemption`'s exit (`SystemExit(143)`).

    Not a crash: the run saved its checkpoint at an agreed step and exited
    with the code schedulers expect of a terminated job. Start it again to
    resume (`Checkpoint(auto_resume=True)`). A `WorkerError`, so code that
    treats every non-result as a failure keeps doing so; catch `Preempted`
    first to tell the two apart. `exitcode` is the workers' exit code.
    """

    def __reduce__(self) -> Any:
        return (_rebuild_preempted, (str(self), {"rank": self.rank, "exitcode": self.exitcode}))


def _rebuild_preempted(message: str, kwargs: dict[str, Any]) -> Preempted:
    return Preempted(message, **kwargs)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int | None = None,
    start_method: str | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    slurm: SlurmConfig | None = None,
    **kwargs: Any,
) -> Any:
    """Run `fn(*args, **kwargs)` on `nprocs` processes; return rank 0's result.

    Each worker gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT picked by the
    OS, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and OMP_NUM_THREADS=1
    (plus `env`), and calls `torch.set_num_threads` before running `fn`.

    Args:
        fn: the function every rank runs. It reads its rank from the
            environment (or from `engine.backend`).
        *args, **kwargs: passed to `fn`; they must be picklable with "spawn".
        nprocs: number of processes; default: one per CUDA device, else 1.
        start_method: "fork" or "spawn". Default: "fork" when `fn` cannot be
            imported by name (defined in `__main__`, a notebook, or inside
            another function), else "spawn".
        timeout: seconds before every worker is killed and `TimeoutError` raised.
        env: extra environment variables for the workers.
        slurm: submit to SLURM through submitit instead (see `SlurmConfig`).

    Returns:
        What `fn` returned on rank 0 (it must be picklable).

    Raises:
        Preempted: the workers stopped on a preemption (`SystemExit(143)` from
            the `Preemption` callback, after its checkpoint); a `WorkerError`.
        WorkerError: a worker raised or died; the first rank to fail is named,
            with its traceback. The other workers are killed.
        TimeoutError: `timeout` passed; every worker was killed.

    Example:
        >>> import os, cadence
        >>> def rank_and_size():
        ...     return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        >>> cadence.launch(rank_and_size, nprocs=2)  # doctest: +SKIP
        (0, 2)
    """
    if slurm is not None:
        return submit_slurm(fn, args, kwargs, slurm, env=env, timeout=timeout)
    if nprocs is None:
        nprocs = _default_nprocs()
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"launch(nprocs=...) must be an int >= 1, got {nprocs!r}")
    method = start_method or ("spawn" if importable(fn) else "fork")
    _check_start_method(method, fn)
    workdir = Path(tempfile.mkdtemp(prefix="cadence-launch-"))
    worker_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "OMP_NUM_THREADS": os.environ.get("CADENCE_WORKER_THREADS", "1"),
        **(env or {}),
    }
    import torch.multiprocessing

    try:
        context = torch.multiprocessing.start_processes(
            _run_worker,
            args=(fn, args, kwargs, worker_env, str(workdir)),
            nprocs=nprocs,
            join=False,
            start_method=method,
        )
        _join(context.processes, workdir, timeout)
        result_file = workdir / "result.pkl"
        if not result_file.exists():  # every exit code was 0, yet rank 0 returned nothing
            raise _failure(context.processes, workdir, 0)
        with result_file.open("rb") as fh:
            return pickle.load(fh)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_worker(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: dict[str, str],
    workdir: str,
) -> None:
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(local_rank)
    import torch

    # A forked child inherits the parent's thread pool state: resize it before
    # the first torch op, else it can hang (see ENVIRONMENT.md).
    torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS", "1"))))
    if hasattr(signal, "SIGUSR2"):  # on a timeout the launcher asks every stuck rank for its stacks
        stacks = (Path(workdir) / f"stacks-{local_rank}.txt").open("w")  # open until the process ends
        faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        _write_error(Path(workdir), local_rank, exc)
        raise
    if local_rank == 0:
        tmp = Path(workdir) / "result.pkl.tmp"
        with tmp.open("wb") as fh:
            pickle.dump(result, fh)
        tmp.rename(Path(workdir) / "result.pkl")


def _write_error(workdir: Path, rank: int, exc: BaseException) -> None:
    preempted = exc.code if isinstance(exc, SystemExit) and exc.code == _PREEMPTED_EXIT else None
    report: dict[str, Any] = {
        "preempted": preempted,
        "rank": rank,
        "time": time.time(),
        "traceback": traceback.format_exc(),
        "exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "original": None,
    }
    with contextlib.suppress(Exception):
        report["original"] = pickle.dumps(exc)
    tmp = workdir / f"error-{rank}.pkl.tmp"
    with tmp.open("wb") as fh:
        pickle.dump(report, fh)
    tmp.rename(workdir / f"error-{rank}.pkl")


def _join(processes: list[Any], workdir: Path, timeout: float | None) -> None:
    """Wait for every worker; on a failure or the timeout, kill the rest and raise."""
    deadline = None if timeout is None else time.monotonic() + timeout
    waiting = {p.sentinel: rank for rank, p in enumerate(processes)}
    try:
        while waiting:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                running = sorted(waiting.values())
                raise TimeoutError(
                    f"launch: timeout of {timeout} s passed with ranks {running} still running; "
                    "every worker was killed. Raise timeout=... or look for a hang (a collective one rank never joined)."
                    + _stacks(processes, running, workdir)
                )
            for sentinel in multiprocessing.connection.wait(list(waiting), timeout=left):
                rank = waiting.pop(sentinel)  # type: ignore[call-overload]
                processes[rank].join()
                if processes[rank].exitcode != 0:
                    raise _failure(processes, workdir, rank)
    finally:
        _terminate(processes)


def _stacks(processes: list[Any], ranks: list[int], workdir: Path) -> str:
    """The Python stacks of the stuck ranks (faulthandler, on SIGUSR2), for the timeout's message."""
    if not hasattr(signal, "SIGUSR2"):
        return ""
    for rank in ranks:
        with contextlib.suppress(OSError):
            os.kill(processes[rank].pid, signal.SIGUSR2)
    time.sleep(0.5)
    parts = []
    for rank in ranks:
        with contextlib.suppress(OSError):
            text = (workdir / f"stacks-{rank}.txt").read_text().strip()
            if text:
                parts.append(f"\n--- rank {rank}, where it was stuck ---\n{text}")
    return "".join(parts)


def _failure(processes: list[Any], workdir: Path, exited: int) -> WorkerError:
    # Let the other ranks' reports land: a rank blocked in a collective with the
    # failed one errors out right after it, and the first failure is the cause.
    time.sleep(0.2)
    reports = []
    for path in workdir.glob("error-*.pkl"):
        with contextlib.suppress(Exception), path.open("rb") as fh:
            reports.append(pickle.load(fh))
    nprocs = len(processes)
    if not any(r["rank"] == exited for r in reports):
        # The rank seen exiting first left no report: it died outside Python (killed, a segfault, os._exit),
        # and the others' errors ("Connection reset by peer") are its consequence, not the cause.
        code = processes[exited].exitcode
        if code == 0:
            how = "exited with code 0 but returned no result (interrupted?)"
        elif code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        then = min(reports, key=lambda r: r["time"]) if reports else None
        after = f"; then rank {then['rank']} failed: {then['exc_type']}: {then['message']}" if then else ""
        return WorkerError(
            f"rank {exited} of {nprocs} {how} without raising a Python exception "
            f"(out of memory, a segfault, or os._exit); see its output above{after}",
            rank=exited,
            exitcode=code,
        )
    first = min(reports, key=lambda r: r["time"])
    if first.get("preempted") is not None:
        code = first["preempted"]
        return Preempted(
            f"preempted: rank {first['rank']} of {nprocs} stopped at an agreed step and exited with {code} "
            "(SystemExit from the Preemption callback, after its checkpoint); start the run again to resume",
            rank=first["rank"],
            exitcode=code,
        )
    others = sorted(r["rank"] for r in reports if r is not first)
    original = None
    if first["original"] is not None:
        with contextlib.suppress(Exception):
            original = pickle.loads(first["original"])
    also = f" (ranks {others} failed after it)" if others else ""
    message = (
        f"rank {first['rank']} of {nprocs} failed{also}: {first['exc_type']}: {first['message']}\n\n"
        f"Traceback from rank {first['rank']}:\n{first['traceback']}"
    )
    return WorkerError(
        message,
        rank=first["rank"],
        exitcode=processes[first["rank"]].exitcode,
        traceback=first["traceback"],
        exc_type=first["exc_type"],
        original=original,
    )


def _terminate(processes: list[Any]) -> None:
    """SIGTERM every live worker, then SIGKILL whatever is left after a grace period."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()


def importable(fn: Callable[..., Any]) -> bool:
    """True if a spawned process can import `fn` by its module and qualified name."""
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module_name or module_name == "__main__" or "<" in qualname:
        return False
    module = sys.modules.get(module_name)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj is fn


def _check_start_method(method: str, fn: Callable[..., Any]) -> None:
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(
            f"launch(start_method={method!r}) is not available here; available: {multiprocessing.get_all_start_methods()}"
        )
    if method == "fork":
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            raise RuntimeError(
                "launch: CUDA is already initialized in this process, so forked workers cannot use it. "
                "Move the function into an importable module and use start_method='spawn', "
                "or launch before touching CUDA."
            )
    elif not importable(fn):
        raise ValueError(
            f"launch(start_method={method!r}): {getattr(fn, '__qualname__', fn)!r} cannot be imported by a new "
            "process (it is defined in __main__, a notebook, or inside a function). Use start_method='fork' "
            "or move it to a module."
        )


def _default_nprocs() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on `host` (a tiny race remains until it is bound again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class _CallableModule(types.ModuleType):
    # `import cadence.launch` binds the name `cadence.launch` to this module,
    # shadowing the lazily exported function; keep `cadence.launch(fn, ...)`
    # working either way by making the module call `launch`.
    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return launch(fn, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
