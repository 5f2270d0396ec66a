"""The contract harness passes every built-in callback and names what a broken callback breaks."""

from __future__ import annotations

import gc
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import cadence
from cadence.run.registry import callbacks as registry
from cadence.testing import PROPERTIES, ContractError, callback_contract, check_callback

pytestmark = pytest.mark.timeout(180)


def _scheduler(context):
    from cadence.callbacks import LRScheduler

    return LRScheduler(torch.optim.lr_scheduler.StepLR(context.optimizer, step_size=1, gamma=0.9))


def _metric_updates(context):
    from cadence.callbacks import MetricUpdates
    from cadence.metrics import Mean

    return MetricUpdates({"output": Mean()}, inputs=lambda outputs, batch: (outputs,))


# Each built-in as a config entry (built through the registry, as a config file
# would) or a factory when it needs objects. Small intervals so that every hook runs.
BUILTINS = {
    "checkpoint": {"name": "checkpoint"},
    "lr_scheduler": _scheduler,
    "non_finite_skip": {"name": "non_finite_skip", "max_consecutive": 3},
    "grad_clip": {"name": "grad_clip", "max_norm": 0.1},
    "ema": {"name": "ema", "decay": 0.9},
    "early_stopping": {"name": "early_stopping", "monitor": "val.loss", "patience": 0},
    "garbage_collection": {"name": "garbage_collection", "interval": 2},
    "heartbeat": {"name": "heartbeat", "interval": 0.05, "timeout": 60.0},
    "preemption": {"name": "preemption"},
    "time_budget": {"name": "time_budget", "max_time": "01:00:00"},
    "collective_guard": {"name": "collective_guard"},
    "train_metrics": {"name": "train_metrics"},
    "progress_bar": {"name": "progress_bar"},
    "tensorboard": {"name": "tensorboard", "flush_secs": 1},
    "wandb": {"name": "wandb", "mode": "offline"},  # see OPTIONS
    "jsonl": {"name": "jsonl"},
    "text_log": {"name": "text_log"},
    "profiler": {"name": "profiler"},
    "metric_updates": _metric_updates,
    "prediction_writer": {"name": "prediction_writer", "batches_per_file": 2},
}


# W&B keeps its service threads for the whole process once a run started (wandb.teardown()
# would end other runs of the process too): allowed by name, everything else must go.
OPTIONS = {"wandb": {"allow_threads": ("wandb-",)}}


def test_every_builtin_has_a_factory_here():
    assert set(BUILTINS) == set(registry._builtins), "a built-in was added or removed: give it a factory in BUILTINS"


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_the_harness_passes_on_every_builtin(name, tmp_path):
    report = check_callback(BUILTINS[name], workdir=tmp_path, timeout=90, **OPTIONS.get(name, {}))
    assert report.ok
    checked = {r.name for r in report.results}
    assert checked == set(PROPERTIES), f"not every property was checked: {sorted(set(PROPERTIES) - checked)}"


# -- deliberately broken callbacks ------------------------------------------------------------


class Counter(cadence.Callback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, engine):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class ForgetsItsState(Counter):
    def load_state_dict(self, state):
        pass  # the bug: the restored callback starts from zero


class HiddenState(cadence.Callback):
    """Decays the LR with a counter it does not save: a resumed run trains differently."""

    def __init__(self):
        self.calls = 0

    def on_step_start(self, engine):
        self.calls += 1
        for group in engine.optimizers[0].param_groups:
            group["lr"] = 0.05 / self.calls

    def state_dict(self):
        return {}


class CollectiveOnRankZero(cadence.Callback):
    def __init__(self, direct=False):
        self.direct = direct

    def on_step_end(self, engine):
        if engine.backend.rank == 0 and engine.state.step == 2:
            if self.direct:
                dist.all_reduce(torch.ones(3))
            else:
                engine.backend.reduce(torch.ones(1))


class ClipsOnRankZero(cadence.Callback):
    def on_before_optimizer_step(self, engine):
        if engine.backend.rank == 0 and engine.state.step == 1:
            for p in engine.model.parameters():
                p.grad.zero_()


class StopsOnTwoRanks(cadence.Callback):
    def on_before_optimizer_step(self, engine):
        if engine.backend.world_size == 2 and engine.state.step == 1:
            engine.request_stop("only at world size 2")


class HangsOnRankOne(cadence.Callback):
    def on_step_end(self, engine):
        if engine.backend.rank == 1 and engine.state.step == 2:
            time.sleep(60)


class LeaksAThread(cadence.Callback):
    def on_fit_start(self, engine):
        threading.Thread(target=time.sleep, args=(20,), name="leaked-by-callback", daemon=True).start()


class LeaksASignalHandler(cadence.Callback):
    def on_fit_start(self, engine):
        signal.signal(signal.SIGUSR2, lambda *_: None)


class LeavesGcDisabled(cadence.Callback):
    def on_fit_start(self, engine):
        gc.disable()


class FailsTheSecondFit(cadence.Callback):
    def __init__(self):
        self.fits = 0

    def on_fit_start(self, engine):
        self.fits += 1
        if self.fits > 1:
            raise RuntimeError("already used")


class NeedsAnArgument(cadence.Callback):
    def __init__(self, path):
        self.path = path


def _broken(factory, tmp_path, **options):
    options.setdefault("timeout", 30)
    with pytest.raises(ContractError) as info:
        check_callback(factory, workdir=tmp_path, **options)
    return info.value


def test_a_correct_stateful_callback_passes(tmp_path):
    report = check_callback(Counter, workdir=tmp_path)
    assert report.ok and {r.name for r in report.results} == set(PROPERTIES)
    assert all(count > 0 for counts in report.details["collectives"].values() for count in counts)
    assert "ok" in str(report)


def test_state_that_does_not_round_trip(tmp_path):
    error = _broken(ForgetsItsState, tmp_path, checks=("checkpoint",))
    assert error.property == "state_round_trip"
    assert "state_round_trip: after resume, state_dict() differs from the one saved at step 3: steps: 3 != 0" in str(
        error
    )


def test_state_that_is_not_saved_makes_the_resume_differ(tmp_path):
    error = _broken(HiddenState, tmp_path, checks=("checkpoint",))
    assert error.property == "resume_matches"
    assert "parameters after resume + 3 steps differ from the uninterrupted run" in str(error)


@pytest.mark.parametrize("direct", [False, True], ids=["backend.reduce", "torch.distributed.all_reduce"])
def test_a_collective_on_rank_zero_only(direct, tmp_path):
    error = _broken(lambda: CollectiveOnRankZero(direct), tmp_path, checks=("ranks",))
    assert error.property == "same_collectives"
    op = "all_reduce(float32[3])" if direct else "backend.reduce(float32[1])"
    assert f"{op} in CollectiveOnRankZero.on_step_end at step 2 was called on rank(s) [0] only" in str(error)


def test_a_decision_taken_on_one_rank(tmp_path):
    error = _broken(ClipsOnRankZero, tmp_path, checks=("ranks",))
    assert error.property == "same_decisions"
    assert "rank 1's parameters differ from rank 0's" in str(error)


def test_a_decision_that_depends_on_the_world_size(tmp_path):
    error = _broken(StopsOnTwoRanks, tmp_path, checks=("ranks",))
    assert error.property == "same_across_world_sizes"
    assert "1 and 2 ranks end at different step" in str(error)


def test_a_hang_is_reported_as_such(tmp_path):
    started = time.monotonic()
    error = _broken(HangsOnRankOne, tmp_path, checks=("ranks",), timeout=12, world_sizes=(2,))
    assert time.monotonic() - started < 40
    assert error.property == "runs_on_ranks"
    message = str(error)
    assert "hung: still running after 12 s" in message
    assert "rank 1:" in message and "HangsOnRankOne" in message  # where rank 1 was stuck


def test_a_leaked_thread(tmp_path):
    error = _broken(LeaksAThread, tmp_path, checks=("fit_twice",))
    assert error.property == "hygiene"
    assert "thread left running: 'leaked-by-callback'" in str(error)


def test_a_leaked_signal_handler_and_gc_setting(tmp_path):
    handler = signal.getsignal(signal.SIGUSR2)
    try:
        error = _broken(LeaksASignalHandler, tmp_path, checks=("fit_twice",))
        assert error.property == "hygiene" and "SIGUSR2 handler changed" in str(error)
    finally:
        signal.signal(signal.SIGUSR2, handler)
    try:
        error = _broken(LeavesGcDisabled, tmp_path, checks=("fit_twice",))
        assert error.property == "hygiene" and "gc.isenabled() changed: True -> False" in str(error)
    finally:
        gc.enable()


def test_a_callback_that_does_not_survive_two_fits(tmp_path):
    error = _broken(FailsTheSecondFit, tmp_path, checks=("fit_twice",))
    assert error.property == "fit_twice"
    assert "already used" in str(error)


def test_a_callback_that_cannot_be_built_from_its_config(tmp_path):
    error = _broken(NeedsAnArgument, tmp_path)
    assert error.property == "constructible"
    assert "needs the argument(s) path" in str(error)
    assert check_callback(NeedsAnArgument, config={"path": "x"}, checks=(), workdir=tmp_path).ok


def test_raise_on_failure_false_returns_the_report(tmp_path):
    report = check_callback(ForgetsItsState, checks=("checkpoint",), workdir=tmp_path, raise_on_failure=False)
    assert not report.ok
    assert [r.name for r in report.failures] == ["state_round_trip", "resume_matches"]


def test_the_pytest_form_is_one_parametrized_test_per_group(tmp_path):
    test = callback_contract(ForgetsItsState, checks=("constructible", "checkpoint"))
    marks = {mark.name: mark for mark in test.pytestmark}
    assert marks["parametrize"].args == ("check", ("constructible", "checkpoint"))
    assert "timeout" in marks
    test("constructible", tmp_path / "a")
    with pytest.raises(ContractError, match="state_round_trip"):
        test("checkpoint", tmp_path / "b")


# The pytest form on a correct callback, as a callback author would write it.
test_counter_contract = callback_contract(Counter, world_sizes=(1, 2))


# -- the contract harness on the mesh backend ---------------------------------------------------

# The built-ins that act on the step, the parameters or the checkpoint (as on DeepSpeed), on FSDP2
# over every rank (shard=-1: one process, then 1 and 2 ranks, DTensor parameters and the DCP store).
MESH_HARNESSED = [
    "checkpoint",
    "lr_scheduler",
    "non_finite_skip",
    "grad_clip",
    "ema",
    "early_stopping",
    "train_metrics",
]


@pytest.mark.parametrize("name", MESH_HARNESSED)
def test_the_harness_passes_builtin_callbacks_on_the_mesh(name, tmp_path):
    from cadence.backends.mesh import MeshBackend

    report = check_callback(
        BUILTINS[name], workdir=tmp_path, timeout=90, backend=lambda: MeshBackend(shard=-1, device="cpu")
    )
    assert report.ok, str(report)
    assert {r.name for r in report.results} == set(PROPERTIES)
