"""The DCP store: commit protocol, integrity, resharding, async saves, and crash safety (real gloo ranks, real files)."""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence.checkpoint.dcp_store import DCPStore
from cadence.checkpoint.store import FORMAT, CheckpointError
from tests.callbacks import checkpoint_workers
from tests.callbacks.test_resume import assert_bitwise
from tests.checkpoint import dcp_workers as workers

pytestmark = pytest.mark.timeout(120)

FORK = multiprocessing.get_context("fork")


def launch(fn: Any, *args: Any, nprocs: int = 2) -> Any:
    return cadence.launch(fn, *args, nprocs=nprocs, start_method="fork", timeout=90)


def payload(step: int = 7, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    net = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return {
        "format": FORMAT,
        "version": 1,
        "meta": {"step": step, "epoch": 1},
        "engine": {"step": step, "last_loss": 0.5},
        "model": net.state_dict(),
        "optimizers": [optimizer.state_dict()],
        "rng": [{"torch": torch.get_rng_state()}],
        "callbacks": {"ema": {"shadow": {"weight": torch.ones(3, 4)}, "updates": 3}},
        "schedulers": [],
        "config": {"engine": {"seed": 0}},
    }


def equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for key in a:
            equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            equal(x, y, f"{path}.{i}")
    else:
        assert a == b, (path, a, b)


# -- one process: layout, names, integrity --------------------------------------------------------


def test_write_read_layout_names_and_retention(tmp_path: Path) -> None:
    store = DCPStore(tmp_path)
    saved = payload()
    saved["model"] = collections.OrderedDict(saved["model"])
    saved["model"]._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    manifest = store.write("latest", saved)
    assert manifest["step"] == 7 and manifest["store"] == "dcp" and manifest["world_size"] == 1
    assert sorted(os.listdir(tmp_path / "latest")) == [".metadata", "__0_0.distcp", "manifest.json", "objects.pt"]
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "objects.pt"}
    assert all(entry["algorithm"] == "xxh3-64" for entry in manifest["files"].values())
    read = store.read("latest")
    equal(saved, read)
    assert read["model"]._metadata == {"": {"version": 1}}
    assert store.read("latest", keys=["model"]).keys() == {"format", "version", "meta", "model"}
    # DCP's own keys: the model loads with plain torch.distributed.checkpoint, without Cadence.
    import torch.distributed.checkpoint as dcp

    plain = {"model": {k: torch.empty_like(v) for k, v in saved["model"].items()}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(plain, checkpoint_id=str(tmp_path / "latest"), no_dist=True)
    equal(dict(saved["model"]), plain["model"])

    store.link("latest", "ckpt-s000000000007")
    store.write("latest", payload(step=9, seed=1))
    assert store.names() == ["ckpt-s000000000007", "latest"]
    assert store.read("ckpt-s000000000007")["meta"]["step"] == 7 and store.verify("latest")["step"] == 9
    store.delete("ckpt-s000000000007")
    store.wait()
    assert store.names() == ["latest"] and not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    for path in (tmp_path, tmp_path / "latest"):
        located, name = store.locate(path)
        assert (located.directory, name) == (tmp_path, "latest")


def test_sweep_removes_interrupted_writes_of_dead_processes_only(tmp_path: Path) -> None:
    store = DCPStore(tmp_path)
    store.write("latest", payload())
    dead = FORK.Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    (tmp_path / f".tmp-latest.{dead.pid}.abcd").mkdir()
    (tmp_path / f".tmp-latest.{dead.pid}.abcd" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / f".tmp-best.{os.getppid()}.abcd").mkdir()  # a live process writes it
    (tmp_path / f".trash-old.{dead.pid}.ef01").mkdir()
    assert store.sweep() == [f".tmp-latest.{dead.pid}.abcd", f".trash-old.{dead.pid}.ef01"]
    assert sorted(os.listdir(tmp_path)) == [f".tmp-best.{os.getppid()}.abcd", "latest"]


def damage(folder: Path, how: str) -> str:
    """Damage one file of a committed checkpoint; returns the file's name."""
    if how == "truncated shard":
        shard = sorted(folder.glob("__*_0.distcp"))[-1]
        os.truncate(shard, shard.stat().st_size - 100)
        return shard.name
    if how == "flipped byte":
        shard = sorted(folder.glob("__*_0.distcp"))[-1]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
        return shard.name
    if how == "missing .metadata":
        (folder / ".metadata").unlink()
        return ".metadata"
    (folder / "manifest.json").unlink()
    return "manifest.json"


DAMAGES = ["truncated shard", "flipped byte", "missing .metadata", "missing manifest"]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_checkpoint_is_refused_naming_file_and_step(tmp_path: Path, how: str) -> None:
    store = DCPStore(tmp_path)
    store.write("latest", payload(step=13))
    file = damage(tmp_path / "latest", how)
    for call in (store.read, store.verify):
        with pytest.raises(CheckpointError) as info:
            call("latest")
        assert file in str(info.value) and "(step 13)" in str(info.value), str(info.value)
    if how.startswith("missing"):
        assert "never loaded" in str(info.value)


def test_shapes_and_keys_are_checked_against_metadata_before_anything_is_loaded(tmp_path: Path) -> None:
    saved = payload()
    DCPStore(tmp_path).write("latest", saved)
    live = torch.nn.Linear(4, 2).state_dict()
    before = {k: v.clone() for k, v in live.items()}
    for in_place in (False, True):
        store = DCPStore(tmp_path, template={"model": live}, load_in_place=in_place)
        with pytest.raises(
            CheckpointError, match=r"tensor model\.weight has shape \(3, 4\) in the checkpoint and \(2, 4\)"
        ):
            store.read("latest")
        equal(before, live)
    # A matching template: loaded into new tensors (default) or into the template's own (in place).
    target = torch.nn.Linear(4, 3).state_dict()
    read = DCPStore(tmp_path, template={"model": target}).read("latest")
    equal(saved["model"], read["model"])
    assert read["model"]["weight"] is not target["weight"] and not torch.equal(
        target["weight"], saved["model"]["weight"]
    )
    read = DCPStore(tmp_path, template={"model": target}, load_in_place=True).read("latest")
    assert read["model"]["weight"].data_ptr() == target["weight"].data_ptr()
    assert torch.equal(target["weight"], saved["model"]["weight"])
    # objects.pt naming a tensor .metadata lacks: refused as damaged.
    skeleton = torch.load(tmp_path / "latest" / "objects.pt", weights_only=True)
    skeleton["model"]["extra"] = {"__cadence_dcp__": "model.extra"}
    manifest = json.loads((tmp_path / "latest" / "manifest.json").read_text())
    torch.save(skeleton, tmp_path / "latest" / "objects.pt")
    from cadence.checkpoint import dcp_io, file_io

    size, digest = dcp_io.file_digest(tmp_path / "latest" / "objects.pt")
    manifest["files"]["objects.pt"].update(size=size, checksum=digest)
    (tmp_path / "latest" / "manifest.json").write_bytes(file_io.manifest_bytes(manifest))
    with pytest.raises(CheckpointError, match=r"tensor model\.extra is in objects\.pt but not in \.metadata"):
        DCPStore(tmp_path).read("latest")


def test_bad_payloads_are_refused_before_writing(tmp_path: Path) -> None:
    store = DCPStore(tmp_path)
    clash = payload()
    clash["callbacks"] = {"a.b": torch.zeros(2), "a": {"b": torch.ones(2)}}
    with pytest.raises(CheckpointError, match=r"both flatten to the key 'callbacks\.a\.b'"):
        store.write("latest", clash)
    with pytest.raises(ValueError, match="use letters, digits"):
        store.write("../x", payload())
    assert not os.listdir(tmp_path)


def test_async_write_commits_in_order_and_names_after_each_commit(tmp_path: Path) -> None:
    store = DCPStore(tmp_path)
    named: list[tuple[int, int]] = []

    def after(step: int) -> Any:
        def name(manifest: dict[str, Any]) -> None:
            store.link("latest", f"ckpt-s{step:012d}")
            named.append((step, store.manifest("latest")["step"]))

        return name

    pending = [store.write_async("latest", payload(step=s, seed=s), after_commit=after(s)) for s in (1, 2, 3)]
    assert [p.result()["step"] for p in pending] == [1, 2, 3]  # type: ignore[index]
    store.wait()
    assert named == [(1, 1), (2, 2), (3, 3)]  # each name given before the next commit
    for s in (1, 2, 3):
        equal(payload(step=s, seed=s)["model"], store.read(f"ckpt-s{s:012d}")["model"])


# -- resharding (FSDP2 at the store level, forked gloo ranks) ----------------------------------------


def test_resharding_2_to_1_to_no_process_group_1_to_2_and_2d_to_1d(tmp_path: Path) -> None:
    one = launch(workers.save_on_one, str(tmp_path), nprocs=1)
    two = launch(workers.two_ranks, str(tmp_path))
    back = launch(workers.load_on_one, str(tmp_path), nprocs=1)
    sharded = "(Shard(dim=0),)"
    # Bytes are moved, never recomputed: every value equals the saved one exactly.
    equal(two["two"]["model"], back["model"])  # FSDP2 on 2 ranks -> a 1-rank mesh
    equal(two["two"]["optimizer"], back["optimizer"])
    assert set(back["placements"].values()) == {sharded}
    equal(one["model"], two["one->2"]["model"])  # 1 -> 2
    equal(one["optimizer"], two["one->2"]["optimizer"])
    equal(two["twod"]["model"], two["twod->2"]["model"])  # shard 1 x tensor 2 -> FSDP2 over 2 ranks
    equal(two["twod"]["optimizer"], two["twod->2"]["optimizer"])
    assert set(two["twod->2"]["placements"].values()) == {sharded}
    assert two["engines"] == [{"step": 2, "rank": 0}, {"step": 2, "rank": 1}]  # each rank's own objects
    # Rank 1's problem, raised on rank 0 too (rank 0's messages are returned): no rank is left in a collective.
    bad, shape = two["errors"]
    assert "rank 1 cannot save 'latest': ValueError: checkpoint entry model.w: torch.sparse_coo" in bad
    assert "on rank 1: tensor model.0.weight has shape (32, 8) in the checkpoint and (32, 9)" in shape
    assert "(step 3)" in shape and not (tmp_path / "bad").exists()
    # -> one process without a process group (DCP's no_dist): whole tensors.
    read = DCPStore(tmp_path / "two", template={"model": workers.model(9).state_dict()}).read("latest")
    equal(two["two"]["model"], read["model"])
    equal(two["two"]["optimizer"], read["optimizers"][0]["state"])
    assert read["engine"] == {"step": 3, "rank": 0}


# -- DDP(checkpoint="dcp") through the engine and the Checkpoint callback --------------------------


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_ddp_dcp_resume_is_bitwise_and_auto_resume_falls_back_over_damage(tmp_path: Path, async_mode: str) -> None:
    reference = launch(workers.ddp_run, str(tmp_path / "reference"), None, "none", async_mode)
    directory = tmp_path / "ckpt"
    first = launch(workers.ddp_run, str(directory), 13, "none", async_mode)
    store = DCPStore(directory)
    assert store.names() == ["ckpt-s000000000010", "latest"]
    assert sorted(os.listdir(directory / "latest")) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "objects-00001.pt", "objects.pt",
    ]  # fmt: skip
    # Rank 1's own file holds the entries that differ from rank 0's: its engine state, and `meta` when the
    # two ranks' clocks (`meta.time`) read differently, which they almost always but not always do.
    own = set(torch.load(directory / "latest" / "objects-00001.pt", weights_only=True))
    assert "engine" in own and own <= {"engine", "meta"}, own
    copies = []
    for how in DAMAGES if async_mode == "disabled" else []:
        copy = tmp_path / how.replace(" ", "-")
        shutil.copytree(directory, copy)
        damage(copy / "latest", how)
        copies.append(str(copy))
    resumed = launch(workers.ddp_run, str(directory), None, "auto", async_mode)
    assert resumed["restored_from"] == str(directory / "latest")
    assert_bitwise(reference, first, resumed)
    if copies:  # each damaged `latest` is skipped for the complete ckpt-s...10
        restored = launch(workers.auto_resume_each, copies)
        assert restored == [(10, str(Path(c) / "ckpt-s000000000010")) for c in copies]


def test_async_saves_every_10_steps_over_100_steps_each_committed_and_loadable(tmp_path: Path) -> None:
    result = launch(workers.async_many, str(tmp_path))
    steps = list(range(10, 101, 10))
    assert result["saved"][: len(steps)] == steps
    store = DCPStore(tmp_path)
    assert store.names() == [f"ckpt-s{s:012d}" for s in steps] + ["latest"]
    for step in steps:
        read = store.read(f"ckpt-s{step:012d}")
        assert read["meta"]["step"] == step
        equal(result["params"][step], dict(read["model"]))
    assert store.read("latest")["meta"]["step"] == 100


# -- crash safety ---------------------------------------------------------------------------------

KILLS = 12


def check_after_kill(directory: Path, shapes: dict[str, tuple[int, ...]]) -> int | None:
    """Every committed checkpoint verifies, and `latest` holds exactly what was saved at its step."""
    store = DCPStore(directory)
    names = store.names()
    for name in names:
        store.verify(name)
    assert not [
        p.name for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in names
    ]
    if "latest" not in names:
        assert not names, f"checkpoints {names} but no latest"
        return None
    read = store.read("latest")
    step = read["engine"]["step"]
    assert read["meta"]["step"] == step == store.manifest("latest")["step"]
    expected = checkpoint_workers.expected_params(step, shapes)
    assert checkpoint_workers.digest(dict(read["model"])) == checkpoint_workers.digest(expected), f"latest at {step}"
    return step


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_sigkill_during_dcp_saves_never_leaves_a_partial_checkpoint(tmp_path: Path, async_mode: str) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    shapes = {k: tuple(v.shape) for k, v in checkpoint_workers.crash_model().named_parameters()}
    rng = random.Random(async_mode)
    steps: list[int] = []
    marker = directory / "started"
    started = time.perf_counter()
    for _ in range(KILLS):
        marker.unlink(missing_ok=True)
        t0 = time.perf_counter()
        process = FORK.Process(target=workers.save_loop, args=(str(directory), async_mode))
        process.start()
        while not marker.exists() and process.is_alive() and time.perf_counter() - t0 < 60:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.2, 3.0))  # lands in setup, steps, staging, DCP writes, manifests, renames
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and both ranks at once, as a lost node
        process.join(10)
        assert process.exitcode == -signal.SIGKILL, "the save loop ended on its own"
        step = check_after_kill(directory, shapes)
        if step is not None:
            steps.append(step)
    assert len(steps) > KILLS // 3, "too few kills landed after the first commit"
    assert steps == sorted(steps), "auto_resume went back in time"
    print(f"{async_mode}: {KILLS} kills in {time.perf_counter() - started:.1f} s, latest at step {steps[-1]}")
