"""The README's example and the main job run as written."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(60)
def test_readme_python_blocks_run(capsys, cpu_default_device):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {"__name__": "__readme__"}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    engine = namespace["engine"]
    out = capsys.readouterr().out
    assert "epoch 5: loss" in out
    stopped = int(re.search(r"stopped at step (\d+) of 1000", out).group(1))
    assert 0 < stopped < 1000  # StopAtLoss stopped it early: the data is learnable
    assert engine.state.step == stopped + 10  # and the second fit continued from there


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_command():
    text = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    assert "python examples/digits.py" in commands[0]
    test_command = commands[1]
    assert test_command.endswith("OMP_NUM_THREADS=1 python -m pytest")
    # the example package's tests (tests/testing/test_example_package.py) run under it, not only in CI
    assert "./examples/cadence-gradstats" in test_command
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines, ".ci/run must run the README's test command verbatim"


def run_example(name: str, cwd: Path) -> str:
    cwd.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=True,
    ).stdout


def final_accuracy(out: str) -> float:
    return float(re.search(r"final accuracy ([0-9.]+)", out).group(1))


@pytest.mark.timeout(120)
def test_main_job_reaches_its_accuracy(tmp_path):
    out = run_example("digits.py", tmp_path)
    assert final_accuracy(out) >= 0.95, out


@pytest.mark.timeout(300)
def test_main_job_leaves_a_run_and_resumes_after_an_interruption(tmp_path):
    uninterrupted = final_accuracy(run_example("digits.py", tmp_path / "once"))
    (tmp_path / "twice").mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, str(ROOT / "examples" / "digits.py")]
    # SIGINT back to its default in the child: a pytest started in the background ignores it, and so
    # would the child, which then never sees the Ctrl-C.
    first = subprocess.Popen(
        command,
        cwd=tmp_path / "twice",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    for line in first.stdout:  # Ctrl-C after epoch 5's evaluation
        if line.startswith("epoch   5 "):
            first.send_signal(signal.SIGINT)
            break
    out, err = first.communicate(timeout=100)
    assert first.returncode == 130 and "run the same command again to resume" in err, err[-2000:]
    assert "final accuracy" not in out
    # The run directory: the log, metrics, the config as it ran, checkpoints.
    (run,) = (tmp_path / "twice" / "runs").glob("*/*")
    assert list((run / "logs").glob("*.log")) and (run / "metrics.jsonl").stat().st_size > 0
    assert (run / "metadata" / "config.full.yaml").exists() and (run / "checkpoints" / "latest").is_dir()
    assert re.search(r"step \d+ epoch \d+/20", err), "no progress lines on stderr"

    second = subprocess.run(command, cwd=tmp_path / "twice", env=env, capture_output=True, text=True, timeout=110)
    assert second.returncode == 0, second.stderr[-2000:]
    resumed = re.search(r"^resumed from step (\d+) \(epoch (\d+)\)", second.stdout, flags=re.M)
    assert resumed, second.stdout
    assert 0 < int(resumed.group(1)) < 460 and 4 <= int(resumed.group(2)) <= 5
    assert final_accuracy(second.stdout) == uninterrupted  # the same run, not a new one


@pytest.mark.timeout(120)
def test_ctrl_c_before_the_first_checkpoint_says_so_and_leaves_no_empty_log(tmp_path):
    # Batches of one: the first epoch (and its checkpoint) is 1,437 steps away when the run directory is printed.
    first = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "digits.py"), "engine.train.batch_size=1"],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    for line in first.stdout:
        if line.startswith("run directory: "):
            first.send_signal(signal.SIGINT)
            break
    _, err = first.communicate(timeout=100)
    assert first.returncode == 130, err[-2000:]
    assert "interrupted before the first checkpoint: the same command starts the run over" in err, err[-2000:]
    assert "resume from the last checkpoint" not in err and "Traceback" not in err
    (run,) = (tmp_path / "runs").glob("*/*")
    assert not (run / "checkpoints" / "latest").exists()
    assert [path.name for path in (run / "logs").glob("*.log") if path.stat().st_size == 0] == []


@pytest.mark.timeout(60)
def test_a_misspelled_backend_is_one_line_naming_the_closest_and_exit_2(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits.py"), "engine.backend=dpp"],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "config error at 'engine.backend'" in done.stderr and "did you mean 'ddp'?" in done.stderr


@pytest.mark.timeout(120)
def test_compose_example_runs(tmp_path):
    out = run_example("compose.py", tmp_path)
    assert "after 100 steps" in out and "BestAccuracy" in out


@pytest.mark.timeout(60)
def test_ddp_example_help_is_printed_once_without_starting_workers(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ddp_digits.py"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("usage: examples/ddp_digits.py") == 1 and "Traceback" not in done.stderr
