"""Under torchrun's shared store, each attempt's process group starts in a namespace of its own.

torchrun (torch 2.13, c10d rendezvous) keeps one TCPStore for the whole job, so a restarted attempt finds the keys
of the failed one. Here the test process hosts that store, as torchrun's agent does, and two attempts of 2 gloo
ranks start their group on it one after the other; in the second, one rank starts 2 s late, so the other reads
whatever the first attempt left before its peer writes anything. Without a fresh namespace the early rank takes
the dead peer's gloo address ("Gloo connectFullMesh failed ... Connection refused") or waits on it.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cadence.backends.attempt_store import attempt_store
from cadence.backends.process_group import GroupSettings, start_group
from cadence.launch import launch

pytestmark = pytest.mark.timeout(120)


def one_attempt(late_rank: int | None) -> tuple[float, int]:
    """Start the group as a backend does, after `late_rank` waited 2 s; the all-reduce of the ranks and the keys found."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    found = store.num_keys()  # what earlier attempts left (the first sees only the server's own key)
    if int(os.environ["RANK"]) == late_rank:
        time.sleep(2.0)
    start_group("gloo", GroupSettings.build("test", timeout=30), "cpu")
    value = torch.tensor([float(os.environ["RANK"]) + 1.0])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return float(value), found


@pytest.fixture
def agent_store():
    """A store that outlives the attempts, like torchrun's agent's; the workers' environment to reach it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.parametrize("late_rank", [0, 1])
def test_a_second_attempt_on_the_kept_store_starts_its_group_whichever_rank_comes_first(agent_store, late_rank):
    env = agent_store
    first = launch(one_attempt, None, nprocs=2, start_method="fork", timeout=60, env=env)
    assert first[0] == 3.0
    second = launch(one_attempt, late_rank, nprocs=2, start_method="fork", timeout=60, env=env)
    assert second[0] == 3.0
    assert second[1] > first[1]  # the first attempt's keys were there when the second started


def test_rank_0_names_the_ranks_that_never_came(agent_store, monkeypatch):
    env = agent_store
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] did not join .* on torchrun's store at 127\.0\.0\.1:"):
        attempt_store(0, 3, timedelta(seconds=1))
    assert time.monotonic() - started < 10


def test_a_rank_names_rank_0_when_it_never_answers(agent_store, monkeypatch):
    env = agent_store
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TimeoutError, match=r"rank 1 got no answer from rank 0 within .* \(1 s\)"):
        attempt_store(1, 2, timedelta(seconds=1))
