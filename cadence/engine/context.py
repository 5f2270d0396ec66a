"""The step context: what the batch being run holds, for callbacks to read.

`engine.context` is one `StepContext` per engine. The loop, the evaluator
and a backend's own schedule write it; callbacks read it, either as
`engine.context.loss` or by the same names on the engine (`engine.loss`),
which are the context's fields (`ContextField`), not copies. Where in a
step each field is set is the `Event` docstring's story:

    on_batch                    batch (placed on the device)
    on_forward, on_backward     outputs, loss
    on_before_optimizer_step    grad_norm, when a callback computed it (`GradClip`)
    on_eval_batch               batch, outputs, batch_metrics
    on_predict_batch            batch, outputs, batch_indices
    on_log                      logged
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import attrs
import torch

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

T = TypeVar("T")


@attrs.define(slots=True)
class StepContext:
    """The values of the step (or evaluation / prediction batch) being run.

    Attributes:
        batch: the micro-batch being run, on the device (set before on_batch,
            on_eval_batch, on_predict_batch).
        outputs: what the forward returned (the model's outputs, or the result
            of `step_fn`); None between steps, so a language model's logits do
            not live through the next forward.
        loss: the micro-batch's loss, a scalar tensor on the device (not
            divided by gradient accumulation).
        batch_metrics: during evaluation, the batch's metric means that
            `eval_fn` returned (or its loss).
        batch_indices: during predict, the dataset indices of `batch`'s
            samples (None when unknown).
        grad_norm: the step's pre-clip total gradient norm, on the device,
            when a callback computed it (`GradClip` in on_before_optimizer_step;
            `TrainMetrics` logs it); None otherwise.
        logged: the metrics of the last on_log, reduced across ranks
            (`{name: float}`; evaluation results under `split.name`).
    """

    batch: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None
    batch_metrics: Mapping[str, Any] = attrs.field(factory=dict)
    batch_indices: list[int] | None = None
    grad_norm: torch.Tensor | None = None
    logged: dict[str, float] = attrs.field(factory=dict)


class ContextField(Generic[T]):
    """An engine attribute that is a field of its `StepContext` (`engine.loss` is `engine.context.loss`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, engine: None, owner: type) -> ContextField[T]: ...

    @overload
    def __get__(self, engine: Engine, owner: type) -> T: ...

    def __get__(self, engine: Engine | None, owner: type) -> ContextField[T] | T:
        if engine is None:
            return self
        value: T = getattr(engine.context, self.name)
        return value

    def __set__(self, engine: Engine, value: T) -> None:
        setattr(engine.context, self.name, value)
