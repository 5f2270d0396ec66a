"""W&B offline with the network unreachable: history and summary hold the metrics; resume keeps the run id."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install 'cadence[wandb]')")

from wandb.proto import wandb_internal_pb2

import cadence
from cadence.callbacks.checkpoint import Checkpoint
from cadence.callbacks.metrics import TrainMetrics
from cadence.callbacks.wandb import WandB
from tests.conftest import tiny_batches, tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    # Every route out points at a closed local port: a call that needed the network would fail.
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the callback's mode="offline" must do it alone
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def wandb_records(path: Path):
    """The protobuf records of a .wandb file (LevelDB log format: 32 KiB blocks of chunks)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):
            break  # end of what is written so far
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            pending = chunk
        elif kind in (2, 3):  # first, middle
            pending = (pending if kind == 3 else b"") + chunk
            continue
        else:  # last
            pending += chunk
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(pending)
        yield record


def read_run(run_dir: Path, timeout: float = 30.0):
    """(run record, history rows, summary) of one offline run folder."""
    (log,) = run_dir.glob("run-*.wandb")
    # wandb-core (a separate process) writes the file; `run.finish()` may return
    # before it has: wait for the run's exit record.
    deadline = time.monotonic() + timeout
    while True:
        records = list(wandb_records(log))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    run, history, summary = None, [], {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            history.append(
                {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            )
        elif kind == "summary":
            for item in record.summary.update:
                summary["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
    return run, history, summary


def make_engine(callbacks, **kwargs):
    model = tiny_model()
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_dataset(96),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        seed=0,
        log_interval=2,
        train={"batch_size": 8},
        **{"device": "cpu", **kwargs},
    )


def test_offline_history_and_summary_hold_the_logged_metrics(tmp_path):
    sink = WandB(
        project="cadence-test", group="g", name="first", tags=["a", "b"], mode="offline", dir=str(tmp_path / "wb")
    )
    engine = make_engine([TrainMetrics(), sink], eval_data=tiny_batches(2), eval_every_steps=4)
    logged = []
    engine.on(cadence.Event.ON_LOG)(lambda e: logged.append((e.state.step, dict(e.logged))))
    engine.fit(steps=4)
    assert sink.run is None and sink.run_id  # finished at teardown, id kept

    (run_dir,) = (tmp_path / "wb" / "wandb").glob(f"offline-run-*-{sink.run_id}")
    run, history, summary = read_run(run_dir)
    assert run.run_id == sink.run_id and run.project == "cadence-test" and run.run_group == "g"
    assert list(run.tags) == ["a", "b"] and run.display_name == "first"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["log_interval"] == 2

    # Train and eval logs of the same step merge into one history row at that step.
    assert [row["_step"] for row in history] == [2, 4]
    for step, values in logged:
        row = next(row for row in history if row["_step"] == step)
        for name, value in values.items():
            assert row[name.replace(".", "/")] == value
    assert summary["loss"] == logged[-2][1]["loss"]
    assert summary["val/loss"] == logged[-1][1]["val.loss"]


def stop_and_resume(tmp_path, **sink_kwargs):
    """A run logging at 2, 4, 6 and checkpointed at 4, stopped and resumed to 8: the run folders' records."""
    ckpt, wb = str(tmp_path / "ckpt"), str(tmp_path / "wb")

    def run(attempt, sink, checkpoint, **kwargs):
        engine = make_engine([TrainMetrics(), sink, checkpoint], **kwargs)
        engine.on(cadence.Event.ON_STEP_END)(lambda e: e.log("attempt", attempt, "last"))
        return engine

    first_sink = WandB(project="cadence-test", mode="offline", dir=wb, **sink_kwargs)
    run(1, first_sink, Checkpoint(dir=ckpt, interval=4, unit="step", save_on_fit_end=False)).fit(steps=6)
    time.sleep(1.1)  # W&B names offline run folders by the second: a restart is never this fast

    second_sink = WandB(project="cadence-test", mode="offline", dir=wb, **sink_kwargs)
    run(2, second_sink, Checkpoint(dir=ckpt, auto_resume=True), steps=8).fit()
    assert second_sink.run_id == first_sink.run_id

    runs = sorted((Path(wb) / "wandb").glob(f"offline-run-*-{first_sink.run_id}"))
    assert len(runs) == 2  # `wandb sync` uploads both into the one run id, in order
    return first_sink.run_id, [read_run(run_dir) for run_dir in runs]


def test_resumed_run_continues_the_same_run_id(tmp_path):
    run_id, folders = stop_and_resume(tmp_path)
    histories = [[(row["_step"], row["attempt"]) for row in history] for _, history, _ in folders]
    # Step 6 is in both folders: the stopped run logged it after its checkpoint at 4, the
    # resumed run again. W&B keeps a run's steps increasing, so once synced the run holds 6
    # once, with the stopped run's value (W&B drops the resumed run's); resume="rewind" replaces it.
    assert histories == [[(2, 1), (4, 1), (6, 1)], [(6, 2), (8, 2)]]
    assert not any(run.HasField("branch_point") for run, _, _ in folders)
    assert [run.run_id for run, _, _ in folders] == [run_id, run_id]


def test_rewind_resume_replaces_what_the_stopped_run_logged_after_its_checkpoint(tmp_path):
    run_id, folders = stop_and_resume(tmp_path, resume="rewind")
    (first, first_history, _), (second, second_history, second_summary) = folders
    assert not first.HasField("branch_point")
    # The resumed folder starts with W&B's rewind to the checkpoint's step, applied when synced.
    assert (second.branch_point.run, second.branch_point.metric, second.branch_point.value) == (run_id, "_step", 4)
    assert second.run_id == run_id
    assert [(row["_step"], row["attempt"]) for row in first_history] == [(2, 1), (4, 1), (6, 1)]
    assert [(row["_step"], row["attempt"]) for row in second_history] == [(6, 2), (8, 2)]
    # The run W&B rebuilds: the first folder up to the rewind step, then the resumed one.
    rewound = [row for row in first_history if row["_step"] <= 4] + second_history
    assert [(row["_step"], row["attempt"]) for row in rewound] == [(2, 1), (4, 1), (6, 2), (8, 2)]
    assert second_summary["attempt"] == 2
