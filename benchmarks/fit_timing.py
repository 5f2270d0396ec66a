"""Timing Cadence's fit against a reference loop, shared by the benchmarks.

`Windows`: a fit timed in its steady state, in windows of steps, with a timed reference block
between two windows (`mesh.py`: hand-written FSDP2 / TP rounds; `overhead.py`: raw-loop blocks). A run pays a `fit()`'s start and end once; timing windows inside one fit
keeps those out of the per-step figure, and neighbouring windows and blocks are close in time, so
the machine's drift cancels.

`Requester` and `InStepRequester`: what `--overlapped` and `--blocking` of `mesh.py` and
`deepspeed.py` register (`add_agreement_options`, `agreement_callbacks`). Without either, no
registered callback may raise a control request, and a fit on several ranks runs no agreement
per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class Windows:
    """A last callback that cuts a fit into windows of `steps` steps at `on_step_end` (or, with
    `cut_at_log_intervals`, a metrics collector that does, with no per-step hook).

    At each window's end it records the window (seconds per step), runs `reference()` (which
    returns its own seconds per step) until `rounds` of them ran, calls `align()` if given (e.g. a
    barrier of the ranks) and starts the next window. The first window, from the fit's start, is
    not recorded: fit `(rounds + 2) * steps` steps for `rounds` references with a window on either
    side of each.
    """

    requests_in_step = False
    raises_requests = False  # times; requests nothing
    order = 10**6  # after every other callback: a window holds each step's whole end

    def __init__(
        self, steps: int, rounds: int, reference: Callable[[], float], align: Callable[[], Any] | None = None
    ) -> None:
        self.steps, self.rounds, self.reference, self.align = steps, rounds, reference, align
        self.count, self.start = 0, None
        self.windows: list[float] = []
        self.references: list[float] = []

    def on_step_end(self, engine: Any) -> None:
        self.count += 1
        if self.count % self.steps:
            return
        self._cut()

    def cut_at_log_intervals(self, engine: Any) -> None:
        """Cut from a metrics collector instead of as a callback: no per-step hook of the harness.

        The engine runs its collectors at every log interval (`MetricStore.add_collector`), after
        the step's on_step_end hooks and before the interval's on_log: each window then holds
        `steps` whole steps and their intervals' work, and Cadence's side carries nothing per step
        that a user's run would not. `steps` must be a multiple of the engine's log interval.
        """
        interval = engine.config.log_interval
        if self.steps % interval:
            raise ValueError(f"Windows: {self.steps} steps is not a multiple of the log interval, {interval}")
        first = engine.state.step

        def collect() -> None:
            if (engine.state.step - first) % self.steps == 0:
                self._cut()

        engine.metrics.add_collector(collect)

    def _cut(self) -> None:
        if self.start is not None:
            self.windows.append((time.perf_counter() - self.start) / self.steps)
            if len(self.references) < self.rounds:
                self.references.append(self.reference())
        if self.align is not None:
            self.align()
        self.start = time.perf_counter()

    def ratios(self) -> list[float]:
        """Each reference against the mean of the windows on either side of it."""
        w = self.windows
        return [(w[i] + w[i + 1]) / 2 / ref for i, ref in enumerate(self.references)]


class Requester:
    """Declares that it may raise control requests outside the step, raises none, and has no hook.

    Registered, it makes a fit on several ranks agree the step's requests, sent after
    `on_step_start` and awaited before the optimizer step, as any callback that may request
    (`Preemption`, `EarlyStopping`, a user's own) does.
    """

    raises_requests = True
    requests_in_step = False


class InStepRequester:
    """Declares that it may raise control requests inside the step, and raises none.

    Registered, it makes the engine agree the step's requests blocking, after
    `on_before_optimizer_step`, instead of overlapped with forward and backward:
    the way every step ran before 2026-11-26, timed for comparison.
    """

    requests_in_step = True

    def on_before_optimizer_step(self, engine: Any) -> None:
        """Nothing: overriding an in-step hook, with the declaration above, is what counts."""


#: What each `--agreement` mode means, as the benchmarks print it.
AGREEMENTS = {
    "none": "none (no callback may request)",
    "overlapped": "overlapped (--overlapped)",
    "blocking": "before the optimizer step (--blocking)",
}


def add_agreement_options(parser: Any) -> None:
    """`--overlapped` / `--blocking` on an argparse parser, as `args.agreement` (default "none")."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--overlapped",
        dest="agreement",
        action="store_const",
        const="overlapped",
        help="Cadence with a callback that may request: its agreement, overlapped with forward and backward",
    )
    group.add_argument(
        "--blocking",
        dest="agreement",
        action="store_const",
        const="blocking",
        help="Cadence with its agreement before the optimizer step (not overlapped)",
    )
    parser.set_defaults(agreement="none")


def agreement_callbacks(agreement: str) -> list[Any]:
    """The callbacks that give Cadence's fit the agreement of mode `agreement` (one of `AGREEMENTS`)."""
    return {"none": [], "overlapped": [Requester()], "blocking": [InStepRequester()]}[agreement]
