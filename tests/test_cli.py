"""The command line: config overrides of a real script, and the `cadence` console script."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import cadence
from cadence.run.config_cli import parse_cli
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[1]
# The console script beside this interpreter (a venv), else the one on PATH (pip install --target, as on the GPU machine).
CADENCE = Path(sys.executable).with_name("cadence")
if not CADENCE.exists() and shutil.which("cadence"):
    CADENCE = Path(shutil.which("cadence"))  # type: ignore[arg-type]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # attrs resolves the string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


configured = load_example("configured")


def run(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The installed console script, as a user types it."""
    return run(str(CADENCE), *args, cwd=cwd)


# --- config from the command line ----------------------------------------------------------


def test_overrides_reach_nested_values_lists_booleans_and_none():
    cfg = parse_cli(
        configured.TrainConfig,
        [
            "optim.lr=3e-4", "engine.steps=50", "engine.train.batch_size=8", "model.hidden=[64, 16, 8]",
            "optim.betas=[0.8, 0.9]", "optim.amsgrad=true", "model.dropout=None", "engine.seed=null",
            "engine.lineage=123", "model.activation=gelu",
        ],
    )  # fmt: skip
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.engine.steps == 50 and cfg.engine.train.batch_size == 8
    assert cfg.model.hidden == [64, 16, 8] and cfg.optim.betas == (0.8, 0.9)
    assert cfg.optim.amsgrad is True and cfg.model.dropout is None and cfg.engine.seed is None
    assert cfg.engine.lineage == "123"  # string fields keep the text
    assert cfg.model.activation == "gelu"
    assert cfg.engine.log_interval == 20  # the class's own default survives


def test_a_config_file_then_overrides(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("optim:\n  lr: 0.05\n  weight_decay: 0.1\nmodel:\n  dropout: 0.2\n")
    cfg = parse_cli(configured.TrainConfig, ["--config", str(file), "optim.lr=0.5"])
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.model.dropout) == (0.5, 0.1, 0.2)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "optim.lrr=1",
            "config error at 'optim.lrr': unknown key; valid keys are: amsgrad, betas, lr, weight_decay; did you mean 'lr'?",
        ),
        ("engine.train.batch_sise=4", "config error at 'engine.train.batch_sise': unknown key"),
        ("engine.steps=fifty", "config error at 'engine.steps': expected int | None, got 'fifty' (str)"),
        ("model.hidden=[8, x]", "config error at 'model.hidden[1]': expected int, got 'x' (str)"),
        ("optim.amsgrad=1", "config error at 'optim.amsgrad': expected bool, got 1 (int)"),
        ("optim.lr=-1", "config error at 'optim.lr': invalid value -1.0 (float)"),
    ],
)
def test_unknown_keys_and_wrong_types_name_the_dotted_path(override, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_cli(configured.TrainConfig, [override], prog="configured.py")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("configured.py: ") and expected in err


def test_help_lists_every_field_with_type_default_and_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_cli(configured.TrainConfig, ["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "." in line.split()[0]}
    assert "engine.deterministic" in rows and "engine.train.num_workers" in rows
    assert rows["optim.lr"].split()[1:4] == ["float", "0.01", "learning"]
    assert "[32, 32]" in rows["model.hidden"] and "widths of the hidden layers" in rows["model.hidden"]
    assert "float | None" in rows["model.dropout"]


def test_the_example_script_runs_with_overrides(tmp_path):
    done = run(
        sys.executable, str(REPO / "examples" / "configured.py"), "optim.lr=3e-4", "engine.steps=4",
        "engine.log_interval=2", "model.hidden=[8]", f"engine.workspace={tmp_path / 'ws'}", "engine.seed=1",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "final loss" in done.stdout and "after 4 steps" in done.stdout
    run_dir = Path(done.stdout.split("run directory: ")[1].split(" (seed")[0])
    diff = yaml.safe_load((run_dir / "metadata" / "config.diff.yaml").read_text())
    assert diff == {
        "engine": {"log_interval": 2, "seed": 1, "steps": 4},
        "model": {"hidden": [8]},
        "optim": {"lr": 3e-4},
    }
    bad = run(sys.executable, str(REPO / "examples" / "configured.py"), "optim.lr=fast", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "examples/configured.py: config error at 'optim.lr': expected float, got 'fast' (str)"
    ]


# --- the cadence command -------------------------------------------------------------------


def test_help_is_quick_and_imports_no_torch():
    code = "import sys\nfrom cadence.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    done = run(sys.executable, "-c", code)
    assert done.returncode == 0 and done.stdout.strip().endswith("False")
    for command in ("info", "runs", "inspect", "plot"):
        assert command in done.stdout


def test_info_lists_versions_devices_backends_and_callbacks():
    done = cli("info")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"torch {torch.__version__}" in out and f"python {sys.version.split()[0]}" in out
    for name in ("tensorboard", "wandb", "deepspeed", "torchft", "submitit", "matplotlib", "scikit-learn"):
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert line.split()[1][0].isdigit() or "not installed" in line
    lines = out.splitlines()
    assert any(line.split()[:2] == ["local", "yes"] for line in lines)
    ddp = next(line for line in lines if line.split()[:1] == ["ddp"])
    assert ddp.split()[1] == "yes" and "gloo" in ddp
    assert ("nccl" in ddp.split("(")[1]) if torch.cuda.is_available() else ("nccl needs CUDA" in ddp)
    assert any(line.split()[:1] == ["cpu"] for line in lines) and "cuda" in out
    assert any(line.split()[:2] == ["checkpoint", "cadence.callbacks.checkpoint:Checkpoint"] for line in lines)


@pytest.mark.parametrize(
    "command",
    [["cadence", "--help"], ["cadence", "info"], ["examples/digits.py", "--help"], ["examples/lm.py", "--help"]],
    ids=" ".join,
)
def test_output_into_a_closed_pipe_ends_quietly(command):
    """`... | head`: the reader may close the pipe before the output is written; no BrokenPipeError then."""
    program = [str(CADENCE)] if command[0] == "cadence" else [sys.executable, str(REPO / command[0])]
    read, write = os.pipe()
    os.close(read)  # a reader that already left
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        done = subprocess.run([*program, *command[1:]], stdout=write, stderr=subprocess.PIPE, text=True, env=env,
                              timeout=60, check=False)  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def declared() -> tuple[list[str], list[str]]:
    """pyproject.toml's dependencies that apply here (besides torch), and its extras for features."""
    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(line) for line in project["dependencies"]]
    names = [r.name.lower() for r in requirements if r.marker is None or r.marker.evaluate()]
    extras = [extra for extra in project["optional-dependencies"] if extra not in ("docs", "dev", "all")]
    return [name for name in names if name != "torch"], extras


def test_info_lists_exactly_the_dependencies_and_extras_of_pyproject():
    out = cli("info").stdout.splitlines()
    dependencies, extras = declared()
    start, end = out.index("dependencies:"), out.index("optional dependencies:")
    assert sorted(line.split()[0] for line in out[start + 1 : end] if line.strip()) == sorted(dependencies)
    assert "numpy" in dependencies and "xxhash" in dependencies
    optional = "\n".join(out[end:])
    assert [extra for extra in extras if f"cadence[{extra}]" not in optional] == []


def test_getting_started_names_every_required_dependency():
    text = (REPO / "docs" / "index.md").read_text()
    sentence = " ".join(text.split("The required dependencies are ", 1)[1].split(".", 1)[0].split()).lower()
    dependencies, _ = declared()
    assert [name for name in ["torch", *dependencies] if name != "tomli" and name not in sentence] == []


class OpensRunDir(cadence.Callback):
    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at

    def on_fit_start(self, engine):
        _ = engine.run_dir

    def on_step_end(self, engine):
        if engine.state.step == self.fail_at:
            raise RuntimeError("boom")


def make_run(workspace: Path, steps: int, seed: int, fail_at: int | None = None, lineage: str = "default", extra=()):
    model = tiny_model()
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(8), loss_fn=torch.nn.functional.cross_entropy,
        workspace=str(workspace), seed=seed, lineage=lineage, callbacks=[OpensRunDir(fail_at), *extra],
        device="cpu",
    )  # fmt: skip
    if fail_at is None:
        engine.fit(steps=steps)
    else:
        with pytest.raises(cadence.HookError, match="boom"):
            engine.fit(steps=steps)
    return engine


def test_runs_lists_each_run_with_its_last_attempt(tmp_path):
    finished = make_run(tmp_path / "ws", steps=3, seed=0)
    failed = make_run(tmp_path / "ws", steps=5, seed=1, fail_at=2, lineage="other")
    # An attempt whose process died without a word: its record still says running.
    script = (
        "import os, torch, cadence\n"
        "m = torch.nn.Linear(2, 1)\n"
        "e = cadence.Engine(m, torch.optim.SGD(m.parameters(), lr=0.1), [(torch.ones(1, 2), torch.ones(1, 1))] * 9,\n"
        "    loss_fn=torch.nn.functional.mse_loss, seed=5, workspace='ws', lineage='killed', device='cpu')\n"
        "e.on(cadence.Event.ON_STEP_END, once=2)(lambda e: (e.run_dir, os._exit(1)))\n"
        "e.fit(steps=9)\n"
    )
    assert run(sys.executable, "-c", script, cwd=tmp_path).returncode == 1
    done = cli("runs", "ws", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    header, *lines = done.stdout.splitlines()
    header_words = "RUN ID LINEAGE CODE ID STEP BEST LAST ATTEMPT STATE HELD BY"
    assert header.split() == header_words.split()
    rows = {line.split()[0]: line.split() for line in lines}
    assert len(rows) == 3
    row = rows[finished.run_info.run_id]
    # The finished engine is alive in this process: it still holds its run directory.
    assert row[1:5] == ["default", "-", "3", "-"] and row[-2:] == ["finished", f"{socket.gethostname()}:{os.getpid()}"]
    stamp = finished.attempt_timestamp  # YYYYmmdd-HHMMSS; the column shows the last record's local time
    assert row[-4] == f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]}" and len(row[-3]) == 8
    row = rows[failed.run_info.run_id]
    assert row[1:4] == ["other", "-", "2"] and row[-2] == "failed"
    killed = next(r for r in rows.values() if r[1] == "killed")
    assert killed[-2:] == ["lost", "-"] and killed[3] == "2"
    # A lineage folder and a single run directory work too.
    assert len(cli("runs", str(tmp_path / "ws" / "other")).stdout.splitlines()) == 2
    assert len(cli("runs", str(finished.run_dir)).stdout.splitlines()) == 2


def one_error_line(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_and_foreign_directories_are_one_line_and_status_2(tmp_path):
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("not a run")
    (tmp_path / "file.txt").write_text("x")
    one_error_line(cli("runs", str(tmp_path / "nope")), "cadence runs: no such workspace:", "nope")
    one_error_line(cli("runs", str(tmp_path / "foreign")), "is not a Cadence workspace")
    one_error_line(cli("runs", str(tmp_path / "file.txt")), "not a directory")
    one_error_line(cli("runs", cwd=tmp_path), "no such workspace: runs")  # the default ./runs
    one_error_line(cli("plot", str(tmp_path / "nope")), "cadence plot: no such run directory")
    one_error_line(cli("plot", str(tmp_path / "foreign")), "cadence plot:", "not a Cadence run directory")
    one_error_line(cli("inspect", str(tmp_path / "nope")), "cadence inspect: no such checkpoint")
    assert cli().returncode == 2  # no subcommand: argparse's usage error


def test_version():
    done = cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"cadence {cadence.__version__}"


def test_inspect_shows_step_config_tensors_callbacks_and_a_good_manifest(tmp_path):
    from cadence.callbacks import Checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4).to(torch.float64))
    run_config = configured.TrainConfig(engine=cadence.EngineConfig(workspace=str(tmp_path / "ws"), seed=3))
    engine = cadence.Engine(
        model, torch.optim.Adam(model.parameters()), tiny_batches(4), eval_data=tiny_batches(2, seed=9),
        step_fn=lambda m, b: torch.nn.functional.cross_entropy(m[1](m[0](b[0]).double()), b[1]),
        config=run_config.engine, run_config=run_config, callbacks=[Checkpoint(save_best=True)],
        device="cpu",
    )  # fmt: skip
    engine.fit(epochs=2)
    checkpoint = next(c for c in engine.callbacks if isinstance(c, Checkpoint))
    folder = engine.run_dir / "checkpoints" / "latest"
    done = cli("inspect", str(folder))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    fields = {line[:12].strip(): line[12:].strip() for line in out.splitlines() if not line.startswith(" ")}
    assert fields["checkpoint"] == str(folder)
    assert fields["manifest"].startswith("ok: 4 files") and "XXH3-64 checksums match" in fields["manifest"]
    assert fields["step"] == "8" and fields["epoch"].startswith("2")
    assert fields["callbacks"] == "Checkpoint"
    assert fields["model"].startswith("4 tensors, 212 elements") and "float32, float64" in fields["model"]
    assert "  0.weight  float32  [16, 8]  512 B" in out and "  1.weight  float64  [4, 16]  512 B" in out
    assert fields["optimizer"].startswith("#0: 1 param group(s); state 12 tensors")  # step, exp_avg, exp_avg_sq x 4
    assert "config (run):" in out and "    lr: 0.01" in out and "    seed: 3" in out
    # A run directory means its latest checkpoint.
    assert cli("inspect", str(engine.run_dir)).stdout.splitlines()[0] == f"checkpoint  {folder}"
    # `cadence runs` shows the best score the Checkpoint callback tracked.
    row = cli("runs", str(tmp_path / "ws")).stdout.splitlines()[1].split()
    assert row[3] == "8" and row[4] == f"val.loss={checkpoint.best_score:.6g}" and row[-2] == "finished"


def test_inspect_reports_a_damaged_checkpoint_and_refuses_foreign_folders(tmp_path):
    from cadence.callbacks import Checkpoint

    engine = make_run(tmp_path / "ws", steps=2, seed=0, extra=[Checkpoint()])
    folder = engine.run_dir / "checkpoints" / "latest"
    with open(folder / "model.bin", "r+b") as f:  # flip one byte: same size, wrong checksum
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    done = cli("inspect", str(folder))
    assert done.returncode == 1
    assert "manifest    FAILED:" in done.stdout and "model.bin: checksum mismatch" in done.stdout
    # A missing or damaged manifest is a damaged checkpoint too (status 1), not a wrong path (2).
    (folder / "manifest.json").write_text("{not json")
    done = cli("inspect", str(folder))
    assert (
        done.returncode == 1 and "manifest    FAILED:" in done.stdout and "manifest.json is unreadable" in done.stdout
    )
    (folder / "manifest.json").unlink()
    for target in (folder, folder.parent):  # the checkpoint, and the folder whose latest it is
        done = cli("inspect", str(target))
        assert (
            done.returncode == 1 and "manifest    FAILED:" in done.stdout and "manifest.json is missing" in done.stdout
        )
    (tmp_path / "foreign").mkdir()
    one_error_line(cli("inspect", str(tmp_path / "foreign")), "cadence inspect:", "not a checkpoint")
