"""torch's flight recorder for a backend's process groups: on before the first group, dumped on demand.

torch records every collective of every process group of a process, gloo and
NCCL alike (checked on torch 2.13's CPU build with gloo), in one ring buffer:
the group (`pg_id`, its name), the collective's sequence number in that group
(`collective_seq_id`), the op (`gloo:all_reduce`, `nccl:all_reduce`), input and
output sizes and dtypes, whether it completed (`retired`; NCCL also tells
`scheduled` / `started` / `completed`), and the Python stack that issued it.

The ring's size is read once, when the process's first process group starts
(`TORCH_FR_BUFFER_SIZE`, formerly `TORCH_NCCL_TRACE_BUFFER_SIZE`; 0 or unset:
nothing is recorded, and a later change has no effect). So `enable` runs
before the backend starts its group, and a size set in the environment wins.

Dumps:

- `FlightRecorder.dump` writes what the ring holds now into a folder as
  `flight-recorder-rank-{r}`, in torch's own format (a pickle of plain dicts
  and lists, what `python -m torch.distributed.flight_recorder.fr_trace` and
  `cadence hang` read). The `Heartbeat` callback calls it from its watchdog
  thread (it works while the main thread waits in a collective) on a stall,
  on an exception (a collective that timed out), and on request.
- NCCL also dumps by itself when a collective times out
  (`TORCH_NCCL_DUMP_ON_TIMEOUT`, set to 1 by `enable`), into
  `TORCH_FR_DUMP_TEMP_FILE` + rank. torch reads that name when it writes its
  first dump, not when the group starts (`DebugInfoWriter::getWriter`), so
  `dump_into` points it at the run's heartbeat folder at fit start, once the
  run directory is known. Gloo has no dump of its own: a timeout raises, and
  the heartbeat's dump on the exception stands in for it.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger("cadence.flight_recorder")

#: Where torch reads the ring's size, newest name first.
BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: Where torch reads the prefix of its own dump files (the rank is appended), newest name first.
DUMP_FILE_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
#: NCCL dumps the ring when a collective times out (needs a ring).
DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
#: The ring's default size: a few steps of an FSDP model's collectives (torch's analyzer wants the
#: window around a hang, not the run); about 1 KB an entry with its stack.
DEFAULT_ENTRIES = 2000
#: A dump's file name, before the rank: torch's analyzer finds the files by this prefix.
DUMP_PREFIX = "flight-recorder-rank-"


def dump_path(folder: Path, rank: int) -> Path:
    """The file `rank`'s dumps go to in `folder`."""
    return folder / f"{DUMP_PREFIX}{rank}"


class FlightRecorder:
    """This process's flight recorder, as a backend set it up.

    Attributes:
        entries: the ring's size as configured (0: off).
        source: who set it: "cadence", or the environment variable that did.
    """

    def __init__(self, entries: int, source: str) -> None:
        self.entries, self.source = entries, source

    @classmethod
    def enable(cls, entries: int) -> FlightRecorder:
        """Set the ring's size (unless the environment sets one) and NCCL's dump on timeout.

        Call before the process's first process group: the size is read then, once.
        """
        current = cls.current()
        if current.source != "cadence":  # the environment decides
            return current
        os.environ[BUFFER_VARIABLES[0]] = str(entries)
        if entries:
            os.environ.setdefault(DUMP_ON_TIMEOUT, "1")
        return cls(entries, "cadence")

    @classmethod
    def current(cls) -> FlightRecorder:
        """The recorder as the environment configures it (source "cadence" when no variable is set)."""
        for name in BUFFER_VARIABLES:
            value = os.environ.get(name)
            if value is not None:
                try:
                    return cls(max(int(value), 0), name)
                except ValueError:
                    raise ValueError(f"{name}={value!r}: torch's flight recorder size must be an integer") from None
        return cls(0, "cadence")

    def dump_into(self, folder: Path) -> None:
        """Have torch's own dumps (NCCL, on a collective timeout) land in `folder`, unless a variable names a file.

        A name an earlier fit set (one ending in `DUMP_PREFIX`) is replaced: torch reads it at its first dump.
        """
        names = [os.environ.get(name) for name in DUMP_FILE_VARIABLES]
        if self.entries and not any(name and not name.endswith(DUMP_PREFIX) for name in names):
            os.environ[DUMP_FILE_VARIABLES[0]] = str(folder / DUMP_PREFIX)

    def dump(self, folder: Path, rank: int) -> Path | None:
        """Write what the ring holds now to `folder/flight-recorder-rank-{rank}` (atomically); None when off.

        Safe from any thread, also while the main thread waits in a collective.
        An error (a full disk) is logged, never raised: a dump must not end training.
        """
        if not self.entries:
            return None
        path = dump_path(folder, rank)
        try:
            data = _collect()
            tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")  # the watchdog's, or the main thread's
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except Exception as exc:  # a broken dump is reported, never a reason to fail the rank
            logger.warning("flight recorder: cannot dump to %s: %s", path, exc)
            return None
        return path


def _collect() -> bytes:
    """The ring's entries in torch's pickle format: the generic recorder's, and NCCL's where torch has it."""
    from torch._C import _distributed_c10d as c10d

    # Private torch functions, the only way to read the ring from Python (torch 2.13): `_dump_fr_trace`
    # holds every backend's entries (gloo's on a CPU build); CUDA builds keep NCCL's in `_dump_nccl_trace`.
    dumps = [dump() for name in ("_dump_fr_trace", "_dump_nccl_trace") if (dump := getattr(c10d, name, None))]
    if not dumps:
        raise RuntimeError("this torch build has no flight recorder dump (torch._C._distributed_c10d._dump_fr_trace)")
    if len(dumps) == 1:
        return bytes(dumps[0])
    merged: dict[str, Any] = {}
    seen: set[tuple[Any, ...]] = set()
    for raw in dumps:
        part = read_dump(bytes(raw))
        for key, value in part.items():
            if key == "entries":
                for entry in value:
                    ident = tuple(entry.get(k) for k in ("pg_id", "collective_seq_id", "p2p_seq_id", "profiling_name"))
                    if ident not in seen:
                        seen.add(ident)
                        merged.setdefault("entries", []).append(entry)
            elif isinstance(value, dict):
                merged.setdefault(key, {}).update(value)
            else:
                merged.setdefault(key, value)
    return pickle.dumps(merged, protocol=2)


class _PlainUnpickler(pickle.Unpickler):
    """Reads plain dicts, lists, strings and numbers only: a dump names no class, so none is loaded."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a flight recorder dump names no class, this one names {module}.{name}")


def read_dump(data: bytes) -> dict[str, Any]:
    """A dump's content (torch's format) as plain Python objects; nothing in it is executed."""
    loaded = _PlainUnpickler(io.BytesIO(data)).load()
    if not isinstance(loaded, dict):
        raise ValueError(f"a flight recorder dump is a dict, got {type(loaded).__name__}")
    return loaded
