"""examples/ddp_digits.py after examples/digits.py: its own run, trained on two processes (issue 34 defect 4)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


def run(cwd: Path, script: str, *overrides: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, str(ROOT / "examples" / script), "engine.epochs=1", *overrides]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_ddp_digits_trains_its_own_run_after_the_one_process_run(tmp_path):
    pytest.importorskip("sklearn", reason="needs scikit-learn: pip install 'cadence[examples]'")
    alone = run(tmp_path, "digits.py")
    assert "resumed from" not in alone
    two = run(tmp_path, "ddp_digits.py")
    assert "resumed from" not in two and "rank 0 final accuracy" in two
    runs = sorted(path.name for path in (tmp_path / "runs").glob("*/*"))
    assert len(runs) == 2 and runs[0].endswith("-ddp2") and runs[1].endswith("-local1"), runs
    assert runs[0].removesuffix("-ddp2") == runs[1].removesuffix("-local1")  # same code, same config
    # Named explicitly, the one-process run continues on two processes (here: already at its end).
    named = run(tmp_path, "ddp_digits.py", f"engine.run_id={runs[1]}")
    assert "resumed from step 23 (epoch 1)" in named
