"""How a fit agrees its control requests across ranks, chosen once per fit.

The loop calls the chosen `Agreement` unconditionally at two points of every
step: `send(requests)` right after `on_step_start`, `take(requests)` right
before the optimizer step. Which one a fit gets (`choose`):

- `NoAgreement`: several ranks, but no registered callback may raise requests
  and none is pending: the step adds no collective (`Requests.closed`).
- `InlineAgreement`: one rank in the optimizer domain: what is pending is
  accepted as it is.
- `BlockingAgreement`: `backend.agree` at `take`; every rank waits there. Used
  while a callback requests inside the step (`Callback.requests_in_step`), or
  when the backend has no overlapped way.
- `OverlappedAgreement`: `backend.agree_start` at `send`, `backend.agree_finish`
  at `take`: the small all-reduce runs under forward and backward.

While no callback requests inside the step, `send` seals the step
(`Requests.in_step`): a request raised between the two points would miss the
agreement already sent, so it is refused with a `RequestTimingError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cadence.engine.control import IN_STEP_EVENTS

if TYPE_CHECKING:
    from cadence.engine.backend import Backend
    from cadence.engine.control import Requests
    from cadence.engine.engine import Engine


class Agreement:
    """The base: `send` seals the step when asked to, `take` unseals it; subclasses agree."""

    def __init__(self, seals_step: bool) -> None:
        #: Whether requests raised between `send` and `take` are refused (no callback requests in the step).
        self.seals_step = seals_step

    def send(self, requests: Requests) -> None:
        """Right after on_step_start: send what is pending (when overlapped)."""
        requests.in_step = self.seals_step

    def take(self, requests: Requests) -> None:
        """Right before the optimizer step: the agreed values are in `requests.agreed` after it."""
        requests.in_step = False


class InlineAgreement(Agreement):
    """One rank: what is pending is what is agreed."""

    def take(self, requests: Requests) -> None:
        requests.in_step = False
        if requests.any_pending or requests.any_agreed:
            requests.accept(requests.pending)


class NoAgreement(InlineAgreement):
    """Several ranks and nothing that may request: nothing is sent (requests are closed for the fit).

    `take` still clears what the loop agreed itself (an update the backend did
    not apply counts as an agreed skip for one step).
    """


class BlockingAgreement(Agreement):
    """`backend.agree(requests)` before the optimizer step: one small collective every rank waits for."""

    def __init__(self, seals_step: bool, backend: Backend) -> None:
        super().__init__(seals_step)
        self.backend = backend

    def take(self, requests: Requests) -> None:
        requests.in_step = False
        self.backend.agree(requests)


class OverlappedAgreement(Agreement):
    """Sent after on_step_start (`backend.agree_start`), awaited before the optimizer step (`agree_finish`)."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(seals_step=True)
        self.backend = backend

    def send(self, requests: Requests) -> None:
        self.backend.agree_start(requests)  # skip / stop / save / ...: one small collective, not awaited
        requests.in_step = True

    def take(self, requests: Requests) -> None:
        requests.in_step = False
        self.backend.agree_finish(requests)  # sent after on_step_start: done by now unless a rank lags


def choose(engine: Engine) -> Agreement:
    """This fit's agreement, from the backend's `agreement_mode` and what the registered callbacks declare.

    With an overlapped backend every rank must take the same way (callbacks may
    differ by rank): the two declarations are reduced (MAX) over the optimizer
    domain first, and requests are closed for the fit when nothing may request.
    """
    backend, requests = engine.backend, engine.requests
    mode = backend.agreement_mode(engine)
    sealed = not requests_in_step(engine)
    agreeing = requests.any_pending or may_request(engine)
    if mode == "overlapped":
        # On the backend's device: an NCCL group reduces no CPU tensor.
        flags = torch.tensor([int(not sealed), int(agreeing)], device=backend.device)
        in_step, agreeing = backend.reduce(flags, "max", "optimizer").tolist()
        sealed = not in_step
        # On several ranks a request raised now could not be agreed: refused, naming it.
        requests.closed = not agreeing
    if not agreeing:
        return NoAgreement(sealed) if mode != "inline" else InlineAgreement(sealed)
    if mode == "inline":
        return InlineAgreement(sealed)
    if mode == "overlapped" and sealed:
        return OverlappedAgreement(backend)
    return BlockingAgreement(sealed, backend)


def requests_in_step(engine: Engine) -> bool:
    """Whether a registered callback may raise control requests inside the step (`Callback.requests_in_step`)."""
    listeners = engine.bus.listeners(IN_STEP_EVENTS)
    return any(getattr(cb, "requests_in_step", None) is not False for cb in listeners)


def may_request(engine: Engine) -> bool:
    """Whether a registered callback may raise control requests at all (`Callback.raises_requests`)."""
    return any(
        getattr(cb, "raises_requests", None) is not False or getattr(cb, "requests_in_step", None) is True
        for cb in engine.callbacks
    )
