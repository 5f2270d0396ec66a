"""Cadence runs with numpy missing (declared since torch warns without it, but only used when importable);
the wheel's fresh-venv run with only the declared dependencies is .ci/wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# numpy made unimportable before torch loads: torch then has no numpy support,
# as in a venv where numpy was removed after installing Cadence.
WITHOUT_NUMPY = textwrap.dedent(
    """
    import sys
    sys.modules["numpy"] = None
    import torch
    from torch.nn import functional as F
    import cadence
    from cadence.callbacks import Checkpoint

    def engine(**overrides):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 4, (32,)))
        return cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
                              seed=0, train=cadence.DataConfig(batch_size=8), **{"device": "cpu", **overrides})

    def two_ranks():
        with engine(backend="ddp") as e:
            e.request_stop("agreed across ranks")  # a request goes through the agreement buffer
            e.fit(steps=3)
            return e.state.step

    if __name__ == "__main__":
        with engine(callbacks=[Checkpoint()]) as first:
            first.fit(steps=3)
        with engine(callbacks=[Checkpoint(resume=str(first.run_dir / "checkpoints" / "latest"))]) as second:
            second.fit(steps=1)
        assert second.state.step == 4, second.state.step
        # An async save writes from its staging image (its own write path).
        with engine(callbacks=[Checkpoint(dir="async", async_mode="async")]) as third:
            third.fit(steps=3)
        with engine(callbacks=[Checkpoint(dir="async", resume="async/latest")]) as fourth:
            fourth.fit(steps=1)
        assert fourth.state.step == 4, fourth.state.step
        assert cadence.launch(two_ranks, nprocs=2, start_method="fork", timeout=60) == 1
        print("ok")
    """
)


@pytest.mark.timeout(120)
def test_save_resume_and_two_ranks_without_numpy(tmp_path):
    script = tmp_path / "without_numpy.py"
    script.write_text(WITHOUT_NUMPY)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_ci_runs_the_wheel_in_a_fresh_venv():
    run = (ROOT / ".ci" / "run").read_text()
    wheel = (ROOT / ".ci" / "wheel").read_text()
    assert "bash .ci/wheel" in run
    assert 'bin/pip" wheel' in wheel and "wheel_smoke.py" in wheel
    installs = [line for line in wheel.splitlines() if 'bin/pip" install' in line]
    assert installs and not any("[" in line for line in installs), "the fresh venv must get no extras"
