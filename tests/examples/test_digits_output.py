"""examples/digits.py reads cleanly in a 100-column terminal (a real pseudo-terminal) and in a pipe."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

COLUMNS = 100
COMMAND = [sys.executable, str(ROOT / "examples" / "digits.py"), "engine.epochs=3"]


def run_in_terminal(cwd: Path, columns: int = COLUMNS) -> str:
    """The output of COMMAND run in a pseudo-terminal `columns` wide, as bytes the terminal received."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS=str(columns), PYTHONPATH=str(ROOT))
    process = subprocess.Popen(COMMAND, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    out = bytearray()
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed its side
                    break
                if not data:
                    break
                out += data
            elif process.poll() is not None:
                break
        assert process.wait(timeout=100) == 0, out.decode(errors="replace")[-3000:]
    finally:
        os.close(master)
    return out.decode()


def render(raw: str, columns: int = COLUMNS) -> list[str]:
    """What a terminal `columns` wide shows for `raw`: carriage returns, newlines, wrapping, cursor up, erase."""
    lines: list[list[str]] = [[]]
    row = col = 0
    for token in re.findall(r"\x1b\[\d*[A-Za-z]|.", raw, flags=re.S):
        if token.startswith("\x1b["):
            if token.endswith("A"):
                row = max(0, row - int(token[2:-1] or 1))
            elif token.endswith("K"):
                del lines[row][col:]
            continue
        if token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
        else:
            if col == columns:  # autowrap: the character goes to the next line
                row, col = row + 1, 0
            while len(lines) <= row:
                lines.append([])
            line = lines[row]
            line.extend(" " * (col - len(line)))
            if col < len(line):
                line[col] = token
            else:
                line.append(token)
            col += 1
        while len(lines) <= row:
            lines.append([])
    return ["".join(line).rstrip() for line in lines]


BAR = re.compile(r"^epoch \d+/3: +\d+%\|")
REPORT = re.compile(r"^epoch +\d+  step +\d+  val\.loss [0-9.]+  val\.accuracy [0-9.]+$")


@pytest.mark.parametrize("columns", [COLUMNS, 80, 130])
def test_prints_go_above_the_bar_and_the_postfix_is_never_cut_in_a_terminal(tmp_path, columns):
    screen = render(run_in_terminal(tmp_path, columns), columns)
    shown = "\n".join(screen)
    reports = [line for line in screen if "val.accuracy" in line]
    assert len(reports) == 3 and all(REPORT.match(line) for line in reports), shown
    bars = [line for line in screen if BAR.match(line)]
    assert len(bars) == 3, shown
    # Whole entries or none: a postfix that does not fit loses its last entries, never half a number.
    assert all(line.endswith("]") and len(line) <= columns for line in bars), shown
    assert all(re.search(r"step/s(, [\w./]+=[0-9.]+[kMGT]?( [\w./]+=[0-9.]+[kMGT]?)*)?\]$", line) for line in bars), (
        shown
    )
    if columns >= COLUMNS:  # room for everything: the rate, in human units
        assert re.search(r" samples/s=[0-9.]+k\]$", bars[-1]), shown
    assert any(line.startswith("run directory: ") for line in screen)
    assert re.match(r"^final accuracy [0-9.]+ after 69 steps", [line for line in screen if line][-1]), shown


def test_in_a_pipe_stdout_has_the_reports_and_stderr_the_progress_lines(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(COMMAND, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert out[0].startswith("run directory: ") and out[-1].startswith("final accuracy ")
    assert [line for line in out[1:-1] if not REPORT.match(line)] == []
    assert "\r" not in done.stdout and "\r" not in done.stderr
    progress = [line for line in done.stderr.splitlines() if line.startswith("step ")]
    assert progress and all(re.match(r"^step \d+/?\d* epoch \d+/3( eval)? \| ", line) for line in progress)
    assert re.search(r"samples/s=[0-9.]+k", done.stderr), done.stderr  # tens of thousands a second, in k
