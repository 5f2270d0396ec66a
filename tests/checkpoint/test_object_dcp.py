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
