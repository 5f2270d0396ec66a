"""Profiler: a trace of exactly the active steps; record_function ranges only while profiling."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.callbacks.profiler import Profiler
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(90)


def make_engine(callbacks, **kwargs):
    model = tiny_model()
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_batches(12),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        seed=0,
        log_interval=2,
        **{"device": "cpu", **kwargs},
    )


@pytest.fixture
def ranges(monkeypatch):
    """Count every torch.profiler.record_function entered: (name, state.step) pairs."""
    entered: list[tuple[str, int]] = []
    real = torch.profiler.record_function
    engine_box: dict[str, cadence.Engine] = {}

    class Counting(real):  # type: ignore[misc, valid-type]
        def __enter__(self):
            engine = engine_box.get("engine")
            entered.append((self.name, engine.state.step if engine else -1))
            return super().__enter__()

    monkeypatch.setattr(torch.profiler, "record_function", Counting)
    return entered, engine_box


def profiler_steps(trace_file):
    events = json.loads(trace_file.read_text())["traceEvents"]
    names = [e.get("name", "") for e in events]
    steps = sorted({int(n.split("#")[1]) for n in names if n.startswith("ProfilerStep#")})
    return steps, names


def test_trace_holds_exactly_the_active_steps(tmp_path):
    profiler = Profiler(wait=1, warmup=1, active=2, repeat=1, start_step=2, dir=str(tmp_path / "prof"))
    engine = make_engine([profiler])
    engine.fit(steps=10)
    (trace,) = profiler.traces()
    assert trace.name.startswith("rank0.") and trace.name.endswith(".pt.trace.json")
    steps, names = profiler_steps(trace)
    # start_step 2 waits one step (index 2), warms up one (3), records two: indexes 4 and 5.
    assert steps == [4, 5]
    assert names.count("on_step_end") >= 2 and "on_forward" in names and "aten::addmm" in names
    assert profiler.profiler is None  # stopped after its last cycle


def test_repeat_writes_one_trace_per_cycle_under_the_run_dir(tmp_path):
    profiler = Profiler(wait=0, warmup=1, active=1, repeat=2)
    engine = make_engine([profiler], workspace=str(tmp_path))
    engine.fit(steps=6)
    traces = profiler.traces()
    assert len(traces) == 2 and traces[0].parent == engine.run_dir / "profiler"
    assert [profiler_steps(t)[0] for t in traces] == [[1], [3]]


def test_ranges_only_while_profiling(ranges):
    entered, box = ranges
    engine = make_engine([Profiler(wait=1, warmup=1, active=2, repeat=1, start_step=2, dir="prof")])
    box["engine"] = engine
    engine.fit(steps=10)
    events = {e.value for e in cadence.Event}
    ours = [(name, step) for name, step in entered if name in events]
    # Wrapped from the step-end at which warmup begins (3) until the one at which the last cycle ends (6).
    assert {step for _, step in ours} == {3, 4, 5, 6}
    assert ("on_forward", 4) in ours and ("on_step_start", 5) in ours
    assert engine.bus.table == engine.bus.registered  # unwrapped after the profile


def test_without_profiler_no_range_is_entered(ranges):
    entered, box = ranges
    engine = make_engine([])
    box["engine"] = engine
    engine.fit(steps=4)
    assert entered == []
    assert engine.bus.table == engine.bus.registered


def test_fit_twice_profiles_once_and_resume_past_the_window(tmp_path):
    profiler = Profiler(wait=0, warmup=1, active=1, repeat=1, dir=str(tmp_path))
    engine = make_engine([profiler])
    engine.fit(steps=3)
    engine.fit(steps=3)  # the window (steps 0-1) is past: no profiler at all
    assert len(profiler.traces()) == 1
    assert profiler.profiler is None


def test_memory_snapshot_skipped_on_cpu_with_a_reason(tmp_path, caplog):
    profiler = Profiler(wait=0, warmup=1, active=1, dir=str(tmp_path), memory_snapshot=True)
    engine = make_engine([profiler])
    with caplog.at_level(logging.INFO, logger="cadence"):
        engine.fit(steps=3)
    assert "memory_snapshot skipped: the engine's device is not CUDA" in caplog.text
    assert not list(tmp_path.glob("*.pickle"))
    assert len(profiler.traces()) == 1


@pytest.mark.cuda
def test_memory_snapshot_on_cuda_is_written_into_the_run_directory():
    import pickle

    profiler = Profiler(wait=0, warmup=1, active=2, memory_snapshot=True)
    engine = make_engine([profiler], device="cuda")
    engine.fit(steps=4)
    snapshots = sorted((engine.run_dir / "profiler").glob("memory_snapshot_step*.pickle"))
    assert [path.name for path in snapshots] == ["memory_snapshot_step3.pickle"]  # the cycle's last step
    with snapshots[0].open("rb") as file:
        snapshot = pickle.load(file)
    assert snapshot["segments"] and snapshot["device_traces"]  # the allocator's state and its recorded history
    assert len(profiler.traces()) == 1


def test_config_validation():
    with pytest.raises(cadence.ConfigError, match="active"):
        Profiler(active=0)
