"""Control requests that callbacks raise and all ranks agree on."""

from __future__ import annotations

from typing import Any

from cadence.engine.bus import CadenceError
from cadence.engine.events import Event

#: The events inside a step, between the agreement's start (after `on_step_start`)
#: and its end (before the optimizer step).
IN_STEP_EVENTS = (Event.ON_BATCH, Event.ON_FORWARD, Event.ON_BACKWARD, Event.ON_BEFORE_OPTIMIZER_STEP)


class RequestTimingError(CadenceError, RuntimeError):
    """A control request raised inside a step whose requests were already sent for agreement."""


class Requests:
    """Pending control requests, agreed across ranks once per step.

    A callback never branches the loop on its own rank: it raises a request
    (`skip` this optimizer step, `stop`, `save` now, or one it registers), and
    the backend agrees on every request with one MAX all-reduce over a small
    integer vector, so every rank sees the same values at the same step.

    Values are non-negative ints: 0 means "not requested"; a callback may use a
    larger value to carry information (MAX keeps the largest, so encoding
    `world_size - rank` makes the lowest requesting rank win).

    After agreement, `agreed[name]` (and `engine.agreed(name)`) hold the values
    every rank saw; `pending` is cleared.

    When the agreement is overlapped (no callback requests inside the step),
    what is pending after `on_step_start` is sent then and agreed before the
    optimizer step; `in_step` is True in between, and a request raised then is
    a `RequestTimingError`. When no registered callback raises requests at all
    (`Callback.raises_requests`), a fit on several ranks agrees nothing per
    step; `closed` is True during it, and any request is a `RequestTimingError`.
    """

    BUILTIN = ("skip", "stop", "save")

    def __init__(self) -> None:
        self.names: list[str] = list(self.BUILTIN)
        self.index: dict[str, int] = {n: i for i, n in enumerate(self.names)}
        self.pending: list[int] = [0] * len(self.names)
        self.agreed: list[int] = [0] * len(self.names)
        self.any_pending = False
        # Whether `agreed` holds a non-zero value: with nothing pending and
        # nothing agreed, a single process has nothing to do at agreement.
        self.any_agreed = False
        self.reasons: dict[str, str] = {}
        self.checks: set[int] = set()  # slots registered with decision=False
        # True between an overlapped agreement's start and its end.
        self.in_step = False
        # True during a fit on several ranks that agrees nothing per step (no
        # registered callback raises requests): a request would never be agreed.
        self.closed = False

    def register(self, name: str, *, decision: bool = True) -> int:
        """Add a request kind (idempotent); returns its slot.

        `decision=False`: the slot carries a value every rank compares, not a
        decision (`CollectiveGuard`'s hash); `decisions()` leaves it out.
        """
        if name not in self.index:
            self.index[name] = len(self.names)
            self.names.append(name)
            self.pending.append(0)
            self.agreed.append(0)
        if not decision:
            self.checks.add(self.index[name])
        return self.index[name]

    def decisions(self) -> tuple[int, ...]:
        """The agreed values of the decision slots (what the ranks decided, the same at any world size)."""
        return tuple(value for slot, value in enumerate(self.agreed) if slot not in self.checks)

    def request(self, name: str, value: int = 1, reason: str | None = None) -> None:
        try:
            slot = self.index[name]
        except KeyError:
            raise KeyError(f"unknown control request {name!r}; known: {self.names}. Register it first.") from None
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"request {name!r}: value must be an int >= 1, got {value!r}")
        if self.closed:
            raise RequestTimingError(
                f"control request {name!r} raised in a fit that agrees no requests across ranks: every registered "
                "callback declares `raises_requests = False` and none was pending when the fit started, so no step "
                "runs an agreement. Raise it from a callback that does not declare `raises_requests = False` (the "
                "default None, or True), or before the fit starts (it is then agreed at the fit's first step)"
            )
        if self.in_step:
            raise RequestTimingError(
                f"control request {name!r} raised inside the step ({', '.join(e.value for e in IN_STEP_EVENTS)}), after this "
                "step's requests were sent for agreement: no registered callback declares `requests_in_step`, so "
                "the agreement is overlapped with the forward and backward. Set `requests_in_step = True` on the "
                "callback that raises it (every step then waits for the agreement before the optimizer step), or "
                "raise it in on_step_start or after the optimizer step (it is then agreed in the next step)"
            )
        self.pending[slot] = max(self.pending[slot], value)
        self.any_pending = True
        if reason is not None:
            self.reasons[name] = reason

    def accept(self, agreed: list[int]) -> None:
        """Take the agreed values (from the backend) and clear what was pending."""
        self.agreed[:] = agreed
        self.any_agreed = any(agreed)
        if self.any_pending:
            self.pending[:] = [0] * len(self.pending)
            self.any_pending = False

    def clear_agreed(self) -> None:
        self.agreed[:] = [0] * len(self.agreed)
        self.any_agreed = False

    def get(self, name: str) -> int:
        return self.agreed[self.index[name]]

    def state_dict(self) -> dict[str, Any]:
        """The requests raised and not agreed yet, by name, with their reasons."""
        pending = {name: value for name, value in zip(self.names, self.pending) if value}
        return {"pending": pending, "reasons": {n: r for n, r in self.reasons.items() if n in pending}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make exactly `state`'s requests pending (registering their kinds); nothing else."""
        self.pending[:] = [0] * len(self.pending)
        self.any_pending = False
        reasons = state.get("reasons", {})
        for name, value in state.get("pending", {}).items():
            self.register(name)
            self.request(name, value, reasons.get(name))
