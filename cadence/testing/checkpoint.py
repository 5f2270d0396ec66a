"""State round-trip and resume checks through a real checkpoint (the `Checkpoint` callback's files)."""

from __future__ import annotations

import functools
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence.testing.compare import first_difference, max_parameter_difference
from cadence.testing.scenario import HarnessContext, Scenario, build_engine, parameters, snapshot_state

if TYPE_CHECKING:
    from cadence.testing.harness import Report

#: `state_key` of the Checkpoint callback the harness adds (a checked Checkpoint keeps its own).
CHECKPOINT_KEY = "cadence.testing.checkpoint"
CHECKPOINT_DIR = "harness-checkpoints"


def harness_checkpoint(context: HarnessContext, subject: Any, params: str = "all") -> list[Any]:
    """A Checkpoint that saves `latest` at the end of each fit, into the run's own folder."""
    from cadence.callbacks.checkpoint import Checkpoint

    folder = str(context.workdir / CHECKPOINT_DIR)
    checkpoint = Checkpoint(dir=folder, interval=0, keep_latest_k=0, params=params)  # type: ignore[arg-type]
    checkpoint.state_key = CHECKPOINT_KEY
    return [checkpoint]


def check(
    make: Callable[..., Any], workdir: Path, scenario: Scenario, report: Report, *, volatile: Sequence[str]
) -> None:
    """Train, save, resume in a fresh engine; compare the state and the continuation."""
    from cadence.checkpoint.launch_modes import load_checkpoint
    from cadence.testing.harness import failure_text

    started = time.perf_counter()
    steps = scenario.steps
    extra = functools.partial(harness_checkpoint, params=scenario.checkpoint_params)
    run = workdir / "run"  # both runs use the same directory, as a resumed run does
    latest = run / CHECKPOINT_DIR / "latest"
    try:
        # The uninterrupted run: fit (which saves `latest` at its end), then fit again.
        engine, callback, _ = build_engine(make, run, scenario, make_extra=extra)
        try:
            engine.fit(steps=steps)
            saved = _saved_state(engine, callback, latest)
            # The run directory as an interruption right after the save would leave it.
            shutil.copytree(run, workdir / "at-interruption", symlinks=True)
            engine.fit(steps=steps)
            final_params, final_state = parameters(engine), snapshot_state(callback)
        finally:
            engine.close()
        run.rename(workdir / "uninterrupted")
        (workdir / "at-interruption").rename(run)
        # The resumed run: a fresh engine and a new instance of the callback, restored from the file.
        engine, callback, probe = build_engine(make, run, scenario, make_extra=extra)
        try:
            load_checkpoint(engine, latest)
            loaded = probe.loaded
            engine.fit(steps=steps)
            resumed_params, resumed_state = parameters(engine), snapshot_state(callback)
        finally:
            engine.close()
    except Exception as exc:
        report.add("state_round_trip", f"save or resume failed: {failure_text(exc)}", started)
        return
    difference = first_difference(saved, loaded, ignore=volatile)
    report.add(
        "state_round_trip",
        f"after resume, state_dict() differs from the one saved at step {steps}: {difference}" if difference else None,
        started,
    )
    started = time.perf_counter()
    message = None
    worst = max_parameter_difference(final_params, resumed_params)
    if worst != 0.0:
        message = f"parameters after resume + {steps} steps differ from the uninterrupted run by up to {worst:.3g}"
    else:
        difference = first_difference(final_state, resumed_state, ignore=volatile)
        if difference:
            message = f"state_dict() after resume + {steps} steps differs from the uninterrupted run: {difference}"
    report.add("resume_matches", message, started)


def _saved_state(engine: Any, callback: Any, latest: Path) -> Any:
    """The callback's state as the checkpoint file holds it (None when it has no state)."""
    store, name = engine.backend.checkpoint_store(engine).locate(latest)
    states = store.read(name, keys=["callbacks"])["callbacks"]  # the payload only (a DeepSpeed store loads nothing)
    return states.get(callback.state_key) if snapshot_state(callback) is not None else None
