"""Per-rank heartbeats and a stall watchdog that says who is stuck where."""

from __future__ import annotations

import faulthandler
import json
import logging
import mmap
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from cadence.engine import config as config_module
from cadence.engine.callback import Callback
from cadence.engine.order import Order

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.heartbeat")

#: The events a rank's live record names, by their index in it.
EVENTS = (
    "", "on_fit_start", "on_epoch_start", "on_step_start", "on_batch", "on_forward", "on_backward",
    "on_before_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_eval_start", "on_eval_batch",
    "on_eval_end", "on_epoch_end", "on_fit_end", "on_teardown",
)  # fmt: skip
_CODE = {name: i for i, name in enumerate(EVENTS)}
# Slots of the live record (int64 each): the 1-based step, the event, evaluation batches, the
# fit's generation (a number every rank of the fit shares), and whether a long operation runs.
_STEP, _EVENT, _EVALS, _GENERATION, _LONG = range(5)
_SLOTS = 8
#: The signal that makes a rank dump its Python stacks into `stacks-rank-{r}.txt` (faulthandler,
#: in C: it works while the rank's main thread holds the GIL). A real-time signal: SIGUSR1 and
#: SIGUSR2 belong to Preemption under SLURM and to `cadence.launch`.
DUMP_SIGNAL = getattr(signal, "SIGRTMIN", 34) + 3


class _Live:
    """A rank's last event and step in a file mapped into memory (`heartbeat/rank-{r}.live`).

    The hot path writes int64 slots of the mapping: no call, no I/O, and other
    processes on the host read them through the page cache at once, even while
    this rank's main thread holds the GIL and none of its threads can run.
    """

    def __init__(self, path: Path | None) -> None:
        self.path, self._map = path, None
        if path is None:  # outside a fit: plain memory
            self.slots = memoryview(bytearray(8 * _SLOTS)).cast("q")
            return
        with path.open("w+b") as fh:
            fh.write(bytes(8 * _SLOTS))
            fh.flush()
            self._map = mmap.mmap(fh.fileno(), 8 * _SLOTS)
        self.slots = memoryview(self._map).cast("q")

    def close(self) -> None:
        self.slots.release()
        if self._map is not None:
            self._map.close()


def read_live(path: Path) -> list[int] | None:
    """Another rank's live slots, or None when its file is missing or short."""
    try:
        with path.open("rb") as fh:
            data = fh.read(8 * _SLOTS)
    except OSError:
        return None
    return list(memoryview(data).cast("q")) if len(data) == 8 * _SLOTS else None


def _positive(instance: Any, attribute: Any, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"heartbeat.{attribute.name} must be > 0 seconds, got {value!r}")


@attrs.define(kw_only=True)
class HeartbeatConfig:
    """How often `Heartbeat` writes and when it calls a rank stalled.

    Attributes:
        interval: seconds between writes of `heartbeat/rank-{r}.json`.
        timeout: seconds without any event before a stall is reported.
        first_timeout: the timeout until the first step of a fit completes
            (compilation, warm-up); None: `timeout`.
        exit_on_stall: end the stalled process with `exit_code` after the
            report, so the launcher can restart it.
        exit_code: the exit code of a stalled process (124, like `timeout(1)`).
        watch_all: rank 0 also watches the heartbeat files of every rank.
        directory: where the files go; None: `engine.run_dir / "heartbeat"`.
    """

    interval: float = attrs.field(default=10.0, validator=_positive)
    timeout: float = attrs.field(default=600.0, validator=_positive)
    first_timeout: float | None = attrs.field(default=None, validator=_positive)
    exit_on_stall: bool = False
    exit_code: int = attrs.field(default=124, validator=attrs.validators.ge(1))
    watch_all: bool = True
    directory: str | None = None


class Heartbeat(Callback):
    """Records each rank's last event cheaply and reports a rank that stops moving.

    In the loop each hooked event only writes its number (and the step) into a
    small file mapped into memory (`heartbeat/rank-{r}.live`): no call, no I/O.
    Two daemon threads started at fit start and joined at teardown do the rest:

    - a writer puts `heartbeat/rank-{r}.json` (rank, host, pid, step, event,
      time of the last progress, time written) every `interval` seconds,
      atomically (write then rename);
    - a watchdog checks every `min(interval, timeout / 8)` seconds whether the
      step, event or evaluation batch moved. When it has not for `timeout`
      seconds (`first_timeout` until the fit's first step completes), it
      reports which rank is stuck in which event at which step and for how
      long, dumps every Python stack of the process with `faulthandler` to the
      log and to `heartbeat/stacks-rank-{r}.txt`, and with `exit_on_stall`
      ends the process with `exit_code` (`os._exit`: a stuck main thread
      cannot be unwound). On rank 0 it also watches the other ranks of this
      fit: on its host through their live records (current even while a rank
      holds the GIL, which rank 0 then asks for its stacks with `DUMP_SIGNAL`),
      elsewhere through their JSON files.

    The watchdog pauses while `engine.long_operation_name` is set (blocking
    checkpoint saves), so a long save is not a stall. Steps are numbered from
    1: "step 3" is the third optimizer step (`engine.state.step == 2` while it
    runs).

    Order: `Order.HEARTBEAT` (5), so it marks each event before the others run.

    Example:
        >>> import torch, cadence
        >>> from cadence.callbacks import Heartbeat
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 3
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...     loss_fn=torch.nn.functional.mse_loss, callbacks=[Heartbeat(interval=1, timeout=60)], seed=0)
        >>> engine.fit(steps=3)
        >>> (engine.run_dir / "heartbeat" / "rank-0.json").exists()
        True
    """

    order = Order.HEARTBEAT
    requests_in_step = False  # marks progress; requests nothing
    raises_requests = False

    def __init__(self, config: HeartbeatConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(HeartbeatConfig, config, kwargs, "heartbeat")
        #: The hot-path record (see `_Live`): last event, its 1-based step, evaluation batches.
        self._live = _Live(None)
        self.completed = 0
        #: Stalls reported by this process (its own and, on rank 0, other ranks').
        self.stalls: list[dict[str, Any]] = []
        self._engine: Engine | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._progress_wall = 0.0
        self._fit_start_step = 0
        self._fit_start_wall = 0.0
        self.directory: Path | None = None
        self.rank, self.world_size = 0, 1
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._generation = 0
        self._stacks: Any = None  # the file faulthandler dumps into on DUMP_SIGNAL
        self._others: dict[int, tuple[tuple[int, ...], float]] = {}  # rank 0: each rank's last progress

    # -- the hot path: writes into the live record only -----------------------

    @property
    def event(self) -> str:
        """The last event this rank entered."""
        return EVENTS[self._live.slots[_EVENT]]

    @property
    def step(self) -> int:
        """The 1-based step of the last event (the step in progress, or the one just completed)."""
        return self._live.slots[_STEP]

    def on_step_start(self, engine: Engine) -> None:
        slots = self._live.slots
        slots[_STEP] = engine.state.step + 1
        slots[_EVENT] = 3

    def on_batch(self, engine: Engine) -> None:
        self._live.slots[_EVENT] = 4

    def on_forward(self, engine: Engine) -> None:
        self._live.slots[_EVENT] = 5

    def on_backward(self, engine: Engine) -> None:
        self._live.slots[_EVENT] = 6

    def on_before_optimizer_step(self, engine: Engine) -> None:
        self._live.slots[_EVENT] = 7

    def on_optimizer_step(self, engine: Engine) -> None:
        self._live.slots[_EVENT] = 8

    def on_step_end(self, engine: Engine) -> None:
        slots = self._live.slots
        slots[_STEP] = self.completed = engine.state.step
        slots[_EVENT] = 9

    def on_log(self, engine: Engine) -> None:
        self._live.slots[_EVENT] = 10

    def on_eval_start(self, engine: Engine) -> None:
        self._live.slots[_EVENT] = 11

    def on_eval_batch(self, engine: Engine) -> None:
        slots = self._live.slots
        slots[_EVENT] = 12
        slots[_EVALS] += 1

    def on_eval_end(self, engine: Engine) -> None:
        self._live.slots[_EVENT] = 13

    def on_epoch_start(self, engine: Engine) -> None:
        self._live.slots[_EVENT] = 2

    def on_epoch_end(self, engine: Engine) -> None:
        self._live.slots[_EVENT] = 14

    # -- lifecycle ------------------------------------------------------------

    def on_fit_start(self, engine: Engine) -> None:
        self._shutdown()  # a fit that never tore down
        config = self.config
        self._engine = engine
        self.rank, self.world_size = engine.backend.rank, engine.backend.world_size
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.directory = Path(config.directory) if config.directory else engine.run_dir / "heartbeat"
        self.directory.mkdir(parents=True, exist_ok=True)
        # One number for this fit on every rank: rank 0 reads only records that carry it, so a
        # file left by an earlier fit is ignored and one written before rank 0 got here is not.
        generation = uuid.uuid4().int >> 65
        self._generation = engine.backend.broadcast_object(generation) if self.world_size > 1 else generation
        self._others = {}
        self._live.close()
        self._live = _Live(self.directory / f"rank-{self.rank}.live")
        slots = self._live.slots
        slots[_STEP], slots[_EVENT], slots[_GENERATION] = engine.state.step, _CODE["on_fit_start"], self._generation
        self.completed = engine.state.step
        if threading.current_thread() is threading.main_thread():  # where signal handlers can be set
            self._stacks = self._stacks_path(self.rank).open("a")
            # Ignored once the dump is unregistered again: a late request must not end the process
            # (a real-time signal's default action).
            signal.signal(DUMP_SIGNAL, signal.SIG_IGN)
            faulthandler.register(DUMP_SIGNAL, file=self._stacks, all_threads=True)
        self._fit_start_step = engine.state.step
        self._fit_start_wall = self._progress_wall = time.time()
        self._stop = threading.Event()
        self._write()
        self._threads = [
            threading.Thread(target=self._writer, name=f"cadence-heartbeat-writer-{self.rank}", daemon=True),
            threading.Thread(target=self._watchdog, name=f"cadence-heartbeat-watchdog-{self.rank}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def on_fit_end(self, engine: Engine) -> None:
        self._live.slots[_EVENT] = _CODE["on_fit_end"]

    def on_teardown(self, engine: Engine) -> None:
        if self._shutdown():
            self._live.slots[_EVENT] = _CODE["on_teardown"]
            self._write(finished=True)
        if self._stacks is not None:
            faulthandler.unregister(DUMP_SIGNAL)
            self._stacks.close()
            path = Path(self._stacks.name)
            if path.exists() and not path.stat().st_size:  # nothing was dumped: no empty file left
                path.unlink()
            self._stacks = None
        live, self._live = self._live, _Live(None)
        for slot in (_STEP, _EVENT, _EVALS):
            self._live.slots[slot] = live.slots[slot]
        live.close()
        self._engine = None

    def _shutdown(self) -> bool:
        """Stop and join the threads; True if there were any."""
        if not self._threads:
            return False
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self._poll() + 5.0)
        self._threads = []
        return True

    # -- the threads ----------------------------------------------------------

    def _poll(self) -> float:
        return min(self.config.interval, self.config.timeout / 8)

    def _limit(self) -> float:
        if self.completed > self._fit_start_step:
            return self.config.timeout
        first = self.config.first_timeout
        return first if first is not None else self.config.timeout

    def _writer(self) -> None:
        while not self._stop.wait(self.config.interval):
            self._write()

    def _stacks_path(self, rank: int) -> Path:
        return self.directory / f"stacks-rank-{rank}.txt"  # type: ignore[operator]

    def _write(self, finished: bool = False) -> None:
        if self.directory is None:
            return
        engine = self._engine
        record = {
            "rank": self.rank, "host": self.host, "pid": self.pid, "step": self.step, "event": self.event,
            "time": self._progress_wall, "written": time.time(), "timeout": self._limit(),
            "long_operation": engine.long_operation_name if engine is not None else None, "finished": finished,
            "generation": self._generation,
        }  # fmt: skip
        path = self.directory / f"rank-{self.rank}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError as exc:  # a full or vanished disk must not kill training
            logger.warning("heartbeat: cannot write %s: %s", path, exc)

    def _watchdog(self) -> None:
        poll = self._poll()
        slots = self._live.slots
        last_seen, last_progress, reported = None, time.monotonic(), False
        while not self._stop.wait(poll):
            engine, now = self._engine, time.monotonic()
            if engine is None:
                return
            seen = (slots[_STEP], slots[_EVENT], slots[_EVALS])
            slots[_LONG] = engine.long_operation_name is not None
            if seen != last_seen or slots[_LONG]:
                last_seen, last_progress, reported = seen, now, False
                self._progress_wall = time.time()
            elif not reported and now - last_progress > self._limit():
                reported = True
                self._report_own(now - last_progress)
            if self.rank == 0 and self.config.watch_all and self.world_size > 1:
                self._scan_others()

    def _report_own(self, stalled: float) -> None:
        event, step = self.event, self.step
        message = (
            f"heartbeat: rank {self.rank} ({self.host}, pid {self.pid}) made no progress for {stalled:.1f} s "
            f"(timeout {self._limit():g} s): stuck in {event} at step {step}"
        )
        stacks_path = self._stacks_path(self.rank)
        stacks = ""
        try:
            with stacks_path.open("a") as fh:
                fh.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
                fh.flush()
                start = fh.tell()
                faulthandler.dump_traceback(fh, all_threads=True)
            with stacks_path.open() as fh:
                fh.seek(start)
                stacks = fh.read()
        except OSError as exc:
            stacks = f"(could not dump stacks to {stacks_path}: {exc})"
        self.stalls.append({"rank": self.rank, "event": event, "step": step, "seconds": stalled,
                            "time": time.time(), "stacks": str(stacks_path)})  # fmt: skip
        logger.error("%s; Python stacks (also in %s):\n%s", message, stacks_path, stacks)
        if self.config.exit_on_stall:
            logger.error("heartbeat: ending rank %d with exit code %d", self.rank, self.config.exit_code)
            for handler in logging.getLogger().handlers + logger.handlers:
                handler.flush()
            sys.stderr.flush()
            os._exit(self.config.exit_code)

    def _scan_others(self) -> None:
        """Rank 0: report every other rank of this fit that made no progress for its timeout.

        On this host a rank's progress is its live record (step, event, evaluation
        batches), read through the page cache: it is current even when that rank's
        main thread holds the GIL and its own threads cannot run. Such a rank is
        then asked for its stacks with DUMP_SIGNAL. A rank on another host is
        judged by its JSON file (its progress time, and whether it still writes).
        """
        now, wall = time.monotonic(), time.time()
        for rank in range(1, self.world_size):
            try:
                record = json.loads((self.directory / f"rank-{rank}.json").read_text())  # type: ignore[operator]
            except (OSError, ValueError):
                continue
            if record.get("generation") != self._generation or record.get("finished"):
                continue  # an earlier fit's file, or a rank that is done
            limit = float(record.get("timeout", self.config.timeout))
            live = read_live(self.directory / f"rank-{rank}.live") if record["host"] == self.host else None  # type: ignore[operator]
            if live is not None and live[_GENERATION] == self._generation:
                seen = (live[_STEP], live[_EVENT], live[_EVALS])
                step, event = live[_STEP], EVENTS[live[_EVENT]] if 0 <= live[_EVENT] < len(EVENTS) else "?"
                last = self._others.get(rank)
                if last is None or last[0] != seen or live[_LONG] or record.get("long_operation"):
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
                elif written > limit + 2 * self.config.interval:
                    what = f"has not written its heartbeat for {written:.1f} s (hung holding the GIL, or dead)"
            key = (rank, step, event)
            if what is None or any(s.get("key") == key for s in self.stalls):
                continue
            stacks = self._ask_for_stacks(rank, record, f"rank {rank} stuck in {event} at step {step}")
            self.stalls.append({"rank": rank, "event": event, "step": step, "seconds": stalled,
                                "time": wall, "key": key, "stacks": str(stacks)})  # fmt: skip
            logger.error(
                "heartbeat: rank %d (%s, pid %s) %s: stuck in %s at step %d; its Python stacks: %s",
                rank, record["host"], record["pid"], what, event, step, stacks,
            )  # fmt: skip

    def _ask_for_stacks(self, rank: int, record: Mapping[str, Any], why: str) -> Path | str:
        """Have `rank` (on this host) dump its stacks into its stacks file; that file's path."""
        path = self._stacks_path(rank)
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
