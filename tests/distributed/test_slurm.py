"""The SLURM path of cadence.launch, run through submitit's local executor (2 tasks)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import cadence
from cadence.launch import SlurmConfig, WorkerError, launch, slurm_requeue

pytest.importorskip("submitit", reason="needs submitit: pip install 'cadence[slurm]'")
pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _importable_repo(monkeypatch):
    # submitit's tasks are fresh interpreters: let them import cadence from this checkout.
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def local_config(tmp_path: Path, **kwargs) -> SlurmConfig:
    return SlurmConfig(cluster="local", tasks_per_node=2, time=2, folder=str(tmp_path / "slurm" / "%j"), **kwargs)


def test_two_tasks_train_ddp_and_return_rank_zero_result(tmp_path):
    def train(scale):
        import torch

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
        with cadence.Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data,
            loss_fn=torch.nn.functional.mse_loss,
            backend="auto",
            seed=0,
            train={"batch_size": 4},
            device="cpu",
        ) as engine:
            engine.fit(epochs=1)
            weights = engine.backend.all_gather(model.weight.detach().reshape(-1))
            return {
                "backend": engine.backend.name,
                "rank": rank,
                "world": world,
                "steps": engine.state.step * scale,
                "replicas_equal": bool((weights[0] == weights[1]).all()),
                "master": (os.environ["MASTER_ADDR"], os.environ["LOCAL_WORLD_SIZE"]),
            }

    result = launch(train, 10, slurm=local_config(tmp_path), timeout=100)
    # 32 samples, 2 ranks x batch 4: 4 steps per epoch.
    assert result == {
        "backend": "ddp",
        "rank": 0,
        "world": 2,
        "steps": 40,
        "replicas_equal": True,
        "master": ("127.0.0.1", "2"),
    }


def test_a_failing_task_is_reported_with_its_rank(tmp_path):
    def fail():
        if os.environ["RANK"] == "1":
            raise RuntimeError("rank one ran out of disk")
        return "fine"

    with pytest.raises(WorkerError, match="rank 1 of 2 failed") as info:
        launch(fail, slurm=local_config(tmp_path), timeout=100)
    assert "rank one ran out of disk" in info.value.traceback


def test_requeue_after_preemption_reruns_the_job(tmp_path):
    attempts = tmp_path / "attempts"
    attempts.mkdir()

    def preempted_once():
        rank = os.environ["RANK"]
        attempt = len(list(attempts.glob(f"rank{rank}-*")))
        (attempts / f"rank{rank}-{attempt}").touch()
        if attempt == 0:
            # What the Preemption callback does after its forced checkpoint.
            assert slurm_requeue()
            return "first attempt"
        return f"attempt {attempt}"

    assert launch(preempted_once, slurm=local_config(tmp_path), timeout=100) == "attempt 1"
    assert sorted(p.name for p in attempts.iterdir()) == ["rank0-0", "rank0-1", "rank1-0", "rank1-1"]


def test_requeue_outside_slurm_does_nothing(monkeypatch):
    for name in ("SUBMITIT_FOLDER", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert slurm_requeue() is False


def test_sbatch_script_has_one_task_per_gpu_and_the_requested_resources(tmp_path):
    from submitit.slurm.slurm import SlurmExecutor, _make_sbatch_string

    from cadence.launch_slurm import slurm_parameters

    config = SlurmConfig(
        nodes=2,
        gpus_per_node=8,
        cpus_per_task=6,
        mem="64G",
        partition="train",
        time=120,
        extra={"constraint": "a100", "slurm_qos": "high"},
        folder=str(tmp_path / "%j"),
    )
    generic = {
        "name": "job_name",
        "timeout_min": "time",
        "nodes": "nodes",
        "cpus_per_task": "cpus_per_task",
        "gpus_per_node": "gpus_per_node",
        "tasks_per_node": "ntasks_per_node",
    }
    assert set(generic) <= set(SlurmExecutor._equivalence_dict())
    sbatch = {generic.get(k, k.removeprefix("slurm_")): v for k, v in slurm_parameters(config).items()}
    script = _make_sbatch_string(command="python -m submitit.core._submit x", folder=config.folder, **sbatch)
    for line in (
        "--nodes=2",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--cpus-per-task=6",
        "--mem=64G",
        "--partition=train",
        "--time=120",
        "--qos=high",
        "--constraint=a100",
        "--job-name=cadence",
    ):
        assert f"#SBATCH {line}" in script, line
