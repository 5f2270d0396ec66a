"""JSONL: one line per logged step, eval lines by split, no duplicates after resume, exact DDP eval means."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.backends.local import LocalBackend
from cadence.callbacks.checkpoint import Checkpoint
from cadence.callbacks.jsonl import JSONL, read_jsonl
from cadence.callbacks.metrics import TrainMetrics
from cadence.launch import launch
from tests.conftest import tiny_batches, tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(120)


def make_engine(callbacks, **kwargs):
    model = tiny_model()
    kwargs.setdefault("log_interval", 2)
    kwargs.setdefault("train", {"batch_size": 8})
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        kwargs.pop("data", tiny_dataset(96)),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        seed=0,
        **{"device": "cpu", **kwargs},
    )


def tag_attempt(engine, attempt):
    engine.on(cadence.Event.ON_STEP_END)(lambda e: e.log("attempt", attempt, "last"))


def test_one_line_per_logged_step_and_eval_lines_by_split(tmp_path):
    engine = make_engine(
        [TrainMetrics(), JSONL()], eval_data=tiny_batches(3), eval_every_steps=4, workspace=str(tmp_path)
    )
    logged = []
    engine.on(cadence.Event.ON_LOG)(lambda e: logged.append(dict(e.logged)))
    engine.fit(steps=8)
    engine.evaluate(split="test")
    records = read_jsonl(engine.run_dir / "metrics.jsonl")
    assert [(r["step"], r.get("split")) for r in records] == [
        (2, None), (4, None), (4, "val"), (6, None), (8, None), (8, "val"), (8, "test"),
    ]  # fmt: skip
    for record, values in zip(records, logged):
        assert {k: v for k, v in record.items() if k not in ("step", "epoch", "time", "split")} == values
    assert set(records[2]) == {"step", "epoch", "time", "split", "val.loss"}
    assert records[0]["epoch"] == 0 and records[0]["time"] > 1e9


def test_lines_are_written_in_batches_and_none_is_lost_at_the_end_or_on_an_error(tmp_path):
    jsonl = JSONL(write_interval=3600)
    engine = make_engine([TrainMetrics(), jsonl], workspace=str(tmp_path))
    on_disk = []
    engine.on(cadence.Event.ON_STEP_END, once=7)(lambda e: on_disk.append(len(read_jsonl(jsonl.path))))
    engine.fit(steps=8)
    assert on_disk == [1]  # the first line at once, the next ones held in memory
    assert [r["step"] for r in read_jsonl(jsonl.path)] == [2, 4, 6, 8]  # all written at fit end

    def fail(engine):
        raise RuntimeError("boom")

    engine.on(cadence.Event.ON_STEP_END, once=11)(fail)
    with pytest.raises(cadence.HookError, match="boom"):
        engine.fit(steps=4)
    assert [r["step"] for r in read_jsonl(jsonl.path)] == [2, 4, 6, 8, 10]  # teardown wrote what was logged


def test_resume_truncates_the_lines_after_the_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = make_engine(
        [TrainMetrics(), JSONL(), Checkpoint(dir=ckpt, interval=4, unit="step", save_on_fit_end=False)],
        workspace=str(tmp_path), run_id="r", eval_data=tiny_batches(2), eval_every_steps=4, eval_every_epochs=None,
    )  # fmt: skip
    tag_attempt(first, 1)
    first.fit(steps=10)  # checkpoint at 8; lines up to 10: the stopped run's future
    path = first.run_dir / "metrics.jsonl"
    assert [r["step"] for r in read_jsonl(path)][-2:] == [8, 10]

    second = make_engine(
        [TrainMetrics(), JSONL(), Checkpoint(dir=ckpt, auto_resume=True)],
        workspace=str(tmp_path), run_id="r", eval_data=tiny_batches(2), eval_every_steps=4, eval_every_epochs=None, steps=14,
    )  # fmt: skip
    tag_attempt(second, 2)
    second.fit()  # restored at 8, trains to the configured 14
    records = read_jsonl(path)
    keys = [(r["step"], r.get("split", "train")) for r in records]
    assert keys == sorted(set(keys)), f"duplicated or unordered lines: {keys}"
    assert [r["step"] for r in records if "split" not in r] == [2, 4, 6, 8, 10, 12, 14]
    assert [r["attempt"] for r in records if "split" not in r] == [1, 1, 1, 1, 2, 2, 2]


def test_a_fit_ending_between_intervals_writes_its_last_step_and_a_resume_continues_after_it(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = make_engine(
        [TrainMetrics(), JSONL(), Checkpoint(dir=ckpt, interval=4, unit="step", save_on_fit_end=False)],
        workspace=str(tmp_path), run_id="r",
    )  # fmt: skip
    tag_attempt(first, 1)
    first.fit(steps=7)  # lines at 2, 4, 6 and the fit's last step 7; checkpoint at 4
    path = first.run_dir / "metrics.jsonl"
    assert [r["step"] for r in read_jsonl(path)] == [2, 4, 6, 7]

    second = make_engine(
        [TrainMetrics(), JSONL(), Checkpoint(dir=ckpt, auto_resume=True, save_on_fit_end=True)],
        workspace=str(tmp_path), run_id="r", steps=9,
    )  # fmt: skip
    tag_attempt(second, 2)
    second.fit()  # restored at 4: 6 and 8 at their intervals, 9 at the end
    records = read_jsonl(path)
    assert [(r["step"], r["attempt"]) for r in records] == [(2, 1), (4, 1), (6, 2), (8, 2), (9, 2)]

    third = make_engine(
        [TrainMetrics(), JSONL(), Checkpoint(dir=ckpt, auto_resume=True)], workspace=str(tmp_path), run_id="r", steps=12
    )
    tag_attempt(third, 3)
    third.fit()  # restored at 9 (saved when the fit ended): 10 and 12
    assert [(r["step"], r["attempt"]) for r in read_jsonl(path)][-3:] == [(9, 2), (10, 3), (12, 3)]


def test_first_open_drops_a_previous_attempts_lines_and_a_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "split": "val", "val.loss": 1.0}\n{"step": 4, "loss": 9.0}\n{"step": 6, "lo')
    engine = make_engine([TrainMetrics(), JSONL(path=str(path))])
    engine.fit(steps=4)
    records = read_jsonl(path)
    assert (records[0]["step"], records[0].get("loss")) == (0, None)
    assert [r["step"] for r in records] == [0, 2, 4]
    assert records[-1]["loss"] != 9.0


def test_nothing_written_on_other_ranks(tmp_path):
    backend = LocalBackend(device="cpu")
    backend.rank = 1
    engine = make_engine([TrainMetrics(), JSONL(path=str(tmp_path / "m.jsonl"))], backend=backend)
    engine.fit(steps=4)
    assert not (tmp_path / "m.jsonl").exists()


# -- two gloo ranks ----------------------------------------------------------------------------

EVAL_SIZES = {0: (8, 8, 5), 1: (7, 3)}  # unequal batch counts and sizes per rank


def eval_batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in EVAL_SIZES[rank]]


def ddp_eval(workspace):
    rank = int(os.environ["RANK"])
    engine = cadence.Engine(
        tiny_model(),
        None,
        eval_data=eval_batches(rank),
        loss_fn=F.cross_entropy,
        callbacks=[JSONL()],
        backend="ddp",
        seed=0,
        workspace=workspace,
        run_id="ddp",
        device="cpu",
    )
    with engine:
        results = engine.evaluate()
        with torch.no_grad():
            inputs = torch.cat([x for r in (0, 1) for x, _ in eval_batches(r)])
            targets = torch.cat([y for r in (0, 1) for _, y in eval_batches(r)])
            expected = F.cross_entropy(engine.model(inputs), targets, reduction="sum").item() / len(targets)
            batch_means = [F.cross_entropy(engine.model(x), y).item() for r in (0, 1) for x, y in eval_batches(r)]
        lines = (engine.run_dir / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
        return results, expected, sum(batch_means) / len(batch_means), lines


def test_ddp_eval_line_holds_the_exact_global_mean(tmp_path):
    results, expected, mean_of_means, lines = launch(ddp_eval, str(tmp_path), nprocs=2, start_method="fork", timeout=90)
    assert len(lines) == 1  # written once, by the main process
    record = json.loads(lines[0])
    assert record["split"] == "val"
    assert record["val.loss"] == pytest.approx(expected, rel=1e-6, abs=0)  # float32 batch means
    assert results["val.loss"] == record["val.loss"]
    assert abs(mean_of_means - expected) > 1e-4  # the data tells an exact mean from a mean of means


def ddp_train_between_intervals(workspace):
    import torch.distributed as dist

    from cadence.callbacks.grad_clip import GradClip

    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]
    model = tiny_model()
    engine = cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        loss_fn=F.cross_entropy,
        callbacks=[TrainMetrics(), GradClip(max_norm=1e9), JSONL()],
        backend="ddp",
        seed=0,
        log_interval=2,
        workspace=workspace,
        run_id="ddp-train",
        device="cpu",
    )
    losses = []
    engine.on(cadence.Event.ON_STEP_END)(lambda e: losses.append(e.loss.item()))
    with engine:
        engine.fit(steps=3)  # the interval at 2, then step 3 when the fit ends: a collective on both ranks
        every = [None, None]
        dist.all_gather_object(every, losses)
        lines = (engine.run_dir / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
        return every, lines


def test_ddp_fit_ending_between_intervals_reduces_its_last_steps_on_every_rank(tmp_path):
    every, lines = launch(ddp_train_between_intervals, str(tmp_path), nprocs=2, start_method="fork", timeout=90)
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [2, 3]
    # Each line's loss is its step's, averaged over the two ranks.
    assert records[0]["loss"] == pytest.approx((every[0][1] + every[1][1]) / 2, rel=1e-9)
    assert records[1]["loss"] == pytest.approx((every[0][2] + every[1][2]) / 2, rel=1e-9)
    assert "grad_norm" in records[1]
