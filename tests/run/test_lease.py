"""The run directory's lease: one live launch per run directory, freed by the kernel when its holder dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cadence
from cadence.run import lease
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(180)

CADENCE = Path(sys.executable).with_name("cadence")

# One configuration, so every launch resolves to the same run directory; "hold" keeps the process alive.
SCRIPT = """
import sys, time, torch, cadence
m = torch.nn.Linear(2, 1)
e = cadence.Engine(m, torch.optim.SGD(m.parameters(), lr=0.1), [(torch.ones(1, 2), torch.ones(1, 1))] * 4,
    loss_fn=torch.nn.functional.mse_loss, seed=5, workspace="ws", lineage="leased", device="cpu")
print("opened", e.run_dir, flush=True)
if sys.argv[1] == "hold":
    time.sleep(600)
"""


def launch(cwd: Path, mode: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode], cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def runs_table(cwd: Path) -> dict[str, list[str]]:
    done = subprocess.run([str(CADENCE), "runs", "ws"], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    header, *lines = done.stdout.splitlines()
    assert header.split()[-3:] == ["STATE", "HELD", "BY"]
    return {line.split()[1]: line.split() for line in lines}


def test_a_second_live_launch_fails_naming_the_holder_and_a_killed_holder_frees_the_directory(tmp_path):
    holder = launch(tmp_path, "hold")
    try:
        opened = holder.stdout.readline()
        assert opened.startswith("opened "), holder.stderr.read()
        run_dir = Path(opened.split(" ", 1)[1].strip())
        second = launch(tmp_path, "once")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 1
        assert f"run directory {run_dir} is in use by pid {holder.pid} on host {socket.gethostname()}" in err
        assert "RunDirectoryBusy" in err and "CADENCE_RUN_LEASE_WAIT" in err
        # `cadence runs` names the holder.
        assert runs_table(tmp_path)["leased"][-2:] == ["created", f"{socket.gethostname()}:{holder.pid}"]
        # A launch asked to wait starts once the holder is gone: SIGKILL, no chance to clean up.
        waiting = launch(tmp_path, "once", CADENCE_RUN_LEASE_WAIT="120")
        time.sleep(2.0)
        assert waiting.poll() is None, waiting.communicate()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        out, err = waiting.communicate(timeout=120)
        assert waiting.returncode == 0, err
        assert out.strip() == f"opened {run_dir}"
    finally:
        holder.kill()
        holder.wait()
    # The waiter has exited too: the next launch takes the lease at once, and nobody holds it after.
    again = launch(tmp_path, "once")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert runs_table(tmp_path)["leased"][-1] == "-"
    assert lease.holder(run_dir) is None


def test_engines_of_one_run_in_one_process_share_the_lease_until_the_last_is_closed_or_collected(tmp_path):
    import gc

    def engine() -> cadence.Engine:
        model = tiny_model()
        return cadence.Engine(
            model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(2),
            loss_fn=torch.nn.functional.cross_entropy, seed=1, workspace=str(tmp_path / "ws"), device="cpu",
        )  # fmt: skip

    first, second = engine(), engine()
    assert first.run_dir == second.run_dir
    held = lease.holder(first.run_dir)
    assert held is not None and held["pid"] == os.getpid() and held["attempt"] == first.attempt_timestamp
    run_dir = first.run_dir
    del first
    gc.collect()
    assert lease.holder(run_dir) is not None  # the second engine still holds it
    second.close()
    assert lease.holder(run_dir) is None


def test_a_bad_wait_setting_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(lease.WAIT_ENV, "soon")
    with pytest.raises(ValueError, match="CADENCE_RUN_LEASE_WAIT='soon'"):
        lease.acquire(tmp_path, object(), "now")
    monkeypatch.setenv(lease.WAIT_ENV, "inf")
    assert lease.wait_seconds() == float("inf")


def test_a_forked_child_holds_nothing_of_its_parents_lease(tmp_path):
    import multiprocessing

    model = tiny_model()
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(2),
        loss_fn=torch.nn.functional.cross_entropy, seed=1, workspace=str(tmp_path / "ws"), device="cpu",
    )  # fmt: skip
    run_dir = engine.run_dir
    context = multiprocessing.get_context("fork")
    queue = context.Queue()

    def child() -> None:
        try:
            lease.acquire(run_dir, object(), "child")
            queue.put("acquired")
        except lease.RunDirectoryBusy as exc:
            queue.put(str(exc))

    process = context.Process(target=child)
    process.start()
    answer = queue.get(timeout=60)
    process.join(timeout=60)
    assert f"in use by pid {os.getpid()}" in answer
