"""Loss parallel (`MeshConfig.loss_parallel`): cross-entropy on vocabulary-sharded logits.

With the output projection column-wise over the tensor axis and
`use_local_output=False` in the model's tensor-parallel plan, its logits stay a
DTensor sharded over the vocabulary: no rank holds the whole (batch x sequence
x vocabulary) logits. `torch.distributed.tensor.parallel.loss_parallel()` makes
`F.cross_entropy` (log-softmax and NLL) compute on those shards with small
all-reduces over the tensor axis, and its backward needs the same context: the
backend enters it around forward and the loss (`autocast()`, with the run's
autocast) and around backward (`backward`). The loss comes out as a replicated
DTensor; the loss function returns `loss.to_local()` or `loss.full_tensor()`
(no communication for a replicated value) so the engine, metrics and
callbacks see a plain tensor.
"""

from __future__ import annotations

import contextlib
from typing import Any

from cadence.engine.backend import NULL_CONTEXT

__all__ = ["LossParallelContext"]


class LossParallelContext:
    """`loss_parallel()` and the run's autocast together; re-enterable, as the engine's forward context must be."""

    def __init__(self, autocast: contextlib.AbstractContextManager[Any] = NULL_CONTEXT) -> None:
        self.autocast = autocast
        self.stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        stack = contextlib.ExitStack()
        if self.autocast is not NULL_CONTEXT:
            stack.enter_context(self.autocast)
        stack.enter_context(loss_parallel())
        self.stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool | None:
        return self.stacks.pop().__exit__(*exc)
