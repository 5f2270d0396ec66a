"""The DCP store's commit protocol: the ranks agree on a temporary folder, each writes, the main rank commits.

`prepare` (every rank) splits the payload (`dcp_io.split`) and agrees, in one
all-gather on the store's own group, on the temporary folder
`.tmp-<name>.<pid of rank 0>.<token>` and on which ranks' objects differ from
the main rank's; it returns the DCP writer into that folder. DCP then writes
every rank's files (`dcp.save`, or `dcp.async_save` in a thread). `finish`
(main rank, after every rank's data) writes the manifest from the ranks'
records of sizes and hashes and commits the folder under its name. See
cadence/checkpoint/dcp_store.py.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from cadence.checkpoint import dcp_io, file_io
from cadence.checkpoint.folders import MANIFEST
from cadence.checkpoint.store import FORMAT, CheckpointError

METADATA = ".metadata"
OBJECTS = "objects.pt"
STORE = "dcp"


@attrs.define
class Prepared:
    """One save, agreed by every rank: where it goes, what DCP writes, and what is known of it."""

    tmp: Path
    final: Path
    tensors: dict[str, torch.Tensor]
    writer: Any
    step: int | None
    epoch: int | None
    version: int
    rank: int
    world: int


def prepare(
    name: str,
    payload: Mapping[str, Any],
    final: Path,
    group: Any,
    rank: int,
    world: int,
    *,
    durable: bool,
    thread_count: int,
) -> Prepared:
    """Every rank: split the payload and agree on the temporary folder (one all-gather)."""
    meta = payload.get("meta") if isinstance(payload.get("meta"), Mapping) else {}
    step, epoch = meta.get("step"), meta.get("epoch")  # type: ignore[union-attr]
    problem, digests, skeleton, tensors = None, None, None, None
    try:
        skeleton, tensors = dcp_io.split(payload)
        digests = dcp_io.entry_digests(skeleton)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    everyone = dcp_io.all_gather((os.getpid(), secrets.token_hex(4), digests, problem), group, world)
    for other, (_, _, _, text) in enumerate(everyone):
        if text is not None:
            raise CheckpointError(f"rank {other} cannot save {name!r}: {text}", path=final, step=step)
    assert skeleton is not None and tensors is not None and digests is not None
    pid, token, main_digests, _ = everyone[0]
    tmp = final.parent / f".tmp-{name}.{pid}.{token}"
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        objects: tuple[str, bytes] | None = (OBJECTS, dcp_io.serialize(skeleton))
    else:
        differing = {k: v for k, v in skeleton.items() if main_digests.get(k) != digests[k]}
        objects = (objects_file(rank), dcp_io.serialize(differing)) if differing else None
    writer = dcp_io.writer(tmp, objects=objects, durable=durable, thread_count=thread_count)
    version = payload.get("version", 1)
    return Prepared(tmp, final, tensors, writer, step, epoch, version if isinstance(version, int) else 1, rank, world)


def finish(prepared: Prepared, durable: bool, commit: Callable[[Path, Path], None]) -> dict[str, Any]:
    """Main rank, after every rank's DCP write: the manifest from the ranks' records, then `commit(tmp, final)`."""
    tmp, step = prepared.tmp, prepared.step
    records: dict[str, list[Any]] = {}
    for rank in range(prepared.world):
        path = tmp / f"{dcp_io.RECORD_PREFIX}{rank}.json"
        try:
            records.update(json.loads(path.read_text()))
        except FileNotFoundError:
            raise CheckpointError(
                f"rank {rank} left no record of its files in {tmp.name}", path=prepared.final, step=step
            ) from None
    files: dict[str, dict[str, Any]] = {}
    for entry in sorted(os.scandir(tmp), key=lambda e: e.name):
        if entry.name.startswith(dcp_io.RECORD_PREFIX):
            continue
        size = entry.stat().st_size
        record = records.get(entry.name)
        if record is None or record[0] != size:  # not written through the hashing writer: read it
            record = list(dcp_io.file_digest(Path(entry.path)))
        files[entry.name] = {"size": size, "checksum": record[1], "algorithm": dcp_io.ALGORITHM}
    for needed in (METADATA, OBJECTS):
        if needed not in files:
            raise CheckpointError(
                f"the save left no {needed} in {tmp.name}: not committed", path=prepared.final, step=step
            )
    for rank in range(prepared.world):
        (tmp / f"{dcp_io.RECORD_PREFIX}{rank}.json").unlink()
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "store": STORE,
        "version": prepared.version,
        "step": step,
        "epoch": prepared.epoch,
        "world_size": prepared.world,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
    }
    raw = file_io.manifest_bytes(manifest)  # the one manifest format of every store
    file_io.write_bytes(tmp / MANIFEST, raw, durable)
    if durable:
        file_io.fsync_dir(tmp)
    commit(tmp, prepared.final)
    return dict(json.loads(raw))


def objects_file(rank: int) -> str:
    """Rank `rank`'s own objects (where its entries differ from the main rank's)."""
    return f"objects-{rank:05d}.pt"


def describe(exc: BaseException) -> str:
    """What went wrong, as another rank reports it."""
    return message(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def message(exc: CheckpointError) -> str:
    """A `CheckpointError`'s message without its head (checkpoint path and step)."""
    text = str(exc)
    head = f"checkpoint {exc.path}" if exc.path else "checkpoint"
    head += f" (step {'unknown' if exc.step is None else exc.step}): "
    return text[len(head) :] if text.startswith(head) else text


def wrap(exc: BaseException, what: str, path: Path, step: int | None) -> CheckpointError:
    """`exc` as a `CheckpointError` naming `what` failed (DCP's `CheckpointException` is a `BaseException`)."""
    if isinstance(exc, CheckpointError):
        return exc
    return CheckpointError(f"{what}: {type(exc).__name__}: {exc}", path=path, step=step)
