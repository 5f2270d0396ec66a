"""CI checks what the project agrees on: lint, format and types before the tests, with pinned tools."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_static_checks_before_the_tests_and_fails_on_them():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    checks = next((c for c in commands if c.startswith("ruff check")), None)
    assert checks is not None, "the README no longer shows the static checks CI runs"
    for check in ("ruff check .", "ruff format --check .", "mypy cadence"):
        assert check in checks
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    check_line = next((i for i, line in enumerate(lines) if line.startswith(checks)), None)
    test_line = lines.index(commands[1])  # the README's test command (tests/test_readme.py)
    assert check_line is not None and check_line < test_line, ".ci/run must run the README's checks before the tests"
    assert "exit 1" in lines[check_line], ".ci/run must fail when a static check fails"


def test_the_tools_ci_runs_are_pinned():
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    for tool in ("ruff", "mypy"):
        (pin,) = [spec for spec in dev if re.match(rf"{tool}\b", spec)]
        assert re.fullmatch(rf"{tool}==[\d.]+", pin), f"the dev extra must pin {tool} exactly, got {pin!r}"
