"""TextLog: a log file in the run directory, console on the main process, no handler leaks."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.backends.local import LocalBackend
from cadence.callbacks.metrics import TrainMetrics
from cadence.callbacks.progress import ProgressBar
from cadence.callbacks.text_log import TextLog
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)


def make_engine(callbacks, **kwargs):
    model = tiny_model()
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_batches(8),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        seed=0,
        log_interval=2,
        **{"device": "cpu", **kwargs},
    )


def test_file_and_console_during_the_run_only(tmp_path):
    console = io.StringIO()
    text_log = TextLog(console=True, stream=console)
    engine = make_engine([TrainMetrics(), text_log], workspace=str(tmp_path), eval_data=tiny_batches(1))
    logger = logging.getLogger("cadence")
    before = list(logger.handlers)
    seen_during = []
    engine.on(cadence.Event.ON_STEP_END, once=1)(lambda e: seen_during.append(len(logger.handlers)))
    engine.on(cadence.Event.ON_STEP_END, once=1)(lambda e: logging.getLogger("cadence.test").info("hello from a step"))
    engine.fit(steps=4)
    engine.evaluate()
    logging.getLogger("cadence.test").info("after the run")

    assert seen_during == [len(before) + 2]  # file + console while running
    assert logger.handlers == before  # removed at teardown
    assert text_log.path is not None
    assert text_log.path.parent == engine.run_dir / "logs" and text_log.path.suffix == ".log"
    text = text_log.path.read_text()
    assert "hello from a step" in text and "after the run" not in text
    assert "step 2 epoch 0 | loss=" in text and "step 4 epoch 0 eval val | val.loss=" in text
    assert "hello from a step" in console.getvalue()
    assert "loss=" in console.getvalue()  # no progress bar registered: metrics on the console too


def test_fit_twice_appends_to_one_file_and_no_handler_accumulates(tmp_path):
    text_log = TextLog(console=False)
    engine = make_engine([TrainMetrics(), text_log], workspace=str(tmp_path))
    logger = logging.getLogger("cadence")
    count = len(logger.handlers)
    engine.fit(steps=2)
    engine.fit(steps=2)
    assert len(logger.handlers) == count
    assert text_log.path is not None
    lines = [line for line in text_log.path.read_text().splitlines() if "| loss=" in line]
    assert [line.split(" | ")[0].split(" INFO cadence.metrics: ")[1] for line in lines] == [
        "step 2 epoch 0",
        "step 4 epoch 0",
    ]


def test_metric_lines_are_throttled_but_evaluations_and_the_last_state_are_logged(tmp_path):
    text_log = TextLog(console=False, metrics_interval=3600)
    engine = make_engine([TrainMetrics(), text_log], workspace=str(tmp_path), eval_data=tiny_batches(1))
    engine.fit(steps=8)  # logs at 2, 4, 6, 8; the epoch ends at 8 with an evaluation
    assert text_log.path is not None
    lines = [line.split(" INFO cadence.metrics: ")[1].split(" | ")[0] for line in text_log.path.read_text().splitlines()
             if "cadence.metrics" in line]  # fmt: skip
    assert lines == ["step 2 epoch 0", "step 8 epoch 0", "step 8 epoch 1 eval val"]


def test_console_metrics_left_to_the_progress_bar(tmp_path):
    console = io.StringIO()
    engine = make_engine(
        [TrainMetrics(), TextLog(console=True, stream=console), ProgressBar(mode="lines", stream=io.StringIO())],
        workspace=str(tmp_path),
    )
    engine.on(cadence.Event.ON_STEP_END, once=1)(lambda e: logging.getLogger("cadence").warning("a warning"))
    engine.fit(steps=2)
    assert "a warning" in console.getvalue()
    assert "loss=" not in console.getvalue()


def test_nothing_on_other_ranks(tmp_path):
    backend = LocalBackend(device="cpu")
    backend.rank = 1
    console = io.StringIO()
    text_log = TextLog(console=True, stream=console)
    engine = make_engine([TrainMetrics(), text_log], backend=backend, workspace=str(tmp_path))
    engine.fit(steps=2)
    assert text_log.path is None and not (tmp_path / "logs").exists()
    assert console.getvalue() == ""


def test_level_is_validated_and_restored(tmp_path):
    with pytest.raises(cadence.ConfigError, match="level"):
        TextLog(level="LOUD")
    logger = logging.getLogger("cadence")
    previous = logger.level
    engine = make_engine([TextLog(level="DEBUG", console=False)], workspace=str(tmp_path))
    levels = []
    engine.on(cadence.Event.ON_STEP_END, once=1)(lambda e: levels.append(logger.level))
    engine.fit(steps=1)
    assert levels == [logging.DEBUG] and logger.level == previous
