"""The file checkpoint store: round trips, atomic commits, links, sweeping, and damaged files."""

from __future__ import annotations

import collections
import errno
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash

from cadence.checkpoint import file_io, file_store
from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.store import CheckpointError, CheckpointStore

pytestmark = pytest.mark.timeout(60)


def payload(step: int = 3, scale: float = 1.0) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    state = model.state_dict()
    return {
        "format": "cadence-checkpoint",
        "version": 1,
        "meta": {"step": step, "epoch": 0},
        "model": state,
        "optimizers": [
            {
                "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(3, 4) * scale}},
                "param_groups": [{"lr": 0.1, "params": [0]}],
            }
        ],
        "rng": [{"python": (3, tuple(range(625)), None), "torch": torch.get_rng_state()}],
        "extra": {
            "bf16": torch.randn(5).bfloat16(),
            "half": torch.randn(2, 2).half(),
            "flags": torch.tensor([True, False, True]),
            "ints": torch.arange(7),
            "complex": torch.randn(3, dtype=torch.complex64),
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3),
            "transposed": torch.arange(12.0).reshape(3, 4).t(),
            "tied": state["0.weight"],
            "plain": [1, "two", None, 3.5, (4, 5)],
        },
    }


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_round_trip_keeps_values_dtypes_containers_and_ties(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    assert isinstance(store, CheckpointStore)
    saved = payload()
    manifest = store.write("latest", saved)
    loaded = store.read("latest")
    assert_same(saved, loaded)
    assert isinstance(loaded["model"], collections.OrderedDict)
    assert loaded["model"]._metadata == saved["model"]._metadata  # module versions for load_state_dict
    assert loaded["extra"]["tied"] is loaded["model"]["0.weight"]  # tied tensors are stored once
    assert manifest["step"] == 3 and store.manifest("latest") == manifest
    for name, entry in manifest["files"].items():  # the manifest describes the files on disk
        assert (tmp_path / "latest" / name).stat().st_size == entry["size"]
    for name, entry in manifest["files"].items():  # each checksum is the XXH3-64 of the whole file (xxhsum -H3)
        data = (tmp_path / "latest" / name).read_bytes()
        assert entry == {
            "size": len(data),
            "checksum": f"{xxhash.xxh3_64_intdigest(data):016x}",
            "algorithm": "xxh3-64",
        }
    raw = (tmp_path / "latest" / "manifest.json").read_bytes()
    head, _, tail = raw.rpartition(b',\n "manifest_xxh3_64": "')
    assert tail == b'%016x"\n}\n' % xxhash.xxh3_64_intdigest(head)  # the manifest's own: every byte before it
    assert sorted(manifest["files"]) == ["model.bin", "optimizers.bin", "payload.pt", "state.bin"]


def test_the_checksum_sees_blocks_out_of_place(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    blocks = torch.arange(3 * 1024, dtype=torch.float32)  # three 4 KiB blocks of distinct content
    store.write("latest", {"meta": {"step": 1}, "model": {"w": blocks}})
    path = tmp_path / "latest" / "model.bin"
    data = path.read_bytes()
    path.write_bytes(data[4096:8192] + data[:4096] + data[8192:])  # same bytes, two blocks swapped
    with pytest.raises(CheckpointError, match=r"model\.bin: checksum mismatch"):
        store.read("latest")


def test_read_selected_keys_reads_only_their_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.write("latest", payload())
    (tmp_path / "latest" / "optimizers.bin").write_bytes(b"garbage")  # never opened for keys=["model"]
    loaded = store.read("latest", keys=["model"])
    assert set(loaded) == {"format", "version", "meta", "model"}
    with pytest.raises(CheckpointError, match=r"optimizers\.bin"):
        store.read("latest")


def test_a_commit_replaces_the_name_atomically_and_leaves_nothing_behind(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.write("latest", payload(step=1))
    store.write("latest", payload(step=2))
    assert store.read("latest")["meta"]["step"] == 2
    store.wait()  # the superseded copy is removed in the background
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    assert store.names() == ["latest"] and store.exists("latest") and not store.exists("best")


def test_commit_without_atomic_exchange_moves_the_old_one_aside(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(file_io, "exchange", lambda a, b: False)  # as on macOS / filesystems without it
    store = FileStore(tmp_path)
    store.write("latest", payload(step=1))
    store.write("latest", payload(step=2))
    assert store.read("latest")["meta"]["step"] == 2
    store.wait()  # the superseded copy is removed in the background
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_links_are_hard_links_and_outlive_the_source(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.write("latest", payload(step=5))
    store.link("latest", "ckpt-s000000000005")
    store.link("latest", "best")
    original = tmp_path / "latest" / "model.bin"
    assert os.stat(original).st_ino == os.stat(tmp_path / "best" / "model.bin").st_ino
    assert os.stat(original).st_nlink == 3
    store.write("latest", payload(step=6))
    assert store.read("best")["meta"]["step"] == 5
    assert store.read("ckpt-s000000000005")["meta"]["step"] == 5
    assert store.names() == ["best", "ckpt-s000000000005", "latest"]


def test_link_copies_where_hard_links_fail(tmp_path: Path, monkeypatch) -> None:
    store = FileStore(tmp_path)
    store.write("latest", payload(step=5))

    def no_links(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(file_store.os, "link", no_links)
    store.link("latest", "best")
    assert os.stat(tmp_path / "best" / "model.bin").st_nlink == 1
    assert store.verify("best")["step"] == 5


def test_delete_hides_first_then_removes(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.write("latest", payload())
    store.link("latest", "ckpt-s000000000003")
    store.delete("ckpt-s000000000003")
    assert store.names() == ["latest"]  # at once; the files go in the background
    store.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_sweep_removes_leftovers_of_dead_writers_and_repairs_a_half_commit(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.write("latest", payload(step=7))
    dead = 2**22 + 12345  # above the default pid_max: no such process
    (tmp_path / f".tmp-latest.{dead}.abcd").mkdir()
    (tmp_path / f".tmp-latest.{dead}.abcd" / "model.bin").write_bytes(b"partial")
    (tmp_path / f".trash-ckpt-s000000000001.{dead}.abcd").mkdir()
    live = tmp_path / f".tmp-best.{os.getppid()}.abcd"  # a writer that is still running
    live.mkdir()
    # A commit without exchange that died between its two renames: only the moved-aside copy is left.
    os.rename(tmp_path / "latest", tmp_path / f".old-latest.{dead}.abcd")
    assert store.names() == []
    removed = store.sweep()
    assert sorted(removed) == [f".tmp-latest.{dead}.abcd", f".trash-ckpt-s000000000001.{dead}.abcd"]
    assert store.read("latest")["meta"]["step"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "latest"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate", r"model.bin is \d+ bytes, the manifest says \d+: the file is truncated"),
        ("flip", r"optimizers\.bin: checksum mismatch .* the file is corrupted"),
        ("manifest", r"not a complete checkpoint: manifest.json is missing"),
        ("garbled", r"manifest.json is unreadable"),
        ("edited", r"manifest.json fails its own checksum"),
        ("payload", r"payload.pt: checksum mismatch"),
    ],
)
def test_damaged_checkpoints_give_clear_errors(tmp_path: Path, damage: str, message: str) -> None:
    store = FileStore(tmp_path)
    store.write("latest", payload(step=9, scale=1e3))
    folder = tmp_path / "latest"
    if damage == "truncate":
        data = (folder / "model.bin").read_bytes()
        (folder / "model.bin").write_bytes(data[:-5])
    elif damage in ("flip", "payload"):
        path = folder / ("optimizers.bin" if damage == "flip" else "payload.pt")
        data = bytearray(path.read_bytes())
        data[len(data) // 2 if damage == "payload" else -10] ^= 0x10  # in the last tensor (not between tensors)
        path.write_bytes(bytes(data))
    elif damage == "manifest":
        (folder / "manifest.json").unlink()
    elif damage == "garbled":
        (folder / "manifest.json").write_text("{not json")
    else:
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["step"] = 10
        (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=message) as caught:
        store.verify("latest")
        store.read("latest")
    assert str(folder) in str(caught.value)
    if damage not in ("manifest", "garbled", "edited"):
        assert "(step 9)" in str(caught.value)


def test_locate_and_missing_names(tmp_path: Path) -> None:
    store = FileStore()
    FileStore(tmp_path).write("latest", payload())
    located, name = store.locate(tmp_path)
    assert (located.directory, name) == (tmp_path, "latest")
    located, name = store.locate(tmp_path / "latest")
    assert (located.directory, name) == (tmp_path, "latest")
    with pytest.raises(CheckpointError, match="no such file or folder"):
        store.locate(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        store.locate(tmp_path / "notes.txt")
    with pytest.raises(CheckpointError, match=r"no checkpoint named 'best' .* \(there: latest\)"):
        FileStore(tmp_path).read("best")
    with pytest.raises(ValueError, match="no directory"):
        store.read("latest")


def test_bad_names_and_tensors_are_refused(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(ValueError, match="letters, digits"):
        store.write("../escape", payload())
    with pytest.raises(CheckpointError, match="dense tensors only"):
        store.write("latest", {"meta": {}, "x": torch.eye(3).to_sparse()})
    assert store.names() == [] and not any(tmp_path.iterdir())


class Opaque:
    def __init__(self, value: int) -> None:
        self.value = value


def test_arbitrary_objects_need_an_explicit_trust(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.write("latest", {"meta": {"step": 1}, "callbacks": {"x": Opaque(4)}})
    with pytest.raises(CheckpointError, match="weights_only=False"):
        store.read("latest")
    assert FileStore(tmp_path, weights_only=False).read("latest")["callbacks"]["x"].value == 4


def test_large_tensors_go_through_the_threaded_checksum(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    big = torch.randn(3 * (file_io.CHUNK // 4) // 2 + 7)  # 1.5 chunks: several writes and reads
    store.write("latest", {"meta": {"step": 1}, "model": {"w": big}})
    assert torch.equal(store.read("latest")["model"]["w"], big)


@pytest.mark.timeout(60)
def test_a_read_racing_a_commit_sees_the_old_or_the_new_checkpoint_never_a_mix(tmp_path: Path) -> None:
    """A reader that opened `latest` before a concurrent commit swapped it starts over on the new folder."""
    store = FileStore(tmp_path, durable=False)

    def payload(step: int) -> dict:
        return {"meta": {"step": step}, "model": {"w": torch.full((64, 1024), float(step))}}

    store.write("latest", payload(0))
    stop, errors, seen = threading.Event(), [], []

    def commit_forever() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            store.write("latest", payload(step))
            time.sleep(0.005)  # commits back to back, far closer than any checkpoint interval

    writer = threading.Thread(target=commit_forever)
    writer.start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                read = store.read("latest")
            except CheckpointError as exc:
                errors.append(str(exc))
                continue
            step = read["meta"]["step"]
            assert torch.equal(read["model"]["w"], torch.full((64, 1024), float(step)))
            seen.append(step)
            store.verify("latest")
    finally:
        stop.set()
        writer.join()
    assert not errors, errors[:3]
    assert len(set(seen)) > 3  # the reads really raced many commits
