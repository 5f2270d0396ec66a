"""Text logging through the standard `logging` module: a file in the run directory and the console."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs

from cadence.callbacks.metrics import LineThrottle, eval_split, is_main
from cadence.callbacks.progress import ProgressBar
from cadence.engine.callback import Callback
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

LOGGER = "cadence"
METRICS_LOGGER = "cadence.metrics"


@attrs.define(kw_only=True)
class TextLogConfig:
    """What `TextLog` writes where.

    Attributes:
        level: level of the `cadence` logger while a run is going on.
        file: write `run_dir/logs/{timestamp}.log`.
        console: add a console handler; None: only when the root logger has no
            handlers (otherwise your own logging setup already shows the records).
        console_metrics: also show the metric lines on the console; None: only
            when no `ProgressBar` is registered (the bar already shows them).
        format: the `logging.Formatter` format of both handlers.
        metrics: log metric lines to the `cadence.metrics` logger.
        metrics_interval: at most one training metric line per this many seconds
            (evaluation lines and the fit's last state are always logged); 0 logs
            one per `on_log`. `JSONL` keeps every logged step.
    """

    level: str = "INFO"
    file: bool = True
    console: bool | None = None
    console_metrics: bool | None = None
    format: str = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    metrics: bool = True
    metrics_interval: float = attrs.field(default=10.0, validator=attrs.validators.ge(0))

    def __attrs_post_init__(self) -> None:
        if not isinstance(logging.getLevelName(self.level.upper()), int):
            raise ValueError(f"TextLog: level must be a logging level name (DEBUG, INFO, ...), got {self.level!r}")


class TextLog(Callback):
    """Sends the `cadence` logger to a file in the run directory and the console.

    On the main process only, while a run (fit, evaluate, predict) is going on:
    the handlers are added when it starts and removed at teardown, so nothing
    leaks across fits or engines. The file is `run_dir/logs/{timestamp}.log`,
    one per callback instance (fits append to it). Each `on_log` becomes a
    line `step 50 epoch 0 | loss=0.1234 lr=0.001 ...` on `cadence.metrics`.

    Args:
        config: a `TextLogConfig` (or mapping); or its fields as keywords.
        stream: the console stream (default `sys.stderr`).

    Order: `Order.LOGGER` (90).

    Example:
        >>> from cadence.callbacks.text_log import TextLog
        >>> TextLog(level="DEBUG", console=False).config.level
        'DEBUG'
    """

    order = Order.LOGGER
    raises_requests = False

    def __init__(
        self, config: TextLogConfig | Mapping[str, Any] | None = None, *, stream: IO[str] | None = None, **kwargs: Any
    ) -> None:
        self.config = config_module.configure(TextLogConfig, config, kwargs, "TextLog")
        self.stream = stream
        self.path: Path | None = None
        self._handlers: list[logging.Handler] = []
        self._previous_level: int | None = None
        self._in_eval = False
        self._throttle = LineThrottle(self.config.metrics_interval)

    # -- install / remove ---------------------------------------------------------

    def on_fit_start(self, engine: Engine) -> None:
        self._install(engine)
        self._throttle.reset()

    def on_fit_end(self, engine: Engine) -> None:
        self._throttle.flush()  # the fit's last logged state

    def on_eval_start(self, engine: Engine) -> None:
        self._in_eval = True
        self._install(engine)

    def on_eval_end(self, engine: Engine) -> None:
        self._in_eval = False

    def on_predict_start(self, engine: Engine) -> None:
        self._install(engine)

    def on_teardown(self, engine: Engine) -> None:
        logger = logging.getLogger(LOGGER)
        for handler in self._handlers:
            logger.removeHandler(handler)
            handler.close()
        self._handlers = []
        if self._previous_level is not None:
            logger.setLevel(self._previous_level)
            self._previous_level = None
        self._in_eval = False

    def _install(self, engine: Engine) -> None:
        if self._handlers or not is_main(engine):
            return
        config = self.config
        logger = logging.getLogger(LOGGER)
        formatter = logging.Formatter(config.format)
        if config.file:
            if self.path is None:
                self.path = engine.run_dir / "logs" / f"{engine.attempt_timestamp}.log"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Opened at the first record: a run stopped before it logs anything leaves no empty file.
            file_handler = logging.FileHandler(self.path, encoding="utf-8", delay=True)
            file_handler.setFormatter(formatter)
            self._handlers.append(file_handler)
        console = config.console if config.console is not None else not logging.getLogger().handlers
        if console:
            console_handler = TqdmHandler(self.stream)
            console_handler.setFormatter(formatter)
            show_metrics = config.console_metrics
            if show_metrics is None:
                show_metrics = engine.callbacks.find(ProgressBar) is None
            if not show_metrics:
                console_handler.addFilter(_NotMetrics())
            self._handlers.append(console_handler)
        for handler in self._handlers:
            logger.addHandler(handler)
        self._previous_level = logger.level
        logger.setLevel(config.level.upper())

    # -- metric lines -------------------------------------------------------------

    def on_log(self, engine: Engine) -> None:
        if not self._handlers or not self.config.metrics:
            return
        state, logged, in_eval = engine.state, engine.logged, self._in_eval
        step, epoch = state.step, state.epoch
        self._throttle.offer(lambda: _log_metrics(step, epoch, logged, in_eval), always=in_eval)


class TqdmHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A console handler that writes through `tqdm.write`, so open progress bars stay intact."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


class _NotMetrics(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != METRICS_LOGGER


def _log_metrics(step: int, epoch: int, logged: dict[str, Any], in_eval: bool) -> None:
    where = f"step {step} epoch {epoch}" + (f" eval {eval_split(logged)}" if in_eval else "")
    metrics = " ".join(f"{name}={_format(value)}" for name, value in logged.items())
    logging.getLogger(METRICS_LOGGER).info("%s | %s", where, metrics)


def _format(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


__all__ = ["TextLog", "TextLogConfig", "TqdmHandler"]
