"""What the engine checks and warns about when it builds a loader (`cadence.engine.data.DataSource`)."""

from __future__ import annotations

import logging
import multiprocessing
import sys
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from cadence.engine.data import DataConfig

logger = logging.getLogger("cadence")


def warn_if_inexact(loader: Any) -> None:
    """Say at setup when a replayed loader cannot resume exactly, why, and what to do."""
    if getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0) > 0:
        logger.warning(
            "train data: DataLoader(persistent_workers=True) keeps its worker processes, and their random "
            "state, from one epoch to the next; a run resumed after its first epoch starts new workers, so random "
            "draws inside the dataset (augmentation) and the order drawn at the epoch's start differ from the "
            "uninterrupted run's. For an exact resume pass persistent_workers=False"
        )


def fork_can_deadlock(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether this CPython can hang a child forked while another thread creates a thread state.

    A C++ thread that calls into Python (a gloo or NCCL worker thread dropping
    a tensor that Python let go of first) takes the interpreter's thread-list
    lock without the GIL; a child forked at that moment waits for it forever
    in `os.fork` (CPython gh-112275), fixed in 3.10.15, 3.11.10 and 3.12.
    """
    return version < (3, 10, 15) or (3, 11) <= version < (3, 11, 10)


_warned_fork: set[str] = set()  # the splits already warned about, once per process


def warn_if_fork_can_hang(loader: Any, split: str) -> None:
    """Say at setup when a loader will fork its workers each epoch beside distributed threads on such a Python."""
    if split in _warned_fork or getattr(loader, "num_workers", 0) == 0 or getattr(loader, "persistent_workers", False):
        return
    context = getattr(loader, "multiprocessing_context", None)
    method = context.get_start_method() if context is not None else multiprocessing.get_start_method(allow_none=True)
    if method not in (None, "fork") or sys.platform != "linux" or not fork_can_deadlock():
        return
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    _warned_fork.add(split)
    logger.warning(
        "%s data: a DataLoader forking its %d workers each epoch beside this process's distributed threads can hang "
        "on Python %s: now and then a worker inherits a lock another thread held and waits forever in os.fork "
        "(CPython gh-112275, fixed in 3.10.15, 3.11.10 and 3.12). Use a newer Python, or start the workers "
        "with multiprocessing_context='forkserver' (DataLoader's argument, or the data config's)",
        split,
        loader.num_workers,
        ".".join(map(str, sys.version_info[:3])),
    )


def check_every_rank_has_a_batch(split: str, samples: int, ranks: int, config: DataConfig) -> None:
    """Every data rank gets at least one batch of `split`'s `samples`, or a ValueError saying what to change."""
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
