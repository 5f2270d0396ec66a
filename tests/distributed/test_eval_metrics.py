"""Metric objects and gathered predictions on two gloo ranks with unequal shards equal one process exactly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch._dynamo  # DDP imports it (~1.5 s): once here, not in every forked worker
from torch.nn import functional as F

import cadence
from cadence.launch import launch
from cadence.metrics import Accuracy, Metric
from tests.conftest import tiny_dataset, tiny_model

torchmetrics = pytest.importorskip("torchmetrics", reason="needs torchmetrics: pip install 'cadence[metrics]'")

pytestmark = pytest.mark.timeout(120)

SAMPLES, CLASSES = 41, 4  # 21 + 20 samples; batches of 4: 6 on rank 0, 5 on rank 1


class MacroF1(Metric):
    """Macro F1 from per-class integer counts ("sum" states)."""

    def __init__(self, classes):
        super().__init__()
        self.classes = classes
        for name in ("tp", "fp", "fn"):
            self.add_state(name, torch.zeros(classes, dtype=torch.int64), "sum")

    def update(self, logits, target):
        pred = logits.argmax(1)
        for c in range(self.classes):
            self.tp[c] += ((pred == c) & (target == c)).sum()
            self.fp[c] += ((pred == c) & (target != c)).sum()
            self.fn[c] += ((pred != c) & (target == c)).sum()

    def compute(self):
        denominator = 2 * self.tp + self.fp + self.fn
        f1 = torch.where(denominator > 0, 2 * self.tp / denominator.clamp(min=1), torch.zeros(()))
        return f1.double().mean()


class MacroAUROC(Metric):
    """One-vs-rest macro AUROC from every sample's scores ("cat" states), by the rank-sum formula."""

    def __init__(self):
        super().__init__()
        self.add_state("scores", reduce="cat")
        self.add_state("target", reduce="cat")

    def update(self, logits, target):
        self.scores.append(logits.softmax(1))
        self.target.append(target)

    def compute(self):
        scores, target = torch.cat(self.scores).double(), torch.cat(self.target)
        areas = []
        for c in range(scores.shape[1]):
            s, positive = scores[:, c], target == c
            ranks = _average_ranks(s)
            n_pos, n_neg = int(positive.sum()), int((~positive).sum())
            areas.append((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
        return torch.stack(areas).mean()


def _average_ranks(values):
    order = values.argsort()
    ranks = torch.empty_like(values)
    ranks[order] = torch.arange(1, len(values) + 1, dtype=values.dtype)
    for v in values.unique():  # ties share their mean rank
        tied = values == v
        ranks[tied] = ranks[tied].mean()
    return ranks


def metrics():
    from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score

    return {
        "f1": MacroF1(CLASSES),
        "auroc": MacroAUROC(),
        "accuracy": Accuracy(),
        "tm": torchmetrics.MetricCollection(
            {"f1": MulticlassF1Score(CLASSES, average="macro"), "auroc": MulticlassAUROC(CLASSES, average="macro")}
        ),
    }


def make_engine(backend, given=metrics, **kwargs):
    model = tiny_model(seed=5, classes=CLASSES)
    return cadence.Engine(
        model,
        eval_data=tiny_dataset(SAMPLES, classes=CLASSES, seed=9),
        loss_fn=F.cross_entropy,
        metrics=None if given is None else given(),
        backend=backend,
        seed=0,
        eval={"batch_size": 4},
        **kwargs,
        device="cpu",
    )


def evaluate_on_two_ranks():
    with make_engine("ddp") as engine:
        batches = len(engine.data["val"])
        first = engine.evaluate()
        second = engine.evaluate()  # reset in between: the same values again
        return batches, first, second


def test_f1_and_auroc_on_two_ranks_with_unequal_shards_equal_one_process_exactly():
    batches, two_ranks, again = launch(evaluate_on_two_ranks, nprocs=2, start_method="fork", timeout=90)
    assert batches == 6  # rank 0 of 21 / 20 samples
    with make_engine("local") as engine:
        one_process = engine.evaluate()
    assert set(two_ranks) == {"val.loss", "val.f1", "val.auroc", "val.accuracy", "val.tm.f1", "val.tm.auroc"}
    for name in ("val.f1", "val.auroc", "val.accuracy", "val.tm.f1", "val.tm.auroc"):
        assert two_ranks[name] == one_process[name], name  # exactly, not approximately
    assert again == two_ranks
    # The protocol's metrics are the real ones: they agree with torchmetrics.
    assert two_ranks["val.f1"] == pytest.approx(two_ranks["val.tm.f1"], abs=1e-6)
    assert two_ranks["val.auroc"] == pytest.approx(two_ranks["val.tm.auroc"], abs=1e-6)
    assert 0.0 < two_ranks["val.f1"] < 1.0 and 0.0 < two_ranks["val.auroc"] < 1.0


# -- collectives ----------------------------------------------------------------------------------


def count_collectives(workdir, metric_sets):
    from cadence.testing.collectives import CollectiveLog, CountingDDPBackend

    rank = int(os.environ["RANK"])
    log = CollectiveLog(Path(workdir) / f"rank{rank}.jsonl")
    counts = []
    # One process group for the four engines (each would otherwise start and end its own).
    torch.distributed.init_process_group("gloo")
    with log.patch_torch_distributed():
        for given in metric_sets:
            engine = make_engine(CountingDDPBackend(log, device="cpu"), given)
            engine.evaluate()  # the first evaluation forms torchmetrics' compute groups
            before = log.count
            engine.evaluate()
            counts.append(log.count - before)
            engine.close()
    torch.distributed.destroy_process_group()
    return counts


def collection_of_three():
    from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score

    return torchmetrics.MetricCollection(
        [MulticlassF1Score(CLASSES), MulticlassAccuracy(CLASSES), MulticlassAUROC(CLASSES)]
    )


def one_metric():
    from torchmetrics.classification import MulticlassF1Score

    return MulticlassF1Score(CLASSES)


def everything():
    return {**metrics(), "collection": collection_of_three()}


def test_a_metric_collection_on_ddp_syncs_once_per_evaluation(tmp_path):
    counts = launch(
        count_collectives,
        str(tmp_path),
        [None, one_metric, collection_of_three, everything],
        nprocs=2,
        start_method="fork",
        timeout=90,
    )
    means_only, one, three, all_of_them = counts
    assert means_only == 1  # the reduction of the per-batch means
    # One synchronization round (a header and one packed payload), whatever the number of metrics and
    # states; torchmetrics syncing each member on its own would take 2 collectives per state.
    assert one == three == all_of_them == means_only + 2


# -- predictions ----------------------------------------------------------------------------------


class Index(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return (torch.tensor([float(i)]),)


def index_model():
    model = torch.nn.Linear(1, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0], [-1.0]]))
        model.bias.zero_()
    return model


def predict_on_two_ranks(directory, shuffle):
    from cadence.callbacks.prediction_writer import PredictionWriter

    writer = PredictionWriter(dir=directory, batches_per_file=2)
    with cadence.Engine(
        index_model(),
        callbacks=[writer],
        backend="ddp",
        seed=0,
        predict={"batch_size": 4, "shuffle": shuffle},
        device="cpu",
    ) as engine:
        mine = engine.predict(Index())
        gathered = engine.predict(Index(), gather=True)
        return int(os.environ["RANK"]), sum(len(o) for o in mine), gathered


@pytest.mark.parametrize("shuffle", [False, True])
def test_predict_gather_on_two_ranks_returns_every_sample_once_in_dataset_order(tmp_path, shuffle):
    from cadence.callbacks.prediction_writer import read_predictions

    rank, mine, gathered = launch(
        predict_on_two_ranks, str(tmp_path), shuffle, nprocs=2, start_method="fork", timeout=90
    )
    assert rank == 0 and mine == 21  # this rank's share only, without gather
    expected = torch.arange(SAMPLES, dtype=torch.float32)
    assert torch.equal(gathered[:, 0], expected) and torch.equal(gathered[:, 1], -expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        *(f"rank00000-0000{i}.pt" for i in range(3)),
        *(f"rank00001-0000{i}.pt" for i in range(3)),
    ]  # 6 and 5 batches, two per file
    written = read_predictions(tmp_path)
    assert torch.equal(written, gathered)


# -- the gather underneath --------------------------------------------------------------------------


def gather_mixed():
    from cadence.backends.ddp import DDPBackend
    from cadence.engine.gather import gather_tensors

    rank = int(os.environ["RANK"])
    with cadence.Engine(torch.nn.Linear(1, 1), backend=DDPBackend(device="cpu"), seed=0) as engine:
        mine = [
            torch.arange(3 + rank, dtype=torch.int64),  # unequal lengths
            torch.full((2, 1 + rank), 0.5 + rank, dtype=torch.float16),  # unequal shapes, odd byte counts
            torch.tensor(rank == 1),  # 0-d bool
            torch.empty(0) if rank == 0 else torch.ones(2, dtype=torch.float64),  # empty on one rank, dtypes differ
        ]
        collection = MacroAUROC()  # by hand, outside the engine
        collection.update(torch.randn(3 + rank, CLASSES), torch.arange(3 + rank) % CLASSES)
        with collection.sync(engine.backend):
            synced = len(torch.cat(collection.scores))
        return gather_tensors(engine.backend, mine), synced


def test_gather_tensors_carries_every_shape_and_dtype():
    gathered, synced = launch(gather_mixed, nprocs=2, start_method="fork", timeout=90)
    longs, halves, flags, mixed = gathered
    assert [t.tolist() for t in longs] == [[0, 1, 2], [0, 1, 2, 3]]
    assert [(t.dtype, tuple(t.shape), float(t[0, 0])) for t in halves] == [
        (torch.float16, (2, 1), 0.5),
        (torch.float16, (2, 2), 1.5),
    ]
    assert [bool(t) for t in flags] == [False, True] and flags[0].shape == ()
    assert mixed[0].numel() == 0 and mixed[1].dtype == torch.float64 and mixed[1].tolist() == [1.0, 1.0]
    assert synced == 7


def predict_with_an_empty_rank():
    rank = int(os.environ["RANK"])
    batches = [(torch.ones(3, 1),)] if rank == 0 else []
    with cadence.Engine(index_model(), backend="ddp", seed=0, device="cpu") as engine:
        engine.predict(batches, gather=True)


def test_a_rank_without_predictions_fails_every_rank_instead_of_hanging():
    from cadence.launch import WorkerError

    with pytest.raises(WorkerError, match=r"predict\(gather=True\): the ranks' outputs differ in structure"):
        launch(predict_with_an_empty_rank, nprocs=2, start_method="fork", timeout=60)


def local_engines_in_a_world():
    from torchmetrics.classification import MulticlassF1Score

    # A world of two processes whose engines each have a data domain of one process (as the tensor ranks
    # of one data group on a mesh): torchmetrics must not synchronize over the world.
    torch.distributed.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    data = tiny_dataset(10 + 7 * rank, classes=CLASSES, seed=rank)
    f1 = MulticlassF1Score(CLASSES, average="macro")
    with cadence.Engine(
        tiny_model(seed=5, classes=CLASSES),
        eval_data=data,
        loss_fn=F.cross_entropy,
        metrics={"f1": f1},
        backend="local",
        seed=0,
        device="cpu",
    ) as engine:
        in_engine = engine.evaluate()["val.f1"]
        inputs, targets = data.tensors
        with torch.no_grad():
            f1.update(engine.model(inputs), targets)
        by_hand = float(f1.compute())  # outside the engine: still this process only
    local = MulticlassF1Score(CLASSES, average="macro", sync_on_compute=False)
    world = MulticlassF1Score(CLASSES, average="macro")  # torchmetrics' default: the world, when there is one
    with torch.no_grad():
        for reference in (local, world):
            reference.update(tiny_model(seed=5, classes=CLASSES)(inputs), targets)
    expected, over_the_world = float(local.compute()), float(world.compute())
    results = [None, None]
    torch.distributed.all_gather_object(results, (in_engine, by_hand, expected, over_the_world))
    torch.distributed.destroy_process_group()
    return results


def test_a_one_process_data_domain_inside_a_world_is_not_synchronized_over_the_world():
    per_rank = launch(local_engines_in_a_world, nprocs=2, start_method="fork", timeout=60)
    for in_engine, by_hand, expected, over_the_world in per_rank:
        assert in_engine == by_hand == expected
        assert over_the_world != expected  # what the engine's settings prevent
    assert per_rank[0][0] != per_rank[1][0]  # each rank kept its own data's value
