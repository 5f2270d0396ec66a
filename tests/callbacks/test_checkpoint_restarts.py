"""Restarts that must end where the job ends (issue 34, defect 7).

`fit(steps=N)` trains N steps from wherever the state is when it starts, and a
restore (`resume`, `auto_resume`) happens in the first run's `on_setup`: before
`engine.setup()` existed nothing showed the restored step before `fit`, so a
restarted TorchFT replica group that called `fit(steps=N)` ran N steps past its
restore point (to step 140 of a 120-step job) and wrote the shared `latest`
there. The job's length is `steps=` in the engine config (absolute); a group
restored at it trains nothing and leaves the shared `latest` alone.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

import cadence
from cadence.callbacks import Checkpoint
from cadence.checkpoint.dcp_store import DCPStore
from cadence.checkpoint.store import FORMAT, CheckpointError
from tests.conftest import tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(120)

JOB_STEPS = 12


def group(folder: Path, run_id: str, **checkpoint) -> cadence.Engine:
    """One replica group's engine (one process here): the job's length in its config, checkpoints in `folder`."""
    model = tiny_model()
    return cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_dataset(96),
        loss_fn=torch.nn.functional.cross_entropy, seed=0, train={"batch_size": 4}, eval_every_epochs=None,
        steps=JOB_STEPS, workspace=str(folder.parent / "runs"), run_id=run_id, device="cpu",
        callbacks=[Checkpoint(dir=str(folder), interval=4, keep_latest_k=0, **checkpoint)],
    )  # fmt: skip


def test_setup_restores_before_fit_so_the_step_a_fit_counts_from_is_seen(tmp_path):
    first = group(tmp_path / "ckpt", "a")
    first.fit(steps=6)
    first.close()
    engine = group(tmp_path / "ckpt", "a", auto_resume=True)
    assert engine.state.step == 0  # nothing restored yet: on_setup has not run
    engine.setup()  # the launch modes apply now
    assert engine.state.step == 6 and engine.restored_from == str((tmp_path / "ckpt" / "latest").absolute())
    engine.setup()  # once per engine: a second call restores nothing again
    engine.fit(steps=2)  # counted from the restored step, as setup() showed
    assert engine.state.step == 8
    engine.close()


def test_a_restarted_group_ends_at_the_job_s_step_and_leaves_a_newer_latest_alone(tmp_path):
    shared = tmp_path / "ckpt"
    done = group(shared, "group-0", auto_resume=True)
    done.fit()  # to the job's step
    done.close()
    assert done.state.step == JOB_STEPS
    # A group restarted long ago from the folder's step-4 checkpoint: the job's step, not 4 + 12.
    (tmp_path / "old").mkdir()
    shutil.copytree(shared / "ckpt-s000000000004", tmp_path / "old" / "ckpt-s000000000004")
    late = group(tmp_path / "own", "group-1", resume=str(tmp_path / "old" / "ckpt-s000000000004"))
    late.setup()
    assert late.state.step == 4
    late.fit()
    late.close()
    assert late.state.step == JOB_STEPS
    # A group restarted now: auto_resume restores the shared latest (the job's step), it trains nothing,
    # and it does not write that checkpoint again (it was rewritten with this group's state at fit end).
    latest = shared / "latest" / "manifest.json"
    before = (latest.read_bytes(), os.stat(latest).st_ino)
    again = group(shared, "group-1", auto_resume=True)
    again.setup()
    assert again.state.step == JOB_STEPS
    again.fit()
    again.close()
    assert again.state.step == JOB_STEPS
    assert (latest.read_bytes(), os.stat(latest).st_ino) == before


def test_a_checkpoint_without_its_manifest_names_its_step_for_resume_as_for_auto_resume(tmp_path, caplog):
    first = group(tmp_path / "ckpt", "a")
    first.fit(steps=6)
    first.close()
    (tmp_path / "ckpt" / "latest" / "manifest.json").unlink()
    engine = group(tmp_path / "x", "b", resume=str(tmp_path / "ckpt" / "latest"))
    with pytest.raises(CheckpointError, match=r"\(step 6\): not a complete checkpoint: manifest\.json is missing"):
        engine.setup()  # was "(step unknown)"
    engine.close()
    engine = group(tmp_path / "ckpt", "a", auto_resume=True)
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        engine.setup()
    engine.close()
    assert any("latest (step 6): not a complete checkpoint" in r.message for r in caplog.records)
    # The DCP store names the step of its objects alike, located or listed.
    DCPStore(tmp_path / "dcp").write("latest", {"format": FORMAT, "meta": {"step": 9}, "model": {"w": torch.ones(2)}})
    (tmp_path / "dcp" / "latest" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"\(step 9\): not a complete checkpoint"):
        DCPStore().locate(tmp_path / "dcp" / "latest")
