"""The checkpoint store contract on 2 gloo ranks: collective stores, store errors, positions over the data domain.

`CollectiveFileStore` is a file store whose `write` and `read` are real collectives of every rank (on a gloo group
of its own, as DCP's are): each call all-gathers what it is about to do and fails if the ranks disagree, so ranks
that enter different saves or reads are caught (or hang, which the launch timeout catches).
"""

from __future__ import annotations

import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch._dynamo  # DDP imports it (~1.5 s): once here, not in every forked worker
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.nn import functional as F

import cadence
from cadence.backends.ddp import DDPBackend
from cadence.callbacks.checkpoint import Checkpoint
from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.store import CheckpointError
from cadence.launch import launch
from tests.conftest import tiny_model
from tests.distributed.test_ddp_checkpoint import SeenSamples, indexed_dataset
from tests.distributed.test_ddp_training import flat_parameters

pytestmark = pytest.mark.timeout(120)

MAIN_ONLY = ("names", "link", "delete", "sweep", "manifest", "verify", "locate")


def run(fn, *args):
    return launch(fn, *args, nprocs=2, start_method="fork", timeout=90)


def process_group():
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))


def every_rank(result):
    """Each rank's `result`, in rank order (what a launched function returns: `launch` returns rank 0's)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, result)
    return out


class CollectiveFileStore(FileStore):
    """`write` and `read` are collectives of every rank; the main rank does the file work of a write.

    Args:
        slow_rank: this rank returns from every write 0.3 s after the others (its writer thread lags).
        fail_at: every rank's write of this step raises DCP's `CheckpointException` (after the collectives,
            as DCP raises it on every rank once it has gathered the failures).
    """

    collective = True

    def __init__(self, directory=None, *, slow_rank=None, fail_at=None):
        super().__init__(directory, durable=False)
        self.group = dist.new_group(backend="gloo")  # its own group: writes may run in the writer thread
        self.rank = dist.get_rank()
        self.slow_rank, self.fail_at = slow_rank, fail_at
        self.calls: list = []  # the collectives this rank entered, in order (shared by the copies at() makes)
        self.strays: list = []  # main-only methods called on another rank
        self._inside = 0  # within read: FileStore.read calls manifest itself

    def _collective(self, what):
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, what, group=self.group)
        self.calls.append(what)
        if any(other != what for other in everyone):
            raise RuntimeError(f"ranks entered different collectives: {everyone}")

    def write(self, name, payload):
        step = payload["meta"]["step"]
        self._collective(("write", name, step))
        box = [super().write(name, payload) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        if step == self.fail_at:
            failure = (OSError(28, "No space left on device"), traceback.extract_stack())
            raise CheckpointException("CheckpointException: save failed", {1: failure})
        if self.rank == self.slow_rank:
            time.sleep(0.3)
        return box[0]

    def read(self, name, keys=None):
        self._collective(("read", name))
        self._inside += 1
        try:
            return super().read(name, keys)
        finally:
            self._inside -= 1

    def barrier(self):
        self._collective(("barrier",))

    def _main_only(self, method):
        if self.rank != 0 and not self._inside:
            self.strays.append(method)


for _method in MAIN_ONLY:

    def _watched(self, *args, _name=_method, **kwargs):
        self._main_only(_name)
        return getattr(FileStore, _name)(self, *args, **kwargs)

    setattr(CollectiveFileStore, _method, _watched)


class CollectiveBackend(DDPBackend):
    def __init__(self, **store_options):
        super().__init__(timeout=30, device="cpu")
        self.store_options = store_options

    def checkpoint_store(self, engine):
        return CollectiveFileStore(**self.store_options)


def make_engine(backend, *, callbacks=(), shuffle=False, step_fn=None, steps=None):
    model = tiny_model(seed=3)
    return cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), indexed_dataset(),
        step_fn=step_fn or SeenSamples(), callbacks=callbacks, seed=0, steps=steps, backend=backend,
        train={"batch_size": 4, "shuffle": shuffle},
        device="cpu",
    )  # fmt: skip


def checkpoint_of(engine) -> Checkpoint:
    return next(c for c in engine.callbacks if isinstance(c, Checkpoint))


def test_collective_store_saves_prunes_and_auto_resumes_with_every_rank_in_the_same_collectives(tmp_path):
    directory = tmp_path / "ckpt"

    def train():
        process_group()
        engine = make_engine(
            CollectiveBackend(), callbacks=[Checkpoint(dir=str(directory), interval=1, keep_latest_k=2)]
        )
        params = {}
        engine.on(cadence.Event.ON_STEP_END)(lambda e: params.__setitem__(e.state.step, flat_parameters(e.model)))
        engine.fit(steps=4)
        first = checkpoint_of(engine).store
        dist.barrier()
        if dist.get_rank() == 0:  # damage latest (and ckpt-s4, which shares its files): auto_resume falls back
            path = directory / "latest" / "model.bin"
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x01
            path.write_bytes(bytes(data))
        dist.barrier()
        checkpoint = Checkpoint(dir=str(directory), auto_resume=True, save_on_fit_end=False)
        resumed = make_engine(CollectiveBackend(), callbacks=[checkpoint])
        resumed.fit(steps=0)  # on_setup: auto_resume
        return every_rank(
            {
                "saved": first.calls,
                "strays": first.strays + checkpoint.store.strays,
                "resume": checkpoint.store.calls,
                "step": resumed.state.step,
                "equal": torch.equal(flat_parameters(resumed.model), params[3]),
            }
        )

    rank0, rank1 = run(train)
    assert rank0["saved"] == rank1["saved"] and rank0["resume"] == rank1["resume"]
    assert [c for c in rank0["saved"] if c[0] == "write"] == [("write", "latest", s) for s in (1, 2, 3, 4)]
    assert rank0["saved"].count(("barrier",)) == 5  # the sweep at start, then the names of each save
    assert rank0["resume"] == [("barrier",), ("read", "ckpt-s000000000003")]  # candidates checked on rank 0 only
    assert rank0["strays"] == rank1["strays"] == []
    for report in (rank0, rank1):
        assert report["step"] == 3 and report["equal"], report
    assert sorted(p.name for p in directory.iterdir()) == ["ckpt-s000000000003", "ckpt-s000000000004", "latest"]


def test_async_saves_of_a_collective_store_are_the_same_on_every_rank_when_one_lags(tmp_path):
    """A lagging writer thread once made one rank drop a waiting save the other was writing."""
    directory = tmp_path / "ckpt"

    def train():
        process_group()
        checkpoint = Checkpoint(dir=str(directory), interval=0, async_mode="async")
        engine = make_engine(CollectiveBackend(slow_rank=1), callbacks=[checkpoint])
        engine.on(cadence.Event.ON_STEP_END)(lambda e: checkpoint.save(e))  # a latest-only save at every step
        engine.fit(steps=6)
        return every_rank((checkpoint.store.calls, checkpoint.store.strays))

    (calls0, strays0), (calls1, strays1) = run(train)
    assert calls0 == calls1
    assert [c for c in calls0 if c[0] == "write"] == [("write", "latest", s) for s in range(1, 7)]
    assert strays0 == strays1 == []
    assert FileStore(directory).manifest("latest")["step"] == 6


def test_dcp_checkpoint_exception_reaches_every_rank_as_a_checkpoint_error(tmp_path):
    """DCP's CheckpointException is a BaseException: it used to escape `except Exception` and skip the barrier."""
    directory = tmp_path / "ckpt"

    def train():
        process_group()
        engine = make_engine(CollectiveBackend(fail_at=2), callbacks=[Checkpoint(dir=str(directory), interval=2)])
        with pytest.raises(CheckpointError) as caught:  # a documented error reaches the caller as itself
            engine.fit(steps=4)
        error = caught.value
        return every_rank((type(error).__name__, str(error), engine.state.step))

    for name, message, step in run(train):
        assert name == "CheckpointError" and step == 2, message
        assert f"checkpoint {directory / 'latest'} (step 2): saving ['latest', 'ckpt-s000000000002'] failed" in message
        assert "CheckpointException" in message and "No space left on device" in message


class OneDataRank(DDPBackend):
    """Two ranks that see the same data (a data domain of one rank), as tensor-parallel peers do."""

    def setup(self, engine):
        super().setup(engine)
        self.data_rank, self.data_size = 0, 1

    def all_gather_object(self, obj, domain="data"):
        return [obj] if domain == "data" else super().all_gather_object(obj, domain)


class SeenWithDropout(SeenSamples):
    """Records the samples of each step; dropout draws from each rank's own RNG (restored per rank)."""

    def __call__(self, model, batch):
        inputs, targets, index = batch
        self.steps.append(index.tolist())
        return F.cross_entropy(F.dropout(model(inputs), p=0.5, training=True), targets)


def test_the_train_position_is_kept_over_the_data_domain_and_the_rng_per_rank(tmp_path):
    directory = tmp_path / "ckpt"

    def train():
        process_group()
        torch.manual_seed(dist.get_rank())  # the ranks' RNG differ (the engine seeds every rank alike)
        uninterrupted = SeenWithDropout()
        reference = make_engine(OneDataRank(timeout=30, device="cpu"), shuffle=True, step_fn=uninterrupted)
        reference.fit(steps=10)
        first = make_engine(
            OneDataRank(timeout=30, device="cpu"),
            shuffle=True,
            step_fn=SeenWithDropout(),
            callbacks=[Checkpoint(dir=str(directory), interval=0)],
        )
        first.fit(steps=5)  # 5 of the epoch's 16 batches: the position is saved
        seen = SeenWithDropout()
        resume = Checkpoint(dir=str(directory), resume=str(directory / "latest"))
        second = make_engine(
            OneDataRank(timeout=30, device="cpu"), shuffle=True, step_fn=seen, callbacks=[resume], steps=10
        )
        second.fit()
        payload = FileStore(directory).read("latest", keys=["data", "rng"])
        return every_rank(
            {
                "same_samples": seen.steps == uninterrupted.steps[5:],
                "bitwise_equal": torch.equal(flat_parameters(second.model), flat_parameters(reference.model)),
                "positions": len(payload["data"]["train"]),
                "rngs": len(payload["rng"]),
            }
        )

    for report in run(train):
        assert report == {"same_samples": True, "bitwise_equal": True, "positions": 1, "rngs": 2}, report
