"""NonFiniteSkip: skips agreed on every rank, parameters untouched, no added collective."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch.nn import functional as F

import cadence
from cadence import Event
from cadence.callbacks import NonFiniteSkip
from cadence.callbacks.non_finite import NonFiniteError
from cadence.launch import launch
from tests.conftest import CollectivesPerStep, count_collectives, tiny_batches, tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(120)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def poison_loss(engine):
    engine.loss = engine.loss * float("nan")


def poison_gradient(engine):
    next(engine.model.parameters()).grad[0, 0] = float("inf")


class Snapshots(cadence.Callback):
    """Parameters before and after every step (order 0: before everything)."""

    order = 0

    def __init__(self):
        self.before, self.after = {}, {}

    def on_step_start(self, engine):
        self.before[engine.state.step + 1] = flat(engine.model)

    def on_step_end(self, engine):
        self.after[engine.state.step] = flat(engine.model)

    def unchanged(self):
        return sorted(step for step in self.after if torch.equal(self.before[step], self.after[step]))


def local_engine(callbacks, batches=8, **kwargs):
    model = tiny_model()
    return cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), tiny_batches(batches),
        loss_fn=F.cross_entropy, callbacks=callbacks, seed=0, **{"device": "cpu", **kwargs},
    )  # fmt: skip


def test_nan_loss_and_inf_gradient_skip_their_steps_only():
    snapshots, skip = Snapshots(), NonFiniteSkip()
    engine = local_engine([snapshots, skip])
    engine.on(Event.ON_FORWARD, once=2, order=5)(poison_loss)
    engine.on(Event.ON_BEFORE_OPTIMIZER_STEP, once=5, order=5)(poison_gradient)
    engine.fit(steps=8)
    assert snapshots.unchanged() == [2, 5]
    assert engine.state.skipped_steps == 2 and skip.total == 2 and skip.consecutive == 0
    assert skip.last == {"step": 5, "rank": 0, "kind": "gradient"}
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())


def test_non_finite_micro_batch_in_gradient_accumulation_skips_the_step():
    snapshots = Snapshots()
    engine = local_engine([snapshots, NonFiniteSkip()], grad_accum=2)
    calls = iter(range(100))
    # Only the 3rd forward: the first micro-batch of step 2.
    engine.on(Event.ON_FORWARD, order=5, when=lambda e: next(calls) == 2)(poison_loss)
    engine.fit(steps=4)
    assert snapshots.unchanged() == [2] and engine.state.skipped_steps == 1


def test_max_consecutive_raises_naming_step_and_rank_and_a_good_step_resets():
    engine = local_engine([NonFiniteSkip(max_consecutive=3)])
    bad = {1, 2, 4, 5, 6}
    engine.on(Event.ON_FORWARD, order=5, when=lambda e: e.state.step + 1 in bad)(poison_loss)
    # The documented type is caught as itself; the hook is named in a note.
    with pytest.raises(NonFiniteError, match="raised by callback 'NonFiniteSkip' in on_step_end at step 6") as info:
        engine.fit(steps=8)
    error = info.value
    assert error.hook_event is Event.ON_STEP_END and error.hook_callback == "NonFiniteSkip"
    assert (error.step, error.rank, error.kind, error.consecutive) == (6, 0, "loss", 3)
    assert "3 consecutive" in str(error) and "step 6" in str(error) and "rank 0" in str(error)
    assert engine.state.step == 6 and engine.state.skipped_steps == 5


def test_state_round_trip_and_config():
    skip = NonFiniteSkip(max_consecutive=0)
    engine = local_engine([skip])
    engine.on(Event.ON_FORWARD, order=5)(poison_loss)
    engine.fit(steps=12)  # max_consecutive=0 never raises
    assert skip.state_dict() == {"consecutive": 12, "total": 12}
    other = NonFiniteSkip()
    other.load_state_dict(skip.state_dict())
    assert other.consecutive == 12 and other.total == 12
    with pytest.raises(cadence.ConfigError, match="max_consecutive"):
        NonFiniteSkip(max_consecutive=-1)


# -- two gloo ranks ---------------------------------------------------------------


def ddp_engine(callbacks):
    model = tiny_model(seed=3)
    return cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), tiny_dataset(200),
        loss_fn=F.cross_entropy, callbacks=callbacks, backend="ddp", seed=0, log_interval=1000,
        train={"batch_size": 4, "shuffle": False},
        device="cpu",
    )  # fmt: skip


def two_ranks_nan_and_inf(with_callback, out):
    counter = count_collectives()
    snapshots, per_step = Snapshots(), CollectivesPerStep(counter)
    skip = NonFiniteSkip()
    with ddp_engine([snapshots, per_step, *([skip] if with_callback else [])]) as engine:
        rank = engine.backend.rank
        if with_callback:
            engine.on(Event.ON_FORWARD, once=5, order=5, when=lambda e: rank == 1)(poison_loss)
            engine.on(Event.ON_BEFORE_OPTIMIZER_STEP, once=9, order=5, when=lambda e: rank == 0)(poison_gradient)
        lasts = []
        engine.on(Event.ON_STEP_END, order=99)(lambda e: lasts.append(skip.last) if e.agreed("skip") else None)
        engine.fit(steps=12)
        result = {
            "unchanged": snapshots.unchanged(), "skipped": engine.state.skipped_steps,
            "per_step": per_step.per_step, "lasts": lasts,
            "final": flat(engine.model).tolist(),
        }  # fmt: skip
        Path(out, f"rank-{rank}.json").write_text(json.dumps(result))


def test_two_ranks_skip_exactly_the_poisoned_steps_without_an_added_collective(tmp_path):
    launch(two_ranks_nan_and_inf, True, str(tmp_path), nprocs=2, start_method="fork", timeout=90)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for result in ranks:
        assert result["unchanged"] == [5, 9]  # bitwise unchanged across exactly these steps
        assert result["skipped"] == 2
        assert result["lasts"] == [{"step": 5, "rank": 1, "kind": "loss"}, {"step": 9, "rank": 0, "kind": "gradient"}]
    assert ranks[0]["final"] == ranks[1]["final"]

    baseline = tmp_path / "baseline"
    baseline.mkdir()
    launch(two_ranks_nan_and_inf, False, str(baseline), nprocs=2, start_method="fork", timeout=90)
    plain = json.loads((baseline / "rank-0.json").read_text())
    assert sum(plain["per_step"]) >= 12, "the counter saw no collectives: it counts nothing"
    assert ranks[0]["per_step"] == plain["per_step"], "NonFiniteSkip added a collective to the step"


def two_ranks_consecutive(out):
    with ddp_engine([NonFiniteSkip(max_consecutive=3)]) as engine:
        rank = engine.backend.rank
        engine.on(Event.ON_FORWARD, order=5, when=lambda e: rank == 1 and e.state.step >= 3)(poison_loss)
        try:
            engine.fit(steps=12)
        except NonFiniteError as exc:
            error = exc
            Path(out, f"rank-{rank}.json").write_text(
                json.dumps({"message": str(error), "step": engine.state.step, "type": type(error).__name__})
            )


def test_two_ranks_raise_the_same_error_after_max_consecutive_skips(tmp_path):
    launch(two_ranks_consecutive, str(tmp_path), nprocs=2, start_method="fork", timeout=90)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert ranks[0]["type"] == "NonFiniteError" and ranks[0]["step"] == 6
    assert "the last at step 6 (non-finite loss first seen on rank 1)" in ranks[0]["message"]
