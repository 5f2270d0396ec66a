"""Reading tensor files: direct and page-cache reads, large tensors in their own buffers, old layouts, damage."""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from pathlib import Path

import pytest
import torch

from cadence.checkpoint import file_io, file_read
from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.store import CheckpointError

pytestmark = pytest.mark.timeout(60)
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="direct I/O and mincore are Linux's")


def tensors() -> dict[str, torch.Tensor]:
    """Small and large tensors of several dtypes, with sizes that leave offsets unaligned when packed."""
    torch.manual_seed(0)
    return {
        "scalar": torch.tensor(3.0),  # 4 bytes, as AdamW's `step`
        "large": torch.randn(700_000),  # 2.8 MB: its own buffer
        "odd": torch.randint(0, 255, (5,), dtype=torch.uint8),
        "double": torch.randn(300_000).double(),  # 2.4 MB
        "half": torch.randn(7).half(),
        "huge": torch.randn(9_000_000),  # 36 MB: larger than a read piece (several reads, streamed when verified)
        "empty": torch.empty(0, 3),
        "ints": torch.arange(300_000),
    }


def write(directory: Path, **options) -> FileStore:
    store = FileStore(directory, **options)
    store.write("latest", {"meta": {"step": 1}, "model": tensors(), "optimizers": [{"m": torch.randn(3_000_000)}]})
    return store


def assert_model(loaded: dict) -> None:
    for name, expected in tensors().items():
        got = loaded["model"][name]
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected), name


@pytest.mark.parametrize("direct", [None, True, False])
def test_every_path_reads_back_what_was_written(tmp_path: Path, direct: bool | None) -> None:
    store = write(tmp_path, direct_io=direct)
    store.verify("latest")
    loaded = store.read("latest")
    assert_model(loaded)
    for name in ("large", "double", "huge", "ints"):  # read straight into their own buffers, aligned
        assert loaded["model"][name].data_ptr() % file_io.TENSOR_ALIGN == 0
    assert torch.equal(store.read("latest")["optimizers"][0]["m"], loaded["optimizers"][0]["m"])


def test_tensors_start_at_aligned_offsets(tmp_path: Path) -> None:
    _, table, _ = file_io.split({"model": tensors()})
    assert all(offset % file_io.TENSOR_ALIGN == 0 for _, offset, *_ in table)
    write(tmp_path)
    sizes = {f.name: f.stat().st_size for f in (tmp_path / "latest").iterdir()}
    ends = {}
    for file, offset, nbytes, *_ in table:
        ends[file] = max(ends.get(file, 0), offset + nbytes)
    assert sizes["model.bin"] == ends["model.bin"]  # padding only between tensors


@pytest.mark.parametrize("direct", [True, False])
def test_files_written_back_to_back_still_read(tmp_path: Path, monkeypatch, direct: bool) -> None:
    """Checkpoints written before tensors were aligned in their files: unaligned large tensors are copied."""
    monkeypatch.setattr(file_io, "TENSOR_ALIGN", 1)
    store = write(tmp_path, direct_io=direct)
    monkeypatch.undo()
    assert (tmp_path / "latest" / "model.bin").stat().st_size == sum(t.nbytes for t in tensors().values())
    store.verify("latest")
    assert_model(store.read("latest"))


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("where", ["scalar", "large", "huge", "ints"])
def test_a_flipped_byte_in_any_tensor_is_found(tmp_path: Path, direct: bool, where: str) -> None:
    store = write(tmp_path, direct_io=direct)
    _, table, _ = file_io.split({"model": tensors()})
    names = list(tensors())
    _, offset, nbytes, *_ = table[names.index(where)]
    path = tmp_path / "latest" / "model.bin"
    data = bytearray(path.read_bytes())
    data[offset + nbytes - 1] ^= 0x04
    path.write_bytes(bytes(data))
    for check in (store.verify, store.read):
        with pytest.raises(CheckpointError, match=r"model\.bin: checksum mismatch"):
            check("latest")


def test_a_file_shorter_than_its_table_says_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(5000))
    entries = [(0, 0, 4000, "uint8", (4000,)), (1, 4032, 2000, "uint8", (2000,))]
    with file_read.TensorReads([(path, entries)], {}, direct=False) as reads:
        with pytest.raises(CheckpointError, match=r"t\.bin ends early: the file is truncated"):
            reads.read(0)
    entries = [(0, 64, 100, "uint8", (100,)), (1, 0, 10, "uint8", (10,))]
    with pytest.raises(CheckpointError, match="tensor table out of order"):
        file_read.TensorReads([(path, entries)], {}, direct=False)


@linux_only
def test_reads_carry_on_through_the_page_cache_when_direct_reads_are_refused(tmp_path: Path, monkeypatch) -> None:
    store = write(tmp_path, direct_io=True)
    real, refused = os.preadv, []

    def preadv(fd, buffers, offset, *flags):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "refused")
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    assert_model(store.read("latest"))
    assert refused


@linux_only
def test_direct_reads_are_chosen_for_large_files_not_in_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(file_read.DIRECT_MIN))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert file_read.cached_fraction(fd, file_read.DIRECT_MIN) > 0.9  # just written
        assert not file_read._direct_pays(fd, file_read.DIRECT_MIN)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert file_read.cached_fraction(fd, file_read.DIRECT_MIN) < 0.1
        assert file_read._direct_pays(fd, file_read.DIRECT_MIN)
        assert not file_read._direct_pays(fd, file_read.DIRECT_MIN - 1)  # small files: the page cache
    finally:
        os.close(fd)


def test_reads_without_positioned_reads(tmp_path: Path, monkeypatch) -> None:
    """Where os.preadv is missing (Windows), reads seek under a lock."""
    store = write(tmp_path, direct_io=False)
    monkeypatch.setattr(file_read, "_PREADV", False)
    store.verify("latest")
    assert_model(store.read("latest"))
