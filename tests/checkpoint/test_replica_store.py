"""The checkpoint side of TorchFT, in one process: the writer decided at each save, per-replica data states.

A backend here pretends to be one replica group (its `writes_checkpoint` and
store are what the ddp backend's `ft` option sets); tests/backends/test_ft.py
runs the real thing across processes.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

import cadence
from cadence.backends.local import LocalBackend
from cadence.backends.mesh import MeshBackend
from cadence.callbacks import Checkpoint
from cadence.checkpoint.dcp_store import DCPStore
from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.replica import AsyncReplicaStore, ReplicaStore
from tests.conftest import tiny_dataset, tiny_model


class ReplicaGroup(LocalBackend):
    """Replica group `replica_id` of `groups`: writes the run's checkpoint only at the steps in `writes_at`."""

    def __init__(self, replica_id: int = 1, groups: int = 2, writes_at: tuple[int, ...] = ()) -> None:
        super().__init__(device="cpu")
        self.replica_id, self.groups, self.writes_at = replica_id, groups, writes_at
        self.data_rank, self.data_size = replica_id, groups
        self.engine = None

    def setup(self, engine) -> None:
        super().setup(engine)
        self.engine = engine

    @property
    def writes_checkpoint(self) -> bool:
        return self.engine.state.step in self.writes_at

    def data_shard(self, split: str) -> tuple[int, int]:
        return (self.data_rank, self.data_size) if split == "train" else (0, 1)

    def checkpoint_store(self, engine):
        return ReplicaStore(FileStore(), self.replica_id, self.groups)


def engine_on(backend, folder, samples=96, **checkpoint):
    model = tiny_model()
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_dataset(samples),
        eval_data=tiny_dataset(40),
        loss_fn=torch.nn.functional.cross_entropy,
        backend=backend,
        callbacks=[Checkpoint(dir=str(folder), interval=1, keep_latest_k=0, **checkpoint)],
        seed=0,
        train={"batch_size": 4},
        eval={"batch_size": 8},
        eval_every_epochs=None,
        device="cpu",
    )


def test_the_writer_is_decided_at_each_save_and_the_others_write_their_data_state(tmp_path):
    with engine_on(ReplicaGroup(writes_at=(2, 3)), tmp_path) as engine:
        engine.fit(steps=5)
        ckpt = engine.callbacks[0]
        assert ckpt.last_saved.step == 3  # on_save fires for the run's checkpoint only
    store = FileStore(tmp_path)
    assert store.names() == ["ckpt-s000000000002", "ckpt-s000000000003", "latest"]
    assert store.manifest("latest")["step"] == 3  # written while this group was the writer
    own = FileStore(tmp_path / "replicas" / "replica-1")
    assert own.names() == ["latest"] and own.manifest("latest")["step"] == 5  # every save
    state = own.read("latest")
    assert state["engine"]["batch_in_epoch"] == 5 and len(state["data"]["train"]) == 1
    assert "model" not in state


def test_restore_takes_the_group_s_own_data_position_over_the_checkpoint_s(tmp_path):
    with engine_on(ReplicaGroup(writes_at=(4,)), tmp_path) as engine:
        engine.fit(steps=6)  # the run's checkpoint at step 4, this group's data state at step 6
    with engine_on(ReplicaGroup(writes_at=()), tmp_path, auto_resume=True) as engine:
        engine.evaluate()  # the first run: on_setup restores
        assert engine.state.step == 4  # the run's checkpoint
        assert engine.state.batch_in_epoch == 6  # this group's own position wins
        resumed = engine.feed.iterator is not None and next(engine.feed.iterator)
    with engine_on(ReplicaGroup(writes_at=()), tmp_path / "reference") as engine:
        engine.fit(steps=6)
        expected = next(engine.feed.iterator)  # the batch after 6 of this group's share
    assert torch.equal(resumed[0], expected[0]) and torch.equal(resumed[1], expected[1])


def test_a_group_without_a_data_state_replays_its_share_to_the_checkpoint_s_batch(tmp_path):
    with engine_on(ReplicaGroup(replica_id=0, writes_at=(3,)), tmp_path) as engine:
        engine.fit(steps=3)
    with engine_on(ReplicaGroup(replica_id=1, writes_at=()), tmp_path, auto_resume=True) as engine:
        engine.evaluate()
        assert (engine.state.step, engine.state.batch_in_epoch) == (3, 3)
        assert engine.backend.data_shard("val") == (0, 1)
        assert len(engine.data[engine.eval_splits[0]]) == 5  # evaluation inside the group: the whole set (40 / 8)
        assert len(engine.data["train"]) == 12  # training: this group's half (48 / 4)


# -- a replica group of two ranks with the DCP store (the mesh backend's ft checkpoints) ------------
#
# Two forked ranks, FSDP2 over shard=2, pretending to be one replica group of two: the store is what
# `MeshBackend(ft=...)` builds (a `ReplicaStore` around the DCP store, the data state written by group
# rank 0, positions indexed inside the group). tests/backends/test_ft.py runs it with torchft.


class HeldCommits(DCPStore):
    """The DCP store, its async commits held until this group's data state of step `until` is committed.

    Forces the slow interleaving: the step-4 save of the run's checkpoint commits (and writes the
    group's data state) only after the group, no longer the writer, wrote its step-6 data state.
    """

    def __init__(self, *args, until: int, committed: threading.Event, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.until, self.committed = until, committed

    def write_async(self, name, payload, after_commit=None):
        def held(manifest):
            assert self.committed.wait(60), f"the data state of step {self.until} was never committed"
            if after_commit is not None:
                after_commit(manifest)

        return super().write_async(name, payload, after_commit=held)


class HeldReplicaStore(AsyncReplicaStore):
    """Tells `HeldCommits` when the data state of step `until` is committed."""

    def write_replica(self, name, payload) -> None:
        super().write_replica(name, payload)
        if payload["engine"]["step"] == self.inner.until:
            self.inner.committed.set()


class MeshReplicaGroup(MeshBackend):
    """Replica group `replica_id` of `groups` on a 2-rank mesh: writes the run's checkpoint at `writes_at`.

    `hold_until`: its async commits wait until its data state of that step is committed (`HeldCommits`).
    """

    def __init__(
        self, replica_id: int = 1, groups: int = 2, writes_at: tuple[int, ...] = (), hold_until: int | None = None
    ) -> None:
        super().__init__(shard=2, timeout=60, device="cpu")
        self.replica_id, self.groups, self.writes_at = replica_id, groups, writes_at
        self.hold_until = hold_until
        self.engine = None

    def setup(self, engine) -> None:
        super().setup(engine)
        self.engine = engine

    @property
    def writes_checkpoint(self) -> bool:
        return self.engine.state.step in self.writes_at

    def data_shard(self, split: str) -> tuple[int, int]:
        if split == "train":  # as under ft: this group's data ranks among every group's
            return self.replica_id * self.data_size + self.data_rank, self.groups * self.data_size
        return self.data_rank, self.data_size

    def checkpoint_store(self, engine):
        if self.hold_until is None:
            inner = DCPStore.for_engine(engine)
            return ReplicaStore(inner, self.replica_id, self.groups, main=self.rank == 0, positions=(0, self.data_size))
        inner = HeldCommits.for_engine(engine, until=self.hold_until, committed=threading.Event())
        main, positions = self.rank == 0, (0, self.data_size)
        return HeldReplicaStore(inner, self.replica_id, self.groups, main=main, positions=positions)


def _group_run(backend, folder: str, steps: int, **checkpoint) -> dict:
    with engine_on(backend, folder, samples=192, **checkpoint) as engine:  # 12 batches per data rank
        if steps:
            engine.fit(steps=steps)
        else:
            engine.evaluate()  # the first run: on_setup restores
        ckpt = next(c for c in engine.callbacks if isinstance(c, Checkpoint))
        assert ckpt.wait(60)
        state = engine.state
        following = next(engine.feed.iterator) if engine.feed.iterator is not None else None
        return {
            "step": state.step,
            "batch_in_epoch": state.batch_in_epoch,
            "next": None if following is None else following[0].clone(),
            "saved": None if ckpt.last_saved is None else ckpt.last_saved.step,
        }


def _two_rank_group(directory: str) -> dict:
    dist.init_process_group("gloo")
    out: dict = {}
    for mode in ("disabled", "async"):
        folder = f"{directory}/{mode}"
        # Group 1 writes the run's checkpoint at step 4 only; its data state at every save (to step 6).
        # Async: the step-4 commit (with its data state) is held until the step-6 data state is committed,
        # which once in six runs happened by itself and left the older data state (issue 34, defect 2).
        hold = 6 if mode == "async" else None
        first = _group_run(MeshReplicaGroup(writes_at=(4,), hold_until=hold), folder, 6, async_mode=mode)
        # It restarts: the run's checkpoint (step 4) and its own data position (batch 6), per data rank.
        again = _group_run(MeshReplicaGroup(), folder, 0, auto_resume=True, async_mode=mode)
        # Group 0 has no data state there: it replays its share to the checkpoint's batch.
        other = _group_run(MeshReplicaGroup(replica_id=0), folder, 0, auto_resume=True, async_mode=mode)
        out[mode] = {"first": first, "again": again, "other": other}
    out["reference"] = _group_run(MeshReplicaGroup(), f"{directory}/reference", 6)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)
    return every


def test_a_two_rank_group_writes_dcp_checkpoints_and_one_data_state_and_restores_per_data_rank(tmp_path):
    results = cadence.launch(_two_rank_group, str(tmp_path), nprocs=2, start_method="fork", timeout=120)
    per_rank = results  # every rank's
    for mode in ("disabled", "async"):
        folder = tmp_path / mode
        store = DCPStore(folder)
        assert store.names() == ["ckpt-s000000000004", "latest"]
        manifest = store.verify("latest")  # the group's two ranks wrote their shards; rank 0 committed
        assert (manifest["step"], manifest["world_size"], manifest["store"]) == (4, 2, "dcp")
        assert any(name.endswith(".distcp") for name in manifest["files"])
        own = FileStore(folder / "replicas" / "replica-1")
        assert own.names() == ["latest"]  # one data state for the group, written by its rank 0
        state = own.read("latest")
        assert (state["meta"]["step"], state["meta"]["group_world"], state["meta"]["data_ranks"]) == (6, 2, 2)
        assert len(state["data"]["train"]) == 2 and len(state["rng"]) == 2 and "model" not in state
        assert not (folder / "replicas" / "replica-0").exists()
    rank0 = per_rank[0]
    for mode in ("disabled", "async"):
        result = rank0[mode]
        assert result["first"]["saved"] == 4  # on_save: the run's checkpoint only
        assert (result["again"]["step"], result["again"]["batch_in_epoch"]) == (4, 6)
        assert (result["other"]["step"], result["other"]["batch_in_epoch"]) == (4, 4)
    for rank_result in per_rank:
        expected = rank_result["reference"]["next"]
        for mode in ("disabled", "async"):
            # Each data rank goes on with the batch after its own 6th: its own position came back.
            assert torch.equal(rank_result[mode]["again"]["next"], expected)
