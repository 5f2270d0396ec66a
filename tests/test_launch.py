"""cadence.launch: local workers (fork/spawn), failures, timeouts, notebooks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import cadence
from cadence.launch import WorkerError, importable, launch
from tests.conftest import execute_notebook

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_PACKAGES = "the notebook tests need nbformat, nbclient and ipykernel: pip install -e '.[dev]'"


def report_environment(tag):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        keys = ("MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "EXTRA")
        return tag, total.item(), {k: os.environ.get(k) for k in keys}, torch.get_num_threads()
    finally:
        dist.destroy_process_group()


def test_fork_returns_rank_zero_result_with_torchrun_environment():
    tag, total, env, threads = launch(
        report_environment, "hi", nprocs=2, start_method="fork", env={"EXTRA": "x"}, timeout=60
    )
    assert (tag, total, threads) == ("hi", 3.0, 1)
    assert env == {
        "MASTER_ADDR": "127.0.0.1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
        "EXTRA": "x",
    }


def test_spawn_runs_an_importable_function():
    assert importable(report_environment)
    tag, total, env, _ = launch(report_environment, "spawned", nprocs=2, start_method="spawn", timeout=80)
    assert (tag, total, env["WORLD_SIZE"]) == ("spawned", 3.0, "2")


def test_local_function_defaults_to_fork_and_spawn_is_refused():
    def local_fn():
        return int(os.environ["RANK"]) + 10

    assert not importable(local_fn)
    assert launch(local_fn, nprocs=2, timeout=30) == 10
    with pytest.raises(ValueError, match="cannot be imported by a new process"):
        launch(local_fn, nprocs=2, start_method="spawn")


def test_lazy_export_and_callable_module():
    import importlib

    assert cadence.launch(lambda: "ok", nprocs=1, timeout=30) == "ok"
    module = importlib.import_module("cadence.launch")
    assert callable(module) and module(lambda: "still ok", nprocs=1, timeout=30) == "still ok"
    assert cadence.SlurmConfig is importlib.import_module("cadence.launch_slurm").SlurmConfig


def test_bad_nprocs_is_an_error():
    with pytest.raises(ValueError, match="nprocs"):
        launch(lambda: None, nprocs=0)


def fail_on_rank_one(pid_dir):
    Path(pid_dir, f"{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    if os.environ["RANK"] == "1":
        raise KeyError("the data shard of rank one is missing")
    time.sleep(60)  # rank 0 must be killed, not waited for


def test_worker_exception_names_rank_and_traceback_and_kills_the_others(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(fail_on_rank_one, str(tmp_path), nprocs=2, start_method="fork", timeout=60)
    assert time.monotonic() - start < 20
    error = info.value
    assert error.rank == 1 and error.exc_type == "builtins.KeyError"
    assert "rank 1 of 2 failed" in str(error)
    assert "in fail_on_rank_one" in error.traceback and "data shard of rank one" in error.traceback
    assert isinstance(error.original, KeyError)
    for rank in (0, 1):
        pid = int((tmp_path / f"{rank}.pid").read_text())
        assert not _alive(pid), f"rank {rank} (pid {pid}) outlived launch"


def test_worker_that_dies_without_exception_is_reported():
    def die():
        if os.environ["RANK"] == "1":
            os._exit(7)
        time.sleep(60)

    with pytest.raises(WorkerError, match="rank 1 of 2 exited with code 7") as info:
        launch(die, nprocs=2, start_method="fork", timeout=60)
    assert info.value.exitcode == 7


def test_a_rank_killed_outside_python_is_the_cause_not_the_rank_that_errors_after_it():
    # CI of d0fdb77: rank 0 died without a report and the error named rank 1's "Connection reset by peer".
    import signal

    import torch.distributed as dist

    def die_then_reset():
        dist.init_process_group("gloo")
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # rank 1 waits for the dead rank, then raises

    with pytest.raises(WorkerError) as info:
        launch(die_then_reset, nprocs=2, start_method="fork", timeout=60)
    message = str(info.value)
    assert info.value.rank == 0 and message.startswith("rank 0 of 2 was killed by signal SIGKILL"), message
    assert "; then rank 1 failed: " in message


def test_timeout_kills_every_worker(tmp_path):
    def hang():
        Path(tmp_path, f"{os.environ['RANK']}.pid").write_text(str(os.getpid()))
        time.sleep(120)

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running") as info:
        launch(hang, nprocs=2, start_method="fork", timeout=2)
    assert time.monotonic() - start < 15
    message = str(info.value)  # where each stuck rank was: its Python stack
    assert "--- rank 0, where it was stuck ---" in message and "--- rank 1," in message
    assert "in hang" in message
    for rank in (0, 1):
        assert not _alive(int((tmp_path / f"{rank}.pid").read_text()))


def test_launch_from_main_module_like_a_notebook(tmp_path):
    # A function defined in __main__ with no file behind it (a notebook cell,
    # `python -`): spawn cannot import it, so launch forks.
    cell = textwrap.dedent(
        """
        import os, torch, torch.distributed as dist
        import cadence

        def train():
            dist.init_process_group("gloo")
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t)
            dist.destroy_process_group()
            return f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} saw {t.item()}"

        assert train.__module__ == "__main__"
        print(cadence.launch(train, nprocs=2, timeout=60))
        """
    )
    result = subprocess.run(
        [sys.executable, "-"],
        input=cell,
        capture_output=True,
        text=True,
        timeout=80,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "rank 0 of 2 saw 1.0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent has not reaped it yet).
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") == -1
    except FileNotFoundError:
        return False


def test_launch_from_a_real_notebook_cell(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason=NOTEBOOK_PACKAGES)
    nbclient = pytest.importorskip("nbclient", reason=NOTEBOOK_PACKAGES)
    pytest.importorskip("ipykernel", reason=NOTEBOOK_PACKAGES)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    define = textwrap.dedent(
        """
        import os, torch, cadence

        def train(steps):
            model = torch.nn.Linear(4, 1)
            data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
            with cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                                loss_fn=torch.nn.functional.mse_loss, seed=0, device="cpu") as engine:
                engine.fit(steps=steps)
                return engine.backend.describe(), engine.state.step
        """
    )
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(define),
            nbformat.v4.new_code_cell("print(cadence.launch(train, 3, nprocs=2))"),
        ]
    )
    client = nbclient.NotebookClient(
        notebook, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    # As when pytest runs in the background (`&`, nohup): SIGINT ignored, and still ignored after.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        execute_notebook(client)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "running a notebook changed SIGINT's handler"
    finally:
        signal.signal(signal.SIGINT, previous)
    printed = "".join(output.get("text", "") for output in notebook.cells[1].outputs)
    assert "('ddp(rank=0/2, gloo, device=cpu)', 3)" in printed, notebook.cells[1].outputs


def test_interrupted_rank_zero_is_reported_not_a_missing_file():
    def interrupted():
        if os.environ["RANK"] == "0":
            raise KeyboardInterrupt  # torch's worker wrapper exits 0 on it

    with pytest.raises(WorkerError, match=r"rank 0 of 2 failed: builtins\.KeyboardInterrupt"):
        launch(interrupted, nprocs=2, start_method="fork", timeout=30)
