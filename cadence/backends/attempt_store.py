"""A namespace of torchrun's shared store that only this attempt's processes use.

torchrun's c10d rendezvous shares its agent's TCPStore with the workers
(`TORCHELASTIC_USE_AGENT_STORE=True`, the default since torch 2.5), and torch
2.13's agent keeps that one server for the whole job: every restart gets the
same MASTER_PORT, and `init_process_group("env://")` builds its keys there with
no prefix per attempt. A restarted attempt then finds the keys the failed one
left, among them each rank's gloo address (or NCCL's unique id): a rank that
reads a peer's key before that peer wrote it again connects to the dead
process ("Gloo connectFullMesh failed ... Connection refused") or waits on it.

`TORCHELASTIC_RESTART_COUNT` cannot name the attempt: each agent counts its own
restarts, so two nodes can disagree (pytorch/pytorch#135712). So the ranks agree
on a fresh token through the store itself, in a way no key left by an earlier
attempt can answer: every rank > 0 posts a fresh nonce (`hello/<rank>`); rank 0
echoes each nonce it reads with its own fresh token (`welcome/<rank>/<nonce>`),
again whenever a rank's nonce changes (the first it read may be a dead
attempt's); a rank takes the token only from the key named by its own nonce,
and confirms under the token (`<token>/ready`, a count), which rank 0 waits for.
The process group then lives under `cadence/attempt/<token>/`.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

PREFIX = "cadence/attempt"

#: Seconds between rank 0's looks at the ranks it has not heard from yet: the first, and the most.
POLL_S = (0.005, 0.1)


def shares_agent_store() -> bool:
    """Whether torchrun hands its workers its own store (MASTER_ADDR:MASTER_PORT), kept across restarts."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.PrefixStore:
    """The shared store at MASTER_ADDR:MASTER_PORT under a prefix fresh for this attempt; every rank must call it.

    Raises:
        TimeoutError: the ranks did not all agree within `timeout` (naming the missing ones, on rank 0).
    """
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    token = _welcome(store, world_size, deadline) if rank == 0 else _join(store, rank, timeout)
    return dist.PrefixStore(f"{PREFIX}/{token}", store)


def _welcome(store: dist.TCPStore, world_size: int, deadline: float) -> str:
    """Rank 0: answer every rank's latest nonce with a new token until each confirmed it.

    A few requests per look, whatever the world size: the nonces in one `multi_get`, the answers in one
    `multi_set`, the confirmations counted by one key under the token.
    """
    token = uuid.uuid4().hex
    ranks = range(1, world_size)
    hellos = [f"{PREFIX}/hello/{rank}" for rank in ranks]
    if not hellos:
        return token
    try:  # every rank posted a nonce once (this attempt's, or an earlier one's)
        store.wait(hellos, timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except dist.DistStoreError as exc:
        raise _missing(store, hellos, ranks) from exc
    answered: list[bytes | None] = [None] * len(hellos)
    pause = POLL_S[0]
    while True:
        nonces = store.multi_get(hellos)
        changed = [i for i, nonce in enumerate(nonces) if nonce != answered[i]]
        if changed:
            keys = [f"{PREFIX}/welcome/{ranks[i]}/{nonces[i].decode()}" for i in changed]
            store.multi_set(keys, [token] * len(changed))  # type: ignore[attr-defined]  # public; not in torch's stub
            for i in changed:
                answered[i] = nonces[i]
        if store.add(f"{PREFIX}/{token}/ready", 0) == len(hellos):
            return token
        if time.monotonic() > deadline:
            raise _missing(store, [f"{PREFIX}/{token}/ready/{rank}" for rank in ranks], ranks)
        time.sleep(pause)
        pause = min(pause * 2, POLL_S[1])


def _missing(store: dist.TCPStore, keys: list[str], ranks: range) -> TimeoutError:
    waiting = [rank for rank, key in zip(ranks, keys) if not store.check([key])]
    return TimeoutError(
        f"process group start: ranks {waiting} did not join within the group's init timeout "
        f"on torchrun's store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    )


def _join(store: dist.TCPStore, rank: int, timeout: timedelta) -> str:
    """Rank > 0: post a nonce, take the token rank 0 answers it with, confirm."""
    nonce = uuid.uuid4().hex
    store.set(f"{PREFIX}/hello/{rank}", nonce)
    welcome = f"{PREFIX}/welcome/{rank}/{nonce}"
    try:
        store.wait([welcome], timeout)
    except dist.DistStoreError as exc:
        raise TimeoutError(
            f"process group start: rank {rank} got no answer from rank 0 within the group's init timeout "
            f"({timeout.total_seconds():g} s) on torchrun's store at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']}"
        ) from exc
    token = store.get(welcome).decode()
    store.delete_key(welcome)
    store.set(f"{PREFIX}/{token}/ready/{rank}", "1")  # which ranks came, for rank 0's error
    store.add(f"{PREFIX}/{token}/ready", 1)
    return token
