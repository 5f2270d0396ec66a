"""A debug option: ranks that issue different collectives fail at once, naming the first difference.

"My DDP run froze" is most often a collective that one rank issued and another did
not, or issued with another shape: a reduction inside a rank-0-only hook, ranks that
log different keys. The collectives still pair up by position, so the run hangs at
a later one or silently mixes tensors that do not belong together.

`CollectiveGuard` records, on every rank, each collective issued through
`torch.distributed` on the world group (its op, dtype, shape, and the callback and
event, or the function, that issued it) and folds the sequence of one step into a
62-bit hash. The hash rides in the step's agreement the ranks already exchange (two
request slots of the MAX all-reduce: `h` and `2**62 - h`, whose maxima add up to
`2**62` exactly when every rank sent the same `h`), so it adds no collective per
step. When the hashes of a step differ, every rank learns it at the same step;
the ranks then exchange their records of that step once (one `all_gather_object`)
and each raises `CollectiveMismatch` naming the step, the first differing
collective, and what each rank issued there.

The window of step `k` runs from step `k`'s `on_step_start` to step `k + 1`'s, and
its hash is agreed in step `k + 1`; the last window of a fit is checked at the
fit's end (one small all-reduce per fit). What it does not see: collectives on a
sub-group (ranks of different pipeline stages or tensor groups differ there by
design), point-to-point sends and receives, collectives issued from C++ (DDP's
gradient buckets), and a rank that waits in a collective no other rank issues
before the agreement: that one still hangs; `cadence hang RUN_DIR` names it (the
heartbeat and the flight recorder, docs/observability.md).

Cost: a Python frame walk and a hash update per collective, only while the guard
is registered on a run of several processes. Use it to find the cause, not in
production.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from cadence.engine.bus import CadenceError
from cadence.engine.callback import Callback
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

#: The collectives recorded (functions of `torch.distributed`); point-to-point ops are left out.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
)  # fmt: skip
TOP = 2**62  # the hash is in [1, TOP); its complement TOP - h too: both fit the agreement's int64 MAX
HASH, COMPLEMENT = "collective_guard.hash", "collective_guard.complement"


class CollectiveMismatch(CadenceError, RuntimeError):
    """The ranks issued different collectives in one step (raised on every rank)."""


@attrs.define(kw_only=True)
class CollectiveGuardConfig:
    """Attributes:
    max_records: collectives kept per step for the report (the hash covers every one).
    """

    max_records: int = attrs.field(default=10_000, validator=attrs.validators.ge(1))


class CollectiveGuard(Callback):
    """Fails every rank at the first step whose collectives differ between ranks (a debug option).

    Example (two ranks; a config names it `collective_guard`):
        engine = cadence.Engine(..., backend=DDPBackend(), callbacks=[CollectiveGuard()])
    """

    order = 1_000  # after every other callback's on_step_start: their collectives belong to the closing window
    raises_requests = True  # the hash, in on_step_start
    requests_in_step = False

    def __init__(self, config: CollectiveGuardConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(CollectiveGuardConfig, config, kwargs, "collective_guard")
        self.active = False
        self.records: list[str] = []  # this window's collectives, for the report
        self.digest = hashlib.blake2b(digest_size=8)
        self.closed: tuple[str, list[str]] | None = None  # the window whose hash is being agreed: (label, records)
        self.label = ""
        self.originals: dict[str, Callable[..., Any]] = {}

    # -- events ---------------------------------------------------------------

    def on_fit_start(self, engine: Engine) -> None:
        self.active = engine.backend.world_size > 1 and dist.is_available() and dist.is_initialized()
        if not self.active:
            return
        engine.requests.register(HASH)
        engine.requests.register(COMPLEMENT)
        self.label = f"the start of the fit (before step {engine.state.step + 1})"
        self.reset()
        self.install()

    def on_step_start(self, engine: Engine) -> None:
        if not self.active:
            return
        value = self.close(f"step {engine.state.step}" if engine.state.step else self.label)
        engine.request(HASH, value)
        engine.request(COMPLEMENT, TOP - value)

    def on_step_end(self, engine: Engine) -> None:
        if self.active and self.closed is not None:
            self.check(engine.agreed(HASH) + engine.agreed(COMPLEMENT))

    def on_fit_end(self, engine: Engine) -> None:
        if not self.active:
            return
        self.uninstall()
        value = self.close(f"step {engine.state.step} (the last of the fit, and what followed it)")
        backend = str(dist.get_backend())
        device = f"cuda:{torch.cuda.current_device()}" if "nccl" in backend and "gloo" not in backend else "cpu"
        both = torch.tensor([value, TOP - value], dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        self.check(int(both.sum()))
        self.active = False

    def on_teardown(self, engine: Engine) -> None:
        self.uninstall()
        self.active = False

    # -- windows --------------------------------------------------------------

    def reset(self) -> None:
        self.records, self.digest, self.closed = [], hashlib.blake2b(digest_size=8), None

    def close(self, label: str) -> int:
        """End the current window (named `label`); its hash in [1, TOP)."""
        value = 1 + int.from_bytes(self.digest.digest(), "little") % (TOP - 1)
        self.closed = (label, self.records)
        self.records, self.digest = [], hashlib.blake2b(digest_size=8)
        return value

    def check(self, agreed_sum: int) -> None:
        """Raise on every rank when the closed window's hashes differed (the agreed maxima do not add to TOP)."""
        closed, self.closed = self.closed, None
        if closed is None or agreed_sum == TOP:
            return
        label, mine = closed
        everyone: list[Any] = [None] * dist.get_world_size()
        gather = self.originals.get("all_gather_object", dist.all_gather_object)
        gather(everyone, mine)
        raise CollectiveMismatch(explain(label, everyone))

    def record(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        group = kwargs.get("group", next((a for a in args[1:] if isinstance(a, dist.ProcessGroup)), None))
        if group is not None and group is not dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
            return  # a sub-group: ranks of different groups differ there by design
        entry = f"{op} {describe(args[0] if args else kwargs.get('tensor'))} from {issuer()}"
        self.digest.update(entry.encode())
        self.digest.update(b"\0")
        if len(self.records) < self.config.max_records:
            self.records.append(entry)

    # -- the wrappers ---------------------------------------------------------

    def install(self) -> None:
        """Wrap `torch.distributed`'s collectives (process-wide, until `uninstall`)."""
        if self.originals:
            return
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                self.originals[name] = original
                setattr(dist, name, self.wrap(name, original))

    def wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.record(name, args, kwargs)
            return original(*args, **kwargs)

        recorded.__wrapped__ = original  # type: ignore[attr-defined]
        return recorded

    def uninstall(self) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)
        self.originals = {}


def describe(value: Any) -> str:
    """`float32 (2, 3)` for a tensor, `3 x float32 (4,)` for a list of them, the type name otherwise."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return f"{len(value)} x {describe(value[0])}"
    return type(value).__name__


def issuer() -> str:
    """Who issued the collective: `Callback.on_event` of the innermost callback hook, else the innermost caller."""
    frame = sys._getframe(3)  # issuer <- record <- recorded <- the caller
    caller = ""
    while frame is not None:
        code = frame.f_code
        owner = frame.f_locals.get("self") if code.co_name.startswith("on_") else None
        if isinstance(owner, Callback):
            return f"{type(owner).__name__}.{code.co_name}"
        module = frame.f_globals.get("__name__", "?")
        if not caller and not module.startswith("torch"):
            caller = f"{module}.{code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return caller or "?"


def explain(label: str, everyone: list[list[str]]) -> str:
    """The report: the first position where the ranks' records differ, and what each rank issued there."""
    longest = max(len(records) for records in everyone)
    first = next(
        (i for i in range(longest) if len({r[i] if i < len(r) else None for r in everyone}) > 1),
        None,
    )
    if first is None:  # the kept records agree: the difference is past max_records
        where = "after the recorded ones (raise max_records to see it)"
        lines: list[str] = []
    else:
        where = f"collective #{first + 1} of the step"
        lines = [
            f"  rank {rank}: {records[first] if first < len(records) else '(none: it issued only ' + str(len(records)) + ')'}"
            for rank, records in enumerate(everyone)
        ]
    counts = ", ".join(f"rank {rank}: {len(records)}" for rank, records in enumerate(everyone))
    return (
        f"collective guard: the ranks issued different collectives in {label}; the first difference is {where}:\n"
        + "\n".join(lines)
        + f"\ncollectives on the world group in that step ({counts}). A collective inside a hook that runs on "
        "some ranks only, or with values that differ between ranks (logged keys, shapes), pairs with another "
        "rank's different collective: move it out of the rank-dependent branch or make every rank issue it"
    )
