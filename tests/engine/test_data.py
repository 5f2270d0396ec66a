"""Data sharding: training padded to equal counts, evaluation and prediction exact (each sample once)."""

from __future__ import annotations

import logging
import pickle
import platform

import pytest
import torch
import torch._dynamo  # DDP imports it (~1.5 s): once here, not in every forked worker

import cadence
from cadence.backends.ddp import DDPBackend
from cadence.engine.data import DataConfig, DataSource, ExactShardSampler
from cadence.engine.loader_checks import fork_can_deadlock
from cadence.launch import launch
from tests.conftest import tiny_dataset

pytestmark = pytest.mark.timeout(60)


class IndexDataset(torch.utils.data.Dataset):
    """Item i is the tensor [i]: a batch says which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index])


def indices_seen(source: DataSource, epoch: int = 0) -> list[int]:
    return [i for batch in source.epoch_iter(epoch, fresh=True) for i in batch.flatten().tolist()]


def shards(n: int, split: str, ranks: int = 2, epoch: int = 0, **config) -> list[list[int]]:
    return [
        indices_seen(
            DataSource(IndexDataset(n), DataConfig(**config), split=split, seed=7, data_rank=r, data_size=ranks), epoch
        )
        for r in range(ranks)
    ]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("split", ["eval", "predict"])
def test_eval_and_predict_see_every_sample_exactly_once_across_ranks(split, num_workers):
    per_rank = shards(65, split, batch_size=4, num_workers=num_workers)
    assert sorted(i for rank in per_rank for i in rank) == list(range(65))  # no padding, no dropping
    assert per_rank[0] == list(range(0, 65, 2)) and per_rank[1] == list(range(1, 65, 2))  # unshuffled: strided


@pytest.mark.parametrize("ranks, n", [(2, 65), (3, 10), (4, 4), (5, 101)])
def test_a_shuffled_eval_shard_is_still_exact_and_the_same_permutation_on_every_rank(ranks, n):
    for epoch in (0, 1):
        per_rank = shards(n, "eval", ranks=ranks, epoch=epoch, batch_size=3, shuffle=True)
        assert sorted(i for rank in per_rank for i in rank) == list(range(n))
        assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1
    if n > 10:  # 4 samples may well come out in the same order twice
        assert shards(n, "eval", ranks=ranks, batch_size=3, shuffle=True) != shards(
            n, "eval", ranks=ranks, epoch=1, batch_size=3, shuffle=True
        )  # reshuffled with the epoch


def test_training_stays_padded_to_equal_counts():
    per_rank = shards(65, "train", batch_size=4, shuffle=False)
    assert [len(rank) for rank in per_rank] == [33, 33]  # one sample repeated so that DDP takes equal steps
    assert sorted(set(i for rank in per_rank for i in rank)) == list(range(65))


def test_an_eval_rank_without_a_batch_is_an_error_before_anything_runs():
    with pytest.raises(ValueError, match=r"eval data: 1 samples over 2 data ranks leave a rank with no batch"):
        shards(1, "eval")
    with pytest.raises(ValueError, match=r"drop_last=True"):
        shards(9, "predict", batch_size=5, drop_last=True)  # 5 + 4 samples: rank 1's only batch is dropped
    assert [len(rank) for rank in shards(9, "predict", batch_size=4, drop_last=True)] == [4, 4]


def test_sampler_pickles_and_counts_its_share():
    sampler = ExactShardSampler(range(7), num_replicas=3, rank=1, shuffle=True, seed=5)
    sampler.set_epoch(2)
    copy = pickle.loads(pickle.dumps(sampler))
    assert list(copy) == list(sampler) and len(sampler) == len(list(sampler)) == 2
    assert [len(ExactShardSampler(range(7), num_replicas=3, rank=r)) for r in range(3)] == [3, 2, 2]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\), got 3"):
        ExactShardSampler(range(7), num_replicas=3, rank=3)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_restores_the_position_within_a_shard(num_workers):
    def source():
        config = DataConfig(batch_size=2, shuffle=True, num_workers=num_workers)
        return DataSource(IndexDataset(23), config, split="eval", seed=3, data_rank=1, data_size=2)

    first = source()
    iterator = first.epoch_iter(1, fresh=True)
    head = [next(iterator).flatten().tolist() for _ in range(2)]
    state = first.state_dict()
    rest = [batch.flatten().tolist() for batch in iterator]
    resumed = source()
    resumed.load_state_dict(state)
    assert [batch.flatten().tolist() for batch in resumed.epoch_iter(1, fresh=False)] == rest
    assert [i for b in head + rest for i in b] == indices_seen(source(), epoch=1)  # rank 1's whole share
    assert len(head + rest) == 6  # 11 samples in batches of 2


# -- on 2 gloo ranks -------------------------------------------------------------------------

SAMPLES, BATCH = 65, 4  # 65 = 16 x (2 x 4) + 1: rank 0 holds 33 samples in 9 batches, rank 1 32 in 8


def batchnorm_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # BatchNorm has buffers: with DDP's buffer sync on (the default), a forward can be a collective.
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )


def exact_mean_loss(model: torch.nn.Module, dataset) -> float:
    """The loss over the whole dataset, in one process."""
    inputs, targets = dataset.tensors
    model.eval()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(inputs).double(), targets, reduction="sum").item() / len(dataset)


def _evaluate_on_two_ranks():
    dataset = tiny_dataset(SAMPLES)
    model = batchnorm_model()
    with cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset,
        loss_fn=torch.nn.functional.cross_entropy, eval_data=dataset, predict_data=dataset,
        backend=DDPBackend(timeout=20, device="cpu"), seed=0,  # a hung collective fails in 20 s
        train={"batch_size": BATCH}, eval={"batch_size": BATCH}, predict={"batch_size": BATCH},
    ) as engine:  # fmt: skip
        batches = len(engine.data["val"])
        results = [engine.evaluate()["val.loss"]]
        expected = [exact_mean_loss(model, dataset)]
        engine.fit(steps=2)  # a training forward in between re-arms DDP's buffer sync
        results.append(engine.evaluate()["val.loss"])
        expected.append(exact_mean_loss(model, dataset))
        results.append(engine.evaluate()["val.loss"])  # twice in a row
        predicted = sum(len(out) for out in engine.predict())
        engine.fit(steps=1)  # still in step after evaluations of unequal lengths
        return engine.backend.all_gather_object((batches, predicted, results, expected))


@pytest.mark.timeout(90)
def test_evaluation_on_two_ranks_with_unequal_batch_counts_is_the_exact_global_mean():
    per_rank = launch(_evaluate_on_two_ranks, nprocs=2, start_method="fork", timeout=60)
    (_, _, results, expected), (_, _, results_1, _) = per_rank
    assert results == results_1  # every rank gets the reduced value
    assert results[0] == pytest.approx(expected[0], rel=1e-6, abs=1e-7)
    assert results[1] == pytest.approx(expected[1], rel=1e-6, abs=1e-7)
    assert results[2] == pytest.approx(expected[1], rel=1e-6, abs=1e-7)
    assert expected[0] != expected[1]  # training changed the model
    assert [batches for batches, *_ in per_rank] == [9, 8]  # unequal counts, and nothing hung
    assert [predicted for _, predicted, *_ in per_rank] == [33, 32]  # 65 predictions, none repeated


def test_building_a_loader_shows_no_torchdata_deprecation_warning():
    # torchdata's `set_vital` deprecation would be the first line of every run and notebook cell.
    import warnings

    from tests.conftest import tiny_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = tiny_model()
        cadence.Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            tiny_dataset(),
            loss_fn=torch.nn.functional.cross_entropy,
            device="cpu",
        )
    assert not [w for w in caught if "set_vital" in str(w.message)]


def test_which_pythons_can_hang_a_forked_worker():
    # CPython gh-112275: fixed in 3.10.15, 3.11.10 and 3.12.0.
    hangs = [(3, 10, 0), (3, 10, 14), (3, 11, 0), (3, 11, 7), (3, 11, 9)]
    fixed = [(3, 10, 15), (3, 11, 10), (3, 11, 14), (3, 12, 0), (3, 13, 5), (3, 14, 0)]
    assert [fork_can_deadlock(v) for v in hangs] == [True] * len(hangs)
    assert [fork_can_deadlock(v) for v in fixed] == [False] * len(fixed)


def _fork_warnings() -> dict[str, object]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cadence").addHandler(handler)
    torch.distributed.init_process_group("gloo")  # launch set the rendezvous: a process with gloo's threads
    try:
        heard = {}
        for name, data, config in [
            ("forkserver", torch.utils.data.DataLoader(IndexDataset(8), batch_size=4, num_workers=2,
                                                       multiprocessing_context="forkserver"), DataConfig()),
            ("persistent", torch.utils.data.DataLoader(IndexDataset(8), batch_size=4, num_workers=2,
                                                       persistent_workers=True), DataConfig()),
            ("built forkserver", IndexDataset(8), DataConfig(batch_size=4, num_workers=2,
                                                             multiprocessing_context="forkserver")),
            ("fork", torch.utils.data.DataLoader(IndexDataset(8), batch_size=4, num_workers=2), DataConfig()),
            ("fork again", torch.utils.data.DataLoader(IndexDataset(8), batch_size=4, num_workers=1), DataConfig()),
        ]:  # fmt: skip
            del records[:]
            DataSource(data, config, split="eval", seed=0)
            heard[name] = list(records)
        built = DataSource(
            IndexDataset(8), DataConfig(batch_size=4, num_workers=2, multiprocessing_context="forkserver"),
            split="train", seed=0,
        )  # fmt: skip
        heard["start method"] = built.loader.multiprocessing_context.get_start_method()
        heard["built forkserver samples"] = sorted(
            i for b in built.epoch_iter(0, fresh=True) for i in b.flatten().tolist()
        )
        return heard
    finally:
        torch.distributed.destroy_process_group()
        logging.getLogger("cadence").removeHandler(handler)


@pytest.mark.timeout(120)
def test_a_loader_that_forks_workers_beside_distributed_threads_warns_on_the_pythons_that_can_hang():
    heard = launch(_fork_warnings, nprocs=1, start_method="fork", timeout=90)
    assert heard["forkserver"] == heard["persistent"] == heard["built forkserver"] == []
    assert heard["start method"] == "forkserver" and heard["built forkserver samples"] == list(range(8))
    assert heard["fork again"] == []  # once per split and process
    if fork_can_deadlock():
        (message,) = heard["fork"]
        assert "eval data" in message and "2 workers" in message and "gh-112275" in message
        assert "multiprocessing_context='forkserver'" in message and platform.python_version() in message
    else:
        assert heard["fork"] == []
