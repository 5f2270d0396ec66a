"""`cadence plot`: a PNG with one panel per metric family from a real run's metrics.jsonl."""

from __future__ import annotations

import io

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("matplotlib", reason="the plot extra is not installed (pip install 'cadence[plot]')")

from PIL import Image

import cadence
from cadence.callbacks.jsonl import read_jsonl
from cadence.callbacks.metrics import default_callbacks
from cadence.callbacks.progress import ProgressBar
from cadence.callbacks.text_log import TextLog
from cadence.cli import main
from cadence.plot import families, figure, plot
from tests.conftest import tiny_batches, tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(90)

EXPECTED = ["loss", "lr", "throughput", "time", "eval: val"]


@pytest.fixture
def run_dir(tmp_path):
    model = tiny_model()
    metrics, progress, jsonl, text_log = default_callbacks()
    assert isinstance(progress, ProgressBar) and isinstance(text_log, TextLog)
    progress.stream = io.StringIO()
    text_log.config.console = False
    callbacks = [metrics, progress, jsonl, text_log]
    engine = cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_dataset(64),
        eval_data=tiny_batches(2),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        log_interval=2,
        seed=0,
        workspace=str(tmp_path),
        train={"batch_size": 8},
        device="cpu",
    )
    engine.fit(epochs=2)
    return engine.run_dir


def test_plot_writes_a_png_with_a_panel_per_family(run_dir):
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert list(families(records)) == EXPECTED
    assert [axes.get_title() for axes in figure(records).axes] == EXPECTED

    written = cadence.plot(run_dir)  # type: ignore[operator]  # mypy sees the submodule; it is callable
    assert written == run_dir / "metrics.png"
    image = Image.open(written)
    assert image.format == "PNG"
    assert image.info["Description"] == "panels: " + "; ".join(EXPECTED)
    assert image.size == (1200, 960)  # 2 columns x 3 rows of panels at 100 dpi

    # Both spellings work: the lazily exported function and the (callable) module.
    import cadence.plot as module

    assert module.plot(run_dir, out=run_dir / "again.png") == run_dir / "again.png"
    assert module(run_dir, run_dir / "third.png").exists()  # type: ignore[operator]


def test_cli_plot(run_dir, capsys):
    out = run_dir / "cli.png"
    assert main(["plot", str(run_dir), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert Image.open(out).info["Description"].startswith("panels: loss; lr")


def test_families_group_by_prefix_and_split():
    records: list[dict[str, object]] = [
        {"step": 1, "epoch": 0, "time": 0.0, "loss": 1.0, "lr.body": 0.1, "lr.head": 0.2, "mfu": 0.3, "custom": 1},
        {"step": 1, "epoch": 0, "time": 0.0, "split": "val", "val.loss": 2.0, "val.accuracy": 0.5},
        {"step": 1, "epoch": 0, "time": 0.0, "split": "test", "test.accuracy": 0.4},
    ]
    assert families(records) == {
        "loss": ["loss", "val.loss"],
        "lr": ["lr.body", "lr.head"],
        "mfu": ["mfu"],
        "custom": ["custom"],
        "eval: test": ["test.accuracy"],
        "eval: val": ["val.loss", "val.accuracy"],
    }


def test_errors_name_the_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no metrics file at .*metrics\.jsonl"):
        plot(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no records yet"):
        plot(tmp_path)
