"""Checkpoints on object storage: the file store on a real S3 server (moto on 127.0.0.1), pointers, retention,
damage, sweeping, auto-resume, and SIGKILLs during uploads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence.checkpoint import object_paths
from cadence.checkpoint.deepspeed_store import DeepSpeedStore
from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.object_file import ObjectFileStore
from cadence.checkpoint.object_store import SAVES, ObjectStore
from cadence.checkpoint.store import CheckpointError, for_location, is_url
from cadence.testing.s3 import S3Server
from tests.callbacks.checkpoint_workers import build, outcome
from tests.callbacks.test_resume import assert_bitwise
from tests.checkpoint.test_file_store import payload

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]


def saves(server: S3Server, url: str) -> dict[str, bool]:
    """Every save prefix under `url` and whether its manifest is there (listed by the server, not the store)."""
    fs: Any = server.filesystem()
    fs.invalidate_cache()
    if not fs.exists(f"{url}/{SAVES}"):
        return {}
    found = {p.rsplit("/", 1)[-1]: False for p in fs.ls(f"{url}/{SAVES}", detail=False)}
    for key in fs.find(f"{url}/{SAVES}"):
        if key.endswith("/manifest.json"):
            found[key.rsplit("/", 2)[-2]] = True
    return found


def wait_for_an_upload(
    server: S3Server, url: str, before: set[str], out: Path, alive: Callable[[], bool], seconds: float
) -> None:
    """Poll until the training has restored (`out` is written), committed a save since `before` and is uploading
    the next, or until it is not `alive()` or `seconds` have passed: the moment a kill tests."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and alive():
        new = [done for save, done in saves(server, url).items() if save not in before]
        if out.exists() and any(new) and not all(new):  # one save committed, the next being uploaded
            return
        time.sleep(0.1)


def targets(store: ObjectStore) -> dict[str, str]:
    return {name: store.target(name) or "" for name in store.names()}


def run(directory: str, stop: int | None, resume: str, async_mode: str) -> dict[str, Any]:
    engine, recorder = build(directory, workers=0, mode="step", stop=stop, resume=resume, async_mode=async_mode)
    with engine:
        engine.fit()
        return outcome(engine, recorder)


def test_urls_select_the_object_store_of_the_backends_kind(tmp_path: Path) -> None:
    assert is_url("s3://bucket/x") and is_url("memory://x") and is_url("gs://b")
    assert not is_url("/tmp/x") and not is_url("file:///tmp/x") and not is_url("C://x") and not is_url("runs/a:b")
    local = FileStore()
    assert for_location(local, tmp_path) is local
    assert isinstance(for_location(local, "s3://bucket/run"), ObjectFileStore)
    with pytest.raises(ValueError, match=r"'s3://bucket/run'.*DeepSpeedStore.*filesystem only.*file and dcp"):
        for_location(DeepSpeedStore(backend=None), "s3://bucket/run")


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_run_on_s3_resumes_bitwise_and_keeps_only_the_saves_its_names_point_at(
    tmp_path: Path, s3_server: S3Server, async_mode: str
) -> None:
    url = s3_server.url(f"bitwise-{async_mode}/checkpoints")
    reference = run(str(tmp_path / "reference"), None, "none", async_mode)
    first = run(url, 13, "none", async_mode)
    resumed = run(url, None, "auto", async_mode)
    assert resumed["restored_from"] == f"{url}/latest"
    assert_bitwise(reference, first, resumed)
    store = ObjectFileStore(FileStore(), url)
    assert store.names() == ["ckpt-s000000000030", "ckpt-s000000000040", "latest"]  # keep_latest_k=2
    assert store.manifest("latest")["step"] == 40
    # Retention by listing: the saves left are exactly those a name points at, each complete.
    assert saves(s3_server, url) == dict.fromkeys(targets(store).values(), True)
    assert "ckpt-s000000000040" not in os.listdir(tmp_path)  # nothing local took the URL for a path


def test_pointers_links_deletes_and_locating(s3_server: S3Server) -> None:
    url = s3_server.url("pointers")
    store = ObjectFileStore(FileStore(), url)
    assert store.names() == [] and not store.exists("latest")
    store.write("latest", payload(step=1))
    store.link("latest", "best")
    first = store.target("latest")
    assert store.target("best") == first  # a name is a pointer: no copy
    store.write("latest", payload(step=2))
    store.link("latest", "ckpt-s000000000002")
    assert store.names() == ["best", "ckpt-s000000000002", "latest"]
    assert store.read("best")["meta"]["step"] == 1 and store.read("latest")["meta"]["step"] == 2
    assert len(saves(s3_server, url)) == 2
    store.delete("best")  # the last pointer to the first save: the save goes
    assert first not in saves(s3_server, url) and store.names() == ["ckpt-s000000000002", "latest"]
    store.delete("ckpt-s000000000002")  # `latest` still points at its save: it stays
    assert list(saves(s3_server, url)) == [store.target("latest")]
    torch.testing.assert_close(store.read("latest")["model"], payload(step=2)["model"], rtol=0, atol=0)
    at, name = store.locate(url)
    assert (str(at.directory), name) == (url, "latest")
    at, name = store.locate(f"{url}/latest/")
    assert (str(at.directory), name) == (url, "latest")
    with pytest.raises(CheckpointError, match=r"no checkpoint named 'best' in s3://.*there: latest"):
        store.read("best")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        store.locate(f"{url}/nothing")


def test_damage_is_refused_naming_file_and_url_and_auto_resume_falls_back(s3_server: S3Server) -> None:
    url = s3_server.url("damage/checkpoints")
    run(url, 13, "none", "disabled")  # ckpt-s000000000010 and latest (step 13)
    store = ObjectFileStore(FileStore(), url)
    fs: Any = s3_server.filesystem()
    key = f"{url}/{SAVES}/{store.target('latest')}/optimizers.bin"
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0x10
    fs.pipe_file(key, bytes(data))  # same size, one bit flipped
    with pytest.raises(CheckpointError, match=r"checkpoint s3://.*/latest \(step 13\): optimizers.bin: checksum"):
        ObjectFileStore(FileStore(), url).verify("latest")  # a fresh process's store: nothing cached
    engine, _ = build(url, workers=0, mode="step", stop=None, resume="auto")
    with engine:
        engine.fit(steps=0)
        assert (engine.state.step, engine.restored_from) == (10, f"{url}/ckpt-s000000000010")


def test_sweep_removes_unreferenced_saves_but_not_one_a_live_process_writes(s3_server: S3Server) -> None:
    url = s3_server.url("sweep")
    store = ObjectFileStore(FileStore(), url)
    store.write("latest", payload(step=1))
    fs: Any = s3_server.filesystem()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stamp = int(time.time() * 1000)
        host = object_paths.host()  # this host, as ids spell it
        dead = f"{stamp:013d}-{2**22 + 17}-00000000-latest-{host}"  # no such pid
        writing = f"{stamp:013d}-{live.pid}-00000001-latest-{host}"
        orphan = f"{stamp:013d}-{os.getpid()}-00000002-latest-{host}"  # complete, but no name points at it
        fs.pipe_file(f"{url}/{SAVES}/{dead}/model.bin", b"partial")
        fs.pipe_file(f"{url}/{SAVES}/{writing}/model.bin", b"partial")
        fs.pipe_file(f"{url}/{SAVES}/{orphan}/model.bin", b"x")
        fs.pipe_file(f"{url}/{SAVES}/{orphan}/manifest.json", b"{}")
        assert store.names() == ["latest"]
        assert sorted(store.sweep()) == sorted([f"{SAVES}/{dead}", f"{SAVES}/{orphan}"])
        assert sorted(saves(s3_server, url)) == sorted([store.target("latest"), writing])
    finally:
        live.kill()
        live.wait()
    assert store.sweep() == [f"{SAVES}/{writing}"]  # its writer is gone


@pytest.mark.timeout(600)  # two fresh interpreters per case; minutes on a loaded machine
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_sigkill_during_uploads_never_shows_a_partial_checkpoint_and_auto_resume_falls_back(
    tmp_path: Path, s3_server: S3Server, async_mode: str
) -> None:
    """A training process saving 48 MB at every step is killed while a save is being uploaded, until two kills
    have cut an upload short (a kill that lands between uploads is checked the same way)."""
    url = s3_server.url(f"kills-{async_mode}/checkpoints")
    store = ObjectFileStore(FileStore(), url)
    expected_step, hit_uploads = 0, 0
    for round_ in range(6):
        if hit_uploads == 2:
            break
        out = tmp_path / f"restored-{round_}"
        child = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/checkpoint/object_workers.py"), url, str(out), async_mode],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            before = set(saves(s3_server, url))
            wait_for_an_upload(s3_server, url, before, out, lambda child=child: child.poll() is None, 150)
            assert child.poll() is None, f"the training process exited ({child.returncode}) before it was killed"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        restored = out.read_text().split()
        assert int(restored[0]) == expected_step  # auto-resume took the last complete checkpoint
        listed = saves(s3_server, url)
        names = targets(store)
        assert names, "no checkpoint is visible after the kill"
        for name, save in names.items():  # every visible name leads to a complete, verified save
            assert listed[save], (name, save)
            store.verify(name)
        hit_uploads += any(s not in before and s not in names.values() for s in listed)  # an upload cut short
        expected_step = store.manifest("latest")["step"]
        assert expected_step > 0
    assert hit_uploads == 2
    assert store.sweep()  # the cut uploads go
    assert set(saves(s3_server, url)) == set(targets(store).values())
    assert json.loads(s3_server.filesystem().cat_file(f"{url}/latest/pointer.json"))["step"] == expected_step  # type: ignore[attr-defined]
