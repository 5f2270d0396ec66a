"""The Checkpoint callback: names, retention, forced and async saves, launch modes, errors, callback state."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence.callbacks.checkpoint import Checkpoint, CheckpointConfig
from cadence.checkpoint import file_read, from_checkpoint
from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.launch_modes import load_checkpoint
from cadence.checkpoint.store import CheckpointError
from cadence.checkpoint.writer import AsyncWriter, Job
from tests.conftest import tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(60)


class Counter(cadence.Callback):
    """A stateful callback: counts steps, times a factor."""

    def __init__(self, key: str = "Counter", factor: int = 1) -> None:
        self.state_key, self.factor, self.count = key, factor, 0

    def on_step_end(self, engine: cadence.Engine) -> None:
        self.count += self.factor

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


class Events(cadence.Callback):
    """Records on_save / on_load with the step and the last saved checkpoint."""

    order = 200

    def __init__(self) -> None:
        self.saves: list[Any] = []
        self.loads: list[int] = []

    def on_save(self, engine: cadence.Engine) -> None:
        ckpt = next(c for c in engine.callbacks if isinstance(c, Checkpoint))
        self.saves.append(ckpt.last_saved)
        # The commit is done when on_save fires: every name verifies now (an async `latest` may be newer yet).
        for name in ckpt.last_saved.names:
            step = ckpt.store.verify(name)["step"]
            assert step == ckpt.last_saved.step or (name == "latest" and step > ckpt.last_saved.step)

    def on_load(self, engine: cadence.Engine) -> None:
        self.loads.append(engine.state.step)


def make(directory: Path | None = None, *, model=None, callbacks=(), eval_data=False, **kwargs: Any):
    """A tiny engine; Checkpoint options go in `checkpoint=`."""
    options = kwargs.pop("checkpoint", {})
    ckpt = Checkpoint(dir=str(directory), **options) if directory is not None else None
    model = model if model is not None else tiny_model()
    engine_kwargs = dict(loss_fn=torch.nn.functional.cross_entropy, seed=0, train=cadence.DataConfig(batch_size=8))
    engine_kwargs.update(kwargs)
    engine = cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.05),
        tiny_dataset(),
        eval_data=tiny_dataset(32, seed=5) if eval_data else None,
        callbacks=[*callbacks, *([ckpt] if ckpt else [])],
        **{"device": "cpu", **engine_kwargs},
    )
    return engine, ckpt


@contextlib.contextmanager
def undeletable(path: Path) -> Iterator[None]:
    """Make `path` impossible to change for real: immutable for root, read-only otherwise."""
    if os.geteuid() == 0:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
        if done.returncode:
            pytest.skip(f"chattr +i is not supported here: {done.stderr.decode().strip()}")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)


def snapshot(engine: cadence.Engine) -> dict[str, Any]:
    return {
        "params": {k: v.clone() for k, v in engine.model.state_dict().items()},
        "optimizer": repr(engine.optimizers[0].state_dict()),
        "state": engine.state.state_dict(),
    }


def assert_untouched(engine: cadence.Engine, before: dict[str, Any]) -> None:
    after = snapshot(engine)
    assert after["state"] == before["state"] and after["optimizer"] == before["optimizer"]
    for k, v in before["params"].items():
        assert torch.equal(after["params"][k], v), k
    assert engine.restored_from is None


# -- names, intervals, retention ------------------------------------------------------------


def test_retention_keeps_k_history_plus_latest_and_best(tmp_path: Path) -> None:
    events, scores = Events(), []
    options = {"interval": 1, "keep_latest_k": 3, "save_best": True, "score_name": "loss"}
    engine, ckpt = make(
        tmp_path,
        callbacks=[events],
        eval_data=True,
        checkpoint=options,
        steps=20,
        eval_every_steps=1,
        eval_every_epochs=None,
    )
    engine.on(cadence.Event.ON_EVAL_END)(lambda e: scores.append((e.eval_results["val"]["val.loss"], e.state.step)))
    engine.fit()
    store = FileStore(tmp_path)
    assert store.names() == ["best", "ckpt-s000000000018", "ckpt-s000000000019", "ckpt-s000000000020", "latest"]
    assert len([s for s in events.saves if any(n.startswith("ckpt-s") for n in s.names)]) == 20
    assert (ckpt.best_score, ckpt.best_step) == min(scores) and len(scores) == 20
    assert store.manifest("best")["step"] == ckpt.best_step
    assert store.manifest("latest")["step"] == 20


def test_best_holds_the_ema_average_when_asked(tmp_path: Path) -> None:
    from cadence.callbacks.ema import EMA

    ema, averages = EMA(decay=0.5, best_with_ema=True, eval_with_ema=False), []
    options = {"interval": 0, "save_best": True}
    engine, ckpt = make(tmp_path, callbacks=[ema], eval_data=True, checkpoint=options, eval_every_steps=2)
    engine.on(cadence.Event.ON_SAVE)(
        lambda e: (
            averages.append(dict(zip(ema.names, [s.clone() for s in ema.shadow])))
            if ckpt.last_saved.names == ("best",)
            else None
        )
    )
    engine.fit(steps=6)
    assert averages, "best was never saved"
    best = FileStore(tmp_path).read("best")["model"]
    for name, value in averages[-1].items():
        assert torch.equal(best[name], value), name
    assert not torch.equal(best["0.weight"], engine.model[0].weight.detach())


def test_a_failing_delete_warns_once_and_training_goes_on(tmp_path: Path, caplog) -> None:
    engine, _ = make(tmp_path, checkpoint={"interval": 1, "keep_latest_k": 2})
    first = tmp_path / "ckpt-s000000000001"
    guard = contextlib.ExitStack()
    engine.on(cadence.Event.ON_SAVE, once=1)(lambda e: guard.enter_context(undeletable(first)))
    with guard, caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        engine.fit(steps=6)
        assert engine.state.step == 6
        # As root the snapshot cannot even be hidden; otherwise it is hidden but its files stay.
        kept = [first.name] if os.geteuid() == 0 else []
        assert FileStore(tmp_path).names() == [*kept, "ckpt-s000000000005", "ckpt-s000000000006", "latest"]
    warnings = [r.message for r in caplog.records if "cannot delete" in r.message]
    assert len(warnings) == 1 and first.name in warnings[0]


def test_epoch_mode_names_and_default_interval(tmp_path: Path) -> None:
    engine, _ = make(tmp_path, checkpoint={"keep_latest_k": 0}, epochs=3)
    engine.fit()
    assert FileStore(tmp_path).names() == ["ckpt-e000001", "ckpt-e000002", "ckpt-e000003", "latest"]
    engine, _ = make(tmp_path / "steps", checkpoint={"keep_latest_k": 0}, steps=40)
    engine.fit()  # default interval: 40 // 20 = 2 steps
    assert FileStore(tmp_path / "steps").names() == [f"ckpt-s{s:012d}" for s in range(2, 41, 2)] + ["latest"]


class RequestAt(cadence.Callback):
    """Raises a request at given steps; registers `preempt` like the Preemption callback."""

    order = 110

    def __init__(self, name: str, steps: set[int]) -> None:
        self.name, self.steps = name, steps

    def on_fit_start(self, engine: cadence.Engine) -> None:
        engine.requests.register(self.name)

    def on_before_optimizer_step(self, engine: cadence.Engine) -> None:
        if engine.state.step + 1 in self.steps:
            engine.request(self.name, 1, "test")


@pytest.mark.parametrize("request_name", ["save", "preempt"])
def test_forced_saves_update_latest_only(tmp_path: Path, request_name: str) -> None:
    events = Events()
    engine, _ = make(tmp_path, callbacks=[events, RequestAt(request_name, {3, 5})], checkpoint={"interval": 0})
    engine.fit(steps=7)
    assert [(s.names, s.step, s.reason) for s in events.saves] == [
        (("latest",), 3, "requested"),
        (("latest",), 5, "requested"),
        (("latest",), 7, "end of fit"),
    ]
    assert FileStore(tmp_path).names() == ["latest"]


def test_registered_after_the_first_run_and_saved_by_hand(tmp_path: Path) -> None:
    engine, _ = make()
    engine.fit(steps=2)
    checkpoint = Checkpoint(dir=str(tmp_path), interval=0)
    engine.add_callback(checkpoint)
    engine.fit(steps=2)
    assert FileStore(tmp_path).manifest("latest")["step"] == 4
    engine.state.step += 1  # a new state: saved again
    checkpoint.save(engine)
    assert checkpoint.last_saved.reason == "manual" and FileStore(tmp_path).manifest("latest")["step"] == 5


def test_checkpoint_config_from_a_mapping_and_errors() -> None:
    assert Checkpoint({"interval": 5}).config == CheckpointConfig(interval=5)
    with pytest.raises(cadence.ConfigError, match=r"checkpoint\.async_mode"):
        Checkpoint(async_mode="sometimes")
    with pytest.raises(TypeError, match="not both"):
        Checkpoint(CheckpointConfig(), interval=3)


# -- async ----------------------------------------------------------------------------------


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("cadence-checkpoint")]


def test_async_saves_commit_fire_on_save_and_drain_at_teardown(tmp_path: Path) -> None:
    events = Events()
    engine, ckpt = make(tmp_path, callbacks=[events], checkpoint={"interval": 2, "async_mode": "async"})
    engine.fit(steps=10)
    assert not writer_threads()
    assert FileStore(tmp_path).manifest("latest")["step"] == 10
    assert [s.step for s in events.saves if s.names[0] == "latest" and len(s.names) > 1] == [2, 4, 6, 8, 10]
    used = [s for s in ckpt.saver.writer._stagings if s.buffers]
    pointers = {k: v.data_ptr() for k, v in used[0].buffers.items()}
    engine.fit(steps=2)  # survives a second fit; the staging buffers are reused
    assert not writer_threads()
    assert {k: v.data_ptr() for k, v in used[0].buffers.items()} == pointers
    assert FileStore(tmp_path).manifest("latest")["step"] == 12


def test_the_first_async_save_copies_into_staging_reserved_at_the_first_step(tmp_path: Path) -> None:
    engine, ckpt = make(tmp_path, checkpoint={"interval": 2, "async_mode": "async", "save_on_fit_end": False})
    engine.fit(steps=1)
    staging = max(ckpt.saver.writer._stagings, key=lambda s: s.nbytes)
    assert staging.nbytes, "no staging reserved at the first step end: the first save pays for fresh memory"
    assert not [t for t in threading.enumerate() if t.name == "cadence-staging-prefault"]  # joined at teardown
    pool = staging._pools[0]
    engine.fit(steps=1)  # the first save, at step 2 (the reserve, armed again, is a no-op now)
    assert staging._pools == [pool]  # the reserve held the whole payload
    assert all(pool.data_ptr() <= t.data_ptr() < pool.data_ptr() + pool.numel() for t in staging.buffers.values())
    assert FileStore(tmp_path).manifest("latest")["step"] == 2


def test_writer_replaces_a_waiting_latest_but_never_drops_history() -> None:
    release, committed = threading.Event(), []

    def commit(job: Job) -> None:
        release.wait(10)
        committed.append((job.step, job.names, job.payload["x"].item() if job.payload else None))

    writer = AsyncWriter(commit)
    writer.start()
    x = torch.zeros(())
    writer.submit(Job({"x": x.fill_(1)}, "latest", ("ckpt-s1",), 1, 0, "interval"))  # taken by the thread
    while not writer._inflight:
        pass
    writer.submit(Job({"x": x.fill_(2)}, "latest", (), 2, 0, "requested"))  # waits
    writer.submit(Job({"x": x.fill_(3)}, "latest", (), 3, 0, "requested"))  # replaces step 2
    writer.submit(Job(None, None, ("best",), 3, 0, "best"))  # joins the waiting job of the same state
    blocked = threading.Thread(target=writer.submit, args=(Job({"x": x.fill_(4)}, "latest", ("ckpt-s4",), 4, 0, "i"),))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive(), "a waiting job that names best must not be dropped: the submit waits"
    release.set()
    blocked.join(5)
    assert writer.close(5)
    assert committed == [(1, ("latest", "ckpt-s1"), 1.0), (3, ("latest", "best"), 3.0), (4, ("latest", "ckpt-s4"), 4.0)]
    assert not writer_threads()


def test_a_background_write_error_is_raised_in_the_loop(tmp_path: Path) -> None:
    engine, _ = make(tmp_path, checkpoint={"interval": 1, "async_mode": "async"})
    guard = contextlib.ExitStack()
    engine.on(cadence.Event.ON_SAVE, once=1)(lambda e: guard.enter_context(undeletable(tmp_path)))
    with guard, pytest.raises(CheckpointError, match="background write of") as caught:
        engine.fit(steps=10)
    assert caught.value.hook_callback == "Checkpoint"  # the documented type, the hook in a note
    assert engine.state.step < 10
    assert not writer_threads()


# -- launch modes ---------------------------------------------------------------------------


def trained(directory: Path, steps: int, **kwargs: Any) -> cadence.Engine:
    engine, _ = make(directory, **kwargs)
    engine.fit(steps=steps)
    return engine


def setup_only(engine: cadence.Engine) -> None:
    engine.fit(steps=0)  # fires on_setup (the launch mode) without training


def test_precedence_resume_then_auto_resume_then_pretrained(tmp_path: Path) -> None:
    a, b, empty = tmp_path / "a", tmp_path / "b", tmp_path / "empty"
    run_a, run_b = trained(a, 4), trained(b, 2)
    options = {"save_on_fit_end": False, "auto_resume": True, "pretrained": str(a / "latest")}
    events = Events()
    engine, _ = make(a, callbacks=[events], checkpoint={**options, "resume": str(b / "latest")})
    setup_only(engine)
    assert engine.state.step == 2 and events.loads == [2] and engine.restored_from == str(b / "latest")
    engine, _ = make(a, checkpoint={**options, "pretrained": str(b / "latest")})
    setup_only(engine)
    assert engine.state.step == 4
    engine, _ = make(empty, checkpoint=options)
    setup_only(engine)
    assert engine.state.step == 0 and engine.optimizers[0].state_dict()["state"] == {}
    for k, v in run_a.model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[k], v)
    del run_b


def test_pretrained_is_strict_and_takes_exclusions(tmp_path: Path) -> None:
    source = trained(tmp_path / "a", 2)
    other = tiny_model(seed=3, classes=5)  # another head
    engine, _ = make(tmp_path / "b", model=other, checkpoint={"pretrained": str(tmp_path / "a")})
    with pytest.raises(CheckpointError, match=r"model tensors differ in shape: 2.weight: checkpoint \(4, 16\)"):
        setup_only(engine)
    head = other[2].weight.clone()
    options = {"pretrained": str(tmp_path / "a"), "pretrained_exclude": ["2.*"], "save_on_fit_end": False}
    engine, _ = make(tmp_path / "c", model=tiny_model(seed=3, classes=5), checkpoint=options)
    head = engine.model[2].weight.clone()
    setup_only(engine)
    assert torch.equal(engine.model[0].weight, source.model[0].weight)
    assert torch.equal(engine.model[2].weight, head)


def test_pretrained_from_a_torch_save_file(tmp_path: Path) -> None:
    source = tiny_model(seed=9)
    torch.save({"model": source.state_dict()}, tmp_path / "weights.pt")
    events = Events()
    engine, _ = make(tmp_path / "c", callbacks=[events], checkpoint={"pretrained": str(tmp_path / "weights.pt")})
    setup_only(engine)
    assert events.loads == [0]
    assert torch.equal(engine.model[0].weight, source[0].weight)


def test_from_checkpoint_restores_once(tmp_path: Path) -> None:
    trained(tmp_path / "a", 3)
    events = Events()
    model = tiny_model()
    engine = from_checkpoint(
        tmp_path / "a",
        model,
        torch.optim.AdamW(model.parameters(), lr=0.05),
        tiny_dataset(),
        loss_fn=torch.nn.functional.cross_entropy,
        seed=0,
        train=cadence.DataConfig(batch_size=8),
        callbacks=[events, Checkpoint(dir=str(tmp_path / "a"), auto_resume=True)],
        device="cpu",
    )
    assert engine.state.step == 3 and events.loads == [3]
    engine.fit(steps=1)
    assert events.loads == [3] and engine.state.step == 4


def test_restore_order(tmp_path: Path) -> None:
    order: list[str] = []

    class Tracked(Counter):
        def load_state_dict(self, state: dict[str, Any]) -> None:
            order.append(f"callback {self.state_key}")
            super().load_state_dict(state)

    class AverageLike(Tracked):
        restore_with_model = True

    scheduler_kwargs = {"callbacks": [Tracked("late"), AverageLike("ema")]}
    trained(tmp_path, 2, **scheduler_kwargs)
    engine, _ = make(tmp_path, checkpoint={"auto_resume": True, "save_on_fit_end": False}, **scheduler_kwargs)
    engine.model.register_load_state_dict_post_hook(lambda module, keys: order.append("model"))
    engine.optimizers[0].register_load_state_dict_post_hook(lambda optimizer: order.append("optimizer"))
    engine.on(cadence.Event.ON_LOAD)(lambda e: order.append("on_load"))
    setup_only(engine)
    assert order == ["model", "callback ema", "optimizer", "callback late", "on_load"]


# -- damaged checkpoints and errors ---------------------------------------------------------


def damage(folder: Path, how: str) -> None:
    if how == "truncated":
        path = folder / "optimizers.bin"
        path.write_bytes(path.read_bytes()[:-3])
    elif how == "flipped":
        path = folder / "model.bin"
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        (folder / "manifest.json").unlink()


@pytest.mark.parametrize(
    ("how", "message", "fallback_step"),
    [
        ("truncated", "optimizers.bin is .* the file is truncated", 4),  # latest and ckpt-s6 share the file
        ("flipped", "model.bin: checksum mismatch", 4),
        ("missing manifest", "manifest.json is missing", 6),
    ],
)
def test_damage_is_a_clear_error_and_auto_resume_falls_back(tmp_path: Path, caplog, how, message, fallback_step):
    trained(tmp_path, 6, checkpoint={"interval": 2, "keep_latest_k": 0})
    damage(tmp_path / "latest", how)
    engine, _ = make(tmp_path / "x", checkpoint={"resume": str(tmp_path / "latest")})
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match=message) as caught:
        setup_only(engine)
    assert str(tmp_path / "latest") in str(caught.value)
    assert_untouched(engine, before)
    engine, _ = make(tmp_path, checkpoint={"auto_resume": True, "save_on_fit_end": False})
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        setup_only(engine)
    assert engine.state.step == fallback_step
    assert any(
        "falling back to the previous complete checkpoint" in r.message and "latest" in r.message
        for r in caplog.records
    )


def test_auto_resume_refuses_when_every_checkpoint_is_damaged(tmp_path: Path) -> None:
    trained(tmp_path, 2, checkpoint={"interval": 0})
    damage(tmp_path / "latest", "flipped")
    engine, _ = make(tmp_path, checkpoint={"auto_resume": True})
    with pytest.raises(CheckpointError, match="no complete checkpoint to resume from"):
        setup_only(engine)


@pytest.mark.parametrize("problem", ["missing", "not a checkpoint", "model keys", "config"])
def test_load_errors_name_the_file_and_step_and_leave_the_engine_untouched(tmp_path: Path, problem: str) -> None:
    trained(tmp_path / "a", 3)
    path, kwargs = tmp_path / "a" / "latest", {}
    if problem == "missing":
        path, message = tmp_path / "nowhere", "no such file or folder"
    elif problem == "not a checkpoint":
        path, message = tmp_path, "not a checkpoint"
    elif problem == "model keys":
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4), torch.nn.Linear(4, 4)
        )
        kwargs, message = {"model": model}, r"model keys do not match: missing from the checkpoint \[3.weight, 3.bias\]"
    else:
        kwargs, message = {"grad_accum": 2}, "incompatible with the checkpoint's: grad_accum: checkpoint 1, this run 2"
    engine, _ = make(tmp_path / "b", checkpoint={"resume": str(path)}, **kwargs)
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match=message) as caught:
        engine.fit(steps=2)
    assert str(path) in str(caught.value)
    if problem in ("model keys", "config"):
        assert "(step 3)" in str(caught.value)
    assert_untouched(engine, before)


def all_tensors(engine: cadence.Engine) -> list[torch.Tensor]:
    state = engine.optimizers[0].state_dict()["state"]
    return [t.clone() for t in engine.model.state_dict().values()] + [
        v.clone() for entry in state.values() for v in entry.values()
    ]


@pytest.mark.parametrize("direct", [True, False])
def test_large_tensors_resume_bitwise_and_a_damaged_file_leaves_the_engine_untouched(
    tmp_path: Path, monkeypatch, direct: bool
) -> None:
    """Tensors of 1 MB and more are read into buffers of their own, which the optimizer then keeps."""
    monkeypatch.setattr(file_read, "_choose_direct", lambda path, size, option: direct)

    def large() -> torch.nn.Module:
        torch.manual_seed(0)
        layers = (torch.nn.Linear(8, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))
        return torch.nn.Sequential(*layers)

    reference, _ = make(tmp_path / "a", model=large())
    reference.fit(steps=3)
    shutil.copytree(tmp_path / "a" / "latest", tmp_path / "saved")
    reference.fit(steps=2)
    resumed, _ = make(tmp_path / "b", model=large(), checkpoint={"resume": str(tmp_path / "saved")})
    resumed.fit(steps=2)
    for ours, theirs in zip(all_tensors(resumed), all_tensors(reference), strict=True):
        assert torch.equal(ours, theirs)
    moment = resumed.optimizers[0].state[resumed.model[2].weight]["exp_avg"]
    assert moment.data_ptr() % 64 == 0
    shutil.copytree(tmp_path / "saved", tmp_path / "damaged")
    path = tmp_path / "damaged" / "optimizers.bin"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))
    before = all_tensors(resumed)
    with pytest.raises(CheckpointError, match=r"optimizers\.bin: checksum mismatch"):
        load_checkpoint(resumed, tmp_path / "damaged")
    for ours, theirs in zip(all_tensors(resumed), before, strict=True):
        assert torch.equal(ours, theirs)


def test_a_config_change_is_allowed_when_not_strict_and_restarts_the_epoch(tmp_path: Path, caplog) -> None:
    trained(tmp_path, 3)
    engine, _ = make(
        tmp_path,
        checkpoint={"auto_resume": True, "strict": False, "save_on_fit_end": False},
        train=cadence.DataConfig(batch_size=4),
    )
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        setup_only(engine)
    assert (engine.state.step, engine.state.batch_in_epoch) == (3, 0)
    assert any("train.batch_size: checkpoint 8, this run 4" in r.message for r in caplog.records)


# -- callback states ------------------------------------------------------------------------


def test_two_instances_of_a_stateful_callback_round_trip_by_key(tmp_path: Path) -> None:
    trained(tmp_path, 3, callbacks=[Counter("a", 1), Counter("b", 10)])
    a, b = Counter("a", 1), Counter("b", 10)
    engine, _ = make(tmp_path, callbacks=[a, b], checkpoint={"auto_resume": True})
    engine.fit(steps=2)
    assert (a.count, b.count) == (5, 50)


@pytest.mark.parametrize("strict", [True, False])
def test_states_of_unregistered_and_missing_callbacks_are_reported(tmp_path: Path, caplog, strict: bool) -> None:
    trained(tmp_path, 2, callbacks=[Counter("a"), Counter("b")])
    options = {"auto_resume": True, "strict": strict, "save_on_fit_end": False}
    engine, _ = make(tmp_path, callbacks=[Counter("a"), Counter("c")], checkpoint=options)
    text = r"missing \['c'\] .*unexpected \['b'\]"
    if strict:
        with pytest.raises(CheckpointError, match=text):
            setup_only(engine)
        assert engine.state.step == 0
    else:
        with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
            setup_only(engine)
        assert engine.state.step == 2
        assert any("unexpected ['b']" in r.message for r in caplog.records)
