"""An unchanged training script runs under `torchrun --nproc_per_node 2`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cadence.launch import free_port

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
TORCHRUN_GRACE_S = 40  # torchrun's own grace for its workers after SIGTERM is 30 s

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import cadence

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                            loss_fn=torch.nn.functional.cross_entropy, seed=0, epochs=2, train={"batch_size": 8}, device="cpu")
    engine.fit()
    result = {
        "backend": engine.backend.describe(),
        "step": engine.state.step,
        "weights": [round(float(v), 7) for v in engine.model[0].weight.flatten()[:8]],
        "checksum": float(sum(p.double().sum() for p in model.parameters())),
    }
    engine.close()
    with open(os.path.join(sys.argv[1], f"rank{os.environ.get('RANK', 'single')}.json"), "w") as fh:
        json.dump(result, fh)
    """
)


def run_torchrun(command: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run`, but a timeout stops torchrun with SIGTERM, which it passes on to its workers.

    torchrun starts each worker in a session of its own: killing torchrun alone (what `subprocess.run` does on a
    timeout) would leave them running. On SIGTERM it stops them (SIGKILL after its 30 s grace) and exits.
    """
    with subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as run:
        try:
            stdout, stderr = run.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            run.send_signal(signal.SIGTERM)
            try:
                stdout, stderr = run.communicate(timeout=TORCHRUN_GRACE_S)
            except subprocess.TimeoutExpired:
                run.kill()
                stdout, stderr = run.communicate()
            raise AssertionError(f"torchrun ran past {timeout} s; its stderr:\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr)


def test_unchanged_script_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--max-restarts",
        "0",
        str(script),
        str(tmp_path),
    ]
    done = run_torchrun(command, env, tmp_path, timeout=60)  # + the grace: within the test's 120 s
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["backend"] == "ddp(rank=0/2, gloo, device=cpu)"
    assert ranks[1]["backend"] == "ddp(rank=1/2, gloo, device=cpu)"
    assert ranks[0]["step"] == ranks[1]["step"] == 8  # 64 samples / (2 ranks x 8) x 2 epochs
    assert ranks[0]["weights"] == ranks[1]["weights"] and ranks[0]["checksum"] == ranks[1]["checksum"]

    # The same script, with no launcher, trains on one process with the local backend.
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    single = json.loads((tmp_path / "ranksingle.json").read_text())
    assert single["backend"].startswith("local(") and single["step"] == 16


# Rank 1 dies at step 5 of the first attempt (after the step-4 checkpoint); torchrun restarts both.
DIES_ONCE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import cadence
    from cadence.callbacks import Checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                            loss_fn=torch.nn.functional.cross_entropy, seed=0, steps=8, train={"batch_size": 4},
                            callbacks=[Checkpoint(interval=2, auto_resume=True)], workspace="ws", device="cpu")
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if restart == 0 and os.environ["RANK"] == "1":
        engine.on(cadence.Event.ON_STEP_END, when=lambda e: e.state.step == 5)(lambda e: os._exit(3))
    engine.fit()
    if os.environ["RANK"] == "0":
        with open(os.path.join(sys.argv[1], "result.json"), "w") as fh:
            json.dump({"restart": restart, "restored_from": engine.restored_from, "step": engine.state.step,
                       "run_dir": str(engine.run_dir)}, fh)
    engine.close()
    """
)


@pytest.mark.timeout(240)
def test_a_torchrun_restart_resumes_from_the_last_checkpoint_and_is_recorded(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(DIES_ONCE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(name, None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "1",
        str(script), str(tmp_path),
    ]  # fmt: skip
    done = run_torchrun(command, env, tmp_path, timeout=180)  # + the grace: within the test's 240 s
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["restart"] == 1 and result["step"] == 8
    assert result["restored_from"].endswith("latest")  # the step-4 checkpoint, saved by the first attempt
    records = [json.loads(line) for line in (Path(result["run_dir"]) / "metadata" / "attempts.jsonl").open()]
    attempts = {}
    for record in records:
        attempts.setdefault(record["attempt"], []).append(record)
    first, second = attempts.values()
    assert {r["torchelastic_restart_count"] for r in first} == {0}
    assert {r["torchelastic_restart_count"] for r in second} == {1}
    # Its last record: the step-4 save's, when torchrun's SIGTERM came first ("running"), or the peer's death seen
    # in step 6's all-reduce ("failed"; rank 1 ended only after step 5's, so rank 0 had finished step 5).
    assert (first[-1]["state"], first[-1]["step"]) in (("running", 4), ("failed", 5)), first[-1]
    # The restart resumed from step 4: its fit started there, and it finished at step 8.
    assert next(r["step"] for r in second if r["state"] == "running") == 4
    assert second[-1]["state"] == "finished" and second[-1]["step"] == 8
