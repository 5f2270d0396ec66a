"""TimeBudget: once max_time has passed, every rank saves and stops at the same step; a resumed run goes on.

The budget expires inside a pause: 2 s of budget and a 3 s sleep at the end of step 3, so the first step that
starts after the deadline is step 4 (steps 1-3 take milliseconds), and the run stops after it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence import Event
from cadence.callbacks import Checkpoint, TimeBudget
from cadence.callbacks.time_budget import parse_duration
from cadence.launch import launch
from cadence.run.config import ConfigError
from cadence.run.registry import build_callback
from tests.conftest import tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(120)

BUDGET, PAUSE, PAUSE_STEP, STEPS = 2.0, 3.0, 3, 8


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (90, 90.0),
        (1.5, 1.5),
        ("00:00:30", 30.0),
        ("01:30:00", 5400.0),
        ("2:00:00:00", 172800.0),
        ("10:00:00.5", 36000.5),
    ],
)
def test_max_time_is_seconds_or_a_clock(value, seconds):
    assert parse_duration(value) == seconds
    assert TimeBudget(max_time=value).seconds == seconds


@pytest.mark.parametrize("value", ["1h", "01:60:00", "00:00:00", 0, -5, "1:2", True])
def test_a_bad_max_time_is_refused_naming_the_field(value):
    with pytest.raises((ValueError, ConfigError), match=r"time_budget\.max_time"):
        TimeBudget(max_time=value)


def test_built_by_name_from_a_config_entry():
    budget = build_callback({"name": "time_budget", "max_time": "00:10:00", "save": False})
    assert isinstance(budget, TimeBudget) and budget.seconds == 600 and budget.config.save is False


def make_engine(folder, budget=None, *, backend="auto", resume=False):
    model = tiny_model(seed=3)
    checkpoint = Checkpoint(dir=str(Path(folder, "checkpoints")), interval=0, save_on_fit_end=False, auto_resume=resume)
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_dataset(400), loss_fn=F.cross_entropy,
        callbacks=[checkpoint] + ([budget] if budget is not None else []), backend=backend, seed=0,
        train={"batch_size": 4}, steps=STEPS, workspace=str(Path(folder, "runs")), device="cpu",
    )  # fmt: skip
    saves, starts = [], []
    engine.on(Event.ON_SAVE)(lambda e: saves.append(e.state.step))
    engine.on(Event.ON_FIT_START)(lambda e: starts.append(e.state.step))  # after a resume's restore (on_setup)
    return engine, checkpoint, saves, starts


def pause(engine):
    time.sleep(PAUSE)


def test_one_process_stops_after_the_step_the_budget_ran_out_saves_it_and_resumes(tmp_path):
    budget = TimeBudget(max_time=BUDGET)
    engine, checkpoint, saves, _ = make_engine(tmp_path, budget)
    engine.on(Event.ON_STEP_END, once=PAUSE_STEP)(pause)
    engine.fit()  # to step STEPS (absolute); returns: a spent budget is a clean stop
    assert budget.expired and budget.stopped_at == PAUSE_STEP + 1 == engine.state.step
    assert saves == [PAUSE_STEP + 1] and checkpoint.store.manifest("latest")["step"] == PAUSE_STEP + 1
    assert budget.remaining == float("inf")  # outside a fit
    engine.close()

    resumed, _, saves, starts = make_engine(tmp_path, TimeBudget(max_time=3600), resume=True)
    resumed.fit()
    assert starts == [PAUSE_STEP + 1] and resumed.state.step == STEPS and saves == []
    resumed.close()


def two_ranks(out, resume):
    rank = int(os.environ["RANK"])
    # Only rank 0's budget runs out: the agreement stops rank 1 at the same step.
    budget = TimeBudget(max_time=BUDGET if rank == 0 else 3600)
    engine, checkpoint, saves, starts = make_engine(out, None if resume else budget, backend="ddp", resume=resume)
    if not resume:
        engine.on(Event.ON_STEP_END, once=PAUSE_STEP)(pause)
    engine.fit()
    report = {"started": starts[0], "step": engine.state.step, "saves": saves, "expired": budget.expired,
              "stopped_at": budget.stopped_at, "latest": checkpoint.store.manifest("latest").get("step")}  # fmt: skip
    Path(out, f"{'resumed' if resume else 'first'}-{rank}.json").write_text(json.dumps(report))
    engine.close()


@pytest.mark.slow
def test_two_ranks_stop_at_the_same_step_with_a_checkpoint_and_resume(tmp_path):
    launch(two_ranks, str(tmp_path), False, nprocs=2, start_method="fork", timeout=90)
    first = [json.loads((tmp_path / f"first-{r}.json").read_text()) for r in (0, 1)]
    for report in first:
        assert report["step"] == PAUSE_STEP + 1 and report["latest"] == PAUSE_STEP + 1, first
        assert report["expired"] and report["stopped_at"] == PAUSE_STEP + 1, first
    assert first[0]["saves"] == [PAUSE_STEP + 1]  # on_save fires on the writing rank after the commit
    launch(two_ranks, str(tmp_path), True, nprocs=2, start_method="fork", timeout=90)
    for rank in (0, 1):
        resumed = json.loads((tmp_path / f"resumed-{rank}.json").read_text())
        assert resumed["started"] == PAUSE_STEP + 1 and resumed["step"] == STEPS, resumed
