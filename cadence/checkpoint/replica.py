"""Checkpoints of a job made of TorchFT replica groups: one run checkpoint, one data state per group.

The run's checkpoint (model, optimizers, schedulers, counters, callbacks) is
written by one replica group at a time (the backend's `writes_checkpoint`,
decided at each save) through the inner store, in the checkpoint folder as
usual. Each replica group's own *data state* (its train positions, its
`epoch`/`batch_in_epoch`/`samples_seen`/`tokens_seen` and its RNG states) is
written by that group at every save of `latest`, to
`replicas/replica-<id>/latest` in the same folder (a small file checkpoint).

On restore the group's own data state wins over the positions in the run's
checkpoint (which are the writing group's): every group goes on with its own
share of the data where it was. A group without a saved data state replays
its share up to the checkpoint's batch. See docs/fault-tolerance.md.

With a collective inner store (DCP: the mesh backend, FSDP2 inside each
group) every rank of the writing group writes the run's checkpoint together
(the store's collectives run on the group's own process group), while the
group's data state is one file written by the group's main rank (`main`): the
train positions in a payload are already gathered over the group's data ranks
(`build_payload`), one entry per data rank, so one file holds the positions of
every data rank of the group and commits them together. Over a store that
stages its own asynchronous saves (an `AsyncCheckpointStore`: DCP) the replica
store is one too (`AsyncReplicaStore`, chosen by `ReplicaStore(inner, ...)`):
its `write_async` goes through the inner store's, and the writing group's data
state is written after the run's checkpoint is committed.

A group's data states are committed in the order of its saves, as every store
commits its checkpoints: an async save's data state, written after its run
checkpoint commits, can come after a newer save's (written at once by a group
that did not write that checkpoint); it is then dropped, never written over
the newer one.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from cadence.checkpoint.store import (
    FORMAT,
    VERSION,
    AsyncCheckpointStore,
    CheckpointError,
    CheckpointStore,
    PendingSave,
)

logger = logging.getLogger("cadence.checkpoint")

#: The run checkpoint's entry for the TorchFT Manager's own counters (`Manager.state_dict`).
FT_KEY = "ft"
#: Engine counters that belong to a replica group's position in its own data.
DATA_COUNTERS = ("epoch", "batch_in_epoch", "samples_seen", "tokens_seen")


def replica_payload(payload: Mapping[str, Any], replica_id: int) -> dict[str, Any]:
    """The data state of a full payload built by this replica group (`build_payload`)."""
    engine = payload["engine"]
    rng = list(payload.get("rng") or [])
    return {
        "format": FORMAT,
        "version": VERSION,
        "meta": {
            "step": engine.get("step"),
            "epoch": engine.get("epoch"),
            "batch_in_epoch": engine.get("batch_in_epoch"),
            "replica_id": replica_id,
            "group_world": len(rng),
            "data_ranks": len((payload.get("data") or {}).get("train") or ()),
        },
        "engine": {name: engine[name] for name in DATA_COUNTERS if name in engine},
        "data": dict(payload.get("data") or {}),
        "rng": rng,
    }


class _DataStateOrder:
    """Orders the writes of one replica group's data state by the saves they belong to (shared by `at()` copies).

    Each save takes a ticket in the loop, in order; an async save writes its
    data state after its run checkpoint commits, possibly after a newer save's
    data state (a group that does not write the run's checkpoint writes its
    data state at once): the older one is then dropped, never written over it.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.issued = 0
        self.written = 0

    def ticket(self) -> int:
        with self.lock:
            self.issued += 1
            return self.issued


class ReplicaStore(CheckpointStore):
    """A store for one replica group: the run's checkpoints through `inner`, this group's data state beside them.

    Args:
        inner: the store of the run's checkpoints (the backend's usual one: a
            file store, or a collective DCP store whose collectives stay
            inside the replica group).
        replica_id: this replica group's id.
        group_size: the number of replica groups (data is sharded over all of them).
        main: this rank writes the group's data state (the group's main rank:
            with a collective inner store every rank of the group calls
            `write`/`write_replica`, and only one writes the data state file).
        positions: `(first, size)`: how the backend's `restore` indexes train
            positions (by `backend.data_rank`): a list of `size` entries in
            which this group's data ranks are `first, first + 1, ...`. None:
            by data rank over every replica group (`replica_id * group ranks`,
            `group_size * group ranks`: the ddp backend, whose `data_rank` is
            the job-wide one); the mesh backend indexes inside the group
            (`(0, data_size)`).
        ft: the group's `FaultTolerance` (`manager_state`/`load_manager_state`):
            the run's checkpoint carries its Manager's step (`"ft"`), which a
            full read puts back (TorchFT's own advice: a group restored to the
            same step as the others does not heal, see
            `FaultTolerance.load_manager_state`). None: not saved.
    """

    def __new__(cls, inner: CheckpointStore | None = None, *args: Any, **kwargs: Any) -> ReplicaStore:
        # Over a store that stages its own async saves, the replica store does too.
        if cls is ReplicaStore and isinstance(inner, AsyncCheckpointStore):
            cls = AsyncReplicaStore
        return super().__new__(cls)

    def __init__(
        self,
        inner: CheckpointStore,
        replica_id: int,
        group_size: int,
        *,
        main: bool = True,
        positions: tuple[int, int] | None = None,
        ft: Any = None,
    ) -> None:
        super().__init__(inner.directory)
        self.inner, self.replica_id, self.group_size = inner, replica_id, group_size
        self.main, self.positions, self.ft = main, positions, ft
        self._order = _DataStateOrder()
        self.kind = inner.kind  # type: ignore[misc]
        self.collective = inner.collective  # type: ignore[misc]
        self.background_safe = inner.background_safe  # type: ignore[misc]
        self.restores_model = inner.restores_model  # type: ignore[misc]

    def at(self, directory: Any) -> ReplicaStore:
        other = copy.copy(self)
        other.inner = self.inner.at(directory)
        other.directory = Path(directory)
        return other

    def replica_directory(self, replica_id: int | None = None) -> Path:
        """Where a replica group's data state lives (this group's by default)."""
        rid = self.replica_id if replica_id is None else replica_id
        return self.path("replicas") / f"replica-{rid}"

    def _replica_store(self) -> CheckpointStore:
        from cadence.checkpoint.file_store import FileStore

        return FileStore(self.replica_directory())

    # -- writing ----------------------------------------------------------------------------------

    def _with_manager(self, payload: Mapping[str, Any]) -> Mapping[str, Any]:
        if self.ft is None or "engine" not in payload:
            return payload
        return {**payload, FT_KEY: self.ft.manager_state()}

    def write(self, name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        manifest = self.inner.write(name, self._with_manager(payload))
        if name == "latest":
            self.write_replica(name, payload)
        return manifest

    def write_replica(self, name: str, payload: Mapping[str, Any]) -> None:
        """Write this group's data state (for `latest` only: a group's data state has one version; main rank only)."""
        if name == "latest" and self.main:
            self._write_state(self._order.ticket(), replica_payload(payload, self.replica_id))

    def _write_state(self, ticket: int, state: Mapping[str, Any]) -> None:
        """Commit the data state of the save that took `ticket`, unless a newer save's is already committed."""
        order = self._order
        with order.lock:
            if ticket < order.written:
                logger.info(
                    "ft: replica group %d's data state of step %s is older than the one committed; not written",
                    self.replica_id,
                    state["meta"].get("step"),
                )
                return
            self._replica_store().write("latest", state)
            order.written = ticket

    def link(self, src: str, dst: str) -> None:
        self.inner.link(src, dst)

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def wait(self) -> None:
        self.inner.wait()

    def barrier(self) -> None:
        self.inner.barrier()

    def sweep(self) -> list[str]:
        """Leftovers of this group's own interrupted data-state writes.

        The shared folder is left alone: another replica group, possibly on
        another host, may be writing the run's checkpoint into it right now.
        """
        return self._replica_store().sweep()

    # -- reading ----------------------------------------------------------------------------------

    def read(self, name: str, keys: Iterable[str] | None = None) -> dict[str, Any]:
        """The run's checkpoint `name` with this group's own data state in place of the writer's."""
        wanted = None if keys is None else list(keys)
        payload = self.inner.read(name, wanted)
        if wanted is not None and not {"engine", "data", "rng"} & set(wanted):
            return payload
        result = self.with_own_data(payload, source=str(self.inner.path(name)))
        if self.ft is not None and "engine" in payload:  # a full read: a restore follows
            self.ft.load_manager_state(payload.get(FT_KEY))
        return result

    def read_replica(self) -> dict[str, Any] | None:
        """This group's saved data state, or None when there is none (a damaged one is logged and ignored)."""
        store = self._replica_store()
        if not store.exists("latest"):
            return None
        try:
            return store.read("latest")
        except CheckpointError as exc:
            logger.warning("ft: ignoring this replica group's damaged data state: %s", exc)
            return None

    def _slots(self, payload: Mapping[str, Any], mine: Mapping[str, Any] | None) -> tuple[int, int]:
        """`(first, size)`: where this group's train positions go in the list `restore` indexes."""
        if self.positions is not None:
            return self.positions
        group_world = int((payload.get("meta") or {}).get("world_size") or len(payload.get("rng") or []) or 1)
        if mine is not None:
            group_world = int(mine["meta"].get("group_world") or group_world)
        return self.replica_id * group_world, self.group_size * group_world

    def with_own_data(self, payload: Mapping[str, Any], source: str = "") -> dict[str, Any]:
        """`payload` with this group's data position, data counters and RNG (its train positions by data rank)."""
        result = dict(payload)
        if "engine" not in payload:
            return result
        mine = self.read_replica()
        first, size = self._slots(payload, mine)
        positions: list[Any] = [None] * size
        if mine is None:
            # The run's checkpoint holds the writing group's positions, not ours:
            # this group replays its own share up to the checkpoint's batch.
            logger.info(
                "ft: no data state of replica group %d beside %s; its share of the data is replayed to batch %s",
                self.replica_id,
                source,
                payload["engine"].get("batch_in_epoch"),
            )
            result["data"] = {"train": positions} if (payload.get("data") or {}).get("train") is not None else {}
            return result
        own_positions = (mine.get("data") or {}).get("train")
        if own_positions is not None and first + len(own_positions) <= size:
            positions[first : first + len(own_positions)] = own_positions
            result["data"] = {**dict(payload.get("data") or {}), "train": positions}
        elif own_positions is not None:
            # Saved on another number of data ranks: `restore` sees the saved list, warns and
            # restarts the interrupted epoch (a position cannot be resharded).
            result["data"] = {**dict(payload.get("data") or {}), "train": list(own_positions)}
        else:
            result["data"] = {}
        result["engine"] = {**dict(payload["engine"]), **mine["engine"]}
        if mine.get("rng"):
            result["rng"] = mine["rng"]
        logger.info(
            "ft: replica group %d goes on with its own data position (epoch %s, batch %s, saved at step %s) "
            "and the run's checkpoint %s (step %s)",
            self.replica_id,
            mine["engine"].get("epoch"),
            mine["engine"].get("batch_in_epoch"),
            mine["meta"].get("step"),
            source,
            (payload.get("meta") or {}).get("step"),
        )
        return result

    def manifest(self, name: str) -> dict[str, Any]:
        return self.inner.manifest(name)

    def verify(self, name: str) -> dict[str, Any]:
        return self.inner.verify(name)

    def names(self) -> list[str]:
        return self.inner.names()

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def path(self, name: str) -> Path:
        return self.inner.path(name)

    def locate(self, path: Any) -> tuple[ReplicaStore, str]:
        store, name = self.inner.locate(path)
        other = copy.copy(self)
        other.inner, other.directory = store, store.directory
        return other, name


class AsyncReplicaStore(ReplicaStore, AsyncCheckpointStore):
    """A `ReplicaStore` over a store that stages its own async saves (`ReplicaStore(inner, ...)` picks it)."""

    def write_async(
        self,
        name: str,
        payload: Mapping[str, Any],
        after_commit: Callable[[dict[str, Any]], None] | None = None,
    ) -> PendingSave:
        """Every rank: the inner store's async save of the run's checkpoint.

        The group's data state of `payload` (small: positions, counters, RNG)
        is taken now and written by the inner store's committing rank right
        after the commit, before `after_commit`: it is never newer than the
        group's committed checkpoint. Returns the inner store's handle.
        """
        assert isinstance(self.inner, AsyncCheckpointStore)
        write_async = self.inner.write_async
        state = replica_payload(payload, self.replica_id)
        payload = self._with_manager(payload)
        if name != "latest":
            return write_async(name, payload, after_commit=after_commit)
        ticket = self._order.ticket()  # taken in the loop: this save's place among the group's saves

        def committed(manifest: dict[str, Any]) -> None:
            # On the inner store's main rank (DCP: group rank 0), in its commit thread, maybe after a
            # newer save's data state (written at once by a group that did not write this checkpoint).
            self._write_state(ticket, state)
            if after_commit is not None:
                after_commit(manifest)

        return write_async(name, payload, after_commit=committed)
