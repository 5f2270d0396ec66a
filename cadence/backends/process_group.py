"""A backend's process group: started with the flight recorder on, under a long timeout until the first steps end.

A first `torch.compile`, a checkpoint load or a cold cache make the first
steps of a run much slower than the rest, on some ranks more than others,
and the others wait for them in a collective. One timeout cannot serve both:
long enough for the start, it leaves a hang in steady state undetected for as
long. So a backend takes two (`GroupSettings`): the group starts with
`init_timeout`, and `TimeoutSwitch` sets the steady `timeout` on the
backend's groups once the first `init_steps` steps of its first fit have
ended (the process group API: `ProcessGroup.set_timeout`, a public method of
torch's group object that sets the timeout of the collectives issued after
it, on gloo and NCCL; `torch.distributed.distributed_c10d._set_pg_timeout` is
its private wrapper).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import attrs
import torch.distributed as dist

from cadence.backends.attempt_store import attempt_store, shares_agent_store
from cadence.backends.device import resolve_device
from cadence.backends.flight_recorder import DEFAULT_ENTRIES, FlightRecorder
from cadence.engine.callback import Callback
from cadence.engine.order import Order

if TYPE_CHECKING:
    from cadence.engine.bus import Handle
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.backends")

#: What `torchrun` and `cadence.launch` set, and `init_process_group` reads.
REQUIRED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def _timedelta(value: timedelta | float | None, where: str) -> timedelta | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise TypeError(f"{where}: expected seconds (a number) or a timedelta, got {value!r}")
    result = value if isinstance(value, timedelta) else timedelta(seconds=float(value))
    if result <= timedelta(0):
        raise ValueError(f"{where} must be > 0 seconds, got {value!r}")
    return result


@attrs.frozen(kw_only=True)
class GroupSettings:
    """How a backend starts its process group, and its timeouts.

    Attributes:
        timeout: the collective timeout in steady state.
        init_timeout: the timeout while the group starts and until the first
            `init_steps` steps of the first fit have ended (compilation, a
            checkpoint load, warm-up); None: `timeout` throughout.
        init_steps: the steps `init_timeout` lasts (counted from the first fit's start).
        flight_recorder: entries of torch's flight recorder ring (0: off);
            a size set in the environment (`TORCH_FR_BUFFER_SIZE`) wins.
    """

    timeout: timedelta
    init_timeout: timedelta | None = None
    init_steps: int = 1
    flight_recorder: int = DEFAULT_ENTRIES

    @classmethod
    def build(
        cls,
        where: str,
        timeout: timedelta | float,
        init_timeout: timedelta | float | None = None,
        init_steps: int = 1,
        flight_recorder: int = DEFAULT_ENTRIES,
    ) -> GroupSettings:
        """Settings from seconds or timedeltas, checked; errors name `where` and the field."""
        steady = _timedelta(timeout, f"{where}.timeout")
        assert steady is not None
        first = _timedelta(init_timeout, f"{where}.init_timeout")
        for name, value in (("init_steps", init_steps), ("flight_recorder", flight_recorder)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "init_steps" else 0):
                bound = ">= 1" if name == "init_steps" else ">= 0 (0: off)"
                raise ValueError(f"{where}.{name} must be an int {bound}, got {value!r}")
        if first is not None and first < steady:
            raise ValueError(
                f"{where}.init_timeout ({first.total_seconds():g} s) is shorter than {where}.timeout "
                f"({steady.total_seconds():g} s): the first steps get the longer one; raise it or leave it unset"
            )
        return cls(timeout=steady, init_timeout=first, init_steps=init_steps, flight_recorder=flight_recorder)

    @classmethod
    def of(cls, where: str, config: Any) -> GroupSettings:
        """Settings from a backend config's `timeout`, `init_timeout`, `init_steps` and `flight_recorder`."""
        names = ("timeout", "init_timeout", "init_steps", "flight_recorder")
        return cls.build(where, **{name: getattr(config, name) for name in names})

    @property
    def first_timeout(self) -> timedelta:
        """The timeout the group starts with."""
        return self.init_timeout if self.init_timeout is not None else self.timeout


def start_group(group_backend: str, settings: GroupSettings, device: str | None) -> FlightRecorder:
    """`init_process_group` from the launcher's environment, the flight recorder on before it; returns the recorder.

    `device` is the backend's requested device (`cadence.backends.device.resolve_device`). Under torchrun's
    shared store the group's keys go under a prefix fresh for this attempt (`cadence.backends.attempt_store`):
    a restart would otherwise read the failed attempt's addresses.
    """
    missing = [name for name in REQUIRED_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"DDPBackend: no process group is initialized and the environment lacks {missing}. "
            "Start the script with `torchrun --nproc_per_node N script.py`, call `cadence.launch(fn, nprocs=N)`, "
            "or call torch.distributed.init_process_group yourself first."
        )
    recorder = FlightRecorder.enable(settings.flight_recorder)
    kwargs: dict[str, Any] = {}
    resolved = resolve_device(device, process_group=group_backend)
    if group_backend == "nccl" and resolved.type == "cuda":  # bound to this rank's GPU: NCCL starts eagerly on it
        kwargs["device_id"] = resolved
    if shares_agent_store():
        kwargs["rank"], kwargs["world_size"] = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        kwargs["store"] = attempt_store(kwargs["rank"], kwargs["world_size"], settings.first_timeout)
    dist.init_process_group(group_backend, timeout=settings.first_timeout, **kwargs)
    return recorder


class TimeoutSwitch(Callback):
    """Sets a backend's steady timeout on its groups once the first steps have ended.

    The backend arms it at its first step plan when `init_timeout` is set and
    it created the group; it then listens to `on_step_end` until the
    `init_steps`-th step has ended, sets `timeout` on every group the backend
    names (`ProcessGroup.set_timeout`: the collectives issued from then on),
    and unregisters itself. Until then `engine.callbacks` shows it.

    Args:
        settings: the backend's settings.
        groups: the groups to switch, asked at the switch (groups created
            meanwhile, such as an agreement group, are included).
    """

    order = Order.HEARTBEAT
    raises_requests = False
    requests_in_step = False

    def __init__(self, settings: GroupSettings, groups: Callable[[], Iterable[Any]]) -> None:
        self.settings, self.groups = settings, groups
        #: The timeout in force: `init_timeout` until the switch, then `timeout`.
        self.current = settings.first_timeout
        self.steps = 0
        self._handle: Handle | None = None

    def arm(self, engine: Engine) -> TimeoutSwitch:
        """Register on `engine` (once), unless the steady timeout is already in force; returns itself."""
        if self.current != self.settings.timeout and self._handle is None:
            self._handle = engine.add_callback(self)
        return self

    def on_step_end(self, engine: Engine) -> None:
        self.steps += 1
        if self.steps < self.settings.init_steps:
            return
        for group in self.groups():
            group.set_timeout(self.settings.timeout)
        self.current = self.settings.timeout
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
        logger.info(
            "process group timeout: %g s from now on (%g s until step %d ended)",
            self.settings.timeout.total_seconds(),
            self.settings.first_timeout.total_seconds(),
            engine.state.step,
        )
