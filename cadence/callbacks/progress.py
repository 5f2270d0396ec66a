"""A progress bar (tqdm.auto: terminal or notebook) with periodic log lines as the fallback."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any, Literal

import attrs

from cadence.callbacks.metrics import LineThrottle, is_main
from cadence.engine.bus import Handle
from cadence.engine.callback import Callback
from cadence.engine.events import Event
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine


@attrs.define(kw_only=True)
class ProgressBarConfig:
    """How `ProgressBar` shows progress.

    Attributes:
        mode: `bar` (tqdm), `lines` (periodic text lines) or `auto`:
            a bar in a terminal or notebook, lines when the output is a file or pipe.
        metrics: logged names shown in the postfix / lines, when present.
        leave: keep the finished bar on screen.
        refresh_interval: in bar mode, redraw the bar at most once per this many
            seconds (tqdm's `mininterval`, whose own default is 0.1; the postfix
            is formatted as often). Each redraw formats the whole line and writes
            it to the terminal: about 0.6 ms on the reference machine, so five a
            second cost a tiny CPU step (W1) about 0.3% where ten cost 0.6%.
        line_interval: in lines mode, at most one training line per this many
            seconds (evaluation results and the fit's last state are always
            written); 0 writes a line at every log interval.
    """

    mode: Literal["auto", "bar", "lines"] = "auto"
    metrics: tuple[str, ...] = (
        "loss",
        "val.loss",
        "throughput.samples_per_sec",
        "throughput.tokens_per_sec",
    )
    leave: bool = True
    refresh_interval: float = attrs.field(default=0.2, validator=attrs.validators.gt(0))
    line_interval: float = attrs.field(default=10.0, validator=attrs.validators.ge(0))


class ProgressBar(Callback):
    """Shows the fit's progress on the main process.

    Step mode (`fit(steps=...)` or a step target): one bar over the steps,
    from `state.step` (a resumed run starts where it stopped) to the target.
    Epoch mode: one bar per epoch over its steps (`len(loader) / grad_accum`),
    starting at the steps already done in that epoch. The postfix shows the
    loss and throughput of the last `on_log` (formatted at most as often as
    tqdm redraws, and at every evaluation). The bar counts each step while
    steps are slow; once a log interval's steps take less than
    `per_step_below` seconds (a quarter second: the bar then moves at least
    four times a second anyway), it moves at each `on_log` instead and costs no
    call per step, until an interval is slow again. When the output is not a
    terminal (and not a notebook), it writes text lines instead: at most one
    training line per `line_interval` seconds (a log or CI console needs no
    more, and every write to a pipe wakes its reader), every evaluation's
    line, and the fit's last logged state when the fit ends.

    Args:
        config: a `ProgressBarConfig` (or mapping); or its fields as keywords.
        stream: where to write (default `sys.stderr`).

    Order: `Order.PROGRESS` (95).

    Example:
        >>> import io, torch, cadence
        >>> from cadence.callbacks.progress import ProgressBar
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 4
        >>> out = io.StringIO()
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...                         loss_fn=torch.nn.functional.mse_loss,
        ...                         callbacks=[ProgressBar(mode="bar", stream=out)], seed=0)
        >>> engine.fit(steps=3)
        >>> "3/3" in out.getvalue()
        True
    """

    order = Order.PROGRESS
    raises_requests = False
    #: A log interval faster than this (seconds) moves the bar at `on_log`, with no call per step.
    per_step_below = 0.25

    def __init__(
        self,
        config: ProgressBarConfig | Mapping[str, Any] | None = None,
        *,
        stream: IO[str] | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = config_module.configure(ProgressBarConfig, config, kwargs, "ProgressBar")
        self.stream = stream
        self.bar: Any = None  # the tqdm bar while one is open
        self._active = False
        self._lines = False
        self._in_eval = False
        self._postfix: dict[str, str] = {}  # what the bar shows, formatted
        self._unshown: dict[str, Any] = {}  # values logged since, formatted when the bar may redraw
        self._postfix_at = -math.inf
        self._fit_start = 0.0
        self._fit_start_step = 0
        self._throttle = LineThrottle(self.config.line_interval)
        self._open_handle: Handle | None = None  # opens the bar at the next step's start
        self._update_handle: Handle | None = None  # counts each step on the bar, while steps are slow
        self._last_log = 0.0  # when the last training on_log came (the pace of the steps)
        self._opened_at = (0, 0)  # the open bar's first position and the step it opened at

    # -- setup ------------------------------------------------------------------

    def on_fit_start(self, engine: Engine) -> None:
        self._active = is_main(engine)
        self._lines = self._active and self._use_lines()
        self._fit_start, self._fit_start_step = time.perf_counter(), engine.state.step
        self._last_log = self._fit_start
        self._throttle.reset()
        if self._active and not self._lines:
            # Per-step work only when a bar is shown: lines and other ranks cost no call per step.
            self._open_at_next_step(engine)
            self._count_each_step(engine, True)  # until the first interval shows the pace

    def _use_lines(self) -> bool:
        if self.config.mode != "auto":
            return self.config.mode == "lines"
        if _in_notebook() or _is_widget(_bar_class()):  # a widget, or a text bar Jupyter draws
            return False
        isatty = getattr(self._stream(), "isatty", None)
        return not (callable(isatty) and isatty())

    def _stream(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stderr

    # -- per step ---------------------------------------------------------------

    def _open_at_next_step(self, engine: Engine) -> None:
        if self._open_handle is None:
            self._open_handle = engine.add_handler(Event.ON_STEP_START, self._step_start, order=self.order)

    def _step_start(self, engine: Engine) -> None:
        # At a step, not at on_fit_start: a checkpoint restored there has moved the
        # step. Then this handler goes, so a step costs only the bar's update.
        self._open(engine)
        assert self._open_handle is not None
        self._open_handle.remove()
        self._open_handle = None

    def _step_end(self, engine: Engine) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def _count_each_step(self, engine: Engine, each: bool) -> None:
        """Count every step on the bar (`each`), or only catch it up at each `on_log`."""
        if each and self._update_handle is None:
            self._update_handle = engine.add_handler(Event.ON_STEP_END, self._step_end, order=self.order)
        elif not each and self._update_handle is not None:
            self._update_handle.remove()
            self._update_handle = None

    def _catch_up(self, engine: Engine) -> None:
        """Move the bar to the steps done, the ones it did not count one by one."""
        if self.bar is not None:
            # Counted from the bar's opening: at on_epoch_end the epoch's batch count is already reset.
            behind = self._opened_at[0] + engine.state.step - self._opened_at[1] - self.bar.n
            if behind > 0:
                self.bar.update(behind)

    def on_epoch_end(self, engine: Engine) -> None:
        if self.bar is not None and self._epoch_mode(engine):
            self._catch_up(engine)
            self._close()  # one bar per epoch: the next opens at the next epoch's first step
            self._open_at_next_step(engine)

    # -- per log ----------------------------------------------------------------

    def on_eval_start(self, engine: Engine) -> None:
        self._in_eval = True

    def on_eval_end(self, engine: Engine) -> None:
        self._in_eval = False

    def on_log(self, engine: Engine) -> None:
        if not self._active:
            return
        values = {name: engine.logged[name] for name in self.config.metrics if name in engine.logged}
        if self._lines:
            self._offer_line(engine, values)
            return
        self._unshown.update(values)
        now = time.perf_counter()
        if self.bar is not None:
            # Formatted at most as often as tqdm redraws (refresh_interval), not at every log:
            # a redraw shows values at most that old, and every evaluation's at once.
            if self._in_eval or now - self._postfix_at >= self.config.refresh_interval:
                self._show_postfix()
                self._postfix_at = now
            self._catch_up(engine)  # draws the postfix with the steps, when tqdm's interval allows
        if not self._in_eval:
            self._count_each_step(engine, now - self._last_log >= self.per_step_below)
            self._last_log = now

    def _show_postfix(self) -> None:
        if self._unshown:
            self._postfix.update({name: format_value(value) for name, value in self._unshown.items()})
            self._unshown.clear()
        if self.bar is not None and self._postfix:
            # In the order of `metrics`; what does not fit the terminal is left out from the end, whole:
            # tqdm would cut the line, and a cut number reads as another one (`2.553e+04` as `2.553`).
            shown = [(short_name(name), self._postfix[name]) for name in self.config.metrics if name in self._postfix]
            while True:  # separated by spaces, as in the text lines (tqdm's own ", " costs columns)
                self.bar.set_postfix_str(" ".join(f"{name}={value}" for name, value in shown), refresh=False)
                if not shown or _fits(self.bar):
                    break
                shown.pop()

    def _offer_line(self, engine: Engine, values: dict[str, Any]) -> None:
        state, now, in_eval = engine.state, time.perf_counter(), self._in_eval
        step, epoch, target = state.step, state.epoch, engine.fit_target
        # Formatted only if written (a throttled line costs a closure).
        self._throttle.offer(lambda: self._write(self._line(step, epoch, target, in_eval, values, now)), always=in_eval)

    def _write(self, text: str) -> None:
        stream = self._stream()
        stream.write(text)
        stream.flush()

    def _line(
        self, step: int, epoch: int, target: tuple[float, float], in_eval: bool, values: dict[str, Any], now: float
    ) -> str:
        stop_step, stop_epoch = target
        where = f"step {step}" + (f"/{stop_step}" if math.isfinite(stop_step) else "")
        where += f" epoch {epoch}" + (f"/{stop_epoch}" if math.isfinite(stop_epoch) else "")
        if in_eval:
            where += " eval"
        elapsed = now - self._fit_start
        done = step - self._fit_start_step
        timing = f"elapsed {_clock(elapsed)}"
        if done > 0 and math.isfinite(stop_step):
            timing += f" eta {_clock(elapsed / done * max(0, stop_step - step))}"
        metrics = " ".join(f"{short_name(k)}={format_value(v)}" for k, v in values.items())
        return f"{where} | {metrics} | {timing}\n" if metrics else f"{where} | {timing}\n"

    # -- the bar ----------------------------------------------------------------

    def _epoch_mode(self, engine: Engine) -> bool:
        stop_step, stop_epoch = engine.fit_target
        return not math.isfinite(stop_step) and math.isfinite(stop_epoch)

    def _open(self, engine: Engine) -> None:
        tqdm = _bar_class()
        state = engine.state
        stop_step, stop_epoch = engine.fit_target
        if self._epoch_mode(engine):  # the bar stands at the steps done in the epoch
            position = math.ceil(state.batch_in_epoch / engine.config.grad_accum)
            total = steps_per_epoch(engine)
            desc = f"epoch {state.epoch + 1}/{int(stop_epoch)}"
        else:
            position = state.step
            total = int(stop_step) if math.isfinite(stop_step) else None
            desc = "train"
        self._opened_at = (position, state.step)
        self.bar = tqdm(
            total=total,
            initial=self._opened_at[0],
            desc=desc,
            unit="step",
            file=self._stream(),
            leave=self.config.leave,
            dynamic_ncols=True,
            mininterval=self.config.refresh_interval,
        )
        self._show_postfix()

    def _close(self) -> None:
        if self.bar is not None:
            self._show_postfix()  # the last values logged, in the bar's last state
            self.bar.close()
            self.bar = None

    def on_fit_end(self, engine: Engine) -> None:
        self._throttle.flush()  # the fit's last logged state
        self._catch_up(engine)
        self._close()

    def on_teardown(self, engine: Engine) -> None:
        self._close()
        for handle in (self._open_handle, self._update_handle):
            if handle is not None:
                handle.remove()
        self._open_handle = self._update_handle = None
        self._in_eval = False


def steps_per_epoch(engine: Engine) -> int | None:
    """Optimizer steps in one epoch of training data (None when its length is unknown)."""
    source = engine.data.get("train")
    if source is None or not source.has_len():
        return None
    return math.ceil(len(source) / engine.config.grad_accum)


def short_name(name: str) -> str:
    """`throughput.samples_per_sec` -> `samples/s`; other names unchanged."""
    if name.startswith("throughput."):
        name = name[len("throughput.") :]
    return name.replace("_per_sec", "/s")


def _bar_class() -> Any:
    """tqdm.auto's bar: a widget in a notebook with ipywidgets, tqdm's text bar elsewhere.

    In a notebook without ipywidgets tqdm.auto warns at import (`TqdmWarning: IProgress
    not found`) and gives its text bar: the bar Cadence wants there (Jupyter draws its
    carriage returns), so the warning, which the user did not cause, is left out.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        from tqdm import auto
    return auto.tqdm


def _in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (notebook, JupyterLab, VS Code): output shows as it is drawn."""
    return "ipykernel.zmqshell" in sys.modules


def _is_widget(cls: type) -> bool:
    return any(base.__module__ == "tqdm.notebook" for base in cls.__mro__)


def _fits(bar: Any) -> bool:
    """Whether the bar's line, with its postfix and a bar at least one cell wide, fits its terminal."""
    from tqdm.utils import disp_len

    state = bar.format_dict  # measures the terminal again under dynamic_ncols
    ncols = state["ncols"]
    if not ncols:
        return True
    if state["total"]:  # ncols=0: the line without its bar and the bar's two edges
        return disp_len(bar.format_meter(**{**state, "ncols": 0})) + 3 <= ncols
    return disp_len(bar.format_meter(**{**state, "ncols": None})) <= ncols


_UNITS = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def format_value(value: Any) -> str:
    """A logged value, short: 4 significant digits, and from 10,000 on in human units (`25.5k`, `1.2M`)."""
    if isinstance(value, float):
        if math.isfinite(value) and abs(value) >= 1e4:  # where `.4g` turns to `2.553e+04`
            suffix, scale = next((unit for unit in _UNITS if abs(value) >= unit[1]), _UNITS[-1])
            return f"{value / scale:.3g}{suffix}"
        return f"{value:.4g}"
    return str(value)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


__all__ = ["ProgressBar", "ProgressBarConfig"]
