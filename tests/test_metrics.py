"""The Metric protocol and the built-in metrics (one process; synchronization on two ranks: tests/distributed)."""

from __future__ import annotations

import pytest
import torch

from cadence.backends.local import LocalBackend
from cadence.metrics import Accuracy, Mean, Metric


class Collect(Metric):
    def __init__(self):
        super().__init__()
        self.add_state("values", reduce="cat")
        self.add_state("largest", torch.tensor(float("-inf")), "max")

    def update(self, values):
        self.values.append(values)
        self.largest = torch.maximum(self.largest, values.max())

    def compute(self):
        return torch.cat(self.values), self.largest


def test_states_reset_to_their_defaults():
    metric = Collect()
    metric.update(torch.tensor([1.0, 5.0]))
    metric.update(torch.tensor([2.0]))
    values, largest = metric.compute()
    assert values.tolist() == [1.0, 5.0, 2.0] and largest == 5.0
    metric.reset()
    assert metric.values == [] and metric.largest == float("-inf")
    assert metric.state_names == ("values", "largest")


def test_sync_on_one_rank_concatenates_and_restores_the_local_lists():
    metric = Collect()
    metric.update(torch.tensor([1.0, 5.0]))
    metric.update(torch.tensor(2.0))  # 0-d pieces join too
    with metric.sync(LocalBackend(device="cpu")):
        assert len(metric.values) == 1 and metric.values[0].tolist() == [1.0, 5.0, 2.0]
    assert len(metric.values) == 2  # local again: updates go on


def test_bad_state_declarations_say_what_to_do():
    class NoSuper(Metric):
        def __init__(self):
            self.add_state("x", torch.tensor(0))

    with pytest.raises(RuntimeError, match=r"NoSuper: call super\(\).__init__\(\) before add_state"):
        NoSuper()
    metric = Metric()
    with pytest.raises(ValueError, match=r"reduce must be one of \('sum', 'max', 'min', 'cat'\)"):
        metric.add_state("x", torch.tensor(0), "mean")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"a 'sum' state needs a tensor default, got int"):
        metric.add_state("x", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"a 'cat' state starts empty"):
        metric.add_state("x", torch.tensor(0), "cat")
    with pytest.raises(NotImplementedError, match=r"Metric must define update"):
        metric.update()


def test_to_moves_states_and_defaults():
    metric = Accuracy().to("meta")
    assert metric.correct.device.type == "meta"
    metric.reset()
    assert metric.correct.device.type == "meta"


def test_accuracy_top_k_and_labels():
    top1, top2 = Accuracy(), Accuracy(top_k=2)
    scores = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7], [0.2, 0.5, 0.3]])
    target = torch.tensor([1, 2, 0])
    top1.update(scores, target)
    top2.update(scores, target)
    assert float(top1.compute()) == 1 / 3 and float(top2.compute()) == 2 / 3
    labels = Accuracy()
    labels.update(torch.tensor([1, 2, 2]), target)
    assert float(labels.compute()) == 2 / 3
    with pytest.raises(ValueError, match=r"Accuracy\(top_k=2\) needs scores of shape \(N, C, ...\), got labels"):
        top2.update(torch.tensor([1, 2, 0]), target)
    with pytest.raises(ValueError, match=r"preds of shape \(3, 3\) do not fit targets of shape \(2,\)"):
        top1.update(scores, target[:2])
    with pytest.raises(ValueError, match=r"top_k must be an int >= 1"):
        Accuracy(top_k=0)


def test_weighted_mean():
    mean = Mean()
    mean.update(torch.tensor([1.0, 3.0]), weight=torch.tensor([3.0, 1.0]))
    mean.update(10.0, weight=0.0)
    assert float(mean.compute()) == 1.5
