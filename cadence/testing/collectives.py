"""Record every collective a rank calls, with who called it and at which step.

Each worker of a multi-rank check writes one line per collective to its own
file, flushed at once, so the record survives a rank that hangs and is killed.
Comparing the files rank by rank shows a collective called on one rank only.
Each rank also reads its peers' files before every collective it records: when
a peer's collective at the same position differs, it raises `CollectiveMismatch`
instead of entering a collective that would hang or abort.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cadence.backends.ddp import DDPBackend
from cadence.engine.backend import Backend

#: torch.distributed functions the log wraps (when this torch has them).
COLLECTIVES: tuple[str, ...] = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
    "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "all_gather_single", "reduce_scatter_single",
)  # fmt: skip

# Frames in these folders (and contextlib) are plumbing, not the caller worth naming.
PLUMBING = (
    *(
        str(Path(p).resolve()) + os.sep
        for p in (Path(__file__).parent, Path(torch.__file__).parent, Path(__file__).parent.parent / "backends")
    ),
    contextlib.__file__,
)


class CollectiveMismatch(RuntimeError):
    """This rank is about to call a collective that differs from a peer's at the same position."""


class CollectiveLog:
    """Appends `{"op", "sig", "where", "step"}` lines to a file, one per collective.

    Args:
        path: this rank's log.
        peers: the other ranks' logs, by rank, compared before each collective.
    """

    def __init__(self, path: Path, peers: dict[int, Path] | None = None) -> None:
        self.file = path.open("w", encoding="utf-8")
        self.depth = 0
        self.count = 0
        self.engine: Any = None
        self.peers = dict(peers or {})
        self._seen: dict[int, list[dict[str, Any]]] = {rank: [] for rank in self.peers}
        self._offsets: dict[int, int] = dict.fromkeys(self.peers, 0)

    @contextlib.contextmanager
    def call(self, op: str, *args: Any) -> Iterator[None]:
        # A backend method and the torch.distributed call inside it are one collective.
        if self.depth == 0:
            self.record(op, args)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def record(self, op: str, args: tuple[Any, ...]) -> None:
        step = self.engine.state.step if self.engine is not None else None
        where = "" if op.startswith(MARK) else caller()
        line = {"i": self.count, "op": op, "sig": signature(args), "where": where, "step": step}
        self.count += 1
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        self._compare_with_peers(line)

    def _compare_with_peers(self, line: dict[str, Any]) -> None:
        for rank in self.peers:
            seen = self._peer_calls(rank)
            if len(seen) <= line["i"]:
                continue  # that rank has not got this far yet; it compares when it does
            other = seen[line["i"]]
            if (other["op"], other["sig"]) != (line["op"], line["sig"]):
                raise CollectiveMismatch(
                    f"call #{line['i']}: this rank calls {describe_call(line)}, but rank {rank} called "
                    f"{describe_call(other)}; stopping here instead of entering a collective that would hang"
                )

    def _peer_calls(self, rank: int) -> list[dict[str, Any]]:
        seen = self._seen[rank]
        try:
            with self.peers[rank].open("rb") as fh:
                fh.seek(self._offsets[rank])
                chunk = fh.read()
        except FileNotFoundError:
            return seen
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written is read next time
        self._offsets[rank] += len(complete)
        seen.extend(json.loads(text) for text in complete.decode().splitlines() if text)
        return seen

    def wrap(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            with self.call(op, *args):
                return fn(*args, **kwargs)

        recorded.__wrapped__ = fn  # type: ignore[attr-defined]
        return recorded

    @contextlib.contextmanager
    def patch_torch_distributed(self) -> Iterator[None]:
        """Record the torch.distributed collectives called (directly or not) in this block."""
        from torch.distributed import distributed_c10d

        originals: list[tuple[Any, str, Any]] = []
        for name in COLLECTIVES:
            for module in (dist, distributed_c10d):
                fn = getattr(module, name, None)
                if fn is not None:
                    originals.append((module, name, fn))
                    setattr(module, name, self.wrap(name, fn))
        try:
            yield
        finally:
            for module, name, fn in reversed(originals):
                setattr(module, name, fn)
            self.file.close()


def describe_call(line: dict[str, Any]) -> str:
    if line["op"].startswith(MARK):
        return f"event {line['op'][len(MARK) :]} at step {line['step']}"
    return f"{line['op']}({line['sig']}) in {line['where']} at step {line['step']}"


#: Prefix of the entries that mark an event rather than a collective.
MARK = "event:"


class EventMarker:
    """Writes an entry for each rank-symmetric event into the log, after every other callback.

    Collectives the log cannot see (DDP's own, in C++) happen between these
    events; marking them lets a rank that calls an extra collective be caught
    by the first marker of its peer instead of pairing with a hidden collective
    and hanging.
    """

    order = 10**9 + 1
    state_key = "cadence.testing.event-marker"

    def __init__(self, log: CollectiveLog) -> None:
        self.log = log

    def _mark(self, name: str) -> None:
        self.log.record(MARK + name, ())


for _event in (
    "on_fit_start", "on_step_start", "on_forward", "on_backward", "on_before_optimizer_step",
    "on_optimizer_step", "on_step_end", "on_epoch_end", "on_fit_end", "on_eval_start", "on_eval_end",
):  # fmt: skip
    setattr(EventMarker, _event, lambda self, engine, name=_event: self._mark(name))


def signature(args: tuple[Any, ...]) -> str:
    """`float32[3]`-style description of the tensors among `args` (or the op's shape otherwise)."""
    parts = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            parts.append(f"{str(arg.dtype).removeprefix('torch.')}{list(arg.shape)}")
        elif isinstance(arg, (list, tuple)) and arg and all(isinstance(a, torch.Tensor) for a in arg):
            parts.append(f"{len(arg)} x {str(arg[0].dtype).removeprefix('torch.')}{list(arg[0].shape)}")
        elif hasattr(arg, "pending") and hasattr(arg, "names"):  # control requests
            parts.append(f"requests{list(arg.names)}")
    return ", ".join(parts)


def caller() -> str:
    """The callback hook (`Class.on_event`) or else the first non-plumbing function on the stack."""
    frame = sys._getframe(2)
    fallback = None
    while frame is not None:
        code = frame.f_code
        owner = frame.f_locals.get("self") if code.co_name.startswith("on_") else None
        if owner is not None:
            return f"{type(owner).__qualname__}.{code.co_name}"
        if fallback is None and not code.co_filename.startswith(PLUMBING):
            fallback = getattr(code, "co_qualname", code.co_name)
        frame = frame.f_back  # type: ignore[assignment]
    return fallback or "?"


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = []
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            lines.append(json.loads(text))
        except ValueError:  # the last line of a killed rank may be cut
            break
    return lines


class _Counting(Backend):
    """Records a backend's own collectives (as `backend.<method>`) in `self.log`; mixed in before a backend class."""

    log: CollectiveLog

    def reduce(self, tensor: Any, op: Any = "sum", domain: Any = "data") -> Any:
        with self.log.call("backend.reduce", tensor):
            return super().reduce(tensor, op, domain)

    def all_gather(self, tensor: Any, domain: Any = "data") -> Any:
        with self.log.call("backend.all_gather", tensor):
            return super().all_gather(tensor, domain)

    def all_gather_object(self, obj: Any, domain: Any = "data") -> list[Any]:
        with self.log.call("backend.all_gather_object"):
            return super().all_gather_object(obj, domain)

    def agree(self, requests: Any) -> None:
        with self.log.call("backend.agree", requests):
            super().agree(requests)

    def barrier(self, timeout: float | None = None) -> None:
        with self.log.call("backend.barrier"):
            super().barrier(timeout)

    def broadcast_object(self, obj: Any, src: int = 0, domain: Any = "optimizer") -> Any:
        with self.log.call("backend.broadcast_object"):
            return super().broadcast_object(obj, src, domain)


class CountingDDPBackend(_Counting, DDPBackend):
    """`DDPBackend` whose own collectives are recorded too (as `backend.<method>`)."""

    def __init__(self, log: CollectiveLog, **options: Any) -> None:
        super().__init__(**options)
        self.log = log


def counting(backend: Any, log: CollectiveLog) -> Any:
    """`backend` (any distributed backend, not yet set up) with its own collectives recorded too."""
    cls = type(backend)
    backend.__class__ = type(f"Counting{cls.__name__}", (_Counting, cls), {})
    backend.log = log
    return backend
