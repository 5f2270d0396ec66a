"""Bitwise resume in a fresh process, and crash safety under SIGKILL."""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.store import CheckpointError
from tests.callbacks import checkpoint_workers as workers

pytestmark = pytest.mark.timeout(150)

FORK = multiprocessing.get_context("fork")


def in_child(target: Any, *args: Any, timeout: float = 60, **kwargs: Any) -> None:
    """Run `target` in a forked process (a fresh process: nothing of the run lives in the parent)."""
    process = FORK.Process(target=target, args=args, kwargs=kwargs)
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        pytest.fail(f"{target.__name__}{args} did not finish in {timeout} s")
    out = Path(args[1]) if len(args) > 1 else None
    if process.exitcode != 0:
        error = out.with_name(out.name + ".error") if out else None
        detail = error.read_text() if error and error.exists() else ""
        pytest.fail(f"{target.__name__}{args} exited with {process.exitcode}\n{detail}")


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def assert_bitwise(reference: dict[str, Any], first: dict[str, Any], resumed: dict[str, Any]) -> None:
    losses = first["losses"] + resumed["losses"]
    assert len(losses) == len(reference["losses"])
    for i, (a, b) in enumerate(zip(losses, reference["losses"])):
        assert torch.equal(a, b), f"micro-batch {i}: loss {a.item()!r} != uninterrupted {b.item()!r}"
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    ref_opt, opt = reference["optimizer"], resumed["optimizer"]
    assert ref_opt["param_groups"] == opt["param_groups"]
    for index, state in ref_opt["state"].items():
        for key, value in state.items():
            assert torch.equal(opt["state"][index][key], value), (index, key)
    assert resumed["state"] == {**reference["state"], "last_loss": resumed["state"]["last_loss"]}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict[str, Any]]:
    """The uninterrupted runs, one per (mode, num_workers)."""
    root = tmp_path_factory.mktemp("reference")
    found = {}
    for mode, n in (("step", 0), ("step", 2), ("epoch", 0), ("epoch", 2)):
        out = root / f"{mode}-{n}.pt"
        in_child(workers.run, str(root / f"ckpt-{mode}-{n}"), str(out), workers=n, mode=mode)
        found[(mode, n)] = load(out)
    assert len(found[("step", 0)]["losses"]) == 2 * workers.STEPS
    return found


RESUME_BY_STOP = {1: "path", 13: "auto", 20: "from_checkpoint", 39: "auto"}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop", sorted(RESUME_BY_STOP))
def test_step_mode_resume_is_bitwise(tmp_path: Path, references: dict[Any, Any], num_workers: int, stop: int) -> None:
    directory = str(tmp_path / "ckpt")
    in_child(workers.run, directory, str(tmp_path / "first.pt"), workers=num_workers, stop=stop)
    first = load(tmp_path / "first.pt")
    assert first["state"]["step"] == stop
    manifest = FileStore(directory).verify("latest")
    assert manifest["step"] == stop
    resume = RESUME_BY_STOP[stop]
    in_child(workers.run, directory, str(tmp_path / "resumed.pt"), workers=num_workers, resume=resume)
    resumed = load(tmp_path / "resumed.pt")
    assert resumed["restored_from"] is not None and resumed["restored_from"].endswith("latest")
    assert_bitwise(references[("step", num_workers)], first, resumed)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epoch_mode_resume_mid_epoch_is_bitwise(tmp_path: Path, references: dict[Any, Any], num_workers: int) -> None:
    directory = str(tmp_path / "ckpt")
    stop = 7  # 9 micro-batches per epoch in 5 steps: step 7 is in the middle of the second epoch
    in_child(workers.run, directory, str(tmp_path / "first.pt"), workers=num_workers, mode="epoch", stop=stop)
    first = load(tmp_path / "first.pt")
    assert first["state"]["epoch"] == 1 and first["state"]["batch_in_epoch"] == 4
    store = FileStore(directory)
    assert "ckpt-e000001" in store.names()
    assert store.read("latest")["data"]["train"][0] is not None  # mid-epoch: the loader position is saved
    in_child(workers.run, directory, str(tmp_path / "resumed.pt"), workers=num_workers, mode="epoch", resume="auto")
    resumed = load(tmp_path / "resumed.pt")
    assert resumed["state"]["epoch"] == workers.EPOCHS
    assert_bitwise(references[("epoch", num_workers)], first, resumed)


def test_resume_in_a_new_interpreter(tmp_path: Path, references: dict[Any, Any]) -> None:
    """The same, with the resumed run in a brand-new Python process (nothing inherited by fork)."""
    directory = str(tmp_path / "ckpt")
    in_child(workers.run, directory, str(tmp_path / "first.pt"), workers=0, stop=13)
    script = Path(workers.__file__)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parents[2])}
    command = [sys.executable, str(script), "run", directory, str(tmp_path / "resumed.pt"), "--resume", "auto"]
    subprocess.run(command, check=True, timeout=60, env=env, capture_output=True)
    assert_bitwise(references[("step", 0)], load(tmp_path / "first.pt"), load(tmp_path / "resumed.pt"))


def test_ddp_checkpoint_holds_every_rank_and_resumes_bitwise_and_on_one_process(tmp_path: Path, caplog) -> None:
    import cadence

    reference = cadence.launch(workers.ddp_run, str(tmp_path / "reference"), nprocs=2, start_method="fork", timeout=90)
    directory = str(tmp_path / "ckpt")
    first = cadence.launch(workers.ddp_run, directory, 13, nprocs=2, start_method="fork", timeout=90)
    store = FileStore(directory)
    assert store.names() == ["ckpt-s000000000010", "latest"]  # written once, by the main process
    payload = store.read("latest")
    assert payload["meta"]["world_size"] == 2 and len(payload["rng"]) == 2
    positions = payload["data"]["train"]
    assert len(positions) == 2 and all(p is not None for p in positions)
    shutil.copytree(Path(directory) / "latest", tmp_path / "copy" / "latest")
    resumed = cadence.launch(workers.ddp_run, directory, None, "auto", nprocs=2, start_method="fork", timeout=90)
    assert reference["world_size"] == 2
    assert_bitwise(reference, first, resumed)
    # World size 2 -> 1: model and optimizer are restored; the interrupted epoch's rest is re-split over one
    # data rank (tests/distributed/test_reshard_position.py checks the samples).
    with caplog.at_level("INFO", logger="cadence"):
        engine, _ = workers.build(str(tmp_path / "copy"), workers=0, mode="step", stop=None, resume="auto")
        engine.fit(steps=0)
    messages = [r.message for r in caplog.records]
    assert any("the train position of 2 data rank(s) is re-split over 1" in m for m in messages), messages
    assert engine.state.step == 13 and engine.state.batch_in_epoch == payload["engine"]["batch_in_epoch"] > 0
    for name, value in first["params"].items():
        assert torch.equal(engine.model.state_dict()[name], value)


# -- crash safety ---------------------------------------------------------------------------

KILLS = 100


def check_after_kill(directory: Path, shapes: dict[str, tuple[int, ...]]) -> int | None:
    """Every committed checkpoint verifies, and `latest` holds exactly what was saved at its step."""
    store = FileStore(directory)
    names = store.names()
    for name in names:
        store.verify(name)
    assert not [
        p.name for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in names
    ]
    if "latest" not in names:
        assert not names, f"checkpoints {names} but no latest"
        return None
    payload = store.read("latest")
    step = payload["engine"]["step"]
    assert payload["meta"]["step"] == step == store.manifest("latest")["step"]
    model = {k: v for k, v in payload["model"].items()}
    assert workers.digest(model) == workers.digest(workers.expected_params(step, shapes)), f"latest at step {step}"
    return step


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_sigkill_at_random_moments_never_leaves_a_partial_checkpoint(tmp_path: Path, async_mode: str) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    shapes = {k: tuple(v.shape) for k, v in workers.crash_model().named_parameters()}
    rng = random.Random(async_mode)
    steps: list[int] = []
    started = time.perf_counter()
    marker = directory / "started"
    phases = {"start": 0.0, "kill": 0.0, "check": 0.0}
    for _ in range(KILLS):
        marker.unlink(missing_ok=True)
        t0 = time.perf_counter()
        process = FORK.Process(target=workers.save_loop, args=(str(directory), async_mode))
        process.start()
        while not marker.exists() and process.is_alive() and time.perf_counter() - t0 < 20:
            time.sleep(0.002)
        t1 = time.perf_counter()
        time.sleep(rng.uniform(0.0, 0.12))  # lands in setup (sweep, auto_resume), steps, staging or writes
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        t2 = time.perf_counter()
        assert process.exitcode == -signal.SIGKILL, "the save loop ended on its own"
        try:
            step = check_after_kill(directory, shapes)
        except CheckpointError as exc:
            pytest.fail(f"after a kill, a committed checkpoint does not load: {exc}")
        if step is not None:
            steps.append(step)
        phases["start"] += t1 - t0
        phases["kill"] += t2 - t1
        phases["check"] += time.perf_counter() - t2
    assert len(steps) > KILLS // 2, "too few kills landed after the first commit"
    assert steps == sorted(steps), "auto_resume went back in time"
    assert steps[-1] > 20
    timing = ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
    print(
        f"{async_mode}: {KILLS} kills in {time.perf_counter() - started:.1f} s ({timing}), latest at step {steps[-1]}"
    )
