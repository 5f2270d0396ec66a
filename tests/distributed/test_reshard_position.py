"""A train epoch resumed on another number of data ranks goes on from its exact position (issue 34):
the rest of the epoch's order is re-split over the new ranks, no sample repeated or skipped."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

import cadence
from cadence.callbacks.checkpoint import Checkpoint
from cadence.launch import launch
from tests.conftest import tiny_model
from tests.distributed.test_ddp_checkpoint import SeenSamples, indexed_dataset, process_group

pytestmark = pytest.mark.timeout(300)

SAMPLES = 72  # 2 ranks x 9 batches of 4; after 3 steps, 48 samples are left: 12 batches on 1 rank, 4 on 3


def make_engine(*, callbacks=(), step_fn=None, shuffle=True, backend=None, **config):
    model = tiny_model(seed=3)
    return cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), indexed_dataset(SAMPLES), step_fn=step_fn,
        callbacks=callbacks, seed=0, train={"batch_size": 4, "shuffle": shuffle}, device="cpu", backend=backend,
        **config,
    )  # fmt: skip


def part(save_to: str, resume: str | None, steps: int | None, shuffle: bool = True, mesh: bool = False):
    """Train on this launch's ranks to `steps` (None: the epoch's end), saving `latest` in `save_to`;
    returns every rank's seen sample indices. `mesh`: FSDP2 over all ranks (`MeshBackend`, the DCP store)."""
    backend = None
    if mesh:
        from cadence.backends.mesh import MeshBackend

        backend = MeshBackend(shard=int(os.environ["WORLD_SIZE"]), timeout=60, device="cpu")
    elif "RANK" in os.environ:
        process_group()
    seen = SeenSamples()
    checkpoint = Checkpoint(dir=save_to, interval=0, resume=resume)
    # Absolute targets in the config: a resumed run trains from its restored step to them.
    target = {"epochs": 1} if steps is None else {"steps": steps}
    engine = make_engine(callbacks=[checkpoint], step_fn=seen, shuffle=shuffle, backend=backend, **target)
    engine.fit()
    samples = [i for step in seen.steps for i in step]
    return engine.backend.all_gather_object(samples) if engine.backend.world_size > 1 else [samples]


def on(ranks: int, *args, mesh: bool = False):
    if ranks == 1 and not mesh:
        return part(*args)
    return launch(part, *args, mesh=mesh, nprocs=ranks, start_method="fork", timeout=240)


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
def test_two_ranks_to_mid_epoch_then_one_or_three_see_exactly_one_epoch(tmp_path, shuffle):
    two = str(tmp_path / "two")
    first = on(2, two, None, 3, shuffle)
    assert [len(seen) for seen in first] == [12, 12]
    seen_first = Counter(i for seen in first for i in seen)
    # On one rank: the rest of the epoch, 12 batches.
    alone = on(1, str(tmp_path / "one"), f"{two}/latest", None, shuffle)
    assert len(alone[0]) == 48
    assert seen_first + Counter(alone[0]) == Counter(range(SAMPLES))
    # On three ranks, 2 steps (saved inside the re-split epoch), then on one rank to the epoch's end.
    three = on(3, str(tmp_path / "three"), f"{two}/latest", 5, shuffle)
    assert [len(seen) for seen in three] == [8, 8, 8]
    rest = on(1, str(tmp_path / "rest"), f"{tmp_path / 'three'}/latest", None, shuffle)
    assert len(rest[0]) == 24
    assert seen_first + Counter(i for seen in three for i in seen) + Counter(rest[0]) == Counter(range(SAMPLES))


def test_a_mesh_resharded_from_two_data_ranks_to_one_sees_exactly_one_epoch(tmp_path):
    two = str(tmp_path / "two")
    first = on(2, two, None, 3, mesh=True)
    assert [len(seen) for seen in first] == [12, 12]
    alone = on(1, str(tmp_path / "one"), f"{two}/latest", None, mesh=True)
    assert len(alone[0]) == 48
    assert Counter(i for seen in first for i in seen) + Counter(alone[0]) == Counter(range(SAMPLES))


def test_one_process_to_mid_epoch_then_two_ranks_see_exactly_one_epoch(tmp_path):
    """The one-process loader shuffles with its own generator (seeded `seed + epoch`): the same global order."""
    one = str(tmp_path / "one")
    first = on(1, one, None, 6)
    assert len(first[0]) == 24
    two = on(2, str(tmp_path / "two"), f"{one}/latest", None)
    assert [len(seen) for seen in two] == [24, 24]
    assert Counter(first[0]) + Counter(i for seen in two for i in seen) == Counter(range(SAMPLES))
