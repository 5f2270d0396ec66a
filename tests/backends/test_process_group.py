"""A backend's process group: a long timeout until the first steps end, the steady one after; the flight recorder.

On 2 gloo ranks with `timeout=1.5, init_timeout=10, init_steps=2`: rank 1 sleeping 3 s in step 1 makes rank 0
wait 3 s in DDP's all-reduce, which the long timeout allows; the same sleep in step 4 makes rank 0 fail after
1.5 s (gloo: "Application timeout caused pair closure"). `ProcessGroup.set_timeout` (what `TimeoutSwitch` calls) is tested through
that behaviour, not by reading the group's options back.
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence import Event
from cadence.backends.ddp import DDPBackend
from cadence.backends.flight_recorder import FlightRecorder
from cadence.backends.mesh import MeshBackend
from cadence.backends.process_group import GroupSettings, TimeoutSwitch
from cadence.launch import WorkerError, launch
from tests.conftest import tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(120)

STEADY, FIRST, SLEEP = 1.5, 10.0, 3.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout": 5, "init_timeout": 2}, r"DDPBackend\.init_timeout \(2 s\) is shorter than DDPBackend\.timeout"),
        ({"init_timeout": -1}, r"DDPBackend\.init_timeout must be > 0"),
        ({"init_timeout": "1h"}, r"DDPBackend\.init_timeout: expected seconds"),
        ({"init_steps": 0}, r"DDPBackend\.init_steps must be an int >= 1"),
        ({"flight_recorder": -1}, r"DDPBackend\.flight_recorder must be an int >= 0"),
    ],
)
def test_bad_settings_are_refused_before_any_group_naming_the_field(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        DDPBackend(device="cpu", **kwargs)


def test_mesh_and_deepspeed_configs_carry_the_same_settings():
    mesh = MeshBackend(timeout=60, init_timeout=600, init_steps=3, flight_recorder=0, device="cpu")
    assert mesh.group_settings == GroupSettings(
        timeout=timedelta(seconds=60), init_timeout=timedelta(seconds=600), init_steps=3, flight_recorder=0
    )
    assert mesh.timeout == timedelta(seconds=600)  # in force until the first steps end
    with pytest.raises(ValueError, match=r"mesh\.init_timeout \(1 s\) is shorter than mesh\.timeout"):
        MeshBackend(timeout=60, init_timeout=1, device="cpu")
    from cadence.backends.deepspeed import DeepSpeedConfig

    settings = GroupSettings.of("deepspeed", DeepSpeedConfig(init_timeout=900))
    assert settings.first_timeout == timedelta(seconds=900) and settings.timeout == timedelta(seconds=300)


def test_the_flight_recorder_size_in_the_environment_wins(monkeypatch):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        # Set, then deleted: monkeypatch then removes what enable() sets below when the test ends (a delenv
        # of an unset variable records nothing, and the size set here leaked into every later test's ranks).
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    recorder = FlightRecorder.enable(500)
    assert (recorder.entries, recorder.source) == (500, "cadence")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "500" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "64")  # the older name, set by the user
    recorder = FlightRecorder.enable(500)
    assert (recorder.entries, recorder.source) == (64, "TORCH_NCCL_TRACE_BUFFER_SIZE")
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "lots")
    with pytest.raises(ValueError, match="TORCH_NCCL_TRACE_BUFFER_SIZE='lots'"):
        FlightRecorder.enable(500)


def test_dumps_go_to_the_heartbeat_folder_unless_a_file_is_named(tmp_path, monkeypatch):
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.setenv(name, "")  # recorded, so what dump_into sets is removed when the test ends
        monkeypatch.delenv(name)
    FlightRecorder(0, "cadence").dump_into(tmp_path)  # off: torch writes nothing, nothing is set
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    assert FlightRecorder(0, "cadence").dump(tmp_path, 0) is None and not any(tmp_path.iterdir())
    FlightRecorder(100, "cadence").dump_into(tmp_path / "a")
    FlightRecorder(100, "cadence").dump_into(tmp_path)  # a later fit's folder replaces an earlier fit's
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight-recorder-rank-")  # torch appends the rank
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/elsewhere/trace_")
    FlightRecorder(100, "cadence").dump_into(tmp_path)
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/elsewhere/trace_"


def two_timeouts(out):
    rank = int(os.environ["RANK"])
    model = tiny_model(seed=3)
    backend = DDPBackend(timeout=STEADY, init_timeout=FIRST, init_steps=2, device="cpu")
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_dataset(64), loss_fn=F.cross_entropy,
        backend=backend, seed=0, train={"batch_size": 4},
    )  # fmt: skip
    seen = {}

    def look(engine):  # at each step's start: the timeout in force, and whether the switch still listens
        switch = any(isinstance(cb, TimeoutSwitch) for cb in engine.callbacks)
        seen[engine.state.step + 1] = [engine.backend.timeout.total_seconds(), switch]

    def slow(engine):
        if rank == 1 and engine.state.step + 1 in (1, 4):
            time.sleep(SLEEP)

    engine.on(Event.ON_STEP_START, order=0)(look)
    engine.on(Event.ON_STEP_START, order=1)(slow)
    started, report = time.monotonic(), {"seen": seen}
    try:
        engine.fit(steps=6)
    except Exception as exc:
        report.update(error=str(exc), after=time.monotonic() - started, step=engine.state.step)
    Path(out, f"rank-{rank}.json").write_text(json.dumps(report))
    engine.close()


@pytest.mark.slow
def test_a_slow_first_step_waits_under_init_timeout_and_a_later_one_fails_after_timeout(tmp_path):
    try:
        launch(two_timeouts, str(tmp_path), nprocs=2, start_method="fork", timeout=90)
    except WorkerError:
        pass  # rank 1 may fail when rank 0 closes its connections; each rank's report says what happened
    rank0 = json.loads((tmp_path / "rank-0.json").read_text())
    seen = {int(step): value for step, value in rank0["seen"].items()}
    # Steps 1-2 under init_timeout (the switch listening), from step 3 the steady timeout (the switch gone).
    assert seen[1] == seen[2] == [FIRST, True] and seen[3] == seen[4] == [STEADY, False], seen
    # Step 1's 3 s wait passed; step 4's failed after about the steady timeout, in DDP's all-reduce.
    assert rank0["step"] == 3 and re.search(r"timed? ?out", rank0["error"], re.I), (
        rank0
    )  # gloo: "timeout", "Timed out waiting"
    assert SLEEP + STEADY <= rank0["after"] < SLEEP + FIRST, rank0  # the first wait, then ~1.5 s (not 3 s, not 10)


def switch_worker(kind):
    model = tiny_model(seed=3)
    settings = {"timeout": 60, "init_timeout": 600, "device": "cpu"}
    if kind == "deepspeed":
        from cadence.backends.deepspeed import DeepSpeedBackend

        backend = DeepSpeedBackend(zero_stage=1, **settings)
    else:
        backend = MeshBackend(shard=2, **settings)
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_dataset(64), loss_fn=F.cross_entropy,
        backend=backend, seed=0, train={"batch_size": 4},
    )  # fmt: skip
    first = engine.backend.timeout.total_seconds()
    engine.fit(steps=2)
    switched = not any(isinstance(cb, TimeoutSwitch) for cb in engine.callbacks)
    result = [first, engine.backend.timeout.total_seconds(), switched, engine.backend.flight_recorder is not None]
    engine.close()
    return result


@pytest.mark.parametrize("kind", ["mesh", "deepspeed"])
def test_mesh_and_deepspeed_start_their_group_the_same_way(kind):
    if kind == "deepspeed":
        pytest.importorskip("deepspeed", reason="the DeepSpeed backend needs cadence[deepspeed]")
    env = {"DS_ACCELERATOR": "cpu"}
    assert launch(switch_worker, kind, nprocs=2, start_method="fork", timeout=120, env=env) == [600.0, 60.0, True, True]


def nccl_switch(out):
    model = tiny_model(seed=3)
    backend = DDPBackend(timeout=60, init_timeout=600, device="cuda")
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_dataset(64), loss_fn=F.cross_entropy,
        backend=backend, seed=0, train={"batch_size": 4},
    )  # fmt: skip
    first = engine.backend.timeout.total_seconds()
    engine.fit(steps=2)  # ProcessGroup.set_timeout on an NCCL group at the end of step 1
    switched = not any(isinstance(cb, TimeoutSwitch) for cb in engine.callbacks)
    result = [torch.distributed.get_backend(), first, engine.backend.timeout.total_seconds(), switched]
    engine.close()
    return result


@pytest.mark.cuda
def test_the_switch_sets_the_steady_timeout_on_an_nccl_group():
    assert launch(nccl_switch, None, nprocs=1, start_method="spawn", timeout=300) == ["nccl", 600.0, 60.0, True]
