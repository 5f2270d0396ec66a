"""Command-line configs: a script's attrs config from ``--config FILE`` and ``key=value`` overrides.

`parse_cli` is the one call a training script makes; `build` does the same without
``sys.argv``, `parse_overrides` turns dotted ``a.b.c=value`` strings into a nested
dict typed by walking the class, and `field_help` lists every leaf field for
``--help``. Structuring, errors and files live in `cadence.run.config`.

Example:
    >>> @attrs.define(kw_only=True)
    ... class Train:
    ...     steps: int = 100
    ...     lr: float = 3e-4
    >>> build(Train, overrides=["steps=5", "lr=1e-3"])
    Train(steps=5, lr=0.001)
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, cast, get_args, get_origin

import attrs
import yaml

from cadence.run.config import (
    MAPPINGS,
    MISSING,
    NONE,
    ConfigError,
    ConfigLoader,
    config_error,
    converter,
    field_default,
    init_fields,
    is_enum,
    is_union,
    load_file,
    merge,
    plain_value,
    structure,
    type_name,
    type_origin,
    unknown_key,
)

__all__ = ["build", "field_help", "parse_cli", "parse_overrides"]

T = TypeVar("T")


def _strip_optional(t: Any) -> tuple[Any, bool]:
    members = [a for a in get_args(t) if a is not NONE] if is_union(t) else [t]
    return (members[0], members[0] is not t) if len(members) == 1 else (t, False)


def _field_type(cls: type, dotted: str) -> Any:
    t: Any = cls
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        t, here = _strip_optional(t)[0], ".".join(parts[:i])
        if t is Any:
            return Any
        if isinstance(t, type) and attrs.has(t):
            fields = init_fields(t)
            if part not in fields:
                raise config_error([unknown_key(t, part, ".".join(parts[: i + 1]), None)])
            t = fields[part].type
        elif type_origin(t) in MAPPINGS:
            t = (get_args(t) or (Any, Any))[1]
        else:
            raise ConfigError(
                f"config error at '{dotted}': '{here}' is {type_name(t)}, which has no keys;"
                f" set it whole, e.g. {here}=[...]",
                path=dotted,
            )
    return t


def _keeps_raw_text(t: Any) -> bool:
    """String-like fields take the override text as is: ``name=123`` means ``"123"``."""
    if get_origin(t) is Literal or is_enum(t):
        return all(isinstance(getattr(a, "value", a), str) for a in (get_args(t) or t))
    return t in (str, Path)


def parse_overrides(cls: type, overrides: Sequence[str]) -> dict[str, Any]:
    """Parse ``a.b.c=value`` strings into a nested dict, typed by walking ``cls``.

    String-like fields keep the raw text; other values are read as YAML, so
    ``[1, 2]``, ``true``, ``null``/``None``, ``{a: 1}`` and ``3e-4`` all work.

    Raises:
        ConfigError: An item has no ``=`` or names an unknown path.
    """
    result: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"config error in '{item}': expected key=value, e.g. optim.lr=3e-4")
        inner, optional = _strip_optional(_field_type(cls, key))
        raw, value = _keeps_raw_text(inner), cast(Any, text)
        if not raw and not text.strip():  # YAML reads "" as null: `engine.steps=` would clear the field unasked
            clear = f" (to clear it, write {key}=null)" if optional else ""
            raise ConfigError(
                f"config error in '{item}': no value after '=' for {key}{clear}",
                path=key,
                expected=type_name(inner),
                received=text,
            )
        if (optional and text in ("null", "None", "~")) or (not raw and text == "None"):
            value = None
        elif not raw:
            try:
                value = yaml.load(text, Loader=ConfigLoader)  # ConfigLoader is a SafeLoader
            except yaml.YAMLError:
                pass  # keep the text: structure() reports it against the field type
        for part in reversed(key.split(".")):
            value = {part: value}
        result = merge(result, value)
    return result


def _defaults(cls: type) -> dict[str, Any]:
    # A parent's default may differ from the child class's own (factory=lambda: Optim(lr=0.1));
    # partial nested input must merge over the parent's default.
    fields = init_fields(cls).items()
    defaults = ((name, a, field_default(a)) for name, a in fields)
    return {n: plain_value(converter.unstructure(v, a.type)) for n, a, v in defaults if v is not MISSING}


def build(
    cls: type[T],
    *,
    file: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    data: Mapping[str, Any] | None = None,
) -> T:
    """Build a validated config: class defaults, then ``data``, then ``file``, then ``overrides``.

    Example:
        >>> cfg = build(MyConfig, file="run.yaml", overrides=["optim.lr=1e-3"])  # doctest: +SKIP
    """
    merged = merge(_defaults(cls), data or {})
    if file is not None:
        merged = merge(merged, load_file(file))
    return structure(cls, merge(merged, parse_overrides(cls, overrides)))


def _doc_help(cls: type) -> dict[str, str]:
    """Entries of Google-style ``Attributes:`` sections along the MRO (subclass wins)."""
    entries: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        section = indent_of_entries = current = None
        for line in inspect.cleandoc(klass.__dict__.get("__doc__") or "").splitlines():
            indent = len(line) - len(line.lstrip())
            if section is None:
                section = indent if line.strip() == "Attributes:" else None
            elif line.strip() and indent <= section:
                break
            elif line.strip():
                indent_of_entries = indent_of_entries or indent
                match = re.match(r"(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line.strip())
                if indent == indent_of_entries and match:
                    current, entries[match[1]] = match[1], match[2].strip()
                elif current is not None:
                    entries[current] = f"{entries[current]} {line.strip()}".strip()
    return entries


def field_help(cls: type) -> list[tuple[str, str, str, str]]:
    """``(dotted path, type, default, help)`` for every leaf field, nested classes expanded.

    Help comes from ``attrs.field(metadata={"help": ...})`` or the class docstring's
    ``Attributes:`` section.
    """
    return _help_rows(cls, "", None)


def _help_rows(cls: type, prefix: str, instance: Any) -> list[tuple[str, str, str, str]]:
    rows, docs = [], _doc_help(cls)
    for name, a in init_fields(cls).items():
        path = prefix + name
        # Nested defaults come from the parent's default instance when there is one.
        default = getattr(instance, name) if instance is not None else field_default(a)
        if isinstance(a.type, type) and attrs.has(a.type):
            rows += _help_rows(a.type, path + ".", default if isinstance(default, a.type) else None)
            continue
        if default is not MISSING:
            shown = repr(plain_value(converter.unstructure(default, a.type)))
        else:
            shown = "(computed)" if isinstance(a.default, attrs.Factory) else "required"  # type: ignore[arg-type]
        rows.append((path, type_name(a.type), shown, a.metadata.get("help") or docs.get(name, "")))
    return rows


def _split_argv(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    file, overrides, items = None, [], iter(argv)
    for arg in items:
        if arg == "--config" or arg.startswith("--config="):
            if file is not None:
                raise ConfigError("config error on the command line: --config given twice")
            file = arg.partition("=")[2] if "=" in arg else next(items, None)
            if not file:
                raise ConfigError("config error on the command line: --config needs a FILE")
        elif arg.startswith("-"):
            raise ConfigError(f"config error on the command line: unknown option '{arg}'; see --help")
        else:
            overrides.append(arg)
    return file, overrides


def write_stdout(text: str) -> None:
    """Write to stdout; a reader that closed the pipe early (`--help | head`) ends the output quietly.

    After a broken pipe, stdout is pointed at the null device, so the interpreter's
    own flush at exit finds nothing to complain about.
    """
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        try:
            fileno = sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):  # not a file (captured output)
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fileno)
        os.close(devnull)


def parse_cli(cls: type[T], argv: Sequence[str] | None = None, *, prog: str | None = None) -> T:
    """Build ``cls`` from ``[--config FILE] [key=value ...]``; ``--help`` lists every field.

    Exits with status 0 after ``--help``, and with status 2 and one line on stderr
    when the config is wrong.

    Example:
        >>> cfg = parse_cli(MyConfig)  # python train.py optim.lr=1e-3  # doctest: +SKIP
    """
    args = list(sys.argv[1:] if argv is None else argv)
    prog = prog or os.path.basename(sys.argv[0]) or cls.__name__
    if "-h" in args or "--help" in args:
        rows = [("KEY", "TYPE", "DEFAULT", "HELP"), *field_help(cls)]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [
            f"usage: {prog} [--config FILE] [key=value ...]\n",
            "Loads FILE (.yaml, .yml, .toml, .json), then applies dotted key=value overrides.\n",
            *(("  " + "  ".join(row[i].ljust(widths[i]) for i in range(3)) + "  " + row[3]).rstrip() for row in rows),
        ]
        write_stdout("\n".join(lines) + "\n")
        raise SystemExit(0)
    try:
        file, overrides = _split_argv(args)
        return build(cls, file=file, overrides=overrides)
    except ConfigError as exc:
        print(f"{prog}: {' '.join(str(exc).split())}", file=sys.stderr)
        raise SystemExit(2) from None
