"""Training and evaluation data: built loaders and user iterables."""

from __future__ import annotations

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
    seeded per epoch (`seed + epoch`), sharded with a `StatefulDistributedSampler`
    when the backend's data domain has more than one rank. Anything else is
    iterated as given; its state is saved when it has `state_dict()`.
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
        if not iterable and size > 1:
            self.sampler = StatefulDistributedSampler(
                dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=self.seed, drop_last=config.drop_last
            )
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
