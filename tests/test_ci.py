"""CI checks what the project agrees on: lint, format and types before the tests, with pinned tools."""

from __future__ import annotations

import ast
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


def test_a_broken_cadence_import_fails_and_optional_skips_name_their_extra():
    """`importorskip` of Cadence's own modules would turn a broken import into a silent skip."""
    problems = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            name = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            if not isinstance(name, str):
                problems.append(f"{where}: importorskip of a name not written out")
            elif name.split(".")[0] == "cadence":
                problems.append(f"{where}: importorskip({name!r}) skips on a broken import of Cadence: import it")
            elif not any(keyword.arg == "reason" for keyword in node.keywords):
                problems.append(f"{where}: importorskip({name!r}) without a reason naming the extra to install")
    assert not problems, "\n".join(problems)
