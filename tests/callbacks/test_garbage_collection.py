"""GarbageCollection: gc off during fit, collections exactly every `interval` steps, state restored."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch.nn import functional as F

import cadence
from cadence import Event
from cadence.callbacks import GarbageCollection
from cadence.launch import launch
from tests.conftest import tiny_batches, tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(120)


class Collections:
    """Every collection that starts while installed, with the engine step at that moment."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []

    def __call__(self, phase, info):
        if phase == "start":
            self.seen.append((self.engine.state.step, info["generation"]))

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def engine_with(callback, batches=12, **kwargs):
    model = tiny_model()
    return cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(batches), loss_fn=F.cross_entropy,
        callbacks=[callback], seed=0, **{"device": "cpu", **kwargs},
    )  # fmt: skip


@pytest.fixture
def gc_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


@pytest.mark.usefixtures("gc_enabled")
def test_collections_happen_exactly_at_multiples_of_interval_with_gc_disabled():
    engine = engine_with(GarbageCollection(interval=3, generation=1))
    enabled_during = []
    engine.on(Event.ON_STEP_END)(lambda e: enabled_during.append(gc.isenabled()))
    with Collections(engine) as collections:
        engine.fit(steps=12)
    assert collections.seen == [(0, 2), (3, 1), (6, 1), (9, 1), (12, 1)]  # one full collection at fit start
    assert enabled_during == [False] * 12
    assert gc.isenabled()


@pytest.mark.usefixtures("gc_enabled")
def test_a_previously_disabled_gc_stays_disabled_and_errors_restore_it():
    gc.disable()
    engine_with(GarbageCollection(interval=2, collect_at_start=False)).fit(steps=2)
    assert not gc.isenabled()
    gc.enable()
    engine = engine_with(GarbageCollection(interval=2))
    engine.on(Event.ON_STEP_END, once=3)(lambda e: 1 / 0)
    with pytest.raises(cadence.HookError):
        engine.fit(steps=6)
    assert gc.isenabled()
    callback = GarbageCollection()
    callback.on_teardown(engine)  # teardown without a start: nothing to undo
    assert gc.isenabled()


@pytest.mark.usefixtures("gc_enabled")
def test_fit_twice_and_evaluate_alone_leave_gc_as_found():
    callback = GarbageCollection(interval=1, generation=0, collect_at_start=False)
    engine = engine_with(callback, eval_data=tiny_batches(2))
    with Collections(engine) as collections:
        engine.fit(steps=2)
        engine.fit(steps=2)
    assert collections.seen == [(1, 0), (2, 0), (3, 0), (4, 0)] and gc.isenabled()
    engine.evaluate()
    assert gc.isenabled()
    with pytest.raises(cadence.ConfigError, match="generation"):
        GarbageCollection(generation=3)


def two_ranks(out):
    import os

    rank = int(os.environ["RANK"])
    model = tiny_model()
    with cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_dataset(96), loss_fn=F.cross_entropy,
        callbacks=[GarbageCollection(interval=4, collect_at_start=False)], backend="ddp", seed=0,
        train={"batch_size": 4},
        device="cpu",
    ) as engine:  # fmt: skip
        with Collections(engine) as collections:
            engine.fit(steps=12)
        Path(out, f"rank-{rank}.json").write_text(json.dumps(collections.seen))


def test_every_rank_collects_at_the_same_steps(tmp_path):
    launch(two_ranks, str(tmp_path), nprocs=2, start_method="fork", timeout=90)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] == [[4, 1], [8, 1], [12, 1]]
