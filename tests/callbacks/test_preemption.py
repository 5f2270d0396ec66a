"""Preemption: a signal becomes an agreed save + stop at the next step, then exit code 143."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch.nn import functional as F

import cadence
from cadence import Event
from cadence.callbacks import Preemption
from cadence.launch import Preempted, WorkerError, launch
from tests.conftest import tiny_batches, tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(120)


def local_engine(callbacks, batches=10):
    model = tiny_model()
    return cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(batches), loss_fn=F.cross_entropy,
        callbacks=callbacks, seed=0,
        device="cpu",
    )  # fmt: skip


def send_sigterm(engine):
    os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def user_handler():
    """A user's own SIGTERM handler, installed around the test."""
    calls = []

    def handler(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    yield handler, calls
    signal.signal(signal.SIGTERM, previous)


def test_signal_stops_every_rank_after_the_next_step_and_exits_143(user_handler):
    handler, calls = user_handler
    preemption = Preemption()
    engine = local_engine([preemption])
    agreed = {}
    engine.on(Event.ON_STEP_END, order=100)(
        lambda e: agreed.__setitem__(e.state.step, (e.agreed("save"), e.agreed("preempt"), e.agreed("stop")))
    )
    installed = []
    engine.on(Event.ON_STEP_START, once=1)(lambda e: installed.append(signal.getsignal(signal.SIGTERM)))
    engine.on(Event.ON_FORWARD, once=3)(send_sigterm)
    with pytest.raises(SystemExit) as info:
        engine.fit(steps=10)
    assert info.value.code == 143
    assert engine.state.step == 3  # the signal came during step 3: agreed at its boundary
    assert agreed[3] == (1, 1, 1) and all(v == (0, 0, 0) for s, v in agreed.items() if s != 3)
    assert preemption.preempted and preemption.step == 3 and preemption.signal_rank == 0
    assert calls == [signal.SIGTERM]  # the user's handler still ran
    assert installed[0] != handler and signal.getsignal(signal.SIGTERM) is handler  # restored


def test_exit_false_returns_and_fit_again_works(user_handler):
    handler, calls = user_handler
    preemption = Preemption(exit=False)
    engine = local_engine([preemption], batches=20)
    engine.on(Event.ON_STEP_END, once=2)(send_sigterm)  # after step 2's agreement: acted on in step 3
    engine.fit(steps=10)
    assert preemption.preempted and engine.state.step == 3
    engine.fit(steps=2)  # a fresh fit: not preempted, handlers installed and restored again
    assert not preemption.preempted and engine.state.step == 5
    assert signal.getsignal(signal.SIGTERM) is handler and calls == [signal.SIGTERM]


def test_slurm_adds_sigusr1_and_submitit_requeues_by_returning(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    assert Preemption().signals() == [signal.SIGTERM, signal.SIGUSR1]
    assert Preemption(signals=["USR2"]).signals() == [signal.SIGUSR2]
    with pytest.raises(cadence.ConfigError):
        Preemption(signals="SIGTERM")
    with pytest.raises(ValueError, match="unknown signal 'SIGNOPE'"):
        Preemption(signals=["SIGNOPE"])

    import cadence.launch_slurm as launch_slurm

    monkeypatch.setenv("SUBMITIT_FOLDER", "/nonexistent")
    monkeypatch.setattr(launch_slurm, "_requeue_requested", False)
    previous_usr1 = signal.getsignal(signal.SIGUSR1)
    preemption = Preemption()
    engine = local_engine([preemption])
    engine.on(Event.ON_FORWARD, once=2)(lambda e: os.kill(os.getpid(), signal.SIGUSR1))
    engine.fit(steps=10)  # under submitit: no SystemExit, the task requeues when the function returns
    assert preemption.preempted and engine.state.step == 2 and launch_slurm._requeue_requested
    assert signal.getsignal(signal.SIGUSR1) == previous_usr1


def test_fit_in_another_thread_warns_and_installs_nothing(caplog):
    before = signal.getsignal(signal.SIGTERM)
    engine = local_engine([Preemption()])
    seen = []
    engine.on(Event.ON_STEP_END)(lambda e: seen.append(signal.getsignal(signal.SIGTERM)))
    with caplog.at_level(logging.WARNING, logger="cadence.preemption"):
        thread = threading.Thread(target=engine.fit, kwargs={"steps": 2})
        thread.start()
        thread.join(30)
    assert "not the main thread" in caplog.text
    assert seen == [before, before] and signal.getsignal(signal.SIGTERM) == before


def late_signal():
    engine = local_engine([Preemption()])
    engine.on(Event.ON_FIT_END)(send_sigterm)  # after the last agreement
    engine.fit(steps=2)
    return "survived"


def test_a_signal_after_the_last_step_is_delivered_with_the_default_handler():
    # spawn, not fork: this worker ends by its own signal, and a forked child
    # inherits whatever the long-lived test process has running (once, in a
    # full-suite run, such a forked worker hung instead of dying).
    with pytest.raises(WorkerError) as info:
        launch(late_signal, nprocs=1, start_method="spawn", timeout=90)
    assert info.value.exitcode == -signal.SIGTERM


# -- two gloo ranks, with the Checkpoint callback ---------------------------------


def two_ranks_sigterm_on_rank0(out, signal_step):
    from cadence.callbacks import Checkpoint

    rank = int(os.environ["RANK"])
    calls = []

    def user(signum, frame):
        calls.append(signum)

    signal.signal(signal.SIGTERM, user)
    saves = []
    model = tiny_model(seed=3)
    checkpoint = Checkpoint(dir=str(Path(out, "checkpoints")), interval=0, save_on_fit_end=True)
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_dataset(400), loss_fn=F.cross_entropy,
        callbacks=[checkpoint, Preemption()], backend="ddp", seed=0, train={"batch_size": 4},
        device="cpu",
    )  # fmt: skip
    engine.on(Event.ON_SAVE)(lambda e: saves.append(e.state.step))
    if rank == 0:
        engine.on(Event.ON_FORWARD, once=signal_step)(send_sigterm)
    report = {"rank": rank}
    try:
        engine.fit(steps=40)
    except SystemExit as exc:
        report["exit"] = exc.code
    report.update(
        step=engine.state.step, saves=saves, user_calls=calls, restored=signal.getsignal(signal.SIGTERM) is user,
        names=checkpoint.store.names(), latest_step=checkpoint.store.manifest("latest").get("step"),
    )  # fmt: skip
    Path(out, f"rank-{rank}.json").write_text(json.dumps(report))
    engine.close()
    if "exit" in report:
        raise SystemExit(report["exit"])


def test_two_ranks_agree_save_once_and_both_exit_143(tmp_path):
    signal_step = random.Random().randint(3, 30)
    # A clean preemption is its own outcome (still a WorkerError), not a crash with "SystemExit: 143".
    with pytest.raises(
        Preempted, match=r"^preempted: rank [01] of 2 stopped at an agreed step and exited with 143"
    ) as info:
        launch(two_ranks_sigterm_on_rank0, str(tmp_path), signal_step, nprocs=2, start_method="fork", timeout=90)
    assert info.value.exitcode == 143 and isinstance(info.value, WorkerError), info.value
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for report in ranks:
        assert report["exit"] == 143 and report["step"] == signal_step, (signal_step, report)
        assert report["restored"]
        assert report["latest_step"] == signal_step and report["names"] == ["latest"]
    # Exactly one checkpoint committed (on_save fires on the writing rank after each commit), at the
    # agreed step: the forced save; the end-of-fit save at the same step adds nothing.
    assert ranks[0]["saves"] == [signal_step]
    assert ranks[0]["user_calls"] == [signal.SIGTERM] and ranks[1]["user_calls"] == []
