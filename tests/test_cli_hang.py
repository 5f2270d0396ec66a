"""`cadence hang`: asking a running rank for a dump, and a run without heartbeat records.

The multi-rank report (a real hang on 2 gloo ranks, flight recorders included) is
tests/distributed/test_hang.py; here one process on the local backend (no process group, so no
flight recorder) is stuck in a callback while `cadence hang --dump` runs from another thread.
"""

from __future__ import annotations

import contextlib
import io
import threading

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.callbacks import Heartbeat
from cadence.cli import main
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)


class Blocker(cadence.Callback):
    """Blocks the end of step 2 until released (a hang the test ends)."""

    raises_requests = False

    def __init__(self):
        self.blocked, self.release = threading.Event(), threading.Event()

    def on_step_end(self, engine):
        if engine.state.step == 2:
            self.blocked.set()
            self.release.wait(30)


def test_dump_asks_the_running_rank_and_names_the_callback_it_is_stuck_in(tmp_path):
    blocker = Blocker()
    model = tiny_model()
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(4), loss_fn=F.cross_entropy,
        callbacks=[Heartbeat(interval=0.1, timeout=60), blocker], seed=0, workspace=str(tmp_path), device="cpu",
    )  # fmt: skip
    out, codes = io.StringIO(), []

    def ask():
        blocker.blocked.wait(30)
        with contextlib.redirect_stdout(out):
            codes.append(main(["hang", str(engine.run_dir), "--dump", "--wait", "10"]))
        blocker.release.set()

    thread = threading.Thread(target=ask)
    thread.start()
    engine.fit(steps=4)
    thread.join()
    text = out.getvalue()
    assert codes == [0] and engine.state.step == 4, text
    assert "rank 0 (" in text and "step 2, on_step_end, in Blocker.on_step_end" in text, text
    assert "dumps on request: cadence hang --dump" in text  # the stack is the one dumped for this request
    assert "tests/test_cli_hang.py" in text and "in on_step_end" in text
    assert "no flight recorder dump" in text  # the local backend has no process group
    assert "not every running rank dumped" not in text


def test_a_run_without_heartbeat_records_is_a_usage_error(tmp_path, capsys):
    assert main(["hang", str(tmp_path)]) == 2
    assert "has no heartbeat records" in capsys.readouterr().err
    assert main(["hang", str(tmp_path / "missing")]) == 2
