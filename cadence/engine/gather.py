"""Gather tensors of unequal shapes over the data domain in two collectives.

Metric states (concatenated predictions of unequal shards) and gathered
predictions have a different length on every rank, and may have several
dtypes. `gather_tensors` sends a small header of every tensor's dtype and
shape, then every tensor's bytes packed into one buffer: two `all_gather`s
over the backend's data domain whatever the number of tensors, so a
collection of metrics synchronizes in one round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cadence.engine.backend import Backend

#: dtypes a gathered tensor may have (their index is sent in the header).
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip
_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
#: Most dimensions a gathered tensor may have.
MAX_DIMS = 8
_HEADER = 2 + MAX_DIMS  # dtype code, ndim, shape padded with zeros


def gather_tensors(backend: Backend, tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Every rank's version of each tensor: `result[i][r]` is tensor `i` of data rank `r`.

    Ranks may hold tensors of different shapes and dtypes at the same
    position, but the same number of tensors. With one data rank nothing is
    communicated (`result[i] == [tensors[i]]`). Tensors come back on the
    device they were given on (the backend's).
    """
    if backend.data_size == 1:
        return [[t] for t in tensors]
    # No early return without tensors: a rank that has none still takes part, and every rank
    # then fails on the differing counts instead of the others waiting for it.
    device = tensors[0].device if tensors else backend.device
    header = torch.zeros(len(tensors) * _HEADER + 1, dtype=torch.int64)
    header[0] = len(tensors)
    pieces = []
    for i, tensor in enumerate(tensors):
        if tensor.dtype not in _CODES:
            raise TypeError(f"cannot gather a tensor of dtype {tensor.dtype}; supported: {[str(d) for d in DTYPES]}")
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"cannot gather a tensor of {tensor.dim()} dimensions (at most {MAX_DIMS})")
        row = 1 + i * _HEADER
        header[row], header[row + 1] = _CODES[tensor.dtype], tensor.dim()
        header[row + 2 : row + 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        pieces.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    headers = backend.all_gather(header.to(device), domain="data").cpu()
    if any(int(h[0]) != len(tensors) for h in headers):
        counts = [int(h[0]) for h in headers]
        raise RuntimeError(f"ranks gather different numbers of tensors {counts}: every rank must take part alike")
    shapes: list[list[tuple[torch.dtype, tuple[int, ...]]]] = []
    sizes = []
    for h in headers:
        described = []
        for i in range(len(tensors)):
            row = 1 + i * _HEADER
            dtype, ndim = DTYPES[int(h[row])], int(h[row + 1])
            described.append((dtype, tuple(int(d) for d in h[row + 2 : row + 2 + ndim])))
        shapes.append(described)
        sizes.append(sum(_nbytes(dtype, shape) for dtype, shape in described))
    mine = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    rows = backend.all_gather(padded, domain="data")
    result: list[list[torch.Tensor]] = [[] for _ in tensors]
    for rank, described in enumerate(shapes):
        offset = 0
        for i, (dtype, shape) in enumerate(described):
            nbytes = _nbytes(dtype, shape)
            chunk = rows[rank, offset : offset + nbytes]
            # A copy: the bytes are not aligned to the dtype inside the packed row.
            result[i].append(chunk.clone().view(dtype).reshape(shape))
            offset += nbytes
    return result


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * torch.empty((), dtype=dtype).element_size()
