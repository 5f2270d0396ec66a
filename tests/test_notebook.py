"""examples/notebook.ipynb runs top to bottom in a real Jupyter kernel of this environment."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import execute_notebook

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "notebook.ipynb"
KERNEL = "cadence-test"
NOTEBOOK_PACKAGES = "the notebook tests need nbformat, nbclient and ipykernel: pip install -e '.[dev]'"

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernelspec running this interpreter, found through JUPYTER_PATH (no global install)."""
    pytest.importorskip("ipykernel", reason=NOTEBOOK_PACKAGES)
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Cadence tests",
                "language": "python",
                # On the CPU also on a GPU host: the notebook launches forked workers after training in the kernel.
                "env": {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "CUDA_VISIBLE_DEVICES": ""},
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    return KERNEL


def test_the_notebook_runs_top_to_bottom(kernel, tmp_path):
    nbformat = pytest.importorskip("nbformat", reason=NOTEBOOK_PACKAGES)
    nbclient = pytest.importorskip("nbclient", reason=NOTEBOOK_PACKAGES)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    workdir = tmp_path / "work"
    workdir.mkdir()
    client = nbclient.NotebookClient(
        notebook,
        kernel_name=kernel,
        timeout=300,  # per cell
        startup_timeout=120,
        resources={"metadata": {"path": str(workdir)}},
    )
    execute_notebook(client)  # raises CellExecutionError, with the cell and traceback, on any error

    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "interrupted at step" in text and "continued from step" in text
    # Without ipywidgets the progress bar is tqdm's text bar, not a widget bar that warns and falls back.
    assert "IProgress not found" not in text and "TqdmWarning" not in text, text[-3000:]
    assert "step/s" in text, "no progress bar was drawn"
    assert "2 processes:" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot was not displayed"
    assert list((workdir / "runs").rglob("metrics.jsonl")), "the engine wrote no metrics into the notebook's folder"
