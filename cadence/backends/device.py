"""Which device a process trains on: one choice for every backend.

Every backend (local, DDP, mesh, DeepSpeed) calls `resolve_device` at setup;
the rules are the same everywhere:

- `"cuda"` is this process's local-rank GPU (`cuda:LOCAL_RANK`; 0 for a
  single process), `"cuda:N"` is GPU N as given. An index past the GPUs this
  process sees is an error naming the rank, the local rank and the visible
  count, raised before anything is placed.
- `"cpu"`, `"mps"` (and other types torch knows) are taken as given; CUDA or
  MPS requested where there is none is an error.
- None keeps each backend's default: one process (`process_group=None`) takes
  its local-rank GPU, else MPS, else the CPU; a distributed backend takes its
  local-rank GPU when its process group is NCCL, else the CPU.

`choose_device` is the rule itself, a pure function of what it is given
(visible GPU count, MPS); `resolve_device` asks torch for those and makes the
chosen GPU current (`torch.cuda.set_device`), so that NCCL, `torch.cuda` calls
without a device and DeepSpeed all see the same GPU. See docs/gpus.md.
"""

from __future__ import annotations

import os

import torch

__all__ = ["choose_device", "choose_process_group_backend", "make_current", "resolve_device"]


def choose_device(
    requested: str | torch.device | None,
    *,
    local_rank: int = 0,
    rank: int = 0,
    cuda_devices: int = 0,
    mps: bool = False,
    process_group: str | None = None,
) -> torch.device:
    """The device a process uses, from what was asked and what it sees (pure: reads nothing).

    Args:
        requested: `"cuda"`, `"cuda:1"`, `"cpu"`, `"mps"`, a `torch.device`, or None (the default below).
        local_rank: this process's rank on its node; `"cuda"` means `cuda:local_rank`.
        rank: this process's global rank (named in errors).
        cuda_devices: how many CUDA devices this process sees (`torch.cuda.device_count()`).
        mps: whether MPS is available.
        process_group: the torch.distributed backend (`"nccl"`, `"gloo"`, ...) of a distributed
            backend; None for one process without a group (the local backend).

    Raises:
        ValueError: an unknown device string, CUDA or MPS requested where there is none, or a
            CUDA index this process does not see.

    Example:
        >>> choose_device("cuda", local_rank=1, cuda_devices=2)
        device(type='cuda', index=1)
        >>> choose_device(None, cuda_devices=1, process_group="gloo")
        device(type='cpu')
    """
    where = f"rank {rank} (local rank {local_rank})"
    if requested is None or requested == "":
        if process_group is None:  # one process: the best device it has
            if cuda_devices:
                return _cuda(local_rank, local_rank, cuda_devices, where, "the default device (the local-rank GPU)")
            return torch.device("mps") if mps else torch.device("cpu")
        if "nccl" in process_group:  # NCCL communicates GPU tensors: this process's GPU
            what = f"the default device of a {process_group} process group (the local-rank GPU)"
            return _cuda(local_rank, local_rank, cuda_devices, where, what)
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device {requested!r} on {where}: not a device torch knows ({exc}); use 'cpu', 'cuda', 'cuda:N' or 'mps'"
        ) from None
    if device.type == "cuda":
        index = local_rank if device.index is None else device.index
        return _cuda(index, local_rank, cuda_devices, where, f"device {str(requested)!r} was requested")
    if device.type == "mps" and not mps:
        raise ValueError(f"device {str(requested)!r} was requested on {where}, but MPS is not available here")
    return device


def _cuda(index: int, local_rank: int, visible: int, where: str, what: str) -> torch.device:
    if visible == 0:
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(
            f"{what} on {where}, but CUDA is not available here ({why}); "
            "pass device='cpu' (with a gloo process group) to run on the CPU"
        )
    if not 0 <= index < visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        env = f", CUDA_VISIBLE_DEVICES={shown!r}" if shown is not None else ""
        raise ValueError(
            f"{what} on {where}: cuda:{index} is out of range, this process sees {visible} CUDA device(s) "
            f"(cuda:0..cuda:{visible - 1}{env}); start at most {visible} process(es) per node, "
            "or pass device='cuda:N' or device='cpu'"
        )
    return torch.device("cuda", index)


def choose_process_group_backend(requested: str | None, device: torch.device) -> str:
    """The torch.distributed backend a backend creates: `requested`, else NCCL for a CUDA device, else gloo.

    `device` is the one the process will use (`resolve_device` before any
    group: with no device asked for, the local-rank GPU when there is one).

    Example:
        >>> choose_process_group_backend(None, torch.device("cpu"))
        'gloo'
    """
    if requested:
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def resolve_device(
    requested: str | torch.device | None,
    *,
    local_rank: int | None = None,
    rank: int | None = None,
    process_group: str | None = None,
    current: bool = True,
) -> torch.device:
    """`choose_device` with what torch sees here; makes a chosen GPU current (`torch.cuda.set_device`).

    Args:
        requested: as in `choose_device`.
        local_rank: default: the `LOCAL_RANK` environment variable, else 0.
        rank: default: the `RANK` environment variable, else 0.
        process_group: as in `choose_device` (a distributed backend passes `dist.get_backend()`).
        current: call `torch.cuda.set_device` on a chosen GPU (False: only choose, touching no
            CUDA context; a backend that chooses at construction makes it current at setup).

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    # Counting devices initializes no CUDA context (forked workers stay possible); set_device does.
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = choose_device(
        requested,
        local_rank=local_rank,
        rank=rank,
        cuda_devices=cuda_devices,
        mps=_mps_available(),
        process_group=process_group,
    )
    if current:
        make_current(device)
    return device


def make_current(device: torch.device) -> None:
    """Make a CUDA device the current one (a no-op for other types)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())
