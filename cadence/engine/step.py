"""One optimizer step as plain calls: what the backend does, decided once per fit.

`Backend.build_step(engine)` returns a `Step` at the start of every fit; the
loop then calls its methods unconditionally:

    step.micro_batches(engine, batches)   on_batch, forward, on_forward, backward, on_backward each
    step.finish(engine)                   gradients final (unscaled, synced experts)
    applied = step.apply_update(requests) the optimizer step, or the skip an agreed request asked for
    step.zero_grad()

A part a backend has nothing to do for is a plain function that does nothing
(`nothing`), not a None the loop tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from cadence.engine.events import Event

if TYPE_CHECKING:
    from cadence.engine.control import Requests
    from cadence.engine.engine import Engine

#: The context backends return when there is nothing to enter.
NULL_CONTEXT: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()


def nothing(*args: Any) -> None:
    """A step part with nothing to do (no gradients to sync on one process, none to unscale in fp32)."""


def as_given(batch: Any) -> Any:
    """The placement of a batch that is already where the model is (the CPU)."""
    return batch


def plain_backward(loss: torch.Tensor, micro_batches: int) -> None:
    """Backpropagate one micro-batch's loss, averaged over the step's `micro_batches`."""
    (loss / micro_batches if micro_batches > 1 else loss).backward()


@attrs.frozen(kw_only=True)
class Step:
    """What the loop calls on every step of a fit, built by the backend (`Backend.build_step`).

    Attributes:
        optimizer_step: steps the optimizers (no arguments). It returns `False`
            when the backend did not apply the update (DeepSpeed's own
            non-finite skip, a commit TorchFT refused): the loop then counts
            the step as an agreed skip, which every callback sees. Anything
            else (None, a loss) means applied.
        autocast: the context forward runs in (`NULL_CONTEXT`: none).
        to_device: the backend's placement of a batch, or None: batches are
            used as given (the engine's `Placement` reads it once per fit).
        gradient_sync: `set_gradient_sync(last)`, called before every
            micro-batch's forward (True on the step's last).
        backward: backpropagates a micro-batch's loss: `backward(loss, micro_batches)`.
        finish_gradients: makes gradients final before on_before_optimizer_step (unscale fp16).
        skip_step: called instead of `optimizer_step` when a skip was agreed
            (no arguments; the fp16 scaler closes its step).
        zero_grad: clears the gradients (no arguments); `nothing` when the
            optimizer step already did (DeepSpeed).
        schedule: runs all of a step's micro-batches itself, events included
            (pipeline, context parallel), or None: `micro_batches` runs them.
        place: what places each micro-batch before on_batch; the engine sets
            it from its `Placement` (which may copy one ahead).
    """

    optimizer_step: Callable[[], Any]
    autocast: contextlib.AbstractContextManager[Any] = NULL_CONTEXT
    to_device: Callable[[Any], Any] | None = None
    gradient_sync: Callable[[bool], None] = nothing
    backward: Callable[[torch.Tensor, int], None] = plain_backward
    finish_gradients: Callable[[Engine], None] = nothing
    skip_step: Callable[[], None] = nothing
    zero_grad: Callable[[], None] = nothing
    schedule: Callable[[Engine, Sequence[Any]], None] | None = None
    place: Callable[[Any], Any] = as_given

    def micro_batches(self, engine: Engine, batches: Sequence[Any]) -> None:
        """Run one step's micro-batches: the backend's schedule, or each in turn (gradient sync on the last)."""
        if self.schedule is not None:
            self.schedule(engine, batches)
            return
        n, context = len(batches), engine.context
        for i, batch in enumerate(batches, 1):
            context.batch = self.place(batch)
            engine.bus.fire(Event.ON_BATCH)  # a callback may replace context.batch
            self.gradient_sync(i == n)
            self.forward_backward(engine, context.batch, n)

    def forward_backward(self, engine: Engine, batch: Any, micro_batches: int) -> None:
        """One micro-batch: forward under autocast, on_forward, backward, on_backward (the step context's
        `outputs` and `loss` are set before on_forward, which may replace the loss)."""
        context = engine.context
        context.outputs = None  # the last forward's outputs (a language model's logits) do not live through this one
        with self.autocast:
            context.outputs, context.loss = engine.compute_loss(batch)
        engine.bus.fire(Event.ON_FORWARD)
        self.backward(context.loss, micro_batches)  # type: ignore[arg-type]  # set just above, or by on_forward
        engine.bus.fire(Event.ON_BACKWARD)

    def finish(self, engine: Engine) -> None:
        """Make the gradients final (e.g. unscale fp16) before on_before_optimizer_step."""
        self.finish_gradients(engine)

    def apply_update(self, requests: Requests) -> bool:
        """The optimizer step, unless a skip was agreed; returns whether the update was applied.

        An update the backend did not apply (`optimizer_step` returned False)
        is counted as an agreed skip, which every callback sees.
        """
        skip = requests.index["skip"]
        if requests.agreed[skip]:
            self.skip_step()
            return False
        if self.optimizer_step() is False:
            requests.agreed[skip] = 1
            requests.any_agreed = True
            return False
        return True
