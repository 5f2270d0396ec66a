"""Run directories: layout, ids, metadata, git states, the attempt record, rank 0 only."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
from pathlib import Path

import attrs
import pytest
import torch
import yaml

import cadence
from cadence.run import rundir
from cadence.run.config import ConfigError, canonical_yaml, config_hash
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)

GIT_ENV = {
    **os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
}  # fmt: skip


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, capture_output=True, check=True)
    return done.stdout.decode()


def make_repo(path: Path) -> str:
    """A repository with one commit and a remote whose URL carries a token; returns HEAD's sha."""
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    (path / "train.py").write_text("print('train')\n")
    (path / "model.py").write_text("WIDTH = 16\n")
    git(path, "add", ".")
    git(path, "commit", "-q", "-m", "first")
    git(path, "remote", "add", "origin", "https://user:s3cret@example.com/team/proj.git")
    return git(path, "rev-parse", "HEAD").strip()


@attrs.define(kw_only=True)
class Optim:
    lr: float = 0.1
    momentum: float = 0.0


@attrs.define(kw_only=True)
class RunConfig:
    engine: cadence.EngineConfig = attrs.field(factory=lambda: cadence.EngineConfig(steps=3, lineage="exp"))
    optim: Optim = attrs.field(factory=Optim)


def make_engine(workspace: Path, run_config: RunConfig | None = None, **overrides) -> cadence.Engine:
    model = tiny_model()
    cfg = run_config or RunConfig()
    cfg = attrs.evolve(cfg, engine=attrs.evolve(cfg.engine, workspace=str(workspace), **overrides))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr)
    return cadence.Engine(
        model, optimizer, tiny_batches(4), loss_fn=torch.nn.functional.cross_entropy,
        config=cfg.engine, run_config=cfg if run_config is not None else None,
        device="cpu",
    )  # fmt: skip


def read_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def test_same_config_and_code_land_in_the_same_run_dir(tmp_path, monkeypatch):
    sha = make_repo(tmp_path / "repo")
    monkeypatch.chdir(tmp_path / "repo")
    first = make_engine(tmp_path / "ws", RunConfig(), seed=1)
    first.fit(steps=2)
    second = make_engine(tmp_path / "ws", RunConfig(), seed=1)
    info = second.run_info
    assert second.run_dir == first.run_dir
    assert info.code_id == sha[:7]
    assert info.launch == "local1" and info.run_id == f"{sha[:7]}-{info.config_id}-local1"
    assert first.run_dir == tmp_path / "ws" / f"exp-{sha[:7]}" / info.run_id
    # The timestamp is per attempt; the directory is not.
    assert first.attempt_timestamp != second.attempt_timestamp
    attempts = {record["attempt"] for record in rundir.read_attempts(second.run_dir)}
    assert attempts == {first.attempt_timestamp, second.attempt_timestamp}
    meta = first.run_dir / "metadata"
    assert {p.name for p in meta.iterdir()} == {
        "config.full.yaml", "config.canonical.yaml", "config.diff.yaml", "git.yaml", "run.yaml", "attempts.jsonl",
        "lease",
    }  # fmt: skip
    assert config_hash(read_yaml(meta / "config.canonical.yaml")) == info.config_id


def test_one_value_change_gives_a_new_config_id_and_a_diff_of_that_value(tmp_path):
    base = make_engine(tmp_path / "ws", RunConfig())
    changed_config = RunConfig(optim=Optim(lr=0.5))
    changed = make_engine(tmp_path / "ws", changed_config)
    assert changed.run_info.config_id != base.run_info.config_id
    assert read_yaml(changed.run_dir / "metadata" / "config.diff.yaml") == {"optim": {"lr": 0.5}}
    # The default run differs from the defaults in nothing: where it lives is not part of its identity.
    assert read_yaml(base.run_dir / "metadata" / "config.diff.yaml") == {}
    full = read_yaml(changed.run_dir / "metadata" / "config.full.yaml")
    assert full["engine"]["workspace"] == str(tmp_path / "ws") and full["optim"] == {"lr": 0.5, "momentum": 0.0}
    canonical = (changed.run_dir / "metadata" / "config.canonical.yaml").read_text()
    assert canonical == canonical_yaml(changed.run_info.identity)
    assert "workspace: runs" in canonical and "lineage: default" in canonical  # reset placement fields


def test_moving_the_workspace_or_renaming_the_lineage_keeps_the_run_id(tmp_path):
    a = make_engine(tmp_path / "a", seed=1)
    b = make_engine(tmp_path / "b", seed=1, lineage="other")
    assert a.run_info.run_id == b.run_info.run_id
    assert b.run_dir == tmp_path / "b" / "other" / a.run_info.run_id
    c = make_engine(tmp_path / "a", seed=2)
    assert c.run_info.run_id != a.run_info.run_id


def test_clean_tree(tmp_path, monkeypatch):
    sha = make_repo(tmp_path / "repo")
    (tmp_path / "repo" / "notes.txt").write_text("untracked files do not make a tree dirty\n")
    monkeypatch.chdir(tmp_path / "repo")
    engine = make_engine(tmp_path / "ws", seed=0)
    meta = engine.run_dir / "metadata"
    info = read_yaml(meta / "git.yaml")
    assert engine.run_info.code_id == sha[:7]
    assert info["sha"] == sha and info["code_id"] == sha[:7]
    assert info["branch"] == "main"
    assert info["remote"] == "https://example.com/team/proj.git"  # the token is not recorded
    assert info["dirty"] is False and info["diff_sha256"] is None
    assert info["untracked"] == ["notes.txt"]
    assert info["timestamp"] and info["commit_time"]
    assert not (meta / "git.diff").exists()


def test_dirty_tree(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    sha = make_repo(repo)
    (repo / "model.py").write_text("WIDTH = 32\n")  # unstaged
    (repo / "data.py").write_text("ROWS = 5\n")
    git(repo, "add", "data.py")  # staged
    monkeypatch.chdir(repo)
    engine = make_engine(tmp_path / "ws", seed=0)
    meta = engine.run_dir / "metadata"
    diff = (meta / "git.diff").read_bytes()
    assert b"WIDTH = 32" in diff and b"ROWS = 5" in diff
    digest = hashlib.sha256(diff).hexdigest()
    assert engine.run_info.code_id == f"{sha[:7]}-d{digest[:10]}"
    assert engine.run_dir.parent.name == f"exp-{sha[:7]}-d{digest[:10]}"
    info = read_yaml(meta / "git.yaml")
    assert info["dirty"] is True and info["diff_sha256"] == digest and info["sha"] == sha
    # The recorded diff is exactly the change: it reverts the tree to HEAD.
    git(repo, "apply", "--check", "-R", str(meta / "git.diff"))
    # Another change of the code is another code_id, hence another directory.
    (repo / "model.py").write_text("WIDTH = 64\n")
    assert make_engine(tmp_path / "ws", seed=0).run_dir.parent != engine.run_dir.parent


def test_no_git(tmp_path):
    engine = make_engine(tmp_path / "ws", seed=0)  # conftest runs each test in its empty tmp dir
    info = engine.run_info
    assert info.code_id is None and info.git is None
    assert info.run_id == f"{info.config_id}-local1"
    assert engine.run_dir == tmp_path / "ws" / "exp" / info.run_id
    meta = engine.run_dir / "metadata"
    git_yaml = read_yaml(meta / "git.yaml")
    assert git_yaml["available"] is False and str(tmp_path) in git_yaml["reason"]
    assert not (meta / "git.diff").exists()
    assert read_yaml(meta / "run.yaml")["code_id"] is None


def test_code_dir_environment_variable_names_the_repository(tmp_path, monkeypatch):
    sha = make_repo(tmp_path / "repo")
    monkeypatch.setenv(rundir.CODE_DIR_ENV, str(tmp_path / "repo"))
    assert make_engine(tmp_path / "ws", seed=0).run_info.code_id == sha[:7]


def test_run_id_override_and_bad_folder_names(tmp_path):
    engine = make_engine(tmp_path / "ws", seed=0, run_id="baseline")
    assert engine.run_dir == tmp_path / "ws" / "exp" / "baseline"
    # A path where a folder name belongs fails when the config is built, naming the field.
    with pytest.raises(ConfigError, match=r"config error at 'lineage'.*'a/b'"):
        cadence.Engine(tiny_model(), lineage="a/b", device="cpu")
    with pytest.raises(ConfigError, match=r"config error at 'run_id'.*'\.\.'"):
        cadence.Engine(tiny_model(), run_id="..", device="cpu")


def test_a_drawn_seed_is_recorded_and_reused_by_a_retry(tmp_path):
    first = make_engine(tmp_path / "ws")
    run = read_yaml(first.run_dir / "metadata" / "run.yaml")
    assert run["seed"] == first.seed == first.config.seed and run["seed_drawn"] is True
    # The drawn seed is not part of the identity; the retry finds it in run.yaml.
    assert read_yaml(first.run_dir / "metadata" / "config.canonical.yaml")["seed"] is None
    assert read_yaml(first.run_dir / "metadata" / "config.full.yaml")["seed"] == first.seed
    retry = make_engine(tmp_path / "ws")
    assert retry.run_dir == first.run_dir and retry.seed == first.seed
    # Without a recorded attempt there is nothing to reuse.
    fresh = [make_engine(tmp_path / f"other{i}").seed for i in range(2)]
    assert fresh[0] != fresh[1]


def test_nothing_is_written_until_the_run_dir_is_needed(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the workspace should be")
    engine = make_engine(blocker / "ws")  # seed drawn: reading the (absent) record must not fail
    engine.fit(steps=2)
    assert engine.state.step == 2 and list(tmp_path.iterdir()) == [blocker]
    with pytest.raises(OSError, match=r"cannot write the run directory .*workspace"):
        _ = engine.run_dir


class OpensRunDir(cadence.Callback):
    """Stands for a logger or checkpoint: needs the run directory when fit starts."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at

    def on_fit_start(self, engine):
        assert engine.run_dir.is_dir()

    def on_step_end(self, engine):
        if engine.state.step == self.fail_at:
            raise RuntimeError("boom")


def states(engine: cadence.Engine) -> list[tuple[str, int]]:
    return [(r["state"], r["step"]) for r in rundir.read_attempts(engine.run_dir)]


def test_attempt_record_finished_and_failed(tmp_path):
    engine = make_engine(tmp_path / "ws", seed=0)
    engine.add_callback(OpensRunDir())
    engine.fit(steps=2)
    engine.fit(steps=1)
    assert states(engine) == [("running", 0), ("finished", 2), ("running", 2), ("finished", 3)]
    failing = make_engine(tmp_path / "ws", seed=1)
    failing.add_callback(OpensRunDir(fail_at=2))
    with pytest.raises(cadence.HookError, match="boom"):
        failing.fit(steps=5)
    last = rundir.read_attempts(failing.run_dir)[-1]
    assert (last["state"], last["step"]) == ("failed", 2) and "boom" in last["error"]
    assert last["attempt"] == failing.attempt_timestamp and last["pid"] == os.getpid()


def test_the_attempt_record_labels_the_best_score_with_the_monitored_metric(tmp_path):
    """`Checkpoint(monitor="val.acc", mode="max")`: the record's best is `val.acc` (it once read `val.loss`)."""
    from cadence.callbacks import Checkpoint

    def eval_fn(model, batch):
        inputs, targets = batch
        return {"acc": (model(inputs).argmax(1) == targets).float().mean(), "loss": torch.tensor(0.0)}

    model = tiny_model()
    checkpoint = Checkpoint(dir=str(tmp_path / "ckpt"), save_best=True, monitor="val.acc", mode="max")
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(4), loss_fn=torch.nn.functional.cross_entropy,
        eval_data=tiny_batches(2), eval_fn=eval_fn, callbacks=[OpensRunDir(), checkpoint],
        workspace=str(tmp_path / "ws"), seed=0, device="cpu",
    )  # fmt: skip
    engine.fit(epochs=2)
    best = rundir.read_attempts(engine.run_dir)[-1]["best"]
    assert best["metric"] == "val.acc" == checkpoint.best_metric
    assert best["value"] == checkpoint.best_score and best["step"] == checkpoint.best_step is not None


def test_attempt_record_preempted(tmp_path):
    from cadence.callbacks import Preemption

    engine = make_engine(tmp_path / "ws", seed=0)
    engine.add_callback(OpensRunDir())
    engine.add_callback(Preemption(exit=False))
    engine.on(cadence.Event.ON_STEP_END, once=2)(lambda e: signal.raise_signal(signal.SIGTERM))
    engine.fit(steps=10)
    assert engine.state.step < 10
    assert states(engine)[-1][0] == "preempted"


def test_a_run_dir_opened_outside_fit_is_created_then_running(tmp_path):
    engine = make_engine(tmp_path / "ws", seed=0)
    assert engine.run_dir.is_dir()
    engine.fit(steps=1)
    assert [s for s, _ in states(engine)] == ["created", "running", "finished"]
    assert engine.callbacks[-1].state_key == "cadence.RunRecorder"  # every engine's own, registered when built


@pytest.mark.parametrize("order", [1, 200], ids=["opened-before-the-recorder", "opened-after-the-recorder"])
def test_the_recorder_built_with_the_engine_records_a_fit_start_once_whoever_opens_the_directory(tmp_path, order):
    """The recorder exists from construction but writes nothing until the directory opens; a directory opened
    in on_fit_start by a callback before or after the recorder gives one `running` record, not two."""
    opener = OpensRunDir()
    opener.order = order
    engine = make_engine(tmp_path / "ws", seed=0)
    assert engine.callbacks.find(rundir.RunRecorder) is not None
    assert not (tmp_path / "ws").exists()  # registered, and nothing written
    engine.add_callback(opener)
    engine.fit(steps=2)
    assert states(engine) == [("running", 0), ("finished", 2)]


def _two_ranks(workspace: str):
    import torch.distributed as dist

    from cadence.callbacks.jsonl import JSONL
    from cadence.callbacks.metrics import TrainMetrics
    from cadence.callbacks.text_log import TextLog

    model = tiny_model()
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(4), loss_fn=torch.nn.functional.cross_entropy,
        backend="ddp", workspace=workspace, log_interval=1, callbacks=[TrainMetrics(), JSONL(), TextLog(console=False)],
        device="cpu",
    )  # fmt: skip
    rank = engine.backend.rank

    def gather(value):
        out = [None, None]
        dist.all_gather_object(out, value)
        return out

    # Rank 1 opens the directory first: it must not write anything there.
    metadata_after_rank1 = None
    if rank == 1:
        metadata_after_rank1 = (engine.run_dir / "metadata").exists()
    dist.barrier()
    if rank == 0:
        _ = engine.run_dir
    dist.barrier()
    engine.fit(steps=3)
    result = {
        "pids": gather(os.getpid()), "seeds": gather(engine.seed), "run_dirs": gather(str(engine.run_dir)),
        "metadata_after_rank1": gather(metadata_after_rank1),
    }  # fmt: skip
    engine.close()
    return result


@pytest.mark.timeout(90)
def test_two_gloo_ranks_only_rank0_writes(tmp_path):
    from cadence.launch import launch

    result = launch(_two_ranks, str(tmp_path / "ws"), nprocs=2, start_method="fork", timeout=80)
    assert result["seeds"][0] == result["seeds"][1]  # the drawn seed is broadcast
    assert result["run_dirs"][0] == result["run_dirs"][1]
    assert result["metadata_after_rank1"][1] is False
    run_dir = Path(result["run_dirs"][0])
    records = rundir.read_attempts(run_dir)
    assert {r["pid"] for r in records} == {result["pids"][0]}
    assert [r["state"] for r in records] == ["created", "running", "finished"]
    assert {r["world_size"] for r in records} == {2}
    assert read_yaml(run_dir / "metadata" / "run.yaml")["world_size"] == 2
    assert len(list((run_dir / "logs").glob("*.log"))) == 1
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3  # one writer: one line per logged step


# -- the launch is part of the identity ---------------------------------------------------------


def _train_digits_like(workspace: str, run_id: str | None) -> tuple[str, str | None, int, str]:
    """One engine of a fixed config, trained to step 6 with checkpoints; on every rank of a launch."""
    from cadence.callbacks import Checkpoint

    torch.manual_seed(0)
    model = tiny_model()
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.TensorDataset(
            torch.randn(48, 8, generator=torch.Generator().manual_seed(0)), torch.arange(48) % 4),
        loss_fn=torch.nn.functional.cross_entropy, train={"batch_size": 4}, seed=3, steps=6,
        workspace=workspace, lineage="digits", run_id=run_id, callbacks=[Checkpoint(auto_resume=True)],
        device="cpu",
    )  # fmt: skip
    engine.fit()
    engine.close()
    return str(engine.run_dir), engine.restored_from, engine.state.step, engine.run_info.launch


@pytest.mark.timeout(240)
def test_another_world_size_is_another_run_unless_the_run_is_named(tmp_path):
    """Defect 4 of issue 34: examples/ddp_digits.py reopened digits.py's one-process run ("resumed from step 460")."""
    from cadence.launch import launch

    workspace = str(tmp_path / "ws")
    alone, restored, step, launch_id = _train_digits_like(workspace, None)
    assert (restored, step, launch_id) == (None, 6, "local1") and alone.endswith("-local1")
    # Two DDP processes with the same config: a run of their own, trained from scratch.
    two, restored, step, launch_id = launch(
        _train_digits_like, workspace, None, nprocs=2, start_method="fork", timeout=200
    )
    assert (restored, step, launch_id) == (None, 6, "ddp2")
    assert two != alone and Path(two).parent == Path(alone).parent and two.endswith("-ddp2")
    assert read_yaml(Path(two) / "metadata" / "run.yaml")["world_size"] == 2
    # Asked for explicitly: the one-process run's id continues that run on two processes (resharded).
    named, restored, step, _ = launch(
        _train_digits_like, workspace, Path(alone).name, nprocs=2, start_method="fork", timeout=200
    )
    assert named == alone and restored is not None and Path(restored).parent.parent == Path(alone)
    assert step == 6  # already at its end: restored, nothing left to train
