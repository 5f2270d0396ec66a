"""The collective-sequence guard on 2 gloo ranks: a step whose collectives differ fails on every rank, naming them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import cadence
from cadence.callbacks.collective_guard import CollectiveGuard, CollectiveMismatch, explain
from cadence.engine.callback import Callback
from cadence.launch import launch
from cadence.run.registry import build_callback
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(420)

DIVERGE_AT = 3  # the step whose on_step_end issues different collectives on the two ranks


class ShapeByRank(Callback):
    """All-reduces a tensor in on_step_end: the same on both ranks, except at `at`, where the shape differs."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_step_end(self, engine) -> None:
        # Same bytes on both ranks (gloo pairs them without complaint): only the shape differs at `at`.
        shape = (6,) if engine.state.step == self.at and engine.backend.rank == 1 else (2, 3)
        dist.all_reduce(torch.ones(shape))


class HookByRank(Callback):
    """At `at`, rank 0 all-reduces in on_step_end and rank 1 in on_save_point: same tensor, another hook."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, engine) -> None:
        if engine.state.step == self.at and engine.backend.rank == 0:
            dist.all_reduce(torch.ones(2))

    def on_save_point(self, engine) -> None:
        if engine.state.step == self.at and engine.backend.rank == 1:
            dist.all_reduce(torch.ones(2))


def fit(callback: Callback, steps: int) -> str:
    model = tiny_model()
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(n=4), loss_fn=F.cross_entropy,
        backend="ddp", device="cpu", seed=0, callbacks=[callback, CollectiveGuard()],
    )  # fmt: skip
    try:
        engine.fit(steps=steps)
        return f"finished at step {engine.state.step}"
    except CollectiveMismatch as error:
        return f"raised at step {engine.state.step}: {error}"
    finally:
        engine.close()


def worker(out: str) -> None:
    # Steps cross epoch ends (4 batches an epoch): the epoch's own agreement must not disturb the check.
    got = {
        "same": fit(ShapeByRank(at=None), steps=9),
        "shape": fit(ShapeByRank(at=DIVERGE_AT), steps=9),
        "hook": fit(HookByRank(at=DIVERGE_AT), steps=9),
        "last": fit(ShapeByRank(at=5), steps=5),  # the fit's last window: checked at the fit's end
    }
    Path(out, f"rank-{os.environ['RANK']}.json").write_text(json.dumps(got))


@pytest.mark.slow
def test_a_step_whose_collectives_differ_fails_on_every_rank_naming_the_first_difference(tmp_path):
    launch(worker, str(tmp_path), nprocs=2, start_method="fork", timeout=360)
    results = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, got in enumerate(results):
        assert got["same"] == "finished at step 9", (rank, got["same"])
        # Agreed in the next step's agreement: every rank raises there, at the same step.
        shape = got["shape"]
        assert shape.startswith(f"raised at step {DIVERGE_AT + 1}: "), (rank, shape)
        assert f"different collectives in step {DIVERGE_AT};" in shape, shape
        assert "rank 0: all_reduce float32 (2, 3) from ShapeByRank.on_step_end" in shape, shape
        assert "rank 1: all_reduce float32 (6,) from ShapeByRank.on_step_end" in shape, shape
        hook = got["hook"]
        assert hook.startswith(f"raised at step {DIVERGE_AT + 1}: "), (rank, hook)
        assert "rank 0: all_reduce float32 (2,) from HookByRank.on_step_end" in hook, hook
        assert "rank 1: all_reduce float32 (2,) from HookByRank.on_save_point" in hook, hook
        last = got["last"]
        assert last.startswith("raised at step 5: ") and "step 5 (the last of the fit" in last, (rank, last)
    assert results[0]["shape"].split(": ", 1)[1] == results[1]["shape"].split(": ", 1)[1]  # one report


def test_one_process_is_untouched_and_the_config_name_builds_it():
    guard = build_callback({"name": "collective_guard", "max_records": 5})
    assert isinstance(guard, CollectiveGuard) and guard.config.max_records == 5
    model = tiny_model()
    engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(n=4),
                            loss_fn=F.cross_entropy, device="cpu", seed=0, callbacks=[guard])  # fmt: skip
    engine.fit(steps=3)
    assert not guard.active and dist.all_reduce is not None and not guard.originals
    engine.close()
    with pytest.raises(ValueError, match="max_records"):
        CollectiveGuard(max_records=0)


def test_the_report_names_a_missing_collective_and_the_counts():
    text = explain(
        "step 7", [["all_reduce float32 (2,) from A.on_step_end", "barrier list from x.y"], ["barrier list from x.y"]]
    )
    assert "step 7; the first difference is collective #1 of the step" in text
    assert "rank 0: all_reduce float32 (2,) from A.on_step_end" in text and "rank 1: barrier list from x.y" in text
    assert "(rank 0: 2, rank 1: 1)" in text
    text = explain("step 2", [["a"], []])
    assert "rank 1: (none: it issued only 0)" in text
