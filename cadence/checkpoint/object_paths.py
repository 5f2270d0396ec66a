"""Names on object storage: `ObjectPath` (a URL that names like a `Path`) and the ids of saves.

A save's id is `<ms since epoch>-<pid>-<token>-<name>-<host>`: unique, in time
order, a valid checkpoint name (the local store stages it under that name),
and it says who writes it, so that `sweep` leaves a live writer's upload
alone (`maybe_writing`). See cadence/checkpoint/object_store.py.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from typing import Any

from cadence.checkpoint import file_io

#: An unreferenced save without a manifest written from another host is removed by `sweep` after this many seconds.
STALE_AFTER = 24 * 3600.0


class ObjectPath:
    """A URL that names like a `Path` does: `/`, `name`, `parent`, `str`, and `exists`/`is_dir`/`iterdir` through fsspec.

    What callers of the store contract do with `store.directory` and
    `store.path(name)` (name them, join them, list a folder, test for a
    name); not a `pathlib.Path`, which would fold `s3://` into `s3:/`.
    """

    def __init__(self, url: str, fs: Any) -> None:
        self.url, self.fs = url.rstrip("/"), fs

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectPath({self.url!r})"

    def __fspath__(self) -> str:
        return self.url

    def __eq__(self, other: object) -> bool:
        return str(other) == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, part: str) -> ObjectPath:
        return ObjectPath(f"{self.url}/{part}", self.fs)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.url.rsplit("/", 1)[0], self.fs)

    def expanduser(self) -> ObjectPath:
        return self

    def absolute(self) -> ObjectPath:
        return self

    def exists(self) -> bool:
        return bool(self.fs.exists(self.url))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.url))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.url))

    def iterdir(self) -> Iterator[ObjectPath]:
        for entry in sorted(self.fs.ls(self.url, detail=False)):
            yield ObjectPath(self.fs.unstrip_protocol(entry), self.fs)


def new_id(name: str) -> str:
    """A new save's id for a save first named `name` (see the module docstring)."""
    return f"{int(time.time() * 1000):013d}-{os.getpid()}-{secrets.token_hex(4)}-{name}-{host()}"


def maybe_writing(save: str) -> bool:
    """Whether a live process may still be writing `save` (its id names the host, the pid and the time)."""
    parts = save.split("-", 3)
    if len(parts) < 4 or not parts[0].isdigit() or not parts[1].isdigit():
        return False
    started, pid = int(parts[0]) / 1000, int(parts[1])
    if parts[3].endswith(f"-{host()}"):
        return pid != os.getpid() and file_io.alive(pid)
    return time.time() - started < STALE_AFTER


def host() -> str:
    """This host's name as a checkpoint name allows (letters, digits, '-', '_')."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())
