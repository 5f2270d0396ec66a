"""The async writer's staging: file images in reused page-aligned memory, written with direct I/O."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from cadence.checkpoint import direct_io, file_io
from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.staging import Staging, staged_size
from cadence.checkpoint.writer import AsyncWriter, Job
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


# -- pacing: a background write rests between its writes, and stops resting when someone waits ----------


def test_a_paced_write_rests_between_writes_and_hurries_when_waited_for(tmp_path: Path) -> None:
    image = direct_io.image_empty(3 * direct_io._WRITE)
    image.fill_(7)
    size = image.numel()
    pace = direct_io.Pace(1e-6)  # a rest of a million times each write: it would never end on its own
    ends: list[int] = []

    def write() -> None:
        fd = os.open(tmp_path / "paced.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with direct_io.paced(pace):
                direct_io.write_image(tmp_path / "paced.bin", fd, image, size, ends.append)
        finally:
            os.close(fd)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not ends and time.monotonic() < deadline:
        time.sleep(0.01)
    thread.join(0.5)
    assert thread.is_alive() and ends == [direct_io._WRITE]  # resting after its first write
    pace.hurry.set()  # the loop waits for it now: the rest ends and the rest is written at full speed
    thread.join(20)
    assert not thread.is_alive() and ends[-1] == size
    assert (tmp_path / "paced.bin").read_bytes() == bytes([7]) * size
    with direct_io.paced(None):  # outside the writer's thread, and in sync saves: no pace at all
        assert getattr(direct_io._pacing, "pace", None) is None
    with pytest.raises(ValueError, match="share must be in"):
        direct_io.Pace(0)


def test_the_writer_writes_at_full_speed_while_it_is_drained(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    writer = AsyncWriter(lambda job: store.write(job.primary, job.payload), share=1e-6)
    writer.start()
    big = big_payload()
    big["model"]["big"] = torch.randn(10 << 20)  # 40 MB: two direct writes, a rest after the first
    writer.submit(Job(big, "latest", (), step=1, epoch=0, reason="test"))
    time.sleep(0.5)
    assert writer.pending() and not writer.drain(0)  # a look does not hurry it: still resting
    assert writer.drain(timeout=30)  # a wait does
    assert writer.close(timeout=30)
    done, error, _ = writer.take()
    assert error is None and [job.step for job in done] == [1]
    assert_same(store.read("latest"), big_payload() | {"model": big["model"]})
