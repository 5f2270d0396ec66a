"""Training and evaluation data: built loaders and user iterables."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import attrs
import torch


@attrs.define(kw_only=True)
class DataConfig:
    """How the engine builds a loader when it is given a `Dataset`.

    Ignored for a `DataLoader` or any other iterable, which is used as given.

    Attributes:
        batch_size: samples per batch on each rank (per micro-batch).
        shuffle: reshuffle every epoch (seeded); default True for train, False otherwise.
        drop_last: drop the last incomplete batch.
        num_workers: worker processes for loading (0 loads in the main process).
        pin_memory: pin host memory for faster copies to CUDA.
        persistent_workers: keep workers alive across epochs.
        prefetch_factor: batches loaded in advance per worker (num_workers > 0 only).
    """

    batch_size: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    shuffle: bool | None = None
    drop_last: bool = False
    num_workers: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None


class DataSource:
    """One split's data, with the epoch seeding and state the engine needs.

    A `Dataset` becomes a torchdata `StatefulDataLoader` whose shuffling is
    seeded per epoch (`seed + epoch`). When the backend's data domain has more
    than one rank it is sharded: training data by a `StatefulDistributedSampler`
    (padded, so every rank runs the same number of steps), evaluation and
    prediction data by an `ExactShardSampler` (each sample on exactly one rank).
    Anything else is iterated as given; its state is saved when it has
    `state_dict()`.
    """

    def __init__(
        self,
        data: Any,
        config: DataConfig,
        *,
        split: str,
        seed: int,
        data_rank: int = 0,
        data_size: int = 1,
        pin_memory_device: str = "",
    ) -> None:
        self.split, self.seed = split, seed
        self.generator: torch.Generator | None = None
        self.sampler: Any = None
        self.built = isinstance(data, torch.utils.data.Dataset)
        if self.built:
            self.loader = self._build(data, config, data_rank, data_size, pin_memory_device)
        elif isinstance(data, Iterable):
            self.loader = data
        else:
            raise TypeError(
                f"{split} data must be a torch Dataset, a DataLoader or an iterable of batches; got {type(data).__name__}"
            )

    def _build(self, dataset: Any, config: DataConfig, rank: int, size: int, pin_device: str) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

        shuffle = config.shuffle if config.shuffle is not None else self.split == "train"
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        kwargs: dict[str, Any] = {}
        # An IterableDataset shards and shuffles itself: no sampler, no shuffle.
        if not iterable and size > 1 and self.split == "train":
            # Padded to equal counts: DDP needs every rank to take the same steps.
            self.sampler = StatefulDistributedSampler(
                dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=self.seed, drop_last=config.drop_last
            )
            kwargs["sampler"] = self.sampler
        elif not iterable and size > 1:
            # Evaluation and prediction see every sample exactly once: padding
            # would count repeated samples in the "exact" global mean.
            self.sampler = ExactShardSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=self.seed)
            _check_every_rank_has_a_batch(self.split, len(dataset), size, config)
            kwargs["sampler"] = self.sampler
        elif not iterable and shuffle:
            self.generator = torch.Generator()
            kwargs["shuffle"] = True
            kwargs["generator"] = self.generator
        if config.num_workers > 0:
            kwargs["persistent_workers"] = config.persistent_workers
            if config.prefetch_factor is not None:
                kwargs["prefetch_factor"] = config.prefetch_factor
        if self.generator is None and config.num_workers > 0:
            # Worker seeds are drawn from the loader's generator: own one so
            # they follow the run's seed too.
            self.generator = torch.Generator()
            kwargs["generator"] = self.generator
        with warnings.catch_warnings():
            # torchdata calls a deprecated torch API in every loader's __init__: a warning the
            # user can do nothing about, that would be the first line of every run.
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            return StatefulDataLoader(
                dataset,
                batch_size=config.batch_size,
                drop_last=config.drop_last,
                num_workers=config.num_workers,
                pin_memory=config.pin_memory,
                pin_memory_device=pin_device if config.pin_memory else "",
                **kwargs,
            )

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def has_len(self) -> bool:
        try:
            len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            return False
        return True

    def epoch_iter(self, epoch: int, *, fresh: bool) -> Iterator[Any]:
        """An iterator over one epoch; `fresh` reseeds for the start of `epoch`."""
        if self.sampler is not None:
            # Also when resuming mid-epoch: the distributed sampler's saved
            # state holds only its position, and its permutation comes from
            # the epoch (a fresh engine would otherwise replay epoch 0's order).
            self.sampler.set_epoch(epoch)
        if fresh:
            if self.generator is not None:
                self.generator.manual_seed(self.seed + epoch)
            set_epoch = getattr(getattr(self.loader, "sampler", None), "set_epoch", None)
            if not self.built and callable(set_epoch):
                set_epoch(epoch)
        return iter(self.loader)

    def stateful(self) -> bool:
        return callable(getattr(self.loader, "state_dict", None)) and callable(
            getattr(self.loader, "load_state_dict", None)
        )

    def state_dict(self) -> dict[str, Any] | None:
        return self.loader.state_dict() if self.stateful() else None  # type: ignore[union-attr]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.stateful():
            raise TypeError(f"{self.split} data ({type(self.loader).__name__}) cannot restore a saved position")
        self.loader.load_state_dict(state)  # type: ignore[union-attr]


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

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            order = list(range(self.dataset_size))
        mine = order[self.rank :: self.num_replicas]
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


def _check_every_rank_has_a_batch(split: str, samples: int, ranks: int, config: DataConfig) -> None:
    # A rank without a batch would skip what the others do once per
    # evaluation (DDP's buffer sync on the first forward, the metric
    # reduction of the names it never logged) and hang or fail them.
    fewest = samples // ranks
    batches = fewest // config.batch_size if config.drop_last else -(-fewest // config.batch_size)
    if batches == 0:
        raise ValueError(
            f"{split} data: {samples} samples over {ranks} data ranks leave a rank with no batch "
            f"(batch_size={config.batch_size}, drop_last={config.drop_last}); every rank needs at least one: "
            "use more samples, fewer ranks, or drop_last=False"
        )
