"""Every `benchmarks/*.py` runs in its seconds-long `--smoke` mode (tiny sizes, every part once), as a subprocess.

Found by glob: a benchmark added later is run too, and must take `--smoke`. A
benchmark that needs an optional package declares it at module level,
`REQUIRES = {"module": "extra"}`, and is skipped, naming the extra, where that
module is missing. A file without a `__main__` block is a helper the benchmarks
share (`fit_timing.py`): a benchmark must import it, and runs it so.

The figures of a smoke run mean nothing; this checks that the benchmarks still
run against today's Cadence (docs/benchmarks.md gives the commands that measure).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted((ROOT / "benchmarks").glob("*.py"))
MAIN = 'if __name__ == "__main__":'
SCRIPTS = [path for path in FILES if MAIN in path.read_text()]
HELPERS = [path for path in FILES if MAIN not in path.read_text()]


def requires(path: Path) -> dict[str, str]:
    """The module-level `REQUIRES` of a benchmark: optional module -> the extra that installs it."""
    for node in ast.parse(path.read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "REQUIRES" for t in targets) and node.value is not None:
            return ast.literal_eval(node.value)
    return {}


def test_the_benchmarks_are_found():
    assert len(SCRIPTS) >= 8, [path.name for path in FILES]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_benchmark_runs_in_smoke_mode(script: Path, tmp_path: Path):
    for module, extra in requires(script).items():
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"benchmarks/{script.name} needs {module}: pip install 'cadence[{extra}]'")
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"  # the run's own folders: nothing lands in the checkout or /tmp
    cwd.mkdir()
    tmp.mkdir()
    done = subprocess.run(
        [sys.executable, str(script), "--smoke"],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, (
        f"benchmarks/{script.name} --smoke exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )
    assert not list(cwd.iterdir()), f"benchmarks/{script.name} left {sorted(cwd.iterdir())} in its working folder"


@pytest.mark.parametrize("helper", HELPERS, ids=[path.name for path in HELPERS])
def test_every_helper_is_used_by_a_benchmark(helper: Path):
    users = [script.name for script in SCRIPTS if helper.stem in script.read_text()]
    assert users, f"benchmarks/{helper.name} has no __main__ block and no benchmark imports it"
