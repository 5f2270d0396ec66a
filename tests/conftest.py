"""Shared test setup: one thread per process (2 shared cores), tiny models and data."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest
import torch

torch.set_num_threads(1)


def tiny_model(seed: int = 0, inputs: int = 8, classes: int = 4) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(inputs, 16), torch.nn.ReLU(), torch.nn.Linear(16, classes))


def tiny_batches(n: int = 12, batch: int = 8, inputs: int = 8, classes: int = 4, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, inputs, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)
    ]


def tiny_dataset(n: int = 96, inputs: int = 8, classes: int = 4, seed: int = 1) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(n, inputs, generator=g), torch.randint(0, classes, (n,), generator=g)
    )


_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor",
    "all_gather_object", "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all_single",
)  # fmt: skip


def count_collectives() -> dict[str, int]:
    """Count every torch.distributed collective called from Python in this (forked) process."""
    import torch.distributed as dist

    counter = {"n": 0}
    for name in _COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, **kwargs):
            counter["n"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return counter


class CollectivesPerStep:
    """A first callback that records how many `count_collectives` saw in each step; requests nothing."""

    order = 0
    raises_requests = False

    def __init__(self, counter: dict[str, int]) -> None:
        self.counter, self.per_step, self._start = counter, [], 0

    def on_step_start(self, engine) -> None:
        self._start = self.counter["n"]

    def on_step_end(self, engine) -> None:
        self.per_step.append(self.counter["n"] - self._start)


@pytest.fixture(autouse=True)
def _run_in_tmp_cwd(tmp_path, monkeypatch):
    # Engines default to a ./runs workspace: keep every test's files in its tmp dir.
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _no_leaked_signal_handlers():
    # Forked workers inherit the test process's handlers: a test that leaves
    # one behind changes what later tests' workers do on a signal.
    import signal

    watched = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    before = {sig: signal.getsignal(sig) for sig in watched}
    yield
    leaked = {signal.Signals(sig).name for sig in watched if signal.getsignal(sig) != before[sig]}
    for sig in watched:
        signal.signal(sig, before[sig])
    assert not leaked, f"the test left signal handlers installed for {sorted(leaked)}"


def execute_notebook(client) -> None:
    """`client.execute()` of an nbclient NotebookClient, keeping this process's SIGINT and SIGTERM handlers.

    nbclient installs handlers for the kernel's lifetime through asyncio, which
    then resets SIGINT to Python's default handler, not to what it was: under a
    pytest started in the background (`&`, nohup), where SIGINT is ignored, the
    test would leave a handler behind.
    """
    import signal

    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        client.execute()
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def _no_lingering_cadence_threads():
    # Later tests fork workers from this process: a thread still running at a
    # fork (holding a lock the child then needs) can hang the child. Threads
    # that finish their queue (checkpoint cleanup) get a moment to do so.
    import threading

    yield
    lingering = []
    for thread in threading.enumerate():
        if thread.name.startswith("cadence-") and thread.is_alive():
            thread.join(timeout=10)
            if thread.is_alive():
                lingering.append(thread.name)
    assert not lingering, f"the test left cadence threads running: {lingering}"
