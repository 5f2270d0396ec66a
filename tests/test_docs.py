"""The docs run: code blocks of docs/*.md, docstring examples of cadence, and `mkdocs build --strict`.

Convention for docs pages: every ```python block runs, in order, in one
namespace per page, in a temporary working directory. A block that is a
script's file (one that later blocks start as a process) is marked
`<!-- file: train.py -->` on the line before its fence: it is written to that
file in the working directory instead of run. A block that cannot run here (a
SLURM submission, a GPU) is marked `<!-- skip: why -->`, the reason required;
text that is not Python uses another fence (```text, ```bash, ```toml).
"""

from __future__ import annotations

import doctest
import importlib
import io
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cadence

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
FENCE = re.compile(
    r"(?:<!--\s*(?P<marker>skip|file)\b:?(?P<argument>[^>]*?)\s*-->\s*\n)?^```python[^\n]*\n(?P<code>.*?)^```\s*$",
    re.S | re.M,
)
MODULES = sorted(m.name for m in pkgutil.walk_packages(cadence.__path__, "cadence."))


def python_blocks(text: str) -> list[tuple[int, str, str | None, str]]:
    """(line, code, marker, argument) for each ```python block of a page; marker None, "skip" or "file"."""
    return [
        (
            text.count("\n", 0, m.start("code")) + 1,
            m.group("code"),
            m.group("marker"),
            (m.group("argument") or "").strip(),
        )
        for m in FENCE.finditer(text)
    ]


def test_blocks_are_found_and_markers_are_honoured():
    text = (
        "a\n```python\nx = 1\n```\n<!-- skip: needs SLURM -->\n```python\nraise SystemExit\n```\n```text\ny\n```\n"
        "<!-- file: train.py -->\n```python\nprint(1)\n```\n"
    )
    assert python_blocks(text) == [
        (3, "x = 1\n", None, ""),
        (7, "raise SystemExit\n", "skip", "needs SLURM"),
        (14, "print(1)\n", "file", "train.py"),
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_block_that_does_not_run_says_why(page):
    """Every skipped block names its reason; every file block names its file."""
    bare = [line for line, _, marker, argument in python_blocks(page.read_text()) if marker and not argument]
    assert not bare, f"docs/{page.name}: blocks at lines {bare} are marked without a reason (<!-- skip: why -->)"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_code_blocks_run(page, tmp_path, monkeypatch, cpu_default_device):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for line, code, marker, argument in python_blocks(page.read_text()):
        if marker == "skip":
            continue
        if marker == "file":  # a script that later blocks run
            (tmp_path / argument).write_text(code)
            continue
        try:
            # dont_inherit: this file's `from __future__ import annotations` must not leak into the page's code.
            exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec", dont_inherit=True), namespace)
        except Exception as exc:
            raise AssertionError(
                f"docs/{page.name}, the python block at line {line} failed: {type(exc).__name__}: {exc}. "
                "Fix the example, or mark a block that cannot run here with <!-- skip: why --> before its fence."
            ) from exc


def test_the_concepts_diagram_draws_every_event():
    text = (DOCS / "concepts.md").read_text()
    diagram = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert diagram, "docs/concepts.md has no mermaid diagram of the loop"
    missing = [event.value for event in cadence.Event if event.value not in diagram.group(1)]
    assert not missing, f"events missing from the loop diagram: {missing}"


def test_getting_started_shows_the_readme_commands():
    readme = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)[:2]
    index = (DOCS / "index.md").read_text()
    assert len(readme) == 2 and all(command in index for command in readme)


def test_the_front_page_names_every_backend():
    intro = " ".join((DOCS / "index.md").read_text().split("\n## ", 1)[0].split())
    shipped = {"local": "one process", "ddp": "DDP", "mesh": "mesh", "deepspeed": "DeepSpeed", "ft": "TorchFT"}
    assert [shipped[name] for name in shipped if shipped[name] not in intro] == []


@pytest.mark.parametrize("page", ["concepts.md", "backends.md", "checkpoints.md"])
def test_pages_open_with_the_tasks_and_keep_internals_under_their_own_heading(page):
    text = (DOCS / page).read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert "How do I..." in text.split("\n## ", 1)[0], f"docs/{page} does not open with what a user does"
    assert "Internals" in headings, f"docs/{page} has no Internals section"


def test_every_page_of_the_nav_exists_and_every_page_is_in_the_nav():
    nav = re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    missing = [name for name in nav if not (DOCS / name).exists()]
    assert not missing, f"mkdocs.yml lists pages that do not exist: {missing}"
    assert sorted(nav) == sorted(p.name for p in PAGES), "a docs page is not in the nav of mkdocs.yml"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module, tmp_path, monkeypatch, cpu_default_device):
    monkeypatch.chdir(tmp_path)
    imported = importlib.import_module(module)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out = io.StringIO()
    for test in doctest.DocTestFinder(exclude_empty=True).find(imported, module):
        runner.run(test, out=out.write)
    assert runner.failures == 0, f"docstring examples of {module} failed:\n{out.getvalue()}"


def test_docstring_examples_are_collected():
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = {
        test.name for test in finder.find(importlib.import_module("cadence.engine.engine"), "cadence.engine.engine")
    }
    assert "cadence.engine.engine.Engine" in found


@pytest.mark.timeout(600)
def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="needs mkdocs: pip install 'cadence[docs]'")
    pytest.importorskip("mkdocstrings", reason="needs mkdocstrings: pip install 'cadence[docs]'")
    site = tmp_path / "site"
    command = ["mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)]
    result = subprocess.run(
        [sys.executable, "-m", *command],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    assert (site / "concepts" / "index.html").exists()
    api = (site / "api" / "index.html").read_text()
    assert 'id="cadence.Engine"' in api and "check_callback" in api  # mkdocstrings rendered the docstrings
    assert 'class="mermaid"' in (site / "concepts" / "index.html").read_text()
