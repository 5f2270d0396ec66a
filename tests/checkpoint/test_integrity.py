"""Checksums that see real damage: compensating bit flips, swapped words, truncation, a flipped byte in any file.

Every damaged checkpoint is refused with a `CheckpointError` naming the file and the step, by the store, by
`cadence.checkpoint.from_checkpoint` and by `cadence inspect`; auto_resume falls back to the previous complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
import xxhash

import cadence
from cadence.callbacks.checkpoint import Checkpoint
from cadence.checkpoint import from_checkpoint
from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.store import CheckpointError
from tests.conftest import tiny_dataset, tiny_model
from tests.test_cli import cli

pytestmark = pytest.mark.timeout(60)


def block_words(data: bytearray, start: int) -> list[int]:
    return list(struct.unpack_from("<512Q", data, start))


def old_block_sum(data: bytearray, start: int) -> int:
    """What the previous checksum kept of a 4 KiB block: the wrapping sum of its 8-byte words."""
    return sum(block_words(data, start)) % 2**64


def compensating_flips(data: bytearray, start: int) -> None:
    """Set a high bit in one word of the block and clear the same bit in another: the words' sum stays equal."""
    words = block_words(data, start)
    for bit in range(62, -1, -1):
        clear = [i for i, w in enumerate(words) if not w >> bit & 1]
        set_ = [i for i, w in enumerate(words) if w >> bit & 1]
        if clear and set_:
            words[clear[0]] |= 1 << bit
            words[set_[0]] &= ~(1 << bit)
            struct.pack_into("<512Q", data, start, *words)
            return
    raise AssertionError("no bit to flip")


def swapped_words(data: bytearray, start: int) -> None:
    words = block_words(data, start)
    j = next(j for j in range(1, 512) if words[j] != words[0])
    words[0], words[j] = words[j], words[0]
    struct.pack_into("<512Q", data, start, *words)


def damage(folder: Path, how: str) -> str:
    """Damage one file of a checkpoint in place (hard links share it); returns the file's name."""
    file = {"compensating flips": "model.bin", "swapped words": "model.bin", "truncated": "optimizers.bin"}.get(
        how, how.split()[0]
    )
    path = folder / file
    data = bytearray(path.read_bytes())
    if how in ("compensating flips", "swapped words"):  # inside the first tensor (at offset 0, >= 4 KiB)
        before = old_block_sum(data, 0)
        (compensating_flips if how == "compensating flips" else swapped_words)(data, 0)
        assert old_block_sum(data, 0) == before  # invisible to the previous checksum
    elif how == "truncated":
        del data[-3:]
    elif file == "manifest.json":
        text = data.decode()
        if how.endswith("whitespace"):  # JSON says the same; the bytes differ
            at = text.index(' "format"')
            data[at] = ord("\t")
        else:  # a digit of a file's size
            at = text.index('"size": ') + len('"size": ')
            data[at] = ord("1") if data[at] != ord("1") else ord("2")
    elif file == "payload.pt":
        data[len(data) // 2] ^= 0x01
    else:
        data[-1] ^= 0x01  # the last byte is the last tensor's (no padding after it)
    path.write_bytes(bytes(data))
    return file


KINDS = [
    "compensating flips",
    "swapped words",
    "truncated",
    "model.bin flipped",
    "optimizers.bin flipped",
    "state.bin flipped",
    "payload.pt flipped",
    "manifest.json flipped",
    "manifest.json whitespace",
]


def error_pattern(file: str, how: str, step: int) -> str:
    if file == "manifest.json":  # its step cannot be trusted: the message says which it claims
        return rf"\(step unknown\): manifest\.json fails its own checksum .*it says step {step}"
    return rf"\(step {step}\): {file.replace('.', r'.')}.*(checksum mismatch|truncated)"


def payload(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    weight = torch.randn(32, 64, generator=g)  # 8 KiB: two full blocks
    return {
        "format": "cadence-checkpoint",
        "version": 1,
        "meta": {"step": step, "epoch": 0},
        "model": {"weight": weight, "bias": torch.randn(32, generator=g)},
        "optimizers": [{"state": {0: {"exp_avg": torch.randn(32, 64, generator=g)}}, "param_groups": []}],
        "rng": [{"torch": torch.get_rng_state()}],
    }


@pytest.mark.parametrize("how", KINDS)
def test_the_store_refuses_every_kind_of_damage_naming_file_and_step(tmp_path: Path, how: str) -> None:
    store = FileStore(tmp_path)
    saved = payload(7)
    store.write("latest", saved)
    file = damage(tmp_path / "latest", how)
    for check in (store.verify, store.read):
        with pytest.raises(CheckpointError, match=error_pattern(file, how, 7)) as caught:
            check("latest")
        assert str(tmp_path / "latest") in str(caught.value)


def test_checksums_are_xxh3_of_each_file_as_xxhsum_computes_them(tmp_path: Path) -> None:
    manifest = FileStore(tmp_path).write("latest", payload(3))
    for file, entry in manifest["files"].items():
        data = (tmp_path / "latest" / file).read_bytes()
        assert entry["algorithm"] == "xxh3-64" and entry["checksum"] == f"{xxhash.xxh3_64_intdigest(data):016x}"


def test_a_checkpoint_of_the_old_checksum_is_refused_naming_its_algorithm(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.write("latest", payload(5))
    path = tmp_path / "latest" / "manifest.json"
    manifest = json.loads(path.read_text())  # as cadence wrote it before XXH3-64
    del manifest["manifest_xxh3_64"]
    for entry in manifest["files"].values():
        entry["algorithm"] = "crc32-of-4k-sums"
    manifest["files"]["payload.pt"]["algorithm"] = "crc32"
    manifest["manifest_crc32"] = "0badf00d"
    path.write_text(json.dumps(manifest, indent=1))
    with pytest.raises(
        CheckpointError, match=r"\(step 5\): written by an older cadence: its checksums are crc32, crc32-of-4k-sums"
    ):
        store.read("latest")


# -- the engine: resume, auto_resume, from_checkpoint, cadence inspect ----------------------------


def make(directory: Path, **options) -> cadence.Engine:
    model = tiny_model(inputs=64)  # its first tensor (16 x 64 float32) is one full 4 KiB block at offset 0
    return cadence.Engine(
        model, torch.optim.AdamW(model.parameters(), lr=0.05), tiny_dataset(inputs=64),
        loss_fn=torch.nn.functional.cross_entropy, seed=0, train={"batch_size": 8},
        callbacks=[Checkpoint(dir=str(directory), **options)],
        device="cpu",
    )  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Snapshots at steps 2, 4 and 6; `latest` is step 6."""
    directory = tmp_path_factory.mktemp("trained")
    make(directory, interval=2, keep_latest_k=0).fit(steps=6)
    return directory


@pytest.mark.parametrize("how", KINDS)
def test_resume_refuses_and_auto_resume_falls_back_to_the_previous_complete_checkpoint(
    trained: Path, tmp_path: Path, caplog, how: str
) -> None:
    directory = tmp_path / "ckpt"
    for name in ("ckpt-s000000000004", "latest"):
        shutil.copytree(trained / name, directory / name)
    file = damage(directory / "latest", how)
    pattern = error_pattern(file, how, 6)

    with pytest.raises(CheckpointError, match=pattern):
        from_checkpoint(
            directory / "latest", tiny_model(inputs=64), torch.optim.AdamW(tiny_model(inputs=64).parameters()),
            tiny_dataset(inputs=64), loss_fn=torch.nn.functional.cross_entropy,
            device="cpu",
        )  # fmt: skip

    engine = make(directory, auto_resume=True, save_on_fit_end=False)
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        engine.fit(steps=0)
    assert engine.state.step == 4
    warning = next(r.message for r in caplog.records if "falling back to the previous complete checkpoint" in r.message)
    assert "'ckpt-s000000000004'" in warning and file in warning

    if how in ("compensating flips", "manifest.json whitespace"):  # a subprocess each: two of the kinds
        done = cli("inspect", str(directory / "latest"))
        output = done.stdout + done.stderr
        assert done.returncode == 1, output  # a damaged manifest is a damaged checkpoint (as documented)
        assert re.search(pattern, output) and ("FAILED" in done.stdout or file == "manifest.json"), output
