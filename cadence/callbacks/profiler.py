"""`torch.profiler` on a schedule, with each event in a named range while it records."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from cadence.engine.callback import Callback
from cadence.engine.events import Event
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence")

_ge0 = attrs.validators.ge(0)


@attrs.define(kw_only=True)
class ProfilerConfig:
    """When and what `Profiler` records.

    A cycle is `wait` idle steps, `warmup` steps (profiling, results dropped),
    then `active` recorded steps; `repeat` cycles (0: until the run ends),
    the first starting at global step `start_step`.

    Attributes:
        wait: idle steps at the start of each cycle.
        warmup: steps profiled but dropped, so the recorded ones are steady.
        active: steps recorded per cycle (one trace file per cycle and rank).
        repeat: cycles (0: repeat until the end of the run).
        start_step: the global step at which the first cycle starts.
        dir: where traces go; None: `run_dir/profiler/`.
        record_shapes: record operator input shapes.
        profile_memory: track tensor allocations.
        with_stack: record Python stacks (large traces).
        use_gzip: write `.json.gz` traces.
        memory_snapshot: record the CUDA caching allocator's history while a cycle records and
            dump it (`memory_snapshot_step<N>.pickle`, next to the traces; open it at
            https://pytorch.org/memory_viz) at the end of the cycle; skipped, with a logged reason,
            when the engine's device is not CUDA.
    """

    wait: int = attrs.field(default=1, validator=_ge0)
    warmup: int = attrs.field(default=1, validator=_ge0)
    active: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    repeat: int = attrs.field(default=1, validator=_ge0)
    start_step: int = attrs.field(default=0, validator=_ge0)
    dir: str | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    use_gzip: bool = False
    memory_snapshot: bool = False


class Profiler(Callback):
    """Profiles training steps with `torch.profiler` and writes Chrome/Perfetto traces.

    The profiler starts at `on_fit_start` and steps at `on_step_end`, first of
    all callbacks (`Order.PROFILER` = 0), so `ProfilerStep#k` spans one whole
    step, k counted from the fit's start. Traces go to `run_dir/profiler/` through
    `tensorboard_trace_handler` (`<worker>.<time>.pt.trace.json`: TensorBoard's
    profiler plugin and https://ui.perfetto.dev open them). While it warms up
    or records, every event dispatch runs inside
    `torch.profiler.record_function("on_step_end")` etc. (through the bus's
    `instrument`); otherwise the bus runs unwrapped, and once the last cycle
    is written the profiler is stopped and costs nothing.

    Order: `Order.PROFILER` (0).

    Example:
        >>> from cadence.callbacks.profiler import Profiler
        >>> Profiler(wait=2, warmup=1, active=2, start_step=10).config.active
        2
    """

    order = Order.PROFILER
    raises_requests = False

    def __init__(self, config: ProfilerConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(ProfilerConfig, config, kwargs, "Profiler")
        self.profiler: Any = None
        self.trace_dir: Path | None = None
        self._engine: Engine | None = None
        self._instrumented = False
        self._last_step = 0  # the global step after which no cycle records (inf-like when repeat=0)
        self._snapshot_recording = False
        self._cuda = False  # whether the engine trains on CUDA (decided at fit start)

    # -- lifecycle ---------------------------------------------------------------

    def on_fit_start(self, engine: Engine) -> None:
        config = self.config
        cycle = config.wait + config.warmup + config.active
        if config.repeat and engine.state.step >= config.start_step + cycle * config.repeat:
            return  # every cycle already ran (a later fit, or a resume past them)
        self.trace_dir = Path(config.dir) if config.dir else engine.run_dir / "profiler"
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        base = torch.profiler.schedule(
            wait=config.wait,
            warmup=config.warmup,
            active=config.active,
            repeat=config.repeat,
            skip_first=0,
        )
        offset = engine.state.step - config.start_step  # the profiler counts from 0 at this fit's start

        def schedule(step: int) -> torch.profiler.ProfilerAction:
            global_step = step + offset
            return base(global_step) if global_step >= 0 else torch.profiler.ProfilerAction.NONE

        # CUDA kernels and memory only when the engine trains on CUDA: a CPU run on a GPU host
        # leaves CUDA uninitialized (its processes may fork workers afterwards).
        self._cuda = engine.backend.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        rank = engine.backend.rank
        self._engine = engine
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self._trace_ready(rank),
            record_shapes=config.record_shapes,
            profile_memory=config.profile_memory,
            with_stack=config.with_stack,
        )
        self.profiler.start()
        self._sync_instrument(engine)

    def on_step_end(self, engine: Engine) -> None:
        profiler = self.profiler
        if profiler is None:
            return
        profiler.step()
        self._sync_instrument(engine)
        config = self.config
        if config.repeat:
            cycle = config.wait + config.warmup + config.active
            if engine.state.step >= config.start_step + cycle * config.repeat:
                self._stop(engine)  # every cycle is written: stop paying for the profiler

    def on_fit_end(self, engine: Engine) -> None:
        self._stop(engine)

    def on_teardown(self, engine: Engine) -> None:
        self._stop(engine)

    # -- helpers ----------------------------------------------------------------

    def _recording(self) -> bool:
        action = self.profiler.current_action if self.profiler is not None else None
        return action in (
            torch.profiler.ProfilerAction.WARMUP,
            torch.profiler.ProfilerAction.RECORD,
            torch.profiler.ProfilerAction.RECORD_AND_SAVE,
        )

    def _sync_instrument(self, engine: Engine) -> None:
        recording = self._recording()
        if recording != self._instrumented:
            engine.instrument(_record_function if recording else None)
            self._instrumented = recording
        if self.config.memory_snapshot:
            self._memory_history(recording)

    def _memory_history(self, recording: bool) -> None:
        if not self._cuda:
            if recording and not self._snapshot_recording:
                logger.info(
                    "Profiler: memory_snapshot skipped: the engine's device is not CUDA (it records CUDA allocations)"
                )
                self._snapshot_recording = True  # say it once per cycle
            elif not recording:
                self._snapshot_recording = False
            return
        if recording and not self._snapshot_recording:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._snapshot_recording = True

    def _trace_ready(self, rank: int) -> Any:
        handler = torch.profiler.tensorboard_trace_handler(
            str(self.trace_dir), worker_name=f"rank{rank}", use_gzip=self.config.use_gzip
        )

        def ready(profiler: Any) -> None:
            handler(profiler)
            if self._snapshot_recording and self._cuda and self.trace_dir is not None:
                step = self._engine.state.step if self._engine is not None else profiler.step_num
                torch.cuda.memory._dump_snapshot(str(self.trace_dir / f"memory_snapshot_step{step}.pickle"))
                torch.cuda.memory._record_memory_history(enabled=None)
                self._snapshot_recording = False

        return ready

    def _stop(self, engine: Engine) -> None:
        if self._instrumented:
            engine.instrument(None)
            self._instrumented = False
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.stop()  # writes a trace cut short by the end of the fit
        if self._snapshot_recording and self._cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
        self._snapshot_recording = False
        self._engine = None

    def traces(self) -> list[Path]:
        """The trace files written so far."""
        if self.trace_dir is None or not self.trace_dir.exists():
            return []
        return sorted(self.trace_dir.glob("*.pt.trace.json*"))


def _record_function(event: Event) -> Any:
    # Looked up on every call, so a patched torch.profiler.record_function is seen.
    return torch.profiler.record_function(event.value)


__all__ = ["Profiler", "ProfilerConfig"]
