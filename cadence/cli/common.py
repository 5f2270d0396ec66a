"""What the `cadence` subcommands share: the usage error, versions, tables, sizes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class UsageError(Exception):
    """A one-line problem with what the user asked for (exit status 2)."""


def version(*distributions: str) -> str | None:
    """The installed version of the first of `distributions` found, or None."""
    from importlib import metadata

    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """`rows` as aligned lines, the last column left free."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        (indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]).rstrip() for row in rows
    ]


def existing_dir(path: str, what: str) -> Path:
    """`path` as a folder; raises UsageError naming `what` when it is missing or not a folder."""
    folder = Path(path)
    if not folder.exists():
        raise UsageError(f"no such {what}: {folder}")
    if not folder.is_dir():
        raise UsageError(f"not a directory: {folder} (expected a {what})")
    return folder


def human_size(nbytes: float) -> str:
    """`nbytes` in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"  # pragma: no cover
