"""Comparisons the harness makes: nested states, and the process-wide things a run may leak."""

from __future__ import annotations

import gc
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

#: Signals whose handlers a callback may install (and must restore).
WATCHED_SIGNALS: tuple[str, ...] = (
    "SIGINT",
    "SIGTERM",
    "SIGHUP",
    "SIGQUIT",
    "SIGUSR1",
    "SIGUSR2",
    "SIGALRM",
    "SIGCHLD",
)


def first_difference(a: Any, b: Any, path: str = "", *, ignore: Sequence[str] = ()) -> str | None:
    """Where two nested states differ, as `path: a != b`; None when equal.

    Tensors must be equal in dtype, shape and value (NaN equals NaN); floats
    compare exactly (NaN equals NaN). `ignore` holds dotted paths to skip.
    """
    if path in ignore:
        return None
    where = path or "<root>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {_short(a)} != {_short(b)}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        if not torch.equal(a.cpu(), b.cpu()) and not _nan_equal(a, b):
            return f"{where}: tensors differ (max |a - b| = {_max_diff(a, b)})"
        return None
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            only_a = sorted(map(str, set(a) - set(b)))
            only_b = sorted(map(str, set(b) - set(a)))
            return f"{where}: keys differ (only in the first: {only_a}, only in the second: {only_b})"
        for key in a:
            found = first_difference(a[key], b[key], f"{path}.{key}" if path else str(key), ignore=ignore)
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]", ignore=ignore)
            if found:
                return found
        return None
    if attrs.has(type(a)) and type(a) is type(b):
        return first_difference(attrs.asdict(a, recurse=False), attrs.asdict(b, recurse=False), path, ignore=ignore)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    try:
        equal = bool(a == b)
    except Exception:  # an object whose == is not a bool (numpy arrays)
        equal = repr(a) == repr(b)
    return None if equal else f"{where}: {_short(a)} != {_short(b)}"


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_floating_point() and bool(torch.equal(torch.nan_to_num(a.cpu(), 1.5), torch.nan_to_num(b.cpu(), 1.5)))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    try:
        return f"{(a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item():.3g}"
    except RuntimeError:
        return "?"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def max_parameter_difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    worst = 0.0
    for key, value in a.items():
        if torch.is_tensor(value) and value.is_floating_point():
            worst = max(worst, (value.double() - b[key].double()).abs().max().item())
    return worst


@attrs.define
class ProcessSnapshot:
    """What a run must give back: threads, signal handlers, gc settings, logging handlers, grad mode."""

    threads: dict[int, tuple[str, str]]  # ident -> (name, description)
    signals: dict[str, Any]
    gc_enabled: bool
    gc_threshold: tuple[int, ...]
    gc_callbacks: int
    log_handlers: dict[str, int]
    grad_enabled: bool
    trace: Any

    @classmethod
    def take(cls) -> ProcessSnapshot:
        return cls(
            threads={t.ident or 0: (t.name, _describe_thread(t)) for t in threading.enumerate()},
            signals={
                name: signal.getsignal(getattr(signal, name)) for name in WATCHED_SIGNALS if hasattr(signal, name)
            },
            gc_enabled=gc.isenabled(),
            gc_threshold=gc.get_threshold(),
            gc_callbacks=len(gc.callbacks),
            log_handlers={
                name or "root": len(logging.getLogger(name).handlers) for name in ("", "cadence", "py.warnings")
            },
            grad_enabled=torch.is_grad_enabled(),
            trace=(sys.gettrace(), sys.getprofile()),
        )

    def new_threads(self, after: ProcessSnapshot, allow: Sequence[str] = ()) -> dict[int, tuple[str, str]]:
        """Threads alive in `after` but not here, except those named with an allowed prefix."""
        return {i: t for i, t in after.threads.items() if i not in self.threads and not t[0].startswith(tuple(allow))}

    def leaks(self, after: ProcessSnapshot, allow_threads: Sequence[str] = ()) -> list[str]:
        """What `after` holds that this snapshot did not (one line each).

        Threads whose names start with one of `allow_threads` are not counted.
        """
        found = []
        for _, description in self.new_threads(after, allow_threads).values():
            found.append(f"thread left running: {description}")
        for name, handler in after.signals.items():
            if handler is not self.signals.get(name) and handler != self.signals.get(name):
                found.append(f"{name} handler changed: {self.signals.get(name)!r} -> {handler!r}")
        if after.gc_enabled != self.gc_enabled:
            found.append(f"gc.isenabled() changed: {self.gc_enabled} -> {after.gc_enabled}")
        if after.gc_threshold != self.gc_threshold:
            found.append(f"gc.get_threshold() changed: {self.gc_threshold} -> {after.gc_threshold}")
        if after.gc_callbacks != self.gc_callbacks:
            found.append(f"gc.callbacks changed: {self.gc_callbacks} -> {after.gc_callbacks} entries")
        for name, count in after.log_handlers.items():
            if count != self.log_handlers.get(name):
                found.append(f"logging handlers of logger {name!r} changed: {self.log_handlers.get(name)} -> {count}")
        if after.grad_enabled != self.grad_enabled:
            found.append(f"torch.is_grad_enabled() changed: {self.grad_enabled} -> {after.grad_enabled}")
        if after.trace != self.trace:
            found.append(f"sys.settrace/setprofile changed: {self.trace} -> {after.trace}")
        return found


def _describe_thread(thread: threading.Thread) -> str:
    target = getattr(thread, "_target", None)
    where = getattr(target, "__qualname__", None) or type(thread).__qualname__
    module = getattr(target, "__module__", None) or type(thread).__module__
    return f"{thread.name!r} (daemon={thread.daemon}, runs {module}.{where})"


def settled_snapshot(baseline: ProcessSnapshot, wait: float, allow_threads: Sequence[str] = ()) -> ProcessSnapshot:
    """A snapshot taken once new threads have ended, or after `wait` seconds.

    A thread told to stop at teardown may need a moment to notice: give it
    that moment before calling it leaked.
    """
    deadline = time.monotonic() + wait
    while True:
        gc.collect()
        snapshot = ProcessSnapshot.take()
        if not baseline.new_threads(snapshot, allow_threads) or time.monotonic() > deadline:
            return snapshot
        time.sleep(0.05)
