"""Which dataset indices each data rank reads: exact evaluation shards, and a train epoch re-split
over a changed number of data ranks (`Resharding`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

#: Marks a train position inside an epoch that was re-split over another number of data ranks.
RESHARD = "cadence.resharded"


class ExactShardSampler(torch.utils.data.Sampler[int]):
    """Rank `rank`'s share of a dataset, with every index on exactly one rank.

    Rank r takes positions r, r + W, r + 2W, ... of the order (W ranks): no
    padding and no dropping, so ranks may hold counts differing by one. The
    order is the dataset's, or a permutation seeded with `seed + epoch` when
    `shuffle` (the same on every rank). Like torchdata's
    `StatefulDistributedSampler`, its `state_dict()` holds how many indices it
    has yielded this epoch, so a `StatefulDataLoader` restores its position.

    Example:
        >>> list(ExactShardSampler(range(5), num_replicas=2, rank=0))
        [0, 2, 4]
        >>> list(ExactShardSampler(range(5), num_replicas=2, rank=1))
        [1, 3]
    """

    def __init__(self, dataset: Any, *, num_replicas: int, rank: int, shuffle: bool = False, seed: int = 0) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"ExactShardSampler: rank must be in [0, {num_replicas}), got {rank}")
        self.dataset_size = len(dataset)
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.yielded = 0
        self.next_yielded: int | None = None

    def __len__(self) -> int:
        return len(range(self.rank, self.dataset_size, self.num_replicas))

    def indices(self) -> list[int]:
        """This rank's dataset indices for the current epoch, in the order `__iter__` yields them."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            order = list(range(self.dataset_size))
        return order[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        mine = self.indices()
        self.yielded, self.next_yielded = self.next_yielded or 0, None
        for index in mine[self.yielded :]:
            self.yielded += 1
            yield index

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("yielded", -1) < 0:
            raise ValueError(f"ExactShardSampler: invalid state {state!r}; expected {{'yielded': int >= 0}}")
        self.next_yielded = state["yielded"]


class Resharding:
    """Where a map-style train epoch stands, and how its rest is split over this run's data ranks.

    The engine builds the loader of a map-style train `Dataset`, so each
    epoch's global order is known: a permutation seeded with `seed + epoch`
    (the same for `StatefulDistributedSampler` on several data ranks and the
    shuffled loader on one), or the dataset's order. Rank r of W reads
    positions r, r + W, ... of it, so after k samples per rank the epoch has
    consumed exactly its first W x k indices. A run resumed on another number
    of data ranks takes the rest of the order from there, split the same way
    (padded by repeating its head, or cut with `drop_last`, as an epoch is):
    no sample is repeated or skipped. The next epochs are split as usual.

    A position saved inside such an epoch holds where its split started
    (`start`, `first_batch`) and the batch it reached, so it resumes on any
    number of data ranks again.
    """

    def __init__(self, samples: int, *, batch_size: int, drop_last: bool, shuffle: bool, rank: int, ranks: int):
        self.samples, self.batch_size, self.drop_last, self.shuffle = samples, batch_size, drop_last, shuffle
        self.rank, self.ranks = rank, ranks

    def order(self, seed: int, epoch: int) -> list[int]:
        """The epoch's global order of dataset indices."""
        if not self.shuffle:
            return list(range(self.samples))
        return torch.randperm(self.samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()

    def positions(self, saved: Sequence[Any], batch_in_epoch: int) -> list[dict[str, Any]]:
        """This run's position for each of its data ranks, from the `saved` ones of another number of ranks.

        `batch_in_epoch`: the saved run's batches per rank in the epoch (the same on every rank).
        """
        marks = [p for p in saved if isinstance(p, Mapping) and RESHARD in p]
        start, first = (marks[0]["start"], marks[0]["first_batch"]) if marks else (0, 0)
        consumed = min(self.samples, start + len(saved) * (batch_in_epoch - first) * self.batch_size)
        return [{RESHARD: 1, "start": consumed, "first_batch": batch_in_epoch} for _ in range(self.ranks)]

    def share(self, seed: int, epoch: int, position: Mapping[str, Any], batch_in_epoch: int) -> list[int]:
        """This rank's indices of the re-split epoch from `batch_in_epoch` on."""
        rest = self.order(seed, epoch)[position["start"] :]
        if self.drop_last:
            rest = rest[: len(rest) // self.ranks * self.ranks]
        elif rest and len(rest) % self.ranks:
            padding = self.ranks - len(rest) % self.ranks
            rest += (rest * -(-padding // len(rest)))[:padding]
        mine = rest[self.rank :: self.ranks]
        return mine[(batch_in_epoch - position["first_batch"]) * self.batch_size :]


def loader_over(loader: Any, indices: list[int]) -> Any:
    """A `StatefulDataLoader` like the engine-built `loader`, reading `indices` (one re-split epoch)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    names = ["batch_size", "drop_last", "num_workers", "collate_fn", "pin_memory", "pin_memory_device", "generator"]
    if loader.num_workers > 0:
        names += ["prefetch_factor", "multiprocessing_context", "worker_init_fn", "timeout"]
    return StatefulDataLoader(loader.dataset, sampler=indices, **{name: getattr(loader, name) for name in names})
