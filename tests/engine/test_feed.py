"""TrainFeed: each step's micro-batches, the epoch's end, replay to a position, and early errors."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.engine.data import DataConfig, DataSource
from cadence.engine.feed import TrainFeed
from cadence.engine.state import State
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)


def source_of(batches):
    return DataSource(batches, DataConfig(), split="train", seed=0)


def drain(feed, source, state, accum, stop_after=None):
    """Run the steps as the loop does: count the batches, clear `pending` when a step completes."""
    steps = []
    for group in feed.steps(source, state, accum):
        steps.append(list(group))
        state.batch_in_epoch += len(group)
        feed.pending = None
        if len(steps) == stop_after:  # the step budget stops the loop here
            break
    return steps


def test_groups_of_micro_batches_and_the_epoch_end():
    feed, source, state = TrainFeed(), source_of(list(range(5))), State()
    assert drain(feed, source, state, accum=2) == [[0, 1], [2, 3], [4]]
    assert feed.iterator is None and feed.epoch_over(source, state, accum=2)


def test_unfinished_step_is_handed_out_again():
    feed, source, state = TrainFeed(), source_of([10, 11, 12]), State()
    first = next(feed.steps(source, state, accum=1))
    # No step completed (an interrupt): the next fit gets the same micro-batches first.
    assert next(feed.steps(source, state, accum=1)) is first == (10,)


def test_budget_ending_on_the_last_batch_ends_the_epoch():
    feed, source, state = TrainFeed(), source_of([0, 1]), State()
    drain(feed, source, state, accum=1, stop_after=2)
    assert feed.iterator is not None and feed.epoch_over(source, state, accum=1)
    assert feed.iterator is None


def test_data_longer_than_its_length_keeps_the_extra_batches():
    class Lying:  # says 2 batches, yields 3
        def __len__(self):
            return 2

        def __iter__(self):
            return iter([0, 1, 2])

    feed, source, state = TrainFeed(), source_of(Lying()), State()
    drain(feed, source, state, accum=1, stop_after=2)
    assert not feed.epoch_over(source, state, accum=1) and feed.pending == [2]


def test_restart_mid_epoch_replays_data_without_a_saved_position(caplog):
    state = State(epoch=1, batch_in_epoch=3)
    feed = TrainFeed()
    with caplog.at_level(logging.WARNING, logger="cadence"):
        feed.restart(source_of(list(range(6))), state, position_restored=False)
    assert "replaying 3 batches of epoch 1" in caplog.text
    assert drain(feed, source_of([]), state, accum=1) == [[3], [4], [5]]  # the open epoch, not the new source


def test_restart_with_a_restored_position_does_not_replay(caplog):
    feed = TrainFeed()
    with caplog.at_level(logging.WARNING, logger="cadence"):
        # The loader's own state already sits at the saved batch: use it as it is.
        feed.restart(source_of([7, 8]), State(batch_in_epoch=4), position_restored=True)
    assert "replaying" not in caplog.text and feed.position_restored is False
    assert list(feed.iterator) == [7, 8]


def engine(data=None, optimizer=True, **kwargs):
    model = tiny_model()
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None,
        data,
        loss_fn=F.cross_entropy,
        seed=0,
        **{"device": "cpu", **kwargs},
    )


@pytest.mark.parametrize(
    ("data", "optimizer", "message"),
    [(None, True, r"fit\(\) needs train_data"), (tiny_batches(2), False, r"fit\(\) needs an optimizer")],
)
def test_fit_without_data_or_optimizer_fails_before_on_fit_start(data, optimizer, message):
    eng = engine(data, optimizer)
    started = []
    eng.on(cadence.Event.ON_FIT_START)(started.append)
    with pytest.raises(ValueError, match=message):
        eng.fit(steps=1)
    assert started == []


def test_empty_train_data_is_an_error():
    with pytest.raises(ValueError, match="train_data is empty"):
        engine([])  # known empty: refused at construction
    with pytest.raises(ValueError, match="yielded no batch in epoch 1: it is empty, or a one-shot iterator"):
        engine(b for b in []).fit(steps=1)  # found out when iterated
