"""The async writer's staging: file images in reused page-aligned memory, written with direct I/O."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
import torch

from cadence.checkpoint import direct_io, file_io
from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.writer import Staging, staged_size
from tests.checkpoint.test_file_store import assert_same, payload

pytestmark = pytest.mark.timeout(60)

BIN = ("model.bin", "optimizers.bin", "state.bin")


def big_payload(scale: int = 1) -> dict:
    """`payload()` with MBs per file (model.bin large enough for direct I/O), state.bin's tensors under several keys."""
    torch.manual_seed(scale)
    out = payload()
    out["model"]["big"] = torch.randn(3 << 20)  # 12 MB: above direct_io.DIRECT_MIN
    out["optimizers"][0]["state"][0]["exp_avg_sq"] = torch.randn(300_001 * scale)
    out["callbacks"] = {"ema": {"shadow": torch.randn(700_003), "empty": torch.empty(0)}}
    return out


def same_files(a: Path, b: Path) -> None:
    for name in BIN:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    files = {k: v for k, v in FileStore(a.parent).manifest(a.name)["files"].items() if k != "payload.pt"}
    assert files == {k: v for k, v in FileStore(b.parent).manifest(b.name)["files"].items() if k != "payload.pt"}


def images(staged: dict) -> dict[str, bool]:
    """Per file of the store: whether its tensors lie in memory as one file image."""
    _, _, groups = file_io.split(staged)
    found = {}
    for file, tensors in groups.items():
        offsets, size = [], 0
        for t in tensors:
            offsets.append(file_io.padded(size))
            size = offsets[-1] + t.numel() * t.element_size()
        found[file] = direct_io.image_of(tensors, offsets, size) is not None
    return found


def direct_io_works(folder: Path) -> bool:
    probe = folder / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | direct_io.O_DIRECT, 0o644))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return bool(direct_io.O_DIRECT)


def test_staged_payload_is_laid_out_as_the_files_and_written_byte_for_byte_as_the_original(tmp_path: Path) -> None:
    store, staging, original = FileStore(tmp_path), Staging(), big_payload()
    staged = staging.stage(original)
    assert images(staged) == dict.fromkeys(BIN, True)
    assert staged["extra"]["tied"] is staged["model"]["0.weight"]  # tied weights stay tied
    store.write("staged", staged)
    store.write("original", original)
    same_files(tmp_path / "staged", tmp_path / "original")
    assert_same(store.read("staged"), original)
    pointers = {path: t.data_ptr() for path, t in staging.buffers.items()}
    staged = staging.stage(big_payload())  # the same shapes: the same memory
    assert {path: t.data_ptr() for path, t in staging.buffers.items()} == pointers
    changed = big_payload(scale=2)  # one tensor grows: laid out again, still one image per file
    staged = staging.stage(changed)
    assert images(staged) == dict.fromkeys(BIN, True)
    store.write("changed", staged)
    store.write("changed-original", changed)
    same_files(tmp_path / "changed", tmp_path / "changed-original")


def test_a_staged_write_leaves_the_page_cache_alone(tmp_path: Path) -> None:
    if not direct_io_works(tmp_path):
        pytest.skip("no direct I/O on this filesystem")
    store, staging = FileStore(tmp_path), Staging()  # the staging lives while its copies are written
    store.write("latest", staging.stage(big_payload()))
    fd = os.open(tmp_path / "latest" / "model.bin", os.O_RDONLY)
    try:
        cached = direct_io.cached_fraction(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    assert cached < 0.1, f"{cached:.0%} of model.bin went through the page cache: the write was buffered"


def test_direct_io_refused_midway_or_at_open_falls_back_to_buffered_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not direct_io.O_DIRECT:
        pytest.skip("no O_DIRECT here")
    store, original = FileStore(tmp_path), big_payload()
    store.write("original", original)
    staging = Staging()
    staged = staging.stage(original)
    real, refused = os.pwrite, []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & direct_io.O_DIRECT and offset:  # a device refusing a later request
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data[: 1 << 20] if offset == 0 else data, offset)  # a short first write: more than one

    monkeypatch.setattr(os, "pwrite", pwrite)
    store.write("midway", staged)
    assert refused
    monkeypatch.setattr(direct_io, "O_DIRECT", 0)  # a filesystem without direct I/O
    store.write("buffered", staged)
    same_files(tmp_path / "midway", tmp_path / "original")
    same_files(tmp_path / "buffered", tmp_path / "original")


def test_a_payload_that_outgrows_its_reserve_gets_one_more_buffer(tmp_path: Path) -> None:
    original = big_payload()
    staging = Staging()
    partial = {"model": original["model"], "optimizers": original["optimizers"]}  # no callback state
    staging.reserve(staged_size(partial))
    reserved, start = staging.nbytes, staging._pools[0].data_ptr()
    staged = staging.stage(original)
    assert staging.nbytes > reserved and len(staging._pools) == 2 and staging._pools[0].data_ptr() == start
    for tensor in (staged["model"]["big"], staged["optimizers"][0]["state"][0]["exp_avg_sq"]):
        assert start <= tensor.data_ptr() < start + reserved  # the files that fit stay in the reserved buffer
    assert images(staged) == dict.fromkeys(BIN, True)
    store = FileStore(tmp_path)
    store.write("staged", staged)
    store.write("original", original)
    same_files(tmp_path / "staged", tmp_path / "original")
    staging.close()
