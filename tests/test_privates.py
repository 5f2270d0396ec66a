"""No private names read across modules inside `cadence/` (STYLE.md: contracts, not lookups).

A `_name` defined in module A (a module-level function, class or variable, or a
method or attribute of one of A's classes) is A's own business. Another module
B reading it (`from A import _name`, `A._name`, `obj._name`) couples B to A's
internals; parts find each other through documented, public names instead.

`find_private_reads` parses every module with `ast`. A read `obj._name` counts
when `_name` is defined privately in another module of the package and nowhere
in the reading module itself (where it may be that module's own attribute).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_privately(tree: ast.AST) -> set[str]:
    """The private names a module defines: module-level ones, and its classes' methods and attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
            names.add(node.attr)  # self._x = ..., cls._x = ...
        elif isinstance(node, ast.arg) and _private(node.arg):
            names.add(node.arg)
    return names


def find_private_reads(modules: Mapping[str, str]) -> list[str]:
    """`"module:line: what"` for every private name of one module read in another.

    Args:
        modules: dotted module name -> its source.
    """
    trees = {name: ast.parse(source, name) for name, source in modules.items()}
    defined = {name: defined_privately(tree) for name, tree in trees.items()}
    problems = []
    for module, tree in trees.items():
        own = defined[module]
        elsewhere = set().union(*(names for other, names in defined.items() if other != module))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in trees:
                for alias in node.names:
                    if _private(alias.name) and node.module != module:
                        problems.append(f"{module}:{node.lineno}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                if node.attr in elsewhere and node.attr not in own:
                    problems.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return problems


#: Private reads of today that belong to another piece of work (the checkpoint wing's stores share their
#: folder-store base's helpers), as "module: expression" -> how many. It may only shrink: the test fails on
#: a read not listed, on more of one than listed, and on a listed one that is gone (take it off).
KNOWN: dict[str, int] = {}


def package_modules() -> dict[str, str]:
    modules = {}
    for path in sorted((ROOT / "cadence").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path.read_text(encoding="utf-8")
    return modules


def test_the_check_finds_each_kind_of_private_read():
    modules = {
        "pkg.a": "_LIMIT = 3\n\ndef _helper():\n    pass\n\nclass A:\n    def __init__(self):\n        self._state = 1\n",
        "pkg.b": (
            "from pkg.a import _helper\nfrom pkg import a\n\n"
            "def use(obj):\n    a._helper()\n    return obj._state + a._LIMIT\n"
        ),
        # Its own `_state`, and dunders, are not another module's privates.
        "pkg.c": "class C:\n    def __init__(self):\n        self._state = 2\n\n    def get(self):\n"
        "        return self._state, self.__class__\n",
    }
    assert find_private_reads(modules) == [
        "pkg.b:1: from pkg.a import _helper",
        "pkg.b:5: a._helper",
        "pkg.b:6: obj._state",
        "pkg.b:6: a._LIMIT",
    ]


def test_the_package_is_parsed():
    modules = package_modules()
    assert "cadence.engine.engine" in modules and len(modules) > 50
    assert "_fit" in defined_privately(ast.parse(modules["cadence.engine.engine"]))


def test_no_private_name_is_read_across_modules_inside_cadence():
    found: dict[str, list[str]] = {}
    for problem in find_private_reads(package_modules()):
        module, _, what = problem.split(":", 2)
        found.setdefault(f"{module}:{what}", []).append(problem)
    problems = [
        f"{len(where)} x (listed: {KNOWN.get(key, 0)}): " + ", ".join(where)
        for key, where in found.items()
        if len(where) > KNOWN.get(key, 0)
    ]
    problems += [f"{key}: listed in KNOWN but read {len(found.get(key, []))} x now" for key, count in KNOWN.items()
                 if len(found.get(key, [])) < count]  # fmt: skip
    assert not problems, (
        "private names read across modules (make them public and document them, or move the code that needs "
        "them next to them):\n" + "\n".join(problems)
    )
