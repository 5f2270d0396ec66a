"""Skip optimizer steps whose loss or gradients are NaN or Inf, on every rank."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from cadence.engine.bus import CadenceError
from cadence.engine.callback import Callback
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.non_finite")

_REQUEST = "non_finite"


class NonFiniteError(CadenceError, RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient.

    Raised at the same step on every rank, as itself (the hook named in a
    note, see `cadence.CadenceError`). Attributes: `step` (the last
    skipped step, 1-based), `rank` (the rank that saw the non-finite value
    first), `kind` ("loss" or "gradient"), `consecutive`.
    """

    def __init__(self, message: str, *, step: int, rank: int, kind: str, consecutive: int) -> None:
        super().__init__(message)
        self.step, self.rank, self.kind, self.consecutive = step, rank, kind, consecutive

    def __reduce__(self) -> Any:
        return _rebuild, (str(self), self.step, self.rank, self.kind, self.consecutive)


def _rebuild(message: str, step: int, rank: int, kind: str, consecutive: int) -> NonFiniteError:
    return NonFiniteError(message, step=step, rank=rank, kind=kind, consecutive=consecutive)


@attrs.define(kw_only=True)
class NonFiniteSkipConfig:
    """What `NonFiniteSkip` checks and when it gives up.

    Attributes:
        max_consecutive: raise `NonFiniteError` after this many skipped steps in
            a row (0: never raise, skip forever).
        check_loss: check each micro-batch's loss after forward.
        check_gradients: check every gradient before the optimizer step.
    """

    max_consecutive: int = attrs.field(default=10, validator=attrs.validators.ge(0))
    check_loss: bool = True
    check_gradients: bool = True


class NonFiniteSkip(Callback):
    """Skips an optimizer step on every rank when any rank sees a NaN/Inf loss or gradient.

    Each micro-batch's loss is taken after forward (`on_forward`, a reference
    only) and checked with all gradients before the optimizer step, in one
    fused device check: `_foreach_norm` over every gradient, stacked with the
    losses, one `isfinite`. Its result is read to the host once per step (a
    few bytes: one flag per gradient tensor and loss), never per parameter.
    The finding travels in the step's control agreement (request
    "non_finite", its value encoding which rank saw it and whether in the
    loss or only the gradients), so no collective is added. On CUDA the read
    is a sync right before the agreement, which on a multi-rank run reads the
    agreed values back anyway; on a single GPU it is the one sync per step
    this callback costs. See docs/callbacks.md for measured figures.

    Skipped steps are counted in `engine.state.skipped_steps`; after
    `max_consecutive` skips in a row every rank raises the same
    `NonFiniteError`, naming the step and the rank that saw it first (a rank
    whose loss was non-finite wins over ranks that only received its NaN
    through the gradient all-reduce; then the lowest rank).

    Steps are numbered from 1 (the N-th optimizer step ends with
    `engine.state.step == N`). Gradients are this rank's parts
    (`backend.local_gradients`: DTensor shards on a mesh). When the backend's
    optimizer step skips overflowing gradients itself
    (`backend.checks_gradients_itself`: fp16 with a GradScaler, DeepSpeed
    ZeRO >= 1), only the loss is checked, and such a skip is counted by the
    loop like an agreed one.

    Order: `Order.NON_FINITE` (10), before clipping (which would spread a NaN
    into every gradient).

    Example:
        >>> import torch, cadence
        >>> from cadence.callbacks import NonFiniteSkip
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 3
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...     loss_fn=torch.nn.functional.mse_loss, callbacks=[NonFiniteSkip(max_consecutive=3)], seed=0)
        >>> engine.fit(steps=3)
        >>> engine.state.skipped_steps
        0
    """

    order = Order.NON_FINITE
    requests_in_step = True  # the skip is agreed in the step whose gradients it checks
    raises_requests = True  # requests `skip` (and `non_finite`)

    def __init__(self, config: NonFiniteSkipConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(NonFiniteSkipConfig, config, kwargs, "non_finite_skip")
        self.consecutive = 0
        self.total = 0
        #: The last skip: its step, the rank that saw it first, and "loss" or "gradient".
        self.last: dict[str, Any] | None = None
        self._backend: Any = None
        self._losses: list[torch.Tensor] = []
        self._check_gradients = self.config.check_gradients
        self._rank, self._world = 0, 1

    def on_setup(self, engine: Engine) -> None:
        engine.requests.register(_REQUEST)

    def on_fit_start(self, engine: Engine) -> None:
        engine.requests.register(_REQUEST)
        backend = engine.backend
        self._rank, self._world = backend.rank, backend.world_size
        self._backend = backend
        itself = backend.checks_gradients_itself
        self._check_gradients = self.config.check_gradients and not itself
        if self.config.check_gradients and itself:
            logger.info(
                "NonFiniteSkip: the backend's optimizer step skips non-finite gradients itself "
                "(fp16 GradScaler, DeepSpeed); checking the loss only"
            )

    def on_step_start(self, engine: Engine) -> None:
        self._losses.clear()

    def on_forward(self, engine: Engine) -> None:
        # Only a reference: every micro-batch's loss is checked with the gradients, in one read.
        if self.config.check_loss and engine.loss is not None:
            loss = engine.loss.detach()
            self._losses.append(loss if loss.dtype == torch.float32 else loss.float())

    def on_before_optimizer_step(self, engine: Engine) -> None:
        values: list[torch.Tensor] = []
        if self._check_gradients:
            # This rank's part of every gradient (a DTensor's shard, a DeepSpeed partition): a
            # NaN anywhere is in some rank's part, and the agreement spreads it.
            grads = self._backend.local_gradients(engine)
            if grads:
                # One fused 2-norm per gradient: a NaN or Inf anywhere makes its norm non-finite.
                # (ord=inf would also be exact for finite values past ~1e19, but is ~10x slower on
                # CPU; such gradients are broken anyway.)
                values = list(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
        grads_checked = len(values)
        values.extend(self._losses)
        self._losses.clear()
        if not values:
            return
        # The one host read per step: a few bytes, a sync on CUDA (see the class docstring).
        finite = torch.isfinite(_stack(values)).tolist()
        if all(finite):
            return
        kind = 0 if all(finite[grads_checked:]) else 1  # 1: the loss was non-finite here, 0: only gradients
        engine.request(_REQUEST, kind * self._world + (self._world - self._rank))
        engine.request_skip(f"non-finite {'loss' if kind else 'gradient'} on rank {self._rank}")

    def on_step_end(self, engine: Engine) -> None:
        value = engine.agreed(_REQUEST)
        if not value:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        kind, rank = divmod(value - 1, self._world)
        rank = self._world - 1 - rank
        what = "loss" if kind else "gradient"
        step = engine.state.step
        self.last = {"step": step, "rank": rank, "kind": what}
        if engine.backend.is_main:
            logger.warning(
                "step %d: non-finite %s first seen on rank %d; optimizer step skipped on every rank "
                "(%d in a row, %d skipped in total)",
                step,
                what,
                rank,
                self.consecutive,
                engine.state.skipped_steps,
            )
        limit = self.config.max_consecutive
        if limit and self.consecutive >= limit:
            raise NonFiniteError(
                f"{self.consecutive} consecutive optimizer steps had a non-finite loss or gradient, "
                f"the last at step {step} (non-finite {what} first seen on rank {rank}); "
                "lower the learning rate, check the data near this step, enable gradient clipping, "
                "or raise NonFiniteSkip(max_consecutive=...)",
                step=step,
                rank=rank,
                kind=what,
                consecutive=self.consecutive,
            )

    def on_teardown(self, engine: Engine) -> None:
        self._backend = None
        self._losses = []

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive = int(state["consecutive"])
        self.total = int(state["total"])


def _stack(values: list[torch.Tensor]) -> torch.Tensor:
    """The scalars in one tensor, on the first one's device when they live on several.

    Gradients need not live where the loss does: FSDP2's `CPUOffloadPolicy`
    keeps them on the host while the loss is on the GPU, and a backend's
    `local_gradients` may hand out parts on several devices.
    """
    device = values[0].device
    if any(value.device != device for value in values):
        values = [value.to(device) for value in values]
    return torch.stack(values)
