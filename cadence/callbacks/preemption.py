"""Turn a preemption signal into an agreed checkpoint, a clean stop and exit code 143."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from cadence.engine.callback import Callback
from cadence.engine.order import Order
from cadence.run import config as config_module
from cadence.run import registry

if TYPE_CHECKING:
    from types import FrameType

    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.preemption")

_REQUEST = "preempt"


@attrs.define(kw_only=True)
class PreemptionConfig:
    """Which signals mean "preempted" and what happens then.

    Attributes:
        signals: signal names to handle; None: SIGTERM, plus SIGUSR1 under SLURM
            (`SLURM_JOB_ID` set; ask for it with `sbatch --signal=USR1@120`).
        exit: end the process with `exit_code` once the run has stopped (a
            `SystemExit` raised after teardown); False: `fit` just returns
            and `callback.preempted` is True.
        exit_code: 143 (128 + SIGTERM), what schedulers expect of a terminated job.
        requeue: put the job back in the SLURM queue (`cadence.launch.slurm_requeue`);
            None: when running under SLURM or submitit.
    """

    signals: list[str] | None = None
    exit: bool = True
    exit_code: int = 143
    requeue: bool | None = None


class Preemption(Callback):
    """Saves a checkpoint and stops every rank at the same step when the job is preempted.

    At fit start (from the main thread only; elsewhere it warns and does
    nothing) it installs handlers for the preemption signals, keeping the
    previous ones: each signal still reaches the previous handler if that is
    a Python function, and the previous handlers are put back at teardown.
    The handler only sets a flag. At the next step's start (or, when the
    step's agreement runs after `on_before_optimizer_step`, in that hook) the
    callback raises the "preempt" request (value `world_size - rank`, so the lowest
    signalled rank is known) with a `save` and a `stop` request; the step's
    agreement makes every rank see them at the same step, the `Checkpoint`
    callback (order 100) saves at that step's save point (after its
    evaluation, if one is due), the loop stops after it, and
    after teardown (Preemption's own teardown runs last among the built-ins)
    the process exits with `SystemExit(143)`, or first requeues under SLURM.
    Under submitit, `fit` returns instead, and the task requeues itself when
    the launched function returns.

    A signal that arrives after the last step of the run cannot be agreed
    anymore: the handlers are restored and the signal is raised again, so the
    process gets what it would have without this callback.

    Order: `Order.PREEMPTION` (110), after `Checkpoint`. Callbacks with an
    order above 110 do not get `on_teardown` when it exits the process.

    Example:
        >>> import torch, cadence
        >>> from cadence.callbacks import Preemption
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 3
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...     loss_fn=torch.nn.functional.mse_loss, callbacks=[Preemption(exit=False)], seed=0)
        >>> engine.fit(steps=3)
        >>> engine.callbacks[-1].preempted
        False
    """

    order = Order.PREEMPTION
    raises_requests = True  # requests `save` and `stop` on a signal
    # It requests in on_before_optimizer_step only when the step is agreed after it anyway.
    requests_in_step = False

    def __init__(self, config: PreemptionConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(PreemptionConfig, config, kwargs, "preemption")
        for name in self.config.signals or ():
            _signal_number(name)
        #: True once a preemption was agreed in the last fit.
        self.preempted = False
        #: The signal received (None if none) and the lowest rank that received one.
        self.received: int | None = None
        self.signal_rank: int | None = None
        self.step: int | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._handler = self._on_signal
        self._requested = False

    def signals(self) -> list[signal.Signals]:
        """The signals handled here (SIGUSR1 joins SIGTERM under SLURM)."""
        names = self.config.signals
        if names is None:
            names = ["SIGTERM", "SIGUSR1"] if os.environ.get("SLURM_JOB_ID") else ["SIGTERM"]
        return [_signal_number(n) for n in names]

    # -- handlers -------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the loop acts on it at a step boundary, on every rank at once.
        if self.received is None:
            self.received = signum
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):
            previous(signum, frame)

    def on_setup(self, engine: Engine) -> None:
        engine.requests.register(_REQUEST)

    def on_fit_start(self, engine: Engine) -> None:
        engine.requests.register(_REQUEST)
        self.preempted, self.received, self.signal_rank, self.step = False, None, None, None
        self._requested = False
        if not any(_is_checkpoint(cb) for cb in engine.callbacks):
            logger.warning("Preemption: no Checkpoint callback is registered; a preempted run will stop without saving")
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "Preemption: fit runs in thread %r, not the main thread; signal handlers can only be "
                "installed from the main thread, so preemption signals are not handled in this run",
                threading.current_thread().name,
            )
            return
        self._install()

    def _install(self) -> None:
        for sig in self.signals():
            if sig in self._previous:
                continue
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handler)

    def _restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) != self._handler:
                logger.warning("Preemption: the %s handler was replaced during the run; leaving it in place", sig.name)
                continue
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    # -- the loop -------------------------------------------------------------

    def on_step_start(self, engine: Engine) -> None:
        self._request(engine)  # before the step's agreement goes out

    def on_before_optimizer_step(self, engine: Engine) -> None:
        if not engine.requests.in_step:  # the step is agreed after this hook: a signal of this step still makes it
            self._request(engine)

    def _request(self, engine: Engine) -> None:
        if self.received is None or self._requested:
            return
        self._requested = True
        name = signal.Signals(self.received).name
        rank, world = engine.backend.rank, engine.backend.world_size
        engine.request(_REQUEST, world - rank, reason=f"{name} on rank {rank}")
        engine.request_save(f"preemption ({name})")
        engine.request_stop(f"preemption ({name})")

    def on_save_point(self, engine: Engine) -> None:
        value = engine.agreed(_REQUEST)
        if not value or self.preempted:
            return
        self.preempted, self.step = True, engine.state.step
        self.signal_rank = engine.backend.world_size - value
        if engine.backend.is_main:
            logger.warning(
                "preemption signal on rank %d: every rank stops after step %d (checkpoint saved at this step)",
                self.signal_rank,
                self.step,
            )

    def on_teardown(self, engine: Engine) -> None:
        self._restore()
        if not self.preempted:
            self._redeliver_late_signal()
            return
        requeue = self.config.requeue
        if requeue is None:
            requeue = "SLURM_JOB_ID" in os.environ or "SUBMITIT_FOLDER" in os.environ
        if requeue:
            from cadence.launch import slurm_requeue

            slurm_requeue()
            if "SUBMITIT_FOLDER" in os.environ:
                return  # the submitit task requeues itself when the launched function returns
        if self.config.exit:
            raise SystemExit(self.config.exit_code)

    def _redeliver_late_signal(self) -> None:
        """A signal that came too late to be agreed gets what it would have had without us.

        A previous Python handler was already called from ours; a default
        disposition (terminate) is applied now, with the handlers restored.
        """
        received, self.received = self.received, None
        if received is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(received) in (signal.SIG_DFL, None):
            logger.warning(
                "Preemption: %s arrived after the run's last step; raising it again with the default handler",
                signal.Signals(received).name,
            )
            signal.raise_signal(received)


def _signal_number(name: str) -> signal.Signals:
    try:
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except KeyError:
        available = ", ".join(s.name for s in signal.Signals)
        raise ValueError(f"preemption.signals: unknown signal {name!r}; available here: {available}") from None


def _is_checkpoint(callback: Any) -> bool:
    try:
        checkpoint = registry.callbacks.resolve("checkpoint")
    except ImportError:
        return False
    return isinstance(callback, checkpoint)
