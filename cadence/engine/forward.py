"""The forward pass of a training step: a batch in, `(outputs, loss)` out.

Which call makes the loss is the engine's choice of arguments: `step_fn(model,
batch)`, `loss_fn(model(inputs), targets)` for `(inputs, targets)` batches, or
`model(batch)` returning the loss (or a mapping / object with a `loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def compute_loss(
    model: torch.nn.Module,
    batch: Any,
    step_fn: Callable[[torch.nn.Module, Any], Any] | None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
) -> tuple[Any, torch.Tensor]:
    """Forward one batch through `model`; returns `(outputs, loss)`, the loss a scalar tensor."""
    if step_fn is not None:
        result = step_fn(model, batch)
        return result, _loss_of(result, "step_fn")
    if loss_fn is not None:
        if type(batch) is tuple and len(batch) == 2:
            inputs, targets = batch
        else:
            inputs, targets = _split_batch(batch)
        outputs = model(inputs)
        return outputs, loss_fn(outputs, targets)
    try:
        outputs = model(batch)
    except TypeError as exc:
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            raise TypeError(
                f"without loss_fn or step_fn the model is called on the whole batch, here a {type(batch).__name__} "
                f"of 2 (inputs and targets?), and raised: {exc}. Pass loss_fn= (e.g. torch.nn.functional."
                "cross_entropy) for (inputs, targets) batches, or step_fn= for others"
            ) from exc
        raise
    return outputs, _loss_of(outputs, "the model")


def _split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, Mapping):
        raise TypeError("loss_fn expects batches (inputs, targets); for mapping batches use step_fn")
    try:
        inputs, targets = batch
    except (TypeError, ValueError):
        raise TypeError(
            f"loss_fn expects batches of (inputs, targets), got {type(batch).__name__}; use step_fn for other batches"
        ) from None
    return inputs, targets


def _loss_of(result: Any, where: str) -> torch.Tensor:
    loss: Any
    if isinstance(result, torch.Tensor):
        loss = result
    elif isinstance(result, Mapping) and "loss" in result:
        loss = result["loss"]
    else:
        loss = getattr(result, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.ndim:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(result).__name__
        raise TypeError(
            f"{where} must return the loss as a scalar tensor, or a mapping/object with a scalar 'loss'; got {got}"
            " (pass loss_fn= for (inputs, targets) batches)"
        )
    return loss
