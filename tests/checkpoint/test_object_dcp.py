"""The DCP store's checkpoints on a real S3 server (moto on 127.0.0.1), written and read by 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import cadence
from cadence.checkpoint.dcp_store import DCPStore
from cadence.checkpoint.object_dcp import ObjectDCPStore
from cadence.testing.s3 import S3Server
from tests.callbacks.test_resume import assert_bitwise
from tests.checkpoint import dcp_workers as workers

pytestmark = pytest.mark.timeout(300)


def launch(fn: Any, *args: Any) -> Any:
    return cadence.launch(fn, *args, nprocs=2, start_method="fork", timeout=240)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_two_ranks_save_dcp_to_s3_and_resume_bitwise(tmp_path: Path, s3_server: S3Server, async_mode: str) -> None:
    url = s3_server.url(f"dcp-{async_mode}/checkpoints")
    reference = launch(workers.ddp_run, str(tmp_path / "reference"), None, "none", async_mode)
    first = launch(workers.ddp_run, url, 13, "none", async_mode)
    store = ObjectDCPStore(DCPStore(), url)
    assert store.names() == ["ckpt-s000000000010", "latest"]
    manifest = store.verify("latest")
    assert manifest["store"] == "dcp" and manifest["world_size"] == 2 and manifest["step"] == 13
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "objects.pt"} <= set(manifest["files"])
    resumed = launch(workers.ddp_run, url, None, "auto", async_mode)
    assert resumed["restored_from"] == f"{url}/latest"
    assert_bitwise(reference, first, resumed)
    fs = s3_server.filesystem()
    fs.invalidate_cache()
    assert len(fs.ls(f"{url}/.saves")) == len({store.target(name) for name in store.names()})  # retention


def test_objects_keep_no_view_of_a_larger_storage() -> None:
    """The async writer stages tensors as views into one buffer; objects.pt must hold them as their own tensors."""
    import io

    import torch

    from cadence.checkpoint import dcp_io

    state = torch.get_rng_state()
    staging = torch.zeros(1 << 16, dtype=torch.uint8)
    view = staging[4096 : 4096 + state.numel()]
    view.copy_(state)
    loaded = torch.load(io.BytesIO(dcp_io.serialize({"rng": [view], "at": (view,)})), weights_only=True)
    for tensor in (loaded["rng"][0], loaded["at"][0]):
        assert tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == state.numel()
        assert torch.equal(tensor, state)
    torch.set_rng_state(loaded["rng"][0])  # crashed the process on the view (a segfault)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_sigkill_of_both_ranks_during_uploads_never_shows_a_partial_checkpoint(
    tmp_path: Path, s3_server: S3Server, async_mode: str
) -> None:
    """2 DCP ranks saving ~48 MB at every step are killed together while a save is being uploaded, until two kills
    have cut an upload short."""
    import multiprocessing
    import os
    import signal
    import time

    from tests.checkpoint import object_workers
    from tests.checkpoint.test_object_store import saves, wait_for_an_upload

    url = s3_server.url(f"dcp-kills-{async_mode}/checkpoints")
    store = ObjectDCPStore(DCPStore(), url)
    expected_step, hits = 0, 0
    for round_ in range(6):
        if hits == 2:
            break
        out = tmp_path / f"restored-{round_}"
        before = set(saves(s3_server, url))
        process = multiprocessing.get_context("fork").Process(
            target=object_workers.dcp_loop, args=(url, str(out), async_mode)
        )
        process.start()
        try:
            wait_for_an_upload(s3_server, url, before, out, process.is_alive, 240)
            assert process.is_alive(), "the ranks exited before they were killed"
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.join(10)
        assert int(out.read_text().split()[0]) == expected_step  # auto-resume took the last complete one
        listed = saves(s3_server, url)
        names = {name: store.target(name) for name in store.names()}
        assert names, "no checkpoint is visible after the kill"
        for name, save in names.items():
            assert save is not None and listed[save], (name, save)
            assert store.verify(name)["world_size"] == 2
        hits += any(s not in before and s not in names.values() for s in listed)
        expected_step = store.manifest("latest")["step"]
    assert hits == 2
    # The killed ranks are init's to reap, each in its own time: until then its pid looks alive and sweep
    # keeps its upload. Sweep until every cut upload is gone, or the deadline.
    deadline, removed = time.monotonic() + 60, []
    kept = {store.target(name) for name in store.names()}
    while True:
        removed += store.sweep()
        if set(saves(s3_server, url)) == kept or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert removed, "sweep left the cut uploads"
    assert set(saves(s3_server, url)) == kept
