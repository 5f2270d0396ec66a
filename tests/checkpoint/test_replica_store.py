"""The checkpoint side of TorchFT, in one process: the writer decided at each save, per-replica data states.

A backend here pretends to be one replica group (its `writes_checkpoint` and
store are what the ddp backend's `ft` option sets); tests/backends/test_ft.py
runs the real thing across processes.
"""

from __future__ import annotations

import torch

import cadence
from cadence.backends.local import LocalBackend
from cadence.callbacks import Checkpoint
from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.replica import ReplicaStore
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


def engine_on(backend, folder, **checkpoint):
    model = tiny_model()
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_dataset(96),
        eval_data=tiny_dataset(40),
        loss_fn=torch.nn.functional.cross_entropy,
        backend=backend,
        callbacks=[Checkpoint(dir=str(folder), interval=1, keep_latest_k=0, **checkpoint)],
        seed=0,
        train={"batch_size": 4},
        eval={"batch_size": 8},
        eval_every_epochs=None,
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
