"""What a rank's heartbeat shows the others: its live record, and rank 0's watch over the other ranks.

`cadence.callbacks.heartbeat.Heartbeat` writes the live record on the hot path
and, on rank 0, runs `RankWatch.scan` from its watchdog thread.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cadence.callbacks.heartbeat_dump import request_dumps

logger = logging.getLogger("cadence.heartbeat")

#: The events a rank's live record names, by their index in it.
EVENTS = (
    "", "on_fit_start", "on_epoch_start", "on_step_start", "on_batch", "on_forward", "on_backward",
    "on_before_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_eval_start", "on_eval_batch",
    "on_eval_end", "on_epoch_end", "on_fit_end", "on_teardown",
)  # fmt: skip
#: The index of each event in `EVENTS`.
EVENT_CODES = {name: i for i, name in enumerate(EVENTS)}
#: Slots of the live record (int64 each): the 1-based step, the event, evaluation batches, the
#: fit's generation (a number every rank of the fit shares), and whether a long operation runs.
STEP, EVENT, EVALS, GENERATION, LONG = range(5)
SLOTS = 8
#: The signal that makes a rank dump its Python stacks into `stacks-rank-{r}.txt` (faulthandler,
#: in C: it works while the rank's main thread holds the GIL). A real-time signal: SIGUSR1 and
#: SIGUSR2 belong to Preemption under SLURM and to `cadence.launch`.
DUMP_SIGNAL = getattr(signal, "SIGRTMIN", 34) + 3


class LiveRecord:
    """A rank's last event and step in a file mapped into memory (`heartbeat/rank-{r}.live`).

    The hot path writes int64 slots of the mapping: no call, no I/O, and other
    processes on the host read them through the page cache at once, even while
    this rank's main thread holds the GIL and none of its threads can run.
    """

    def __init__(self, path: Path | None) -> None:
        self.path, self._map = path, None
        if path is None:  # outside a fit: plain memory
            self.slots = memoryview(bytearray(8 * SLOTS)).cast("q")
            return
        with path.open("w+b") as fh:
            fh.write(bytes(8 * SLOTS))
            fh.flush()
            self._map = mmap.mmap(fh.fileno(), 8 * SLOTS)
        self.slots = memoryview(self._map).cast("q")

    def close(self) -> None:
        self.slots.release()
        if self._map is not None:
            self._map.close()


def read_live(path: Path) -> list[int] | None:
    """Another rank's live slots, or None when its file is missing or short."""
    try:
        with path.open("rb") as fh:
            data = fh.read(8 * SLOTS)
    except OSError:
        return None
    return list(memoryview(data).cast("q")) if len(data) == 8 * SLOTS else None


def stacks_path(directory: Path, rank: int) -> Path:
    """Where `rank` dumps its Python stacks."""
    return directory / f"stacks-rank-{rank}.txt"


class RankWatch:
    """Rank 0's watch over the other ranks of one fit; what it finds joins `stalls`.

    Args:
        directory: the heartbeat folder every rank writes into.
        rank, host: this rank (0) and its host.
        world_size: the ranks of the fit.
        generation: the fit's number: records that do not carry it are an earlier fit's.
        timeout: the stall timeout for a record that does not name its own.
        interval: seconds between a rank's writes of its JSON record.
        stalls: the list the reports are appended to (the callback's `stalls`).
    """

    def __init__(
        self,
        directory: Path,
        *,
        rank: int,
        host: str,
        world_size: int,
        generation: int,
        timeout: float,
        interval: float,
        stalls: list[dict[str, Any]],
    ) -> None:
        self.directory, self.rank, self.host, self.world_size = directory, rank, host, world_size
        self.generation, self.timeout, self.interval, self.stalls = generation, timeout, interval, stalls
        self._others: dict[int, tuple[tuple[int, ...], float]] = {}  # each rank's last progress

    def scan(self) -> None:
        """Report every other rank of this fit that made no progress for its timeout.

        On this host a rank's progress is its live record (step, event, evaluation
        batches), read through the page cache: it is current even when that rank's
        main thread holds the GIL and its own threads cannot run. Such a rank is
        then asked for its stacks with DUMP_SIGNAL. A rank on another host is
        judged by its JSON file (its progress time, and whether it still writes).
        """
        now, wall = time.monotonic(), time.time()
        for rank in range(1, self.world_size):
            try:
                record = json.loads((self.directory / f"rank-{rank}.json").read_text())
            except (OSError, ValueError):
                continue
            if record.get("generation") != self.generation or record.get("finished"):
                continue  # an earlier fit's file, or a rank that is done
            limit = float(record.get("timeout", self.timeout))
            live = read_live(self.directory / f"rank-{rank}.live") if record["host"] == self.host else None
            if live is not None and live[GENERATION] == self.generation:
                seen = (live[STEP], live[EVENT], live[EVALS])
                step, event = live[STEP], EVENTS[live[EVENT]] if 0 <= live[EVENT] < len(EVENTS) else "?"
                last = self._others.get(rank)
                if last is None or last[0] != seen or live[LONG] or record.get("long_operation"):
                    self._others[rank] = (seen, now)
                    continue
                stalled, what = now - last[1], None
                if stalled > limit:
                    what = f"made no progress for {stalled:.1f} s (timeout {limit:g} s)"
            else:  # another host: its file is all there is
                if record.get("long_operation"):
                    continue
                step, event = record["step"], record["event"]
                stalled, written = wall - record["time"], wall - record["written"]
                what = None
                if stalled > limit:
                    what = f"made no progress for {stalled:.1f} s (timeout {limit:g} s)"
                elif written > limit + 2 * self.interval:
                    what = f"has not written its heartbeat for {written:.1f} s (hung holding the GIL, or dead)"
            key = (rank, step, event)
            if what is None or any(s.get("key") == key for s in self.stalls):
                continue
            stacks = self._ask_for_stacks(rank, record, f"rank {rank} stuck in {event} at step {step}")
            self.stalls.append({"rank": rank, "event": event, "step": step, "seconds": stalled,
                                "time": wall, "key": key, "stacks": str(stacks)})  # fmt: skip
            logger.error(
                "heartbeat: rank %d (%s, pid %s) %s: stuck in %s at step %d; its Python stacks: %s "
                "(`cadence hang %s` joins every rank's records, stacks and flight recorder)",
                rank, record["host"], record["pid"], what, event, step, stacks, self.directory,
            )  # fmt: skip
            # Every rank dumps its stacks and flight recorder at its next poll: the dumps show one moment.
            request_dumps(self.directory, f"rank {self.rank} found rank {rank} stuck in {event} at step {step}")

    def _ask_for_stacks(self, rank: int, record: Mapping[str, Any], why: str) -> Path | str:
        """Have `rank` (on this host) dump its stacks into its stacks file; that file's path."""
        path = stacks_path(self.directory, rank)
        if record["host"] != self.host:
            return f"{path} (written by rank {rank} itself if its watchdog can run: it is on {record['host']})"
        try:
            with path.open("a") as fh:
                fh.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} asked by rank {self.rank}: {why}\n")
            asked = path.stat().st_size
            os.kill(int(record["pid"]), DUMP_SIGNAL)
        except OSError as exc:
            return f"{path} (could not ask pid {record['pid']} for its stacks: {exc})"
        deadline = time.monotonic() + 0.5  # faulthandler writes from the signal handler, in C: at once
        while time.monotonic() < deadline and path.stat().st_size == asked:
            time.sleep(0.02)
        return path
