"""`metrics.jsonl`: one JSON object per logged step, the record every other sink can be rebuilt from."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs

from cadence.callbacks.metrics import eval_split, is_main
from cadence.engine.callback import Callback
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine


@attrs.define(kw_only=True)
class JSONLConfig:
    """Where `JSONL` writes.

    Attributes:
        path: the file; None writes `metrics.jsonl` in the run directory.
        write_interval: lines are kept in memory and written (and flushed) at
            most every this many seconds, and always at evaluation results,
            checkpoint saves, the fit's end and teardown; 0 writes each line
            at once. A hard kill loses at most this much of the record.
    """

    path: str | None = None
    write_interval: float = attrs.field(default=2.0, validator=attrs.validators.ge(0))


class JSONL(Callback):
    """Appends one JSON object per `on_log` to `run_dir/metrics.jsonl` (main process only).

    Lines are written in batches (`write_interval`) and at every evaluation,
    checkpoint save, fit end and teardown.

    Training lines are `{"step", "epoch", "time", <metric>: value, ...}`;
    evaluation lines add `"split"` and carry split-prefixed names
    (`"val.loss"`). `time` is the Unix time of the log. Non-finite values
    are written as `NaN` / `Infinity` (Python's `json` reads them back).

    Resume: the file always describes the run as it continues. When the run
    starts (or a checkpoint is restored) at step k, the first write drops the
    lines after step k, and a line the resumed run writes again at step k
    itself (same split) is not duplicated.

    Order: `Order.LOGGER` (90).

    Example:
        >>> import json, torch, cadence
        >>> from cadence.callbacks.jsonl import JSONL
        >>> from cadence.callbacks.metrics import TrainMetrics
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 4
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...                         loss_fn=torch.nn.functional.mse_loss, log_interval=2,
        ...                         callbacks=[TrainMetrics(), JSONL(path="/tmp/doc.jsonl")], seed=0)
        >>> engine.fit(steps=4)
        >>> [json.loads(line)["step"] for line in open("/tmp/doc.jsonl")][-2:]
        [2, 4]
    """

    order = Order.LOGGER
    raises_requests = False

    def __init__(self, config: JSONLConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(JSONLConfig, config, kwargs, "JSONL")
        self.path: Path | None = None
        self._file: IO[str] | None = None
        self._first_open = True  # a process restart: the file may hold a previous attempt's lines
        self._start_step: int | None = None  # the step the run (re)started from
        self._rewritten: set[tuple[str, int]] = set()  # lines at the start step kept from before
        self._in_eval = False
        self._pending: list[dict[str, Any]] = []  # lines not written yet
        self._last_write = -math.inf

    def on_fit_start(self, engine: Engine) -> None:
        if self._first_open and self._start_step is None:
            self._start_step = engine.state.step

    def on_load(self, engine: Engine) -> None:
        # A checkpoint was restored: lines after its step are from a future that did not happen.
        self._pending.clear()
        self._close()
        self._start_step = engine.state.step

    def on_eval_start(self, engine: Engine) -> None:
        self._in_eval = True

    def on_eval_end(self, engine: Engine) -> None:
        self._in_eval = False

    def on_log(self, engine: Engine) -> None:
        if not is_main(engine) or not engine.logged:
            return
        state = engine.state
        line: dict[str, Any] = {"step": state.step, "epoch": state.epoch, "time": time.time()}
        if self._in_eval:
            line["split"] = eval_split(engine.logged)
        line.update(engine.logged)
        self._pending.append(line)
        now = time.perf_counter()
        # Serializing and writing a line costs more than the step it follows on a tiny
        # model (its code is cold by then): batch them, and write on intervals.
        if self._in_eval or now - self._last_write >= self.config.write_interval:
            self._write(engine)
            self._last_write = now

    def on_save(self, engine: Engine) -> None:
        if is_main(engine):
            self._write(engine)  # the record reaches the disk with every checkpoint

    def on_fit_end(self, engine: Engine) -> None:
        if is_main(engine):
            self._write(engine)

    def _write(self, engine: Engine) -> None:
        if not self._pending:
            return
        lines, self._pending = self._pending, []
        file = self._file or self._open(engine)  # the first open after a (re)start truncates
        text = []
        for line in lines:
            key = (line.get("split", "train"), line["step"])
            if key in self._rewritten:  # the resumed run's line at its start step is already there
                self._rewritten.discard(key)
                continue
            text.append(json.dumps(line) + "\n")
        file.write("".join(text))
        file.flush()

    def on_teardown(self, engine: Engine) -> None:
        if self._pending and is_main(engine):
            self._write(engine)  # also after an exception: what was logged is kept
        self._close()
        self._in_eval = False

    def _open(self, engine: Engine) -> IO[str]:
        path = Path(self.config.path) if self.config.path else engine.run_dir / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._first_open or self._start_step is not None:
            start = self._start_step if self._start_step is not None else engine.state.step
            self._rewritten = _truncate_after(path, start) if path.exists() else set()
        # Truncate once per start or restore, then append (fit twice continues the file).
        self._first_open, self._start_step = False, None
        self.path = path
        self._file = path.open("a", encoding="utf-8")
        return self._file

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _truncate_after(path: Path, step: int) -> set[tuple[str, int]]:
    """Drop the lines of `path` after `step`; return the (kind, step) keys kept at `step`."""
    kept, at_step, dropped = [], set(), False
    with path.open(encoding="utf-8") as fh:
        for text in fh:
            try:
                record = json.loads(text)
            except ValueError:
                dropped = True  # a line cut short by a crash
                continue
            if record.get("step", 0) > step:
                dropped = True
                continue
            if record.get("step") == step:
                at_step.add((record.get("split", "train"), step))
            if not text.endswith("\n"):
                dropped, text = True, text + "\n"  # rewrite, so the next line does not glue on
            kept.append(text)
    if not dropped:
        return at_step
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)
    return at_step


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl` file (a torn last line is skipped)."""
    records = []
    with Path(path).open(encoding="utf-8") as fh:
        for text in fh:
            try:
                records.append(json.loads(text))
            except ValueError:
                continue
    return records


__all__ = ["JSONL", "JSONLConfig", "read_jsonl"]
