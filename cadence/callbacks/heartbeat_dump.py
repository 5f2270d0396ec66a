"""What the heartbeat leaves for `cadence hang`: where each hook is, stack and flight-recorder dumps, dump requests.

Files in the heartbeat folder, besides each rank's `rank-{r}.json` and `rank-{r}.live`:

- `hooks-rank-{r}.json`, written at fit start: where each registered callback's
  hooks are in the source (file, first and last line, event), so that a
  stack frame names the callback it is in (`cadence hang` matches them).
- `stacks-rank-{r}.txt`: the rank's Python stacks (`faulthandler`), appended
  at each dump after a `=== time why` line.
- `flight-recorder-rank-{r}`: torch's flight recorder
  (`cadence.backends.flight_recorder`), rewritten at each dump; NCCL's own
  dump on a collective timeout lands there too.
- `dump-request`: written by `cadence hang --dump`, and by rank 0's watch
  when it finds a rank stalled. Every rank's watchdog sees a newer one within
  a poll and dumps its stacks and its flight recorder, so the dumps of all
  ranks show one moment.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence.engine.bus import FunctionHandler
from cadence.engine.events import Event

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.heartbeat")

#: The file rank 0's watch and `cadence hang --dump` write to ask every rank for a dump.
REQUEST = "dump-request"


def hooks_path(directory: Path, rank: int) -> Path:
    """Where `rank` writes its hooks' locations."""
    return directory / f"hooks-rank-{rank}.json"


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write `data` as JSON through a temporary file and a rename (a reader never sees half of it).

    A failure (a full or vanished disk) is logged, never raised: it must not kill training.
    """
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("heartbeat: cannot write %s: %s", path, exc)


def hook_locations(engine: Engine) -> list[dict[str, Any]]:
    """Every hook the engine calls, with its callback's name and its code's file and lines.

    A registered function's hook is the function itself (`engine.on`); its
    name is `fn:` and the function's qualified name.
    """
    found = []
    for event in Event:
        for hook in engine.hooks(event):
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, FunctionHandler):  # a function registered with filters: its hook is the handler's
                hook, owner = owner.fn, getattr(owner.fn, "__self__", None)
            target = getattr(hook, "__func__", hook)
            code = getattr(target, "__code__", None)
            if code is None:
                continue
            name = f"fn:{target.__qualname__}" if owner is None else type(owner).__qualname__
            lines = [line for _, _, line in code.co_lines() if line is not None]
            found.append({
                "callback": name, "event": event.value, "function": code.co_name, "file": code.co_filename,
                "first": code.co_firstlineno, "last": max(lines, default=code.co_firstlineno),
            })  # fmt: skip
    return found


def dump_stacks(path: Path, header: str) -> str:
    """Append every thread's Python stack to `path` after `=== time header`; the stacks dumped (or why not)."""
    try:
        with path.open("a") as fh:
            fh.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}\n")
            fh.flush()
            start = fh.tell()
            faulthandler.dump_traceback(fh, all_threads=True)
        with path.open() as fh:
            fh.seek(start)
            return fh.read()
    except OSError as exc:
        return f"(could not dump stacks to {path}: {exc})"


def request_dumps(directory: Path, why: str) -> None:
    """Ask every rank writing into `directory` for a dump of its stacks and flight recorder."""
    write_json(directory / REQUEST, {"time": time.time(), "why": why})


class DumpRequests:
    """Sees, from the watchdog thread, the dump requests made after it started (one `stat` per poll)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / REQUEST
        self.seen = self._mtime()

    def _mtime(self) -> float:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return 0.0

    def new(self) -> str | None:
        """The reason of a request made since the last call, or None."""
        mtime = self._mtime()
        if mtime <= self.seen:
            return None
        self.seen = mtime
        try:
            return str(json.loads(self.path.read_text()).get("why", "requested"))
        except (OSError, ValueError, AttributeError):
            return "requested"
