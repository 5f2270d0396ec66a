"""Training and evaluation data: built loaders and user iterables."""

from __future__ import annotations

import logging
import random
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import attrs
import torch

from cadence.engine import loader_checks
from cadence.engine.sampling import RESHARD, ExactShardSampler, Resharding, loader_over

logger = logging.getLogger("cadence")

#: Marks a train position that the engine replays (from the epoch's saved start) rather than the loader restores.
REPLAY = "cadence.replay"


@attrs.define(kw_only=True)
class DataConfig:
    """How the engine builds a loader when it is given a `Dataset`.

    Ignored for a `DataLoader` or any other iterable, which is used as given.

    Attributes:
        batch_size: samples per batch on each rank (per micro-batch).
        shuffle: reshuffle every epoch (seeded); default True for train, False otherwise.
        drop_last: drop the last incomplete batch.
        num_workers: worker processes for loading (0 loads in the main process).
        pin_memory: pin host memory, so copies to CUDA are fast and do not block the host;
            None: pin when the engine's device is CUDA.
        persistent_workers: keep workers alive across epochs.
        prefetch_factor: batches loaded in advance per worker (num_workers > 0 only).
        multiprocessing_context: how workers start: "fork", "spawn" or "forkserver"; None is
            multiprocessing's default (fork on Linux before Python 3.14). "forkserver" pickles the
            dataset to each worker; it avoids the fork hang of older Pythons in distributed runs
            (see `cadence.engine.loader_checks.fork_can_deadlock`).
    """

    batch_size: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    shuffle: bool | None = None
    drop_last: bool = False
    num_workers: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    pin_memory: bool | None = None
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    multiprocessing_context: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(("fork", "spawn", "forkserver")))
    )


class DataSource:
    """One split's data, with the epoch seeding and state the engine needs.

    A `Dataset` becomes a torchdata `StatefulDataLoader` whose shuffling is
    seeded per epoch (`seed + epoch`). When the backend's data domain has more
    than one rank it is sharded: training data by a `StatefulDistributedSampler`
    (padded, so every rank runs the same number of steps), evaluation and
    prediction data by an `ExactShardSampler` (each sample on exactly one rank).
    Its batches are pinned (`pin_memory`, by default) when they go to CUDA
    (`pin_memory_device="cuda"`). Anything else is iterated as given; its state is saved when it has
    `state_dict()`. Otherwise (a plain `DataLoader`, a list) the engine
    resumes mid-epoch by replaying the epoch: the random state that decides
    its order (the global RNGs and the generators of the loader and its
    sampler, taken when the epoch opened) is saved and put back before the
    replay, so the replayed epoch is the one the saved run trained on.
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
        self.resharding: Resharding | None = None  # map-style train data: its epochs can be re-split
        self.resharded: dict[str, Any] | None = None  # the re-split epoch's position (`Resharding`), while open
        self.built = isinstance(data, torch.utils.data.Dataset)
        if self.built:
            self.loader = self._build(data, config, data_rank, data_size, pin_memory_device)
        elif isinstance(data, Iterable):
            self.loader = data
        else:
            raise TypeError(
                f"{split} data must be a torch Dataset, a DataLoader or an iterable of batches; got {type(data).__name__}"
            )
        # Replayed on resume (train data that cannot restore its own position):
        # the random state at the open epoch's start, and one restored from a checkpoint.
        self.replays = split == "train" and not self.built and not self.stateful()
        # Iterating a list or tuple draws no random number: nothing to take at each epoch's start.
        self._draws_random = not isinstance(self.loader, (list, tuple))
        self.epoch_start: dict[str, Any] | None = None
        self._replay_start: dict[str, Any] | None = None
        if self.replays:
            loader_checks.warn_if_inexact(self.loader)
        loader_checks.warn_if_fork_can_hang(self.loader, split)

    def _build(self, dataset: Any, config: DataConfig, rank: int, size: int, pin_device: str) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

        shuffle = config.shuffle if config.shuffle is not None else self.split == "train"
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        kwargs: dict[str, Any] = {}
        if not iterable and self.split == "train":
            self.resharding = Resharding(
                len(dataset), batch_size=config.batch_size, drop_last=config.drop_last, shuffle=shuffle, rank=rank,
                ranks=size,
            )  # fmt: skip
        # An IterableDataset shards and shuffles itself: no sampler, no shuffle.
        if not iterable and size > 1 and self.split == "train":
            # Padded to equal counts: DDP needs every rank to take the same steps.
            self.sampler = StatefulDistributedSampler(
                dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=self.seed, drop_last=config.drop_last
            )
            kwargs["sampler"] = self.sampler
        elif not iterable and (size > 1 or shuffle):
            # Evaluation and prediction see every sample exactly once: padding
            # would count repeated samples in the "exact" global mean. Shuffled
            # on one rank too, so the order is known (gathered predictions).
            self.sampler = ExactShardSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=self.seed)
            loader_checks.check_every_rank_has_a_batch(self.split, len(dataset), size, config)
            kwargs["sampler"] = self.sampler
        elif not iterable and shuffle:
            self.generator = torch.Generator()
            kwargs["shuffle"] = True
            kwargs["generator"] = self.generator
        if config.num_workers > 0:
            kwargs["persistent_workers"] = config.persistent_workers
            if config.prefetch_factor is not None:
                kwargs["prefetch_factor"] = config.prefetch_factor
            if config.multiprocessing_context is not None:
                kwargs["multiprocessing_context"] = config.multiprocessing_context
        if self.generator is None and config.num_workers > 0:
            # Worker seeds are drawn from the loader's generator: own one so
            # they follow the run's seed too.
            self.generator = torch.Generator()
            kwargs["generator"] = self.generator
        pin = config.pin_memory if config.pin_memory is not None else pin_device == "cuda"
        with warnings.catch_warnings():
            # torchdata calls a deprecated torch API in every loader's __init__: a warning the
            # user can do nothing about, that would be the first line of every run.
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            return StatefulDataLoader(
                dataset,
                batch_size=config.batch_size,
                drop_last=config.drop_last,
                num_workers=config.num_workers,
                pin_memory=pin,
                pin_memory_device=pin_device if pin else "",
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

    def epoch_iter(self, epoch: int, *, fresh: bool, batch_in_epoch: int = 0) -> Iterator[Any]:
        """An iterator over one epoch; `fresh` reseeds for the start of `epoch`; else from `batch_in_epoch`."""
        if self.resharded is not None and not fresh and self.resharding is not None:
            share = self.resharding.share(self.seed, epoch, self.resharded, batch_in_epoch)
            return iter(loader_over(self.loader, share))
        self.resharded = None
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
            if self.replays:  # once per epoch (~0.1 ms): what decides this epoch's order, for a replay on resume
                rng = _host_rng() if self._draws_random else None
                self.epoch_start = {"rng": rng, "generators": [g.get_state() for g in self._generators()]}
        return iter(self.loader)

    def replay(self, epoch: int, batches: int) -> Iterator[Any]:
        """An iterator over `epoch` past its first `batches` batches, drawn again from the epoch's start.

        Exact when a checkpoint gave the random state at the epoch's start
        (`load_position`): it is put back before the epoch is opened, and the
        global RNGs are left as they were found.
        """
        start, self._replay_start = self._replay_start, None
        if start is None:
            logger.warning(
                "train data (%s) has no saved position and the checkpoint holds no random state of the epoch's "
                "start; replaying %d batches of epoch %d to reach it (a shuffled order is drawn anew)",
                type(self.loader).__name__,
                batches,
                epoch,
            )
            iterator = self.epoch_iter(epoch, fresh=True)
            for _ in range(batches):
                next(iterator, None)
            return iterator
        logger.info(
            "train data (%s): replaying %d batches of epoch %d from the epoch's saved random state",
            type(self.loader).__name__,
            batches,
            epoch,
        )
        now = _host_rng()
        try:
            if start["rng"] is not None:
                _set_host_rng(start["rng"])
            for generator, state in zip(self._generators(), start["generators"]):
                generator.set_state(state)
            iterator = self.epoch_iter(epoch, fresh=True)
            for _ in range(batches):
                next(iterator, None)
        finally:
            _set_host_rng(now)  # the checkpoint's own RNG snapshot is restored after the position
        return iterator

    def _generators(self) -> list[torch.Generator]:
        """The torch generators that decide a plain loader's order and worker seeds (not the global one)."""
        loader = self.loader
        batch_sampler = getattr(loader, "batch_sampler", None)
        found: dict[int, torch.Generator] = {}
        for owner in (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and generator is not torch.default_generator:
                found.setdefault(id(generator), generator)
        return list(found.values())

    def stateful(self) -> bool:
        return callable(getattr(self.loader, "state_dict", None)) and callable(
            getattr(self.loader, "load_state_dict", None)
        )

    def sample_indices(self) -> list[int] | None:
        """The dataset indices this rank's loader yields this epoch, in order; None when unknown.

        Known for evaluation and prediction `Dataset`s the engine built a
        loader for (an `ExactShardSampler` share when sharded or shuffled):
        `predict(gather=True)` and `PredictionWriter` put samples back in
        dataset order with them. Call it after `epoch_iter`.
        """
        if isinstance(self.sampler, ExactShardSampler):
            return self.sampler.indices()
        if self.built and isinstance(getattr(self.loader, "sampler", None), torch.utils.data.SequentialSampler):
            return list(range(len(self.loader.sampler)))  # type: ignore[union-attr]
        return None

    def state_dict(self) -> dict[str, Any] | None:
        return self.loader.state_dict() if self.stateful() else None  # type: ignore[union-attr]

    def reshard(self, saved: list[Any] | None, state: dict[str, Any]) -> list[Any] | None:
        """Train positions saved on another number of data ranks (`state`: the saved engine state), one per data
        rank of this run (`Resharding`); None when the number is the same or this data cannot be re-split (not a
        map-style `Dataset` the engine built a loader for)."""
        if self.resharding is None or not saved or len(saved) == self.resharding.ranks:
            return None
        positions = self.resharding.positions(saved, state.get("batch_in_epoch") or 0)
        logger.info("the train position of %d data rank(s) is re-split over %d", len(saved), len(positions))
        return positions

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.stateful():
            raise TypeError(f"{self.split} data ({type(self.loader).__name__}) cannot restore a saved position")
        self.loader.load_state_dict(state)  # type: ignore[union-attr]

    def position(self, batch_in_epoch: int) -> dict[str, Any] | None:
        """What a checkpoint saves of the train data at `batch_in_epoch` (None: nothing to save).

        A loader with `state_dict()`: its state, inside an epoch (at a
        boundary the engine reseeds the next epoch itself). A replayed one:
        inside an epoch, the random state at the epoch's start; at a boundary,
        the generators' states now (the next epoch draws its order from them).
        """
        if self.resharded is not None:
            return {**self.resharded, "batch": batch_in_epoch} if batch_in_epoch else None
        if not self.replays:
            return self.state_dict() if batch_in_epoch and self.stateful() else None
        if batch_in_epoch:
            start = self.epoch_start
            if start is not None and start["rng"] is not None:
                start = {**start, "rng": _portable(start["rng"])}
            return {REPLAY: 1, "epoch_start": start}
        generators = self._generators()
        return {REPLAY: 1, "generators": [g.get_state() for g in generators]} if generators else None

    def position_problem(self, state: Any) -> str | None:
        """Why `state` (a saved `position`) cannot be restored here; None when it can."""
        replayed = isinstance(state, dict) and REPLAY in state
        if isinstance(state, dict) and RESHARD in state and self.resharding is None:
            return (
                "the train position was saved inside a re-split epoch; this run's train data is not a map-style Dataset"
            )
        if replayed != self.replays:
            saved = "a loader the engine replays" if replayed else "a loader that restores its own position"
            return (
                f"the train position was saved for {saved}, this run's train data ({type(self.loader).__name__}) "
                "is not one; pass the saved run's kind of train data"
            )
        if replayed:
            start = state.get("epoch_start") or {}
            generators = state.get("generators", start.get("generators", []))
            if len(generators) != len(self._generators()):
                return (
                    f"the train position holds {len(generators)} generator state(s), this run's train data has "
                    f"{len(self._generators())} generator(s); pass the same DataLoader (generator=..., sampler=...)"
                )
        return None

    def load_position(self, state: dict[str, Any], epoch: int) -> bool:
        """Restore a saved `position`; True when the loader now sits at the saved batch, False when it must be replayed."""
        if RESHARD in state:  # the next `epoch_iter` reads the rest of the re-split epoch
            self.resharded = {key: state[key] for key in (RESHARD, "start", "first_batch")}
            return True
        if not self.replays:
            # A distributed sampler's permutation depends on its epoch, which its state does not hold.
            for sampler in {id(s): s for s in (self.sampler, getattr(self.loader, "sampler", None))}.values():
                set_epoch = getattr(sampler, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(epoch)
            self.load_state_dict(state)
            return True
        self._replay_start = state.get("epoch_start")
        for generator, generator_state in zip(self._generators(), state.get("generators", ())):
            generator.set_state(generator_state)
        return False


def _host_rng() -> dict[str, Any]:
    """The global python, numpy and torch CPU random states (see `_portable` for saving them)."""
    snapshot: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with most torch installs
        return snapshot
    snapshot["numpy"] = np.random.get_state()
    return snapshot


def _portable(snapshot: dict[str, Any]) -> dict[str, Any]:
    # numpy's state holds an ndarray, which a weights-only load refuses: keep plain ints.
    if "numpy" not in snapshot:
        return snapshot
    name, keys, pos, has_gauss, gauss = snapshot["numpy"]
    return {**snapshot, "numpy": (name, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss))}


def _set_host_rng(snapshot: dict[str, Any]) -> None:
    version, internal, gauss = snapshot["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(snapshot["torch"])
    if "numpy" in snapshot:
        import numpy as np

        name, keys, pos, has_gauss, gauss = snapshot["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
