"""Per-rank heartbeats and a stall watchdog that says who is stuck where."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
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

    In the loop each hooked event only writes three attributes (event name,
    step, a beat counter): no call, no I/O. Two daemon threads started at fit
    start and joined at teardown do the rest:

    - a writer puts `heartbeat/rank-{r}.json` (rank, host, pid, step, event,
      time of the last progress, time written) every `interval` seconds,
      atomically (write then rename);
    - a watchdog checks every `min(interval, timeout / 8)` seconds whether the
      beat counter moved. When it has not for `timeout` seconds
      (`first_timeout` until the fit's first step completes), it reports which
      rank is stuck in which event at which step and for how long, dumps every
      Python stack of the process with `faulthandler` to the log and to
      `heartbeat/stacks-rank-{r}.txt`, and with `exit_on_stall` ends the
      process with `exit_code` (`os._exit`: a stuck main thread cannot be
      unwound). On rank 0 it also reads the other ranks' files and reports
      any whose progress time is older than its timeout.

    The watchdog pauses while `engine.long_operation_name` is set (blocking
    checkpoint saves), so a long save is not a stall. Steps are numbered from
    1: "step 3" is the third optimizer step (`engine.state.step == 2` while it
    runs). A main thread stuck inside C code that holds the GIL also stops
    the watchdog thread: the files then stop updating and rank 0 reports the
    rank's file as stale instead.

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

    def __init__(self, config: HeartbeatConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(HeartbeatConfig, config, kwargs, "heartbeat")
        #: The hot-path record: last event, its 1-based step, a counter of events.
        self.event = ""
        self.step = 0
        self.beats = 0
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

    # -- the hot path: attribute writes only ----------------------------------

    def on_step_start(self, engine: Engine) -> None:
        self.event, self.step = "on_step_start", engine.state.step + 1
        self.beats += 1

    def on_batch(self, engine: Engine) -> None:
        self.event = "on_batch"
        self.beats += 1

    def on_forward(self, engine: Engine) -> None:
        self.event = "on_forward"
        self.beats += 1

    def on_backward(self, engine: Engine) -> None:
        self.event = "on_backward"
        self.beats += 1

    def on_before_optimizer_step(self, engine: Engine) -> None:
        self.event = "on_before_optimizer_step"
        self.beats += 1

    def on_optimizer_step(self, engine: Engine) -> None:
        self.event = "on_optimizer_step"
        self.beats += 1

    def on_step_end(self, engine: Engine) -> None:
        self.event, self.step = "on_step_end", engine.state.step
        self.completed = engine.state.step
        self.beats += 1

    def on_log(self, engine: Engine) -> None:
        self.event = "on_log"
        self.beats += 1

    def on_eval_start(self, engine: Engine) -> None:
        self.event = "on_eval_start"
        self.beats += 1

    def on_eval_batch(self, engine: Engine) -> None:
        self.event = "on_eval_batch"
        self.beats += 1

    def on_eval_end(self, engine: Engine) -> None:
        self.event = "on_eval_end"
        self.beats += 1

    def on_epoch_start(self, engine: Engine) -> None:
        self.event = "on_epoch_start"
        self.beats += 1

    def on_epoch_end(self, engine: Engine) -> None:
        self.event = "on_epoch_end"
        self.beats += 1

    # -- lifecycle ------------------------------------------------------------

    def on_fit_start(self, engine: Engine) -> None:
        self._shutdown()  # a fit that never tore down
        config = self.config
        self._engine = engine
        self.rank, self.world_size = engine.backend.rank, engine.backend.world_size
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.directory = Path(config.directory) if config.directory else engine.run_dir / "heartbeat"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.event, self.step, self.completed = "on_fit_start", engine.state.step, engine.state.step
        self.beats += 1
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
        self.event = "on_fit_end"
        self.beats += 1

    def on_teardown(self, engine: Engine) -> None:
        if self._shutdown():
            self.event = "on_teardown"
            self._write(finished=True)
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
        last_beats, last_progress, reported = -1, time.monotonic(), False
        while not self._stop.wait(poll):
            engine, now = self._engine, time.monotonic()
            if engine is None:
                return
            if self.beats != last_beats or engine.long_operation_name is not None:
                last_beats, last_progress, reported = self.beats, now, False
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
        stacks_path = self.directory / f"stacks-rank-{self.rank}.txt"  # type: ignore[operator]
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
        now = time.time()
        for rank in range(1, self.world_size):
            path = self.directory / f"rank-{rank}.json"  # type: ignore[operator]
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if record.get("finished") or record.get("long_operation") or record["written"] < self._fit_start_wall:
                continue
            limit = float(record.get("timeout", self.config.timeout))
            since_progress, since_written = now - record["time"], now - record["written"]
            key = (rank, record["step"], record["event"])
            if any(s.get("key") == key for s in self.stalls):
                continue
            if since_progress > limit:
                what = f"made no progress for {since_progress:.1f} s (timeout {limit:g} s)"
            elif since_written > limit + 2 * self.config.interval:
                what = f"has not written its heartbeat for {since_written:.1f} s (hung holding the GIL, or dead)"
            else:
                continue
            self.stalls.append({"rank": rank, "event": record["event"], "step": record["step"],
                                "seconds": since_progress, "time": now, "key": key})  # fmt: skip
            logger.error(
                "heartbeat: rank %d (%s, pid %s) %s: stuck in %s at step %d; its stacks: %s",
                rank,
                record["host"],
                record["pid"],
                what,
                record["event"],
                record["step"],
                self.directory / f"stacks-rank-{rank}.txt",  # type: ignore[operator]
            )
