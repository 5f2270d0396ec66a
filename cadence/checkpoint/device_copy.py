"""Async saves on GPUs: copies of CUDA tensors into pinned host buffers on a side stream.

A CUDA copy queued on the loop's stream runs after the step's kernels and keeps
the next step's kernels waiting; a copy waited for on the host holds the loop.
Here the copies run on a side stream per device, ordered after the work already
queued (the side stream waits for the current stream first, so they copy the
step's final values), and two CUDA events mark their end:

- *early* copies (everything but the late ones: model buffers, which a forward
  writes in place, callback states, ...): the current stream waits for them at
  once, a wait on the GPU (the host goes on), so nothing the loop queues later
  writes them before they are copied;
- *late* copies (parameters and optimizer state, which only an optimizer step
  writes): they run beside the next forward and backward, and the current
  stream waits for them at `release()`, which `CopyFence` calls before the next
  optimizer step (or before anything else that may write them in place).

The writer thread calls `wait()` (the events, on the host) before it reads the
buffers. The buffers are pinned (`Staging` allocates them so): a device-to-host
copy into pageable memory is neither fast nor asynchronous. See
docs/checkpoints.md, "Async saves on GPUs".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from cadence.engine.events import Event

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

Pair = tuple[torch.Tensor, torch.Tensor]  # (pinned host buffer, CUDA source)


class DeviceCopy:
    """One staging's device-to-host copies, on a side stream per device (see the module docstring).

    A staging's buffers are written again only after its job was written (`Staging.busy`),
    so one `DeviceCopy` per staging; copies started again on the same streams run after
    the earlier ones (a stream runs in order).
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._ends: list[Any] = []  # the events of the last `start`: the copies are done when all have fired
        self._unreleased: dict[torch.device, Any] = {}  # device -> late event its current stream has not waited for

    @property
    def pending(self) -> bool:
        """Whether late copies were started that the current streams have not been made to wait for."""
        return bool(self._unreleased)

    def start(self, early: list[Pair], late: list[Pair]) -> None:
        """Queue `early` then `late` copies on the side streams; the current streams wait for `early` at once."""
        devices = {source.device for _, source in early + late}
        for device in devices:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            self._streams[device].wait_stream(torch.cuda.current_stream(device))
        ends: list[Any] = []
        marks: dict[str, dict[torch.device, Any]] = {}
        for group, pairs in (("early", early), ("late", late)):
            for device in devices:
                stream = self._streams[device]
                with torch.cuda.stream(stream):
                    for target, source in pairs:
                        if source.device == device and source.numel():
                            target.copy_(source, non_blocking=True)
                            # Its memory is not handed to the loop's stream before the copy has read it
                            # (a state_dict's temporary tensor may be freed as soon as this returns).
                            source.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
                marks.setdefault(group, {})[device] = event
                ends.append(event)
        for device, event in marks.get("early", {}).items():
            torch.cuda.current_stream(device).wait_event(event)
        self._ends = ends
        self._unreleased.update(marks.get("late", {}) if late else {})

    def release(self) -> None:
        """The current streams wait for the late copies (on the GPU: the host does not wait)."""
        unreleased, self._unreleased = self._unreleased, {}
        for device, event in unreleased.items():
            torch.cuda.current_stream(device).wait_event(event)

    def wait(self) -> None:
        """Block the calling thread until every copy of the last `start` is done (the writer thread)."""
        for event in list(self._ends):
            event.synchronize()


class CopyFence:
    """Calls `release()` on stagings with late copies before anything but a forward and backward may write them.

    `arm(engine, staging)` registers one handler, first in the order, on
    `on_before_optimizer_step` and on every event after which something other
    than the next step's forward and backward may write parameters or optimizer
    state in place: an epoch's end and its evaluation (EMA swaps its average in at
    `on_eval_start`), the next save point, the end of fit, an exception, teardown.
    The first of them to fire releases every armed staging and removes the
    handlers, so the step carries nothing when no save is pending. A callback
    that writes parameters or optimizer state in place earlier in the step
    (`on_step_start` to `on_backward`) must call `release()` first
    (`Checkpoint.release_copies()`).
    """

    EVENTS = (
        Event.ON_BEFORE_OPTIMIZER_STEP,
        Event.ON_EPOCH_END,
        Event.ON_EVAL_START,
        Event.ON_SAVE_POINT,
        Event.ON_FIT_END,
        Event.ON_EXCEPTION,
        Event.ON_TEARDOWN,
    )
    ORDER = -1_000_000  # before every callback that could write what is being copied
    requests_in_step = False  # its handlers never raise control requests
    raises_requests = False

    def __init__(self) -> None:
        self._armed: list[Any] = []  # stagings (anything with `release()`) whose late copies are pending
        self._handles: list[Any] = []

    @property
    def armed(self) -> bool:
        return bool(self._armed)

    def arm(self, engine: Engine, staging: Any) -> None:
        if not any(s is staging for s in self._armed):
            self._armed.append(staging)
        if not self._handles:
            self._handles = [engine.add_handler(event, self._on_event, order=self.ORDER) for event in self.EVENTS]

    def _on_event(self, engine: Engine) -> None:
        self.release()

    def release(self) -> None:
        """Release every armed staging now and remove the handlers."""
        armed, self._armed = self._armed, []
        for staging in armed:
            staging.release()
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()


def optimizer_written(engine: Engine) -> set[int]:
    """The storages (`untyped_storage().data_ptr()`) of the CUDA tensors only an optimizer step writes.

    The model's parameters and the optimizers' state: their copies may run beside the
    next forward and backward (`DeviceCopy`, late copies).
    """
    tensors: list[torch.Tensor] = [*engine.model.parameters()]
    for optimizer in engine.optimizers:
        for state in optimizer.state.values():
            tensors.extend(value for value in state.values() if isinstance(value, torch.Tensor))
    return {t.untyped_storage().data_ptr() for t in tensors if t.device.type == "cuda"}
