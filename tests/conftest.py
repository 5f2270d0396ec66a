"""Shared test setup: one thread per process (2 shared cores), tiny models and data, CUDA tests.

Tests on a machine with a GPU (see docs/gpus.md, "Running the tests on a GPU"):

- A test about CPU behaviour says so: `device="cpu"` on the Engine or the
  backend; multi-process gloo tests pin the CPU in every rank.
- A test that needs CUDA is marked `@pytest.mark.cuda` (`cuda(gpus=2)` for
  two); it is skipped, with the reason, where fewer GPUs are visible.
- A test that trains on the default device on purpose is marked
  `default_device`. The docs' and the README's examples, which name no
  device, run in the test process with the `cpu_default_device` fixture.

Forking after CUDA: a process that has initialized CUDA cannot fork workers
that use it (torch raises "Cannot re-initialize CUDA in forked subprocess", and
`cadence.launch` refuses to fork then). Most multi-process tests fork (0.1 s a
launch instead of 4-5 s with spawn), so rather than make them all spawn, the
tests that may initialize CUDA (marked `cuda` or `default_device`) run last,
after every forking test (`pytest_collection_modifyitems` below), and on a
machine with a GPU any other test that initializes CUDA fails, naming itself
(`_cuda_stays_uninitialized`): it would break every forking test after it.
A `cuda` test that must fork starts its workers with spawn.

Tests that rely on the default device are found without a GPU: every backend
that falls back to its default device (`device=None`) raises, in the test
process and in its forked workers, unless the test is marked `cuda` or
`default_device`. This guard is on in every run (CI's included), so a new test
that would take a GPU on a GPU host fails on a CPU machine first;
`CADENCE_TEST_EXPLICIT_DEVICE=0` turns it off.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest
import torch

torch.set_num_threads(1)

#: CUDA devices this process sees (counting them initializes no CUDA context).
VISIBLE_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
#: The markers of tests that may initialize CUDA: they run after every other test.
CUDA_PHASE = ("cuda", "default_device")


def _gpus_needed(item: pytest.Item) -> int | None:
    marker = item.get_closest_marker("cuda")
    if marker is None:
        return None
    return int(marker.kwargs.get("gpus", marker.args[0] if marker.args else 1))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Skip what needs more GPUs than this machine has, with the reason; then move the tests that
    # may initialize CUDA after every other test (a stable sort: the order within each part is kept).
    for item in items:
        gpus = _gpus_needed(item)
        if gpus is not None and VISIBLE_GPUS < gpus:
            have = (
                "no CUDA device is visible" if not VISIBLE_GPUS else f"only {VISIBLE_GPUS} CUDA device(s) are visible"
            )
            item.add_marker(pytest.mark.skip(reason=f"needs {gpus} CUDA device(s); {have}"))
    items.sort(key=lambda item: any(item.get_closest_marker(name) for name in CUDA_PHASE))


@pytest.fixture(autouse=True)
def _cuda_stays_uninitialized(request):
    # Only on a machine with a GPU, and only while CUDA is not yet initialized (before the CUDA phase).
    watch = VISIBLE_GPUS > 0 and not torch.cuda.is_initialized()
    yield
    if watch and torch.cuda.is_initialized() and not any(request.node.get_closest_marker(m) for m in CUDA_PHASE):
        pytest.fail(
            f"{request.node.nodeid} initialized CUDA but is not marked `cuda` or `default_device`: every forking "
            "test after it would fail ('Cannot re-initialize CUDA in forked subprocess'). Pin the CPU "
            "(device='cpu') in a test about CPU behaviour, or mark the test (see tests/conftest.py)",
            pytrace=False,
        )


@pytest.fixture
def cpu_default_device(monkeypatch):
    """Backends built without a device take the CPU: for examples that name none (docs pages, the README).

    Such examples, run in the test process on a GPU host, would initialize CUDA and then fork
    (docs/launching.md launches workers after building an engine): here they run on the CPU.
    """
    from cadence.backends import device as devices

    choose = devices.choose_device

    def cpu_unless_named(requested, **kwargs):
        return choose("cpu" if requested is None or requested == "" else requested, **kwargs)

    monkeypatch.setattr(devices, "choose_device", cpu_unless_named)


class DefaultDeviceUsed(RuntimeError):
    """Raised when a test's backend falls back to its default device (unless CADENCE_TEST_EXPLICIT_DEVICE=0)."""


@pytest.fixture(autouse=True)
def _explicit_device_only(request, monkeypatch):
    if os.environ.get("CADENCE_TEST_EXPLICIT_DEVICE", "1") == "0":
        return
    if any(request.node.get_closest_marker(m) for m in CUDA_PHASE):
        return
    from cadence.backends import device as devices

    choose = devices.choose_device

    def explicit_only(requested, **kwargs):
        if requested is None or requested == "":
            raise DefaultDeviceUsed(
                f"CADENCE_TEST_EXPLICIT_DEVICE: {request.node.nodeid} built a backend without a device, which picks "
                "CUDA on a machine with a GPU; say device='cpu' (Engine or backend), or mark the test "
                "`default_device` if it checks the default on purpose"
            )
        return choose(requested, **kwargs)

    # The rule itself is replaced (resolve_device calls it by name): a guard of the test harness, inherited
    # by forked workers, not a stand-in for the unit under test.
    monkeypatch.setattr(devices, "choose_device", explicit_only)


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
def _environment_restored():
    # Backends set process-wide variables torch reads once (the flight recorder's size,
    # DeepSpeed's MASTER_ADDR/RANK in one process): harmless in a training process, but
    # in this one every later test's subprocesses and forked workers would inherit them
    # (a benchmark's recorder-off run then recorded, CI run of d0fdb77). Each test gets
    # the environment it started with back.
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


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
