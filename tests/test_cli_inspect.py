"""`cadence inspect` on every store's checkpoints: the store that wrote one checks it, every byte of every file.

Issue 34: inspect verified every checkpoint with the file store, so every DCP and
DeepSpeed checkpoint failed "its own checksum" (each store computed the manifest's
checksum its own way); and a file-store checkpoint with a flipped padding byte
(between two tensors, never read) passed as "checksums match" while `xxhsum` of
the file no longer equalled the manifest. The file store's own output is
tests/test_cli.py's.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
from pathlib import Path

import pytest
import torch
import xxhash

import cadence
from cadence.callbacks import Checkpoint
from cadence.checkpoint.dcp_store import DCPStore
from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.store import FORMAT
from cadence.cli import main
from tests.conftest import tiny_dataset

pytestmark = pytest.mark.timeout(120)


def inspect(target: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["inspect", str(target)])
    return code, out.getvalue()


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_flipped_padding_byte_loads_but_inspect_checks_every_byte_and_names_the_file(tmp_path):
    model = torch.nn.Linear(3, 5)  # a 60-byte weight: 4 bytes of padding before the bias
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_dataset(16, inputs=3),
        loss_fn=torch.nn.functional.cross_entropy, callbacks=[Checkpoint(dir=str(tmp_path))],
        seed=0, train={"batch_size": 4}, eval_every_epochs=None, device="cpu",
    )  # fmt: skip
    engine.fit(steps=2)
    engine.close()
    folder = tmp_path / "latest"
    code, out = inspect(folder)
    assert code == 0, out
    assert "file store: every byte of every file checked, sizes and XXH3-64 checksums match" in out
    table = torch.load(folder / "payload.pt", weights_only=True)["tensors"]
    ends = sorted((entry[1], entry[1] + entry[2]) for entry in table if entry[0] == "model.bin")
    gap = next(end for (_, end), (start, _) in itertools.pairwise(ends) if start > end)  # a padding byte
    flip(folder / "model.bin", gap)
    manifest = json.loads((folder / "manifest.json").read_text())
    data = (folder / "model.bin").read_bytes()
    assert f"{xxhash.xxh3_64_intdigest(data):016x}" != manifest["files"]["model.bin"]["checksum"]  # as xxhsum sees it
    loaded = FileStore(tmp_path).read("latest")  # the padding is never read: the tensors load as saved
    assert all(torch.equal(loaded["model"][k], v) for k, v in model.state_dict().items())
    code, out = inspect(folder)  # was 0, "sizes and XXH3-64 checksums match"
    assert code == 1 and "manifest    FAILED:" in out and "model.bin: checksum mismatch" in out, out
    with pytest.raises(cadence.CadenceError, match=r"model\.bin: checksum mismatch"):
        FileStore(tmp_path).verify("latest")  # auto-resume's check of a candidate, too


def dcp_payload(step: int) -> dict:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    return {
        "format": FORMAT,
        "version": 1,
        "meta": {"step": step, "epoch": 1, "backend": "mesh", "world_size": 1},
        "engine": {"step": step, "epoch": 1},
        "model": net.state_dict(),
        "optimizers": [],
        "rng": [{"torch": torch.get_rng_state()}],
        "callbacks": {},
        "schedulers": [],
    }


def test_inspect_checks_a_dcp_checkpoint_with_the_dcp_store_and_names_a_damaged_file(tmp_path):
    DCPStore(tmp_path).write("latest", dcp_payload(7))  # one process: DCP without a process group
    folder = tmp_path / "latest"
    code, out = inspect(folder)  # was 1: "manifest.json fails its own checksum"
    assert code == 0, out
    assert "dcp store: every byte of every file checked, sizes and XXH3-64 checksums match" in out
    assert "step        7" in out and "model       2 tensors, 15 elements" in out
    assert inspect(tmp_path)[0] == 0  # the folder holding `latest`
    # A manifest of the earlier DCP format (its checksum over the canonical JSON) is still accepted.
    manifest = json.loads((folder / "manifest.json").read_text())
    body = {k: v for k, v in manifest.items() if k != "manifest_xxh3_64"}
    body["manifest_xxh3_64"] = xxhash.xxh3_64_hexdigest(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    )
    (folder / "manifest.json").write_text(json.dumps(body, indent=1))
    assert inspect(folder)[0] == 0
    body["step"] = 8  # but not an edited one
    (folder / "manifest.json").write_text(json.dumps(body, indent=1))
    code, out = inspect(folder)
    assert code == 1 and "manifest.json fails its own checksum" in out, out
    DCPStore(tmp_path).write("latest", dcp_payload(7))
    victim = next(name for name in sorted(os.listdir(folder)) if name.endswith(".distcp"))
    flip(folder / victim, 10)
    code, out = inspect(folder)
    assert code == 1 and f"{victim}: checksum mismatch" in out, out
    (folder / "manifest.json").unlink()  # a DCP folder without its manifest: damaged (1), its step named
    code, out = inspect(folder)
    assert code == 1 and "manifest.json is missing" in out and "(step 7)" in out, out


def test_every_store_writes_one_manifest_format(tmp_path):
    """The manifest's last field is the XXH3-64 of every byte before it, in every store's manifest."""
    FileStore(tmp_path / "file").write("latest", dcp_payload(3))
    DCPStore(tmp_path / "dcp").write("latest", dcp_payload(3))
    for kind in ("file", "dcp"):
        raw = (tmp_path / kind / "latest" / "manifest.json").read_bytes()
        head, _, tail = raw.rpartition(b',\n "manifest_xxh3_64": "')
        assert tail == b'%016x"\n}\n' % xxhash.xxh3_64_intdigest(head)
        manifest = json.loads(raw)
        assert manifest["store"] == kind and {e["algorithm"] for e in manifest["files"].values()} == {"xxh3-64"}


def _deepspeed_run(directory: str) -> None:
    from cadence.backends.deepspeed import DeepSpeedBackend

    model = torch.nn.Linear(8, 4)
    engine = cadence.Engine(
        model, torch.optim.AdamW(model.parameters(), lr=0.01), tiny_dataset(32),
        loss_fn=torch.nn.functional.cross_entropy, callbacks=[Checkpoint(dir=directory)],
        backend=DeepSpeedBackend(zero_stage=1, timeout=60, device="cpu"),
        seed=0, train={"batch_size": 4}, eval_every_epochs=None, device="cpu",
    )  # fmt: skip
    engine.fit(steps=3)
    engine.close()


@pytest.mark.timeout(240)
def test_inspect_checks_a_deepspeed_checkpoint_with_the_deepspeed_store_and_names_a_damaged_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: no GPU probing
    pytest.importorskip("deepspeed", reason="needs cadence[deepspeed]")
    from cadence.launch import launch

    launch(_deepspeed_run, str(tmp_path), nprocs=1, start_method="fork", timeout=180)
    folder = tmp_path / "latest"
    code, out = inspect(folder)  # was 1: "manifest.json fails its own checksum"
    assert code == 0, out
    assert "deepspeed store: every byte of every file checked, sizes and XXH3-64 checksums match" in out
    assert "step        3" in out and "model       2 tensors, 36 elements" in out
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["store"] == "deepspeed" and {e["algorithm"] for e in manifest["files"].values()} == {"xxh3-64"}
    # A manifest of the earlier DeepSpeed format ("manifest_xxh3" over the sorted JSON, "xxh3_64") still passes.
    old = {k: v for k, v in manifest.items() if k != "manifest_xxh3_64"}
    for entry in old["files"].values():
        entry["algorithm"] = "xxh3_64"
    old["manifest_xxh3"] = xxhash.xxh3_64_hexdigest(json.dumps(old, sort_keys=True).encode())
    (folder / "manifest.json").write_text(json.dumps(old, indent=1))
    assert inspect(folder)[0] == 0
    victim = next(name for name in sorted(manifest["files"]) if "optim_states" in name)
    flip(folder / victim, manifest["files"][victim]["size"] - 100)
    code, out = inspect(folder)
    assert code == 1 and f"{victim}: checksum mismatch" in out, out
