"""The training feed: each optimizer step's micro-batches, across fits, interrupts and resumes."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from cadence.engine.data import DataSource
from cadence.engine.state import State

_END = object()


class TrainFeed:
    """Hands the loop one optimizer step's micro-batches at a time.

    A step's micro-batches are all fetched before `on_step_start`, so the loop
    knows which one is last (gradient sync) and never starts a step it has no
    data for. Micro-batches fetched for a step that did not finish (an
    interrupt) stay in `pending` and are used first by the next fit; the loop
    clears `pending` when a step completes. The open epoch's iterator lives
    here too, so a second `fit()` continues the epoch where the first stopped.
    """

    def __init__(self) -> None:
        self.iterator: Iterator[Any] | None = None  # the open epoch's batches; None: no epoch open
        self.pending: Sequence[Any] | None = None  # the unfinished step's micro-batches
        self.position_restored = False  # the loader's restored state already sits at the saved batch

    def steps(self, source: DataSource, state: State, accum: int) -> Iterator[Sequence[Any]]:
        """The micro-batches of each step until the open epoch's data runs out."""
        single = accum == 1  # the usual case: no slice and no list per step
        while True:
            if self.pending is None:
                if self.iterator is None:
                    self.iterator = self.open(source, state)
                if single:
                    batch = next(self.iterator, _END)
                    group: Sequence[Any] = () if batch is _END else (batch,)
                else:
                    group = list(itertools.islice(self.iterator, accum))
                if not group:
                    self._epoch_ran_out(state)
                    return
                self.pending = group
            yield self.pending

    def _epoch_ran_out(self, state: State) -> None:
        self.iterator = None
        if state.batch_in_epoch == 0:
            raise ValueError(
                f"train data yielded no batch in epoch {state.epoch + 1}: it is empty, or a one-shot "
                "iterator (a generator) that an earlier epoch exhausted; pass a Dataset, a DataLoader "
                "or a list"
            )

    def epoch_over(self, source: DataSource, state: State, accum: int) -> bool:
        """Whether the epoch is done: its data ran out, or the step budget ended on its last batch.

        A budget that ends exactly on the epoch's last batch completes the
        epoch (evaluation, on_epoch_end). That is known only for sized data;
        the iterator is then drained so a loader sees its epoch finish.
        """
        if self.iterator is None:
            return True
        if self.pending is not None or not source.has_len() or state.batch_in_epoch < len(source):
            return False
        extra = list(itertools.islice(self.iterator, accum))
        if extra:  # the data was longer than it said: keep what was fetched
            self.pending = extra
            return False
        self.iterator = None
        return True

    def open(self, source: DataSource, state: State) -> Iterator[Any]:
        """The batches of `state.epoch` from `state.batch_in_epoch` on."""
        if state.batch_in_epoch == 0 or self.position_restored:
            self.position_restored = False
            return source.epoch_iter(state.epoch, fresh=state.batch_in_epoch == 0, batch_in_epoch=state.batch_in_epoch)
        # The data cannot restore its position itself: replay the epoch to it.
        return source.replay(state.epoch, state.batch_in_epoch)

    def restart(self, source: DataSource | None, state: State, *, position_restored: bool) -> None:
        """Forget the open epoch after a checkpoint restored `state` (and maybe the loader's position).

        Mid-epoch, the epoch is opened again at once: the saved run opened it
        (which may draw from the global RNG, e.g. a loader without a
        generator) before it saved, so it must be opened before the RNG is
        restored.
        """
        self.iterator, self.pending, self.position_restored = None, None, position_restored
        if state.batch_in_epoch and source is not None:
            self.iterator = self.open(source, state)
