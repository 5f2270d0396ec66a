"""TrainMetrics' CUDA memory figures: read at the reduction, reset per interval, absent off CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.callbacks.memory import CudaMemory
from cadence.callbacks.metrics import TrainMetrics
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)

STEP_EVENTS = [e for e in cadence.Event if e.value in ("on_step_start", "on_batch", "on_forward", "on_backward",
                                                        "on_before_optimizer_step", "on_optimizer_step", "on_step_end")]  # fmt: skip
NAMES = {"memory.peak_allocated_gib", "memory.peak_reserved_gib", "memory.alloc_retries"}


def make_engine(device, memory=True, **kwargs):
    model = tiny_model()
    return cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(12), loss_fn=F.cross_entropy,
        callbacks=[TrainMetrics(memory=memory)], log_interval=2, seed=0, device=device, **kwargs,
    )  # fmt: skip


def record_logs(engine):
    logs = []
    engine.on(cadence.Event.ON_LOG)(lambda e: logs.append(dict(e.logged)))
    return logs


def test_off_cuda_nothing_is_read_or_logged_and_no_hook_is_added():
    assert CudaMemory.started(torch.device("cpu")) is None
    hooks = {}
    for memory in (False, True):
        engine = make_engine("cpu", memory=memory)
        logs = record_logs(engine)
        during = []
        engine.on(cadence.Event.ON_FIT_END)(lambda e, during=during: during.append(
            {event.value: len(e.hooks(event)) for event in STEP_EVENTS}))  # fmt: skip
        engine.fit(steps=4)
        assert len(logs) == 2 and not any(NAMES & set(logged) for logged in logs)
        hooks[memory] = during
    assert hooks[True] == hooks[False]  # the same hooks as without memory figures


@pytest.mark.cuda
def test_on_cuda_the_interval_s_peaks_and_retries_are_logged_and_reset():
    big = 256 * 2**20  # bytes, held for a moment in the first interval only

    engine = make_engine("cuda")
    logs = record_logs(engine)

    @engine.on(cadence.Event.ON_STEP_END, once=1)
    def allocate(engine):
        block = torch.empty(big, dtype=torch.uint8, device="cuda")
        del block

    engine.fit(steps=4)
    assert len(logs) == 2 and all(NAMES <= set(logged) for logged in logs)
    first, second = logs
    assert first["memory.peak_allocated_gib"] >= big / 2**30
    assert first["memory.peak_reserved_gib"] >= first["memory.peak_allocated_gib"]
    assert 0 < second["memory.peak_allocated_gib"] < big / 2**30  # reset: the second interval's own peak
    assert first["memory.alloc_retries"] == 0 and second["memory.alloc_retries"] == 0
