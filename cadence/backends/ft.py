"""TorchFT fault tolerance across replica groups (the `ft` option of the ddp and mesh backends).

A job is several *replica groups*, each its own torch world started by its own
launch (`torchrun` or `cadence.launch`; `WORLD_SIZE` is the group's size). A
TorchFT `Manager` per group asks a *lighthouse* for a quorum of live groups at
every step and all-reduces gradients across the groups in it; a group that
dies is left out of the next quorum while the others go on, and a group that
(re)starts receives a live group's state ("healing") and joins at its step.

What Cadence adds around TorchFT (see docs/fault-tolerance.md):

- The step: the quorum for the next step is started in `zero_grad` (it runs
  while the next batch loads; the forward waits for it, so a healing peer reads
  this group's state between two steps); the optimizer step is
  applied only when the Manager agrees to commit (`should_commit`). A refused
  commit returns False from `optimizer_step`: the loop counts it as an agreed
  skip, so the LR scheduler, EMA and `state.skipped_steps` see it.
- Healing sends the model, the optimizers, the schedulers, the states of the
  registered callbacks and the engine's step counters (`step`, `micro_step`,
  `skipped_steps`, `consecutive_skips`). The receiving group keeps its own data
  position (`epoch`, `batch_in_epoch`, `samples_seen`, `tokens_seen`, its loader
  and RNG): data positions are saved per replica group (`ReplicaStore`) and win
  over the main checkpoint's on restore.
- Inside a group: the ddp backend is one process (torchft's DDP all-reduces
  across groups); the mesh backend runs FSDP2 (shard/replicate axes) inside
  the group and all-reduces each reduce-scattered gradient shard across groups
  through the Manager (`FSDPModule.set_all_reduce_hook`, `all_reduce_hook`).
- Data is sharded over all replica groups (`data_rank = replica_id * W +
  group rank`, `data_size = group_size * W`); metrics, evaluation and control
  requests stay inside the group (no collective crosses groups but TorchFT's).
- Checkpoints: the group with participating rank 0 in the last quorum writes the
  run's checkpoint (decided at each save, the same on every rank of a group);
  every group writes its own data position (`cadence.checkpoint.replica`).
  The ddp backend writes file checkpoints; the mesh backend DCP checkpoints,
  every rank of the writing group its shards, on a gloo group of its own
  replica group (each group is its own torch world: no checkpoint collective
  crosses groups).

The lighthouse: `torchft_lighthouse --bind [::]:29510 --min_replicas N` in
production (`lighthouse="http://host:29510"` or `TORCHFT_LIGHTHOUSE`);
`local_lighthouse()` runs one in this process on 127.0.0.1 for tests and
notebooks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import time
import urllib.request
import warnings
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeGuard

import attrs

from cadence.run import config as config_module

if TYPE_CHECKING:
    import torch
    from torch.distributed.tensor import DTensor

    from cadence.engine.engine import Engine
    from cadence.engine.step import Step

logger = logging.getLogger("cadence.ft")

#: Engine counters a healed replica group takes from its peer: the step it jumps to.
ADOPTED_COUNTERS = ("step", "micro_step", "skipped_steps", "consecutive_skips", "last_loss")
#: Engine counters that stay the group's own: its position in its own share of the data.
OWN_COUNTERS = ("epoch", "batch_in_epoch", "samples_seen", "tokens_seen")

_EXTRA_HINT = "pip install 'cadence[ft]' (torchft-nightly==2026.10.26)"


class QuorumError(RuntimeError):
    """A TorchFT quorum did not form in time; the message names the lighthouse and the missing replica groups."""


def _seconds(value: Any) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _positive(instance: Any, attribute: Any, value: float) -> None:
    if not value > 0:
        raise ValueError(f"FTConfig.{attribute.name} must be > 0 seconds, got {value!r}")


@attrs.define(kw_only=True)
class FTConfig:
    """Fault tolerance across replica groups with TorchFT.

    Attributes:
        replica_id: this replica group's id, 0 .. group_size - 1; None: the
            `REPLICA_GROUP_ID` environment variable.
        group_size: the number of replica groups of the job; None: the
            `NUM_REPLICA_GROUPS` environment variable. Data is sharded over all of them.
        min_replica_size: the fewest replica groups a step may commit with
            (the lighthouse's `--min_replicas` should be the same).
        lighthouse: the lighthouse's address (`http://host:29510`); None: the
            `TORCHFT_LIGHTHOUSE` environment variable.
        process_group: the collective backend across replica groups: "gloo",
            "nccl" or "baby_nccl" (NCCL in a subprocess, abortable); None: gloo
            on CPU, nccl on CUDA.
        process_group_timeout: seconds a collective across replica groups may
            take before it fails (and the step is not committed).
        quorum_timeout: seconds a step waits for the quorum to form before
            raising `QuorumError`.
        timeout: seconds for the Manager's other operations (the commit vote,
            sending a checkpoint to a healing group).
        hostname: the name other groups reach this one by (advertised to the
            lighthouse); None: `socket.gethostname()`.
        max_commit_failures: raise after this many refused commits in a row
            (None: never; a refused commit is a counted skip).
    """

    replica_id: int | None = None
    group_size: int | None = None
    min_replica_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    lighthouse: str | None = None
    process_group: Literal["gloo", "nccl", "baby_nccl"] | None = None
    process_group_timeout: float = attrs.field(default=60.0, converter=_seconds, validator=_positive)
    quorum_timeout: float = attrs.field(default=60.0, converter=_seconds, validator=_positive)
    timeout: float = attrs.field(default=60.0, converter=_seconds, validator=_positive)
    hostname: str | None = None
    max_commit_failures: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(0))
    )

    def resolved(self) -> FTConfig:
        """This config with replica_id, group_size and lighthouse taken from the environment where unset; validated."""
        replica_id = self.replica_id if self.replica_id is not None else _env_int("REPLICA_GROUP_ID", "replica_id")
        group_size = self.group_size if self.group_size is not None else _env_int("NUM_REPLICA_GROUPS", "group_size")
        if group_size < 1:
            raise ValueError(f"FTConfig.group_size (the number of replica groups) must be >= 1, got {group_size}")
        if not 0 <= replica_id < group_size:
            raise ValueError(
                f"FTConfig.replica_id={replica_id} is outside 0 .. group_size - 1 = {group_size - 1}: "
                "give each replica group its own id below group_size"
            )
        if self.min_replica_size > group_size:
            raise ValueError(
                f"FTConfig.min_replica_size={self.min_replica_size} is more than group_size={group_size}: "
                "no quorum could ever commit"
            )
        lighthouse = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ValueError(
                "FTConfig.lighthouse is not set and TORCHFT_LIGHTHOUSE is not in the environment: pass "
                "lighthouse='http://host:29510' (start one with `torchft_lighthouse --bind [::]:29510 "
                "--min_replicas N`, or cadence.backends.ft.local_lighthouse() for tests)"
            )
        return attrs.evolve(self, replica_id=replica_id, group_size=group_size, lighthouse=lighthouse)


def _env_int(name: str, field: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"FTConfig.{field} is not set and {name} is not in the environment: set one of them")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} in the environment is not an integer (FTConfig.{field})") from None


def make_config(value: FTConfig | Mapping[str, Any] | None) -> FTConfig | None:
    """An `FTConfig` from a config, a mapping of its fields, or None."""
    if value is None or isinstance(value, FTConfig):
        return value
    if isinstance(value, Mapping):
        return config_module.configure(FTConfig, None, dict(value), "ft")
    raise TypeError(f"ft must be an FTConfig or a mapping of its fields, got {type(value).__name__}")


def unsupported(what: str, reason: str) -> ValueError:
    """The error for a combination that cannot run with `ft` (raised at setup, before any lighthouse is contacted)."""
    return ValueError(f"ft (TorchFT fault tolerance) with {what} is not supported: {reason}")


#: Mesh axes a replica group cannot have under ft: TorchFT replicates whole groups and all-reduces gradients
#: across them; only the data axes (replicate, shard: FSDP2/HSDP inside a group) fit that.
UNSUPPORTED_AXES = ("tensor", "pipeline", "context", "expert", "expert_tensor")


def check_mesh_axes(axes: Mapping[str, int]) -> None:
    """Raise for mesh axes `ft` cannot run with (for the mesh backend's setup, before any lighthouse is contacted)."""
    bad = {name: size for name, size in axes.items() if name in UNSUPPORTED_AXES and size > 1}
    if bad:
        raise unsupported(
            f"the mesh axes {bad}",
            "a replica group under TorchFT may only shard or replicate its data (replicate, shard axes: FSDP2/HSDP "
            "inside the group); drop ft, or set these axes to 1",
        )


def check_deepspeed() -> None:
    """The error for DeepSpeed with `ft` (for the DeepSpeed backend's setup, before any lighthouse is contacted)."""
    raise unsupported(
        "the deepspeed backend",
        "DeepSpeed runs its own gradient all-reduce and optimizer step, which TorchFT can neither route across "
        "replica groups nor gate on a commit; use the ddp backend with ft",
    )


#: TorchFT's Python loggers: its Manager's, and one each for quorums, commits and errors.
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")


def import_torchft(module: str = "torchft") -> Any:
    """`torchft` (or one of its modules), its logs at warnings and errors; missing, an ImportError naming the extra.

    TorchFT logs every quorum and commit of every step at INFO (hundreds of lines for a
    short run): its Rust side is set to `warn` unless `RUST_LOG` is set, when torchft is
    first imported here (importing torchft earlier yourself keeps its default), and its
    Python loggers to WARNING (`quiet_torchft_logs`).
    """
    import importlib
    import sys

    first = "torchft" not in sys.modules
    try:
        with _rust_log_default("warn") if first else contextlib.nullcontext():
            imported = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"TorchFT fault tolerance needs torchft, which is not installed: {_EXTRA_HINT}") from exc
    quiet_torchft_logs()
    return imported


@contextlib.contextmanager
def _rust_log_default(level: str) -> Iterator[None]:
    """`RUST_LOG=level` while TorchFT's Rust extension loads (it reads it then), unless the user set RUST_LOG.

    Its default is INFO: a line for every quorum and commit of every step, from every
    replica group and the lighthouse. Only this import sees the variable: child processes
    and other Rust libraries do not.
    """
    if "RUST_LOG" in os.environ:
        yield
        return
    os.environ["RUST_LOG"] = level
    try:
        yield
    finally:
        os.environ.pop("RUST_LOG", None)


def quiet_torchft_logs() -> None:
    """TorchFT's Python loggers at WARNING, unless given a level already; drop warnings the user cannot act on.

    Turn them up with `logging.getLogger("torchft").setLevel(logging.INFO)` (and
    `torchft_quorums`, `torchft_commits`), and the Rust side's with `RUST_LOG=info`
    in the environment (docs/fault-tolerance.md).
    """
    import torch.distributed as dist

    for name in TORCHFT_LOGGERS:
        found = logging.getLogger(name)
        if found.level == logging.NOTSET:
            found.setLevel(logging.WARNING)
    manager = logging.getLogger("torchft.manager")
    if not dist.is_nccl_available() and not any(isinstance(f, _NoNcclFlightRecorder) for f in manager.filters):
        manager.addFilter(_NoNcclFlightRecorder())
    # Healing reads the peer's state from a read-only buffer; torch warns once that it could be written.
    warnings.filterwarnings(
        "ignore", "The given buffer is not writable", UserWarning, r"torch\.distributed\._serialization"
    )


class _NoNcclFlightRecorder(logging.Filter):
    """Drops TorchFT's warning that it cannot reset NCCL's flight recorder, on a torch build without NCCL."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "NCCL flight recorder" not in record.getMessage()


# -- the lighthouse ------------------------------------------------------------------------------


@contextlib.contextmanager
def local_lighthouse(
    min_replicas: int = 1,
    *,
    bind: str = "127.0.0.1:0",
    join_timeout_ms: int = 1000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 1000,
) -> Iterator[str]:
    """Run a TorchFT lighthouse in this process; yields its address (`http://127.0.0.1:PORT`).

    For tests and notebooks: it binds 127.0.0.1 on a port the OS picks. Start
    replica groups as separate processes (`subprocess`, `torchrun`), not by
    forking this one: the lighthouse runs Rust threads. Production uses the
    `torchft_lighthouse` binary (docs/fault-tolerance.md).

    Example:
        >>> from cadence.backends.ft import local_lighthouse
        >>> with local_lighthouse(min_replicas=2) as address:   # doctest: +SKIP
        ...     start_replica_groups(lighthouse=address)
    """
    server = import_torchft("torchft.coordination").LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    # The server advertises the host's name; the port is what matters.
    host = bind.rpartition(":")[0] or "127.0.0.1"
    if host in ("0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    try:
        yield f"http://{host}:{server.address().rpartition(':')[2]}"
    finally:
        server.shutdown()
        del server  # its threads end with it


_HEARTBEAT = re.compile(r"^\s*([^\s<>]+?):[0-9a-f-]{36}: seen ([0-9.e-]+)s ago", re.MULTILINE)


def lighthouse_status(address: str, timeout: float = 1.0) -> dict[str, Any]:
    """What the lighthouse's `/status` page says: `{"heartbeats": {replica: seconds since}, "next": text}`."""
    with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=timeout) as response:
        text = response.read().decode("utf-8", "replace")
    heartbeats = {name: float(ago) for name, ago in _HEARTBEAT.findall(text)}
    found = re.search(r"Next quorum status:\s*([^<\n]*)", text)
    return {"heartbeats": heartbeats, "next": found.group(1).strip() if found else ""}


def replica_name(replica_id: int) -> str:
    """The id a replica group has at the lighthouse (TorchFT appends a per-start uuid)."""
    return f"replica_{replica_id}"


# -- the runtime ---------------------------------------------------------------------------------


class FaultTolerance:
    """One replica group's TorchFT Manager and the step functions around it (used by the ddp and mesh backends).

    Attributes:
        config: the resolved `FTConfig`.
        manager: the `torchft.Manager` (after `start`).
        commit_failures: refused commits so far (each one a counted skip).
        heals: times this group received a peer's state.
        participants: replica groups in the last committed quorum.
        participating_rank: this group's rank in it (None while healing).
    """

    def __init__(self, config: FTConfig) -> None:
        import_torchft()  # a missing torchft is named first, before the config or the launch environment
        self.config = config.resolved()
        self.manager: Any = None
        self.commit_failures = 0
        self.heals = 0
        self.participants = 0
        self.participating_rank: int | None = None
        self.group_rank = 0
        self.group_world = 1
        self._engine: Engine | None = None
        self._quorum_pending = False
        self._quorum_started = 0.0
        self._locked = False

    @property
    def replica_id(self) -> int:
        return int(self.config.replica_id)  # type: ignore[arg-type]

    @property
    def group_size(self) -> int:
        return int(self.config.group_size)  # type: ignore[arg-type]

    def data_shard(self, group_rank: int, group_world: int) -> tuple[int, int]:
        """`(data_rank, data_size)`: data is sharded over every rank of every replica group."""
        return self.replica_id * group_world + group_rank, self.group_size * group_world

    @property
    def writes_checkpoint(self) -> bool:
        """Whether this group writes the run's checkpoint now: participating rank 0 of the last quorum.

        Before the first quorum, replica group 0 does. The answer is the same
        on every rank of the group: with several ranks (FSDP2 inside the
        group), group rank 0's answer is broadcast over the group's own
        process group, so a collective store's write (DCP: every rank of the
        group writes its shards) is entered by all of the group's ranks or by
        none. A collective then: every rank of the group asks it at the same
        save (the `Checkpoint` callback does, at each save).
        """
        if self.manager is None or self.participants == 0:
            mine = self.replica_id == 0
        else:
            mine = self.participating_rank == 0
        engine = self._engine
        if self.group_world > 1 and engine is not None:
            return bool(engine.backend.broadcast_object(mine, src=0, domain="optimizer"))
        return mine

    # -- the Manager's own counters in checkpoints ----------------------------------------------

    def manager_state(self) -> dict[str, int]:
        """The Manager's step and committed batches (`Manager.state_dict`): saved in the run's checkpoint."""
        return {} if self.manager is None else {k: int(v) for k, v in self.manager.state_dict().items()}

    def load_manager_state(self, state: Mapping[str, Any] | None) -> None:
        """Put the Manager's step back from a checkpoint (before the first quorum of a fit).

        The quorum heals a group whose Manager step is behind the others'
        (and, with every step at 0, all groups from one at the first quorum:
        a healing group's gradients do not count in that step). Groups that
        restore the same checkpoint get the same step back, so none heals and
        the resumed run repeats the uninterrupted one; a group restored from an
        older checkpoint than the live groups' state is behind and heals.
        """
        if self.manager is None or not state:
            return
        if self._quorum_pending:
            logger.warning("ft: a checkpoint was restored while a quorum was pending; the Manager's step is kept")
            return
        self.manager.load_state_dict({"step": int(state["step"]), "batches_committed": int(state["batches_committed"])})

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, engine: Engine, group_rank: int, group_world: int, device_type: str) -> None:
        """Create the cross-group process group and the Manager (rank 0 starts the group's Manager server)."""
        torchft = import_torchft()
        config = self.config
        self._engine, self.group_rank, self.group_world = engine, group_rank, group_world
        kind = config.process_group or ("nccl" if device_type == "cuda" else "gloo")
        pg_timeout = timedelta(seconds=config.process_group_timeout)
        if kind == "gloo":
            pg = torchft.ProcessGroupGloo(timeout=pg_timeout)
        elif kind == "nccl":
            pg = torchft.ProcessGroupNCCL(timeout=pg_timeout)
        elif kind == "baby_nccl":
            pg = torchft.ProcessGroupBabyNCCL(timeout=pg_timeout)
        else:
            raise ValueError(f"FTConfig.process_group={kind!r}: expected 'gloo', 'nccl' or 'baby_nccl'")
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise RuntimeError(
                f"ft: the replica group's store address is not in the environment ({missing}); start the group "
                "with torchrun or cadence.launch, which set MASTER_ADDR and MASTER_PORT"
            )
        self.manager = torchft.Manager(
            pg=pg,
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=config.min_replica_size,
            use_async_quorum=True,
            timeout=timedelta(seconds=config.timeout),
            quorum_timeout=timedelta(seconds=config.quorum_timeout),
            connect_timeout=timedelta(seconds=config.timeout),
            rank=group_rank,
            world_size=group_world,
            store_addr=os.environ["MASTER_ADDR"],
            store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=config.lighthouse,
            replica_id=replica_name(self.replica_id),
            hostname=config.hostname or socket.gethostname(),
            max_retries=config.max_commit_failures,
        )

    def shutdown(self) -> None:
        manager, self.manager = self.manager, None
        if manager is None:
            return
        if self._locked:
            self._locked = False
            with contextlib.suppress(Exception):
                manager.allow_state_dict_read()
        with contextlib.suppress(Exception):
            manager.shutdown(wait=True)
        self._engine = None

    # -- healing: what a peer sends and how it is applied ---------------------------------------

    def _state_dict(self) -> dict[str, Any]:
        # Called on TorchFT's quorum thread when a peer heals from this group; the
        # loop holds the Manager's state-dict lock from zero_grad to the next
        # step's first forward, and waits there for the quorum (`release_state`),
        # so this reads the state between two steps.
        from cadence.checkpoint.payload import stateful_callbacks

        engine = self._engine
        assert engine is not None
        backend, state = engine.backend, engine.state
        # The forward that runs while the peer fetches updates buffers in place: send copies.
        buffers = frozenset(storage_of(buffer) for buffer in engine.model.buffers())
        return {
            "model": local_shards(backend.model_state_dict(engine), copies=buffers),
            "optimizers": local_shards(backend.optimizer_state_dicts(engine)),
            "schedulers": [scheduler.state_dict() for scheduler in engine.schedulers],
            "callbacks": {key: cb.state_dict() for key, cb in stateful_callbacks(engine).items()},
            "engine": {name: getattr(state, name) for name in ADOPTED_COUNTERS},
        }

    def _load_state_dict(self, received: dict[str, Any]) -> None:
        # Called on the loop's thread inside should_commit (this group's optimizer step).
        from cadence.checkpoint.payload import stateful_callbacks

        engine = self._engine
        assert engine is not None
        backend, state = engine.backend, engine.state
        before = state.step
        specs = backend.model_state_dict(engine)  # the mesh and placements of each (DTensor) entry, by name
        backend.load_model_state_dict(engine, from_local_shards(received["model"], specs))
        backend.load_optimizer_state_dicts(engine, from_local_shards(received["optimizers"], specs))
        for scheduler, saved in zip(engine.schedulers, received["schedulers"]):
            scheduler.load_state_dict(saved)
        callbacks, saved_states = stateful_callbacks(engine), received["callbacks"]
        for key, callback in callbacks.items():
            if key in saved_states:
                callback.load_state_dict(saved_states[key])
            else:
                logger.warning("ft: the healing peer sent no state for callback %r; it keeps its own", key)
        for name in ADOPTED_COUNTERS:
            setattr(state, name, received["engine"][name])
        self.heals += 1
        logger.info(
            "ft: replica group %d healed from a peer: step %d -> %d (data position kept: epoch %d, batch %d)",
            self.replica_id,
            before,
            state.step,
            state.epoch,
            state.batch_in_epoch,
        )

    # -- the step --------------------------------------------------------------------------------

    def begin_quorum(self) -> None:
        """Start the next step's quorum; hold the state lock until that step's first forward."""
        manager = self.manager
        if not self._locked:
            manager.disallow_state_dict_read()
            self._locked = True
        self._quorum_started = time.monotonic()
        manager.start_quorum()
        self._quorum_pending = True

    def release_state(self) -> None:
        """Let the pending quorum read this group's state, between two steps, and wait for it.

        Called before the step's first forward. A peer that heals from this
        group has its state read on TorchFT's quorum thread; it must not run
        beside the forward and backward: FSDP2 puts unsharded parameters on
        the modules there (and its state-dict hook would put the sharded ones
        back under the running forward), and normalization layers update
        their buffers. So the loop waits here for the quorum, which normally
        formed while the batch loaded. What the peer then fetches is the
        parameters and optimizer state, unchanged until this step's commit
        (TorchFT stops serving them first), and copies of the buffers.
        """
        if self._locked:
            self._locked = False
            manager = self.manager
            manager.allow_state_dict_read()
            try:
                manager.wait_quorum()
            except Exception as exc:
                self.raise_quorum_error(exc)
                raise

    def commit(self) -> bool:
        """The Manager's commit vote for this step (applies a pending heal first)."""
        manager = self.manager
        try:
            commit = manager.should_commit()
        except Exception as exc:
            self.raise_quorum_error(exc)
            raise
        self._quorum_pending = False
        self.participants = manager.num_participants()
        self.participating_rank = manager.participating_rank()
        if not commit:
            self.commit_failures += 1
            logger.warning(
                "ft: replica group %d: commit refused at step %d (%d so far): the step is skipped",
                self.replica_id,
                self._engine.state.step + 1 if self._engine is not None else -1,
                self.commit_failures,
            )
        return bool(commit)

    def raise_quorum_error(self, error: BaseException) -> None:
        """Raise `QuorumError` if the pending quorum failed (called when a step raised `error`)."""
        if not self._quorum_pending:
            return
        try:
            self.manager.wait_quorum()
        except Exception as failed:
            raise QuorumError(self._quorum_message(failed)) from failed

    def _quorum_message(self, failed: BaseException) -> str:
        config = self.config
        waited = time.monotonic() - self._quorum_started
        step = self._engine.state.step + 1 if self._engine is not None else "?"
        try:
            status = lighthouse_status(str(config.lighthouse), timeout=0.5)
        except Exception as exc:
            seen = f"its /status page could not be read ({type(exc).__name__}: {exc})"
            missing = [i for i in range(self.group_size) if i != self.replica_id]
            who = f"replica groups other than this one: {missing}"
        else:
            ids = set()
            for name in status["heartbeats"]:
                digits = re.search(r"(\d+)$", name)
                if digits is not None and name.startswith("replica_"):
                    ids.add(int(digits.group(1)))
            missing = [i for i in range(self.group_size) if i not in ids]
            seen = f"replica groups heartbeating there: {sorted(ids)}; its quorum status: {status['next']!r}"
            who = f"missing replica groups: {missing}"
        return (
            f"TorchFT quorum for step {step} did not form within quorum_timeout={config.quorum_timeout:g} s "
            f"(waited {waited:.1f} s): lighthouse {config.lighthouse}; {who} of group_size={self.group_size} "
            f"(min_replica_size={config.min_replica_size}; this is replica group {self.replica_id}); {seen}. "
            f"Start the missing replica groups, or check the lighthouse address and its --min_replicas "
            f"({type(failed).__name__}: {failed})"
        )

    def all_reduce_hook(self) -> Any:
        """FSDP2's all-reduce hook: average a gradient shard across replica groups through the Manager.

        Runs after the group's reduce-scatter (and HSDP all-reduce), in place.
        A failed all-reduce does not raise: the Manager records it and refuses
        the step's commit.
        """
        manager = self.manager

        def hook(output: torch.Tensor) -> None:
            manager.allreduce(output).wait()

        return hook

    def build_step(self, engine: Engine, step: Step) -> Step:
        """Wrap a backend's step: quorum per step, commit-gated optimizer step, healing."""
        if self.manager is None:
            raise RuntimeError("ft: the backend's setup did not start TorchFT (FaultTolerance.start)")
        inner_sync, inner_backward, inner_step, inner_skip, inner_zero = (
            step.gradient_sync,
            step.backward,
            step.optimizer_step,
            step.skip_step,
            step.zero_grad,
        )
        requests = engine.requests
        stop_slot = requests.index["stop"]
        agreed, state = requests.agreed, engine.state
        commit, release, begin = self.commit, self.release_state, self.begin_quorum

        if not self._quorum_pending:
            begin()  # the first step's quorum: it forms while the first batch loads

        def gradient_sync(enabled: bool) -> None:
            release()  # the state between two steps has been read (or was not asked for)
            inner_sync(enabled)

        def backward(loss: torch.Tensor, micro_batches: int) -> None:
            try:
                # The backend's own (the mesh's: inside loss_parallel when configured).
                inner_backward(loss, micro_batches)
            except Exception as exc:  # the all-reduce waits for the quorum: say why it failed
                self.raise_quorum_error(exc)
                raise

        def optimizer_step() -> Any:
            if not commit():
                return False  # counted as an agreed skip by the loop
            result = inner_step()
            return None if result is False else result

        def skip_step() -> None:
            commit()  # the Manager counts every step (and applies a pending heal)
            inner_skip()

        def zero_grad() -> None:
            inner_zero()
            # No quorum after the fit's last step: a group that leaves must not be
            # waited for by the others (their next quorum forms without it).
            target = engine.fit_target[0]
            if state.step + 1 < target and not agreed[stop_slot]:
                begin()

        if getattr(engine.backend, "scaler", None) is not None:
            raise unsupported("a backend that backpropagates itself (fp16 GradScaler)", "use bf16 or fp32")
        return attrs.evolve(
            step,
            gradient_sync=gradient_sync,
            backward=backward,
            optimizer_step=optimizer_step,
            skip_step=skip_step,
            zero_grad=zero_grad,
        )

    def describe(self) -> str:
        return (
            f"ft(replica {self.replica_id}/{self.group_size}, min {self.config.min_replica_size}, "
            f"lighthouse {self.config.lighthouse})"
        )


#: The key marking a DTensor sent as its local shard (`local_shards`).
_SHARD = "__cadence_local_shard__"


def local_shards(tree: Any, copies: frozenset[int] = frozenset()) -> Any:
    """`tree` with every DTensor replaced by its local shard, its global shape and stride (for healing).

    TorchFT heals group rank r from group rank r of a live group, whose mesh
    inside the group is the same: each rank sends its own shards as plain
    tensors and the receiver rebuilds DTensors on its own mesh
    (`from_local_shards`). Other values pass unchanged, but a tensor (or
    local shard) whose storage is one of `copies` (`storage_of`) is sent as
    a copy: the buffers that the forward running while a peer fetches
    updates in place.
    """
    if isinstance(tree, Mapping):
        return {key: local_shards(value, copies) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_shards(value, copies) for value in tree)
    if _is_dtensor(tree):
        shard = local_shards(tree.to_local(), copies)
        return {_SHARD: shard, "shape": tuple(tree.shape), "stride": tuple(tree.stride())}
    if copies and hasattr(tree, "untyped_storage") and storage_of(tree) in copies:
        return tree.clone()
    return tree


def storage_of(tensor: torch.Tensor) -> int:
    """The data pointer of a tensor's storage (of its local shard for a DTensor)."""
    if _is_dtensor(tensor):
        tensor = tensor.to_local()
    return tensor.untyped_storage().data_ptr()


def _is_dtensor(value: Any) -> TypeGuard[DTensor]:
    return hasattr(value, "to_local") and hasattr(value, "placements")


def from_local_shards(tree: Any, specs: Mapping[str, Any], spec: Any = None) -> Any:
    """Undo `local_shards`: each shard becomes a DTensor on the mesh and placements of `specs[name]`.

    `specs` is this rank's model state dict (by parameter name): the entry for
    a name gives the mesh of that name's value in the model state and of its
    optimizer state (exp_avg, momentum_buffer, ... under the same name).
    """
    if isinstance(tree, Mapping):
        if _SHARD in tree:
            if spec is None or not hasattr(spec, "placements"):
                raise RuntimeError("ft: healing received a sharded tensor for an entry this model does not shard")
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(
                tree[_SHARD],
                spec.device_mesh,
                spec.placements,
                run_check=False,
                shape=tree["shape"],
                stride=tree["stride"],
            )
        return {key: from_local_shards(value, specs, specs.get(key, spec)) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(from_local_shards(value, specs, spec) for value in tree)
    return tree


def wrap_ddp(manager: Any, module: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """TorchFT's DistributedDataParallel: gradients all-reduced across replica groups through the Manager."""
    torchft = import_torchft()
    options.pop("find_unused_parameters", None)  # TorchFT sets it (it keeps the buckets from being rebuilt)
    return torchft.DistributedDataParallel(manager, module, **options)
