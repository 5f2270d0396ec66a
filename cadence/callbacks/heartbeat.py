"""Per-rank heartbeats and a stall watchdog that says who is stuck where."""

from __future__ import annotations

import faulthandler
import logging
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

from cadence.callbacks.heartbeat_dump import DumpRequests, dump_stacks, hook_locations, hooks_path, write_json
from cadence.callbacks.heartbeat_watch import (
    DUMP_SIGNAL,
    EVALS,
    EVENT,
    EVENT_CODES,
    EVENTS,
    GENERATION,
    LONG,
    STEP,
    LiveRecord,
    RankWatch,
    stacks_path,
)
from cadence.engine.callback import Callback
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.heartbeat")


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

    For `cadence hang RUN_DIR` (`cadence.callbacks.heartbeat_dump`): each rank writes where its callbacks' hooks
    are at fit start and, with a backend that has a `flight_recorder` (`cadence.backends.flight_recorder`), dumps
    it with its stacks on a stall, when the fit raises (a timed-out collective) and on a dump request.

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
        #: The hot-path record (see `LiveRecord`): last event, its 1-based step, evaluation batches.
        self._live = LiveRecord(None)
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
        self._watch: RankWatch | None = None  # rank 0's watch over the other ranks
        self._recorder: Any = None  # the backend's flight recorder, if it has one
        self._requests: DumpRequests | None = None
        self._dumped_at: tuple[int, int] | None = None  # (step, event) of the last flight-recorder dump
        self._failure: dict[str, Any] | None = None  # where the fit raised, kept in the record

    # -- the hot path: writes into the live record only -----------------------

    @property
    def event(self) -> str:
        """The last event this rank entered."""
        return EVENTS[self._live.slots[EVENT]]

    @property
    def step(self) -> int:
        """The 1-based step of the last event (the step in progress, or the one just completed)."""
        return self._live.slots[STEP]

    def on_step_start(self, engine: Engine) -> None:
        slots = self._live.slots
        slots[STEP] = engine.state.step + 1
        slots[EVENT] = 3

    def on_batch(self, engine: Engine) -> None:
        self._live.slots[EVENT] = 4

    def on_forward(self, engine: Engine) -> None:
        self._live.slots[EVENT] = 5

    def on_backward(self, engine: Engine) -> None:
        self._live.slots[EVENT] = 6

    def on_before_optimizer_step(self, engine: Engine) -> None:
        self._live.slots[EVENT] = 7

    def on_optimizer_step(self, engine: Engine) -> None:
        self._live.slots[EVENT] = 8

    def on_step_end(self, engine: Engine) -> None:
        slots = self._live.slots
        slots[STEP] = self.completed = engine.state.step
        slots[EVENT] = 9

    def on_log(self, engine: Engine) -> None:
        self._live.slots[EVENT] = 10

    def on_eval_start(self, engine: Engine) -> None:
        self._live.slots[EVENT] = 11

    def on_eval_batch(self, engine: Engine) -> None:
        slots = self._live.slots
        slots[EVENT] = 12
        slots[EVALS] += 1

    def on_eval_end(self, engine: Engine) -> None:
        self._live.slots[EVENT] = 13

    def on_epoch_start(self, engine: Engine) -> None:
        self._live.slots[EVENT] = 2

    def on_epoch_end(self, engine: Engine) -> None:
        self._live.slots[EVENT] = 14

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
        self._watch = None
        if self.rank == 0 and config.watch_all and self.world_size > 1:
            self._watch = RankWatch(
                self.directory,
                rank=self.rank,
                host=self.host,
                world_size=self.world_size,
                generation=self._generation,
                timeout=config.timeout,
                interval=config.interval,
                stalls=self.stalls,
            )
        self._live.close()
        self._live = LiveRecord(self.directory / f"rank-{self.rank}.live")
        slots = self._live.slots
        slots[STEP], slots[EVENT], slots[GENERATION] = engine.state.step, EVENT_CODES["on_fit_start"], self._generation
        self.completed = engine.state.step
        if threading.current_thread() is threading.main_thread():  # where signal handlers can be set
            self._stacks = stacks_path(self.directory, self.rank).open("a")
            # Ignored once the dump is unregistered again: a late request must not end the process
            # (a real-time signal's default action).
            signal.signal(DUMP_SIGNAL, signal.SIG_IGN)
            faulthandler.register(DUMP_SIGNAL, file=self._stacks, all_threads=True)
        self._fit_start_step = engine.state.step
        self._fit_start_wall = self._progress_wall = time.time()
        self._recorder, self._requests = getattr(engine.backend, "flight_recorder", None), DumpRequests(self.directory)
        if self._recorder is not None:
            self._recorder.dump_into(self.directory)  # torch's own dumps (NCCL on a timeout) land here
        info = {"rank": self.rank, "generation": self._generation, "hooks": hook_locations(engine)}
        write_json(hooks_path(self.directory, self.rank), info)
        self._failure = None
        self._stop = threading.Event()
        self._write()
        self._threads = [
            threading.Thread(target=self._writer, name=f"cadence-heartbeat-writer-{self.rank}", daemon=True),
            threading.Thread(target=self._watchdog, name=f"cadence-heartbeat-watchdog-{self.rank}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def on_fit_end(self, engine: Engine) -> None:
        self._live.slots[EVENT] = EVENT_CODES["on_fit_end"]

    def on_exception(self, engine: Engine) -> None:
        # Where the fit failed stays in the record after teardown. A collective that timed out raised here
        # (gloo has no dump of its own): the flight recorder as it was then, unless this stall was dumped.
        error = f"{type(engine.exception).__name__}: {engine.exception}"[:500]
        self._failure = {"step": self.step, "event": self.event, "error": error}
        if self._dumped_at != (self.step, self._live.slots[EVENT]):
            self._dump_flight_recorder()

    def _dump_flight_recorder(self) -> None:
        if self._recorder is not None and self.directory is not None:
            self._dumped_at = (self.step, self._live.slots[EVENT])
            self._recorder.dump(self.directory, self.rank)

    def on_teardown(self, engine: Engine) -> None:
        if self._shutdown():
            self._live.slots[EVENT] = EVENT_CODES["on_teardown"]
            self._write(finished=True)
        if self._stacks is not None:
            faulthandler.unregister(DUMP_SIGNAL)
            self._stacks.close()
            path = Path(self._stacks.name)
            if path.exists() and not path.stat().st_size:  # nothing was dumped: no empty file left
                path.unlink()
            self._stacks = None
        live, self._live = self._live, LiveRecord(None)
        for slot in (STEP, EVENT, EVALS):
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

    def _write(self, finished: bool = False) -> None:
        if self.directory is None:
            return
        engine = self._engine
        record = {
            "rank": self.rank, "host": self.host, "pid": self.pid, "step": self.step, "event": self.event,
            "time": self._progress_wall, "written": time.time(), "timeout": self._limit(),
            "long_operation": engine.long_operation_name if engine is not None else None, "finished": finished,
            "generation": self._generation, "main_thread": threading.main_thread().ident, "failure": self._failure,
        }  # fmt: skip
        write_json(self.directory / f"rank-{self.rank}.json", record)

    def _watchdog(self) -> None:
        poll = self._poll()
        slots = self._live.slots
        last_seen, last_progress, reported = None, time.monotonic(), False
        while not self._stop.wait(poll):
            engine, now = self._engine, time.monotonic()
            if engine is None:
                return
            seen = (slots[STEP], slots[EVENT], slots[EVALS])
            slots[LONG] = engine.long_operation_name is not None
            if seen != last_seen or slots[LONG]:
                last_seen, last_progress, reported = seen, now, False
                self._progress_wall = time.time()
            elif not reported and now - last_progress > self._limit():
                reported = True
                self._report_own(now - last_progress)
            if self._watch is not None:
                self._watch.scan()
            why = self._requests.new() if self._requests is not None else None
            if why is not None and self.directory is not None:  # every rank dumps: the dumps show one moment
                self._dump_flight_recorder()  # first: `cadence hang --dump` waits for the stacks, written last
                dump_stacks(stacks_path(self.directory, self.rank), f"rank {self.rank} dumps on request: {why}")

    def _report_own(self, stalled: float) -> None:
        event, step = self.event, self.step
        message = (
            f"heartbeat: rank {self.rank} ({self.host}, pid {self.pid}) made no progress for {stalled:.1f} s "
            f"(timeout {self._limit():g} s): stuck in {event} at step {step}"
        )
        assert self.directory is not None  # set at fit start, before the watchdog starts
        dump = stacks_path(self.directory, self.rank)
        stacks = dump_stacks(dump, message)
        self._dump_flight_recorder()
        self.stalls.append({"rank": self.rank, "event": event, "step": step, "seconds": stalled,
                            "time": time.time(), "stacks": str(dump)})  # fmt: skip
        logger.error("%s; Python stacks (also in %s):\n%s", message, dump, stacks)
        if self.config.exit_on_stall:
            logger.error("heartbeat: ending rank %d with exit code %d", self.rank, self.config.exit_code)
            for handler in logging.getLogger().handlers + logger.handlers:
                handler.flush()
            sys.stderr.flush()
            os._exit(self.config.exit_code)
