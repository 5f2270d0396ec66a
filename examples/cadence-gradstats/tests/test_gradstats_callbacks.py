"""The package's own tests: Cadence's contract harness, then what each callback does."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from cadence_gradstats import GradientHistogram, LRFinder

import cadence
from cadence.run.registry import build_callback, discover
from cadence.testing import callback_contract

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(120)

# One parametrized test per group of contract checks.
test_gradient_histogram_contract = callback_contract(GradientHistogram, config={"interval": 2})
test_lr_finder_contract = callback_contract(LRFinder, config={"num_steps": 4})


def _engine(callback, tmp_path, steps_of_data=8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(steps_of_data)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return cadence.Engine(
        model,
        optimizer,
        data,
        loss_fn=torch.nn.functional.mse_loss,
        callbacks=[callback],
        seed=0,
        log_interval=2,
        workspace=str(tmp_path),
    )


def test_entry_points_are_discovered():
    found = {info.name: info for info in discover()}
    assert found["gradient_histogram"].package == "cadence-gradstats"
    assert found["lr_finder"].target == "cadence_gradstats:LRFinder"
    assert build_callback({"name": "lr_finder", "num_steps": 7}).config.num_steps == 7


def test_gradient_histogram_records_norms_and_histograms(tmp_path):
    grads = GradientHistogram(interval=2, bins=10)
    engine = _engine(grads, tmp_path)
    engine.fit(steps=4)
    lines = [json.loads(line) for line in (engine.run_dir / "gradstats.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4]
    assert set(lines[0]["layers"]) == {"0", "2"}
    # Every gradient entry of the layer is counted once.
    assert sum(lines[-1]["layers"]["0"]["counts"]) == 4 * 8 + 8
    assert engine.logged["grad_norm/2"] == pytest.approx(lines[-1]["layers"]["2"]["norm"], rel=1e-6)
    # The norm is the one of the gradients the optimizer step used (pre-clip).
    assert grads.latest["2"]["norm"] > 0


def test_gradient_histogram_rejects_a_bad_range():
    with pytest.raises(ValueError, match="low"):
        GradientHistogram(low=1.0, high=0.0)


def test_lr_finder_sweeps_exponentially_and_stops(tmp_path):
    finder = LRFinder(min_lr=1e-3, max_lr=1.0, num_steps=4)
    engine = _engine(finder, tmp_path)
    engine.fit(steps=8)
    assert engine.state.step == 4  # the stop was agreed at the sweep's last step
    assert finder.done
    assert finder.lrs == pytest.approx([1e-3, 1e-2, 1e-1, 1.0])
    assert engine.optimizers[0].param_groups[0]["lr"] == pytest.approx(1.0)
    engine.fit(steps=8)  # the sweep is over: a later fit stops after one step
    assert engine.state.step == 5


def test_lr_finder_stops_on_divergence(tmp_path):
    finder = LRFinder(min_lr=1e-2, max_lr=1e4, num_steps=40, smoothing=1.0)
    engine = _engine(finder, tmp_path, steps_of_data=40)
    engine.fit(steps=40)
    assert finder.done and engine.state.step < 40
    assert finder.losses[-1] > finder.config.diverge * finder.best or not math.isfinite(finder.losses[-1])
    assert finder.suggestion() is not None and finder.suggestion() < finder.lrs[-1]


@pytest.mark.parametrize("module", ["cadence_gradstats", "cadence_gradstats.histogram", "cadence_gradstats.lr_finder"])
def test_docstring_examples_run(module, tmp_path, monkeypatch):
    import doctest
    import importlib

    monkeypatch.chdir(tmp_path)
    results = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS, report=False)
    assert results.failed == 0 and results.attempted > 0
