"""Five fits with every control callback leave gc, signal handlers and threads as they found them."""

from __future__ import annotations

import gc
import os
import signal
import threading

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence import Event
from cadence.callbacks import (
    EMA,
    EarlyStopping,
    GarbageCollection,
    GradClip,
    Heartbeat,
    LRScheduler,
    NonFiniteSkip,
    Preemption,
)
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(120)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def baseline():
    return gc.isenabled(), {s: signal.getsignal(s) for s in SIGNALS}, threading.active_count()


def controlled_engine():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callbacks = [
        NonFiniteSkip(max_consecutive=2), GradClip(max_norm=1.0), EMA(decay=0.9), EarlyStopping(patience=10),
        GarbageCollection(interval=2), Heartbeat(interval=0.05, timeout=30), Preemption(exit=False),
        LRScheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)),
    ]  # fmt: skip
    return cadence.Engine(
        model, optimizer, tiny_batches(6), eval_data=tiny_batches(2, seed=3), loss_fn=F.cross_entropy,
        callbacks=callbacks, seed=0,
        device="cpu",
    )  # fmt: skip


def test_five_fits_return_gc_signals_and_threads_to_baseline(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")  # Preemption also takes SIGUSR1
    monkeypatch.setenv("SUBMITIT_FOLDER", "/nonexistent")  # a preemption then requeues by returning
    import cadence.launch_slurm as launch_slurm

    monkeypatch.setattr(launch_slurm, "_requeue_requested", False)
    user_handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        expected = baseline()
        engine = controlled_engine()
        during = []
        engine.on(Event.ON_STEP_END, once=1)(lambda e: during.append(baseline()))

        engine.fit(steps=3)  # 1: plain
        assert baseline() == expected
        assert during[0][0] is False and during[0][1][signal.SIGTERM] != expected[1][signal.SIGTERM]
        assert during[0][2] == expected[2] + 2  # the heartbeat's writer and watchdog

        engine.fit(epochs=2)  # 2: epochs with evaluation
        assert baseline() == expected

        handle = engine.add_handler(Event.ON_STEP_END, lambda e: 1 / 0, once=engine.state.step + 2)
        with pytest.raises(cadence.HookError):  # 3: an error in the middle
            engine.fit(steps=4)
        handle.remove()
        assert baseline() == expected

        engine.on(Event.ON_FORWARD, once=engine.state.step + 1)(lambda e: os.kill(os.getpid(), signal.SIGTERM))
        engine.fit(steps=4)  # 4: preempted (exit=False under submitit: fit returns)
        assert next(c for c in engine.callbacks if isinstance(c, Preemption)).preempted
        assert baseline() == expected

        fresh = controlled_engine()  # 5: another engine in the same process
        fresh.fit(steps=2)
        assert baseline() == expected
    finally:
        signal.signal(signal.SIGTERM, user_handler)
