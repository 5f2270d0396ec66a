"""A real hang on 2 gloo ranks explains itself: `cadence hang` names each rank's step, event and callback,
and the collective (group, sequence number) the other rank waits in.

The bug staged: a callback all-reduces a number over its own process group at every step's end, and on
rank 1 it skips that at step 3. Rank 0 then waits in that all-reduce (#3 of the callback's group); rank 1
goes on into step 4, whose backward waits in DDP's gradient all-reduce, which rank 0 never reaches. Neither
can move: the heartbeat (1.5 s) reports both and dumps their stacks and flight recorders, and the groups'
timeout (6 s) ends the run. The workers are spawned, not forked: the flight recorder's size is read when a
process starts its first process group, and a forked worker inherits the test process's recorder, which an
earlier test's group may already have fixed at 0.

With NCCL (CUDA tests): one rank whose all-reduce is still queued behind a busy stream when dumped, and
(two GPUs) the same staged hang.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import cadence
from cadence.backends.ddp import DDPBackend
from cadence.callbacks import Heartbeat
from cadence.cli import main
from cadence.cli.hang_report import build_report
from cadence.launch import WorkerError, launch
from tests.conftest import tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(300)

SKIP_STEP, GROUP_TIMEOUT, STALL_TIMEOUT = 3, 6.0, 1.5


class SideSum(cadence.Callback):
    """All-reduces a number over its own group at each step's end; rank 1 skips it at SKIP_STEP."""

    raises_requests = False

    def __init__(self, device="cpu"):
        self.device = device

    def on_fit_start(self, engine):
        backend = "gloo" if self.device == "cpu" else "nccl"
        self.group = dist.new_group(backend=backend, timeout=timedelta(seconds=GROUP_TIMEOUT))

    def on_step_end(self, engine):
        if engine.backend.rank == 1 and engine.state.step == SKIP_STEP:
            return  # the bug: this rank skips a collective the others make
        dist.all_reduce(torch.ones(1, device=self.device), group=self.group)


def hang_worker(workspace):
    torch.set_num_threads(1)
    model = tiny_model(seed=3)
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_dataset(64), loss_fn=F.cross_entropy,
        callbacks=[Heartbeat(interval=0.25, timeout=STALL_TIMEOUT), SideSum()],
        backend=DDPBackend(timeout=GROUP_TIMEOUT, device="cpu"), seed=0, train={"batch_size": 4},
        workspace=workspace,
    )  # fmt: skip
    recorder = engine.backend.flight_recorder
    Path(workspace, f"recorder-{engine.backend.rank}.json").write_text(json.dumps([recorder.entries, recorder.source]))
    engine.fit(steps=6)


@pytest.mark.slow
def test_a_skipped_collective_is_reported_with_rank_step_event_callback_and_sequence(tmp_path, capsys):
    with pytest.raises(WorkerError):
        launch(hang_worker, str(tmp_path), nprocs=2, start_method="spawn", timeout=90)
    for rank in (0, 1):  # the backend turned torch's flight recorder on before its group started
        assert json.loads((tmp_path / f"recorder-{rank}.json").read_text()) == [2000, "cadence"]
    folder = next(tmp_path.rglob("heartbeat"))
    assert main(["hang", str(folder.parent)]) == 0
    text = capsys.readouterr().out
    report = build_report(folder)
    rank0, rank1 = report.ranks[0], report.ranks[1]

    # Rank 0: stuck at the end of step 3, inside the callback, in the side group's third all-reduce.
    assert rank0.position == (SKIP_STEP, "on_step_end")
    assert rank0.where.startswith("SideSum.on_step_end"), rank0.where
    side = rank0.waiting()
    assert side is not None and side.group != "0", rank0.collectives
    assert (side.op, side.seq, side.shapes) == ("all_reduce", SKIP_STEP, "float32[1]")
    assert side.issued_by.startswith("SideSum.on_step_end")
    # Rank 1: went on into step 4 and waits in DDP's gradient all-reduce on the default group.
    assert rank1.position == (SKIP_STEP + 1, "on_forward")
    assert rank1.where.startswith("the loop"), rank1.where
    ddp = rank1.waiting()
    assert ddp is not None and ddp.group == "0" and ddp.op == "all_reduce", rank1.collectives
    assert max(c.seq for c in rank1.collectives if c.group == side.group) == SKIP_STEP - 1

    # The diagnosis, first: rank 0 waits in #3 of the side group, which rank 1 never issued.
    first = report.findings[0]
    assert (first.kind, first.group, first.seq) == ("missing", side.group, SKIP_STEP), report.findings
    assert "rank 0 waits in all_reduce #3" in first.text and "never issued by rank 1 (its last: #2)" in first.text
    assert "SideSum.on_step_end" in first.text
    second = report.findings[1]
    assert (second.kind, second.group, second.seq) == ("missing", "0", ddp.seq), report.findings
    assert f"rank 1 waits in all_reduce #{ddp.seq}" in second.text

    # The printed report says the same.
    assert "rank 0 (" in text and f"step {SKIP_STEP}, on_step_end, in SideSum.on_step_end" in text
    assert "rank 1 (" in text and f"step {SKIP_STEP + 1}, on_forward" in text
    assert first.text in text and second.text in text
    assert (folder / "flight-recorder-rank-0").exists() and (folder / "flight-recorder-rank-1").exists()


# -- NCCL (CUDA tests: skipped with the reason where there is no GPU) --------------------------------------


def nccl_worker(workspace):
    """One NCCL rank: the recorder holds NCCL's collectives, and a collective still running shows as waited in."""
    from cadence.backends.flight_recorder import DUMP_FILE_VARIABLES

    model = tiny_model(seed=3)
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_dataset(64), loss_fn=F.cross_entropy,
        callbacks=[Heartbeat(interval=0.25, timeout=60)], backend=DDPBackend(device="cuda"), seed=0,
        train={"batch_size": 4}, workspace=workspace,
    )  # fmt: skip
    assert dist.get_backend() == "nccl" and engine.backend.flight_recorder.entries == 2000
    engine.fit(steps=3)
    folder = engine.run_dir / "heartbeat"
    # NCCL's own dump on a timeout goes to the heartbeat folder (torch appends the rank).
    assert os.environ[DUMP_FILE_VARIABLES[0]] == str(folder / "flight-recorder-rank-")
    tensor = torch.ones(1024, device="cuda")
    torch.cuda._sleep(int(3e9))  # keep the stream busy: the all-reduce queued behind it has not run yet
    work = dist.all_reduce(tensor, async_op=True)
    engine.backend.flight_recorder.dump(folder, 0)
    work.wait()
    torch.cuda.synchronize()
    engine.close()
    return str(folder)


@pytest.mark.cuda
def test_nccl_collectives_are_recorded_and_one_still_running_is_named(tmp_path):
    folder = Path(launch(nccl_worker, str(tmp_path), nprocs=1, start_method="spawn", timeout=300))
    report = build_report(folder)
    view = report.ranks[0]
    assert any(c.op == "all_reduce" and c.group == "0" for c in view.collectives), view.collectives
    waiting = view.waiting()
    assert waiting is not None and waiting.op == "all_reduce" and waiting.shapes == "float32[1024]", view.collectives
    assert waiting.seq == max(c.seq for c in view.collectives if c.group == "0")


@pytest.mark.cuda(gpus=2)
@pytest.mark.slow
def test_a_skipped_collective_on_nccl_is_reported_too(tmp_path):
    launch_env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}  # a timed-out rank tears itself down (torch's default)
    with pytest.raises(WorkerError):
        launch(nccl_hang_worker, str(tmp_path), nprocs=2, start_method="spawn", timeout=180, env=launch_env)
    report = build_report(next(tmp_path.rglob("heartbeat")))
    assert report.ranks[0].position == (SKIP_STEP, "on_step_end")
    assert report.ranks[0].where.startswith("SideSum.on_step_end")
    first = report.findings[0]
    assert first.kind == "missing" and first.seq == SKIP_STEP and "never issued by rank 1" in first.text, (
        report.findings
    )


def nccl_hang_worker(workspace):
    model = tiny_model(seed=3)
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_dataset(64), loss_fn=F.cross_entropy,
        callbacks=[Heartbeat(interval=0.25, timeout=STALL_TIMEOUT), SideSum(device="cuda")],
        backend=DDPBackend(timeout=GROUP_TIMEOUT, device="cuda"), seed=0, train={"batch_size": 4},
        workspace=workspace,
    )  # fmt: skip
    engine.fit(steps=6)
