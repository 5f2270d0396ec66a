"""examples/lm.py keeps its run (issue 34 defect 5): a run directory, checkpoints in the background,
a clean Ctrl-C, the same command resumes, `cadence plot` draws it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.examples.test_lm import ROOT, TINY, final_val_loss

pytestmark = pytest.mark.timeout(400)

CADENCE = Path(sys.executable).with_name("cadence")


def test_lm_leaves_a_run_resumes_after_ctrl_c_and_plots(tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib: pip install 'cadence[plot]'")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, str(ROOT / "examples" / "lm.py"), *TINY, "engine.steps=40", "engine.device=cpu",
               "engine.eval_every_steps=20", "checkpoint.interval=10"]  # fmt: skip
    # SIGINT back to its default in the child: a pytest started in the background ignores it.
    first = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    lines = []
    for line in first.stdout:  # Ctrl-C after step 20's evaluation (checkpoints at 10 and 20 are due by then)
        lines.append(line)
        if "val.loss" in line:
            first.send_signal(signal.SIGINT)
            break
    out, err = first.communicate(timeout=200)
    assert first.returncode == 130, err[-3000:]
    assert "run the same command again to resume" in err and "Traceback" not in err, err[-3000:]
    assert "final val.loss" not in out
    run_dir = Path(next(line for line in lines if line.startswith("run directory: ")).split(": ", 1)[1].strip())
    assert run_dir.parent.parent == tmp_path / "runs" and run_dir.name.endswith("-local1")
    assert (run_dir / "checkpoints" / "latest" / "manifest.json").exists()
    assert list((run_dir / "logs").glob("*.log")) and (run_dir / "metrics.jsonl").stat().st_size > 0
    full = yaml.safe_load((run_dir / "metadata" / "config.full.yaml").read_text())
    assert full["checkpoint"]["async_mode"] == "async" and full["checkpoint"]["auto_resume"] is True

    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = re.search(r"^resumed from step (\d+): (.+)$", second.stdout, flags=re.M)
    assert resumed, second.stdout
    assert 10 <= int(resumed.group(1)) < 40 and str(run_dir) in resumed.group(2)
    assert f"run directory: {run_dir}" in second.stdout
    assert "trained 40 steps" in second.stdout and final_val_loss(second.stdout) < 5.0

    done = subprocess.run([str(CADENCE), "plot", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    image = Path(done.stdout.strip())
    assert image.exists() and image.stat().st_size > 0
