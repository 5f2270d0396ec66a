"""Deterministic kernels, process-wide (`EngineConfig.deterministic=True`; see docs/run-directory.md)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("cadence")


def enable_determinism() -> None:
    """Make torch pick deterministic kernels, process-wide (`EngineConfig.deterministic=True`).

    Sets `torch.use_deterministic_algorithms(True)`, `cudnn.deterministic = True`,
    `cudnn.benchmark = False`, and `CUBLAS_WORKSPACE_CONFIG=:4096:8` (unless set)
    which cuBLAS reads when its first handle is created, so it must come before
    the first CUDA matmul. Costs: slower kernels on GPU (no cuDNN autotuning,
    deterministic reductions), about 32 MiB of cuBLAS workspace per stream, and
    an error from any op that has no deterministic implementation. Not undone
    when the engine ends.
    """
    import torch

    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            logger.warning("deterministic=True: CUDA is already initialized; CUBLAS_WORKSPACE_CONFIG may come too late")
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
