"""Async saves on GPUs: when the loop's stream is made to wait for a save's late copies (`CopyFence`), on CPU.

`DeviceCopy` itself needs CUDA (tests/checkpoint/test_cuda_checkpoint.py); the fence
is the loop's side of it and runs anywhere: armed only after a save, it releases
the armed stagings first thing at the next optimizer step, or at whatever comes
first that may write parameters in place (an epoch's end, evaluation, the end of
fit), and then leaves the loop as it was.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.checkpoint.device_copy import CopyFence
from cadence.engine.events import Event
from tests.conftest import tiny_dataset

pytestmark = pytest.mark.timeout(60)


class Pending:
    """Stands for a staging with late copies: `release()` is what the fence calls."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def release(self) -> None:
        self.log.append("release")


def run(arm_at: int, steps: int, **engine: Any) -> tuple[list[Any], int, int]:
    model = torch.nn.Linear(8, 4)
    run = cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_dataset(32),
        loss_fn=F.cross_entropy,
        device="cpu",
        seed=0,
        train={"batch_size": 8, "shuffle": False},
        log_interval=1000,
        **engine,
    )
    log: list[Any] = []
    fence = CopyFence()
    registered = len(run.callbacks)
    run.on(Event.ON_OPTIMIZER_STEP)(lambda e: log.append(("optimizer step", e.state.step)))
    for event in (Event.ON_EPOCH_END, Event.ON_EVAL_START, Event.ON_FIT_END):
        run.on(event)(lambda e, event=event: log.append(event.value))
    run.on(Event.ON_SAVE_POINT, once=arm_at)(lambda e: fence.arm(e, Pending(log)))
    during = []
    run.on(Event.ON_STEP_START)(lambda e: during.append(len(e.callbacks)))
    run.fit(steps=steps)
    assert not fence.armed
    return log, len(run.callbacks) - registered, max(during) - min(during)


def test_armed_after_a_save_it_releases_before_the_next_optimizer_step_and_leaves_the_loop_as_it_was() -> None:
    log, added, grew = run(arm_at=2, steps=3)
    assert log == [("optimizer step", 0), ("optimizer step", 1), "release", ("optimizer step", 2), "on_fit_end"]
    assert added == 6  # the test's own handlers; the fence's are gone
    assert grew == 7  # its seven handlers lived from the save to the next optimizer step only


def test_a_save_at_an_epoch_s_last_step_is_released_before_the_epoch_s_evaluation() -> None:
    log, _, _ = run(arm_at=4, steps=6, eval_data=tiny_dataset(8, seed=3), eval_every_epochs=1)
    at = log.index("release")  # EMA swaps its average into the parameters at on_eval_start
    assert log[at - 1 : at + 3] == [("optimizer step", 3), "release", "on_eval_start", "on_epoch_end"], log


def test_a_save_at_the_last_step_is_released_at_the_end_of_fit() -> None:
    log, _, _ = run(arm_at=3, steps=3)
    assert log[-2:] == ["release", "on_fit_end"]
