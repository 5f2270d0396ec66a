"""Seeding and determinism: same seed same run, per-rank offsets, workers, deterministic flags."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import cadence
from tests.conftest import tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(60)


class NoisyDataset(torch.utils.data.Dataset):
    """Each item draws fresh noise from torch's RNG: in a worker, the worker's seed decides it."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int):
        return torch.full((4,), float(index)) + torch.rand(4), torch.tensor(index % 2)


def train(seed: int | None, steps: int = 6, **overrides) -> tuple[list[float], list[torch.Tensor], cadence.Engine]:
    """Shuffled data, a dropout layer and RNG-dependent weights: every source of randomness counts."""
    model = torch.nn.Sequential(tiny_model(), torch.nn.Dropout(0.5))
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_dataset(64),
        loss_fn=torch.nn.functional.cross_entropy, seed=seed, **{"device": "cpu", **overrides},
    )  # fmt: skip
    # Re-initialize after the engine seeded everything, so the weights follow the seed too.
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
    losses: list[float] = []
    engine.on(cadence.Event.ON_STEP_END)(lambda e: losses.append(float(e.loss.detach())))
    engine.fit(steps=steps)
    return losses, [p.detach().clone() for p in model.parameters()], engine


def test_same_seed_same_results_different_seed_different_results():
    losses_a, params_a, _ = train(seed=3)
    losses_b, params_b, _ = train(seed=3)
    losses_c, params_c, _ = train(seed=4)
    assert losses_a == losses_b
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    assert losses_a != losses_c
    assert not all(torch.equal(a, c) for a, c in zip(params_a, params_c))


def test_unset_seed_is_drawn_and_recorded_in_the_config():
    _, _, first = train(seed=None, steps=1)
    _, _, second = train(seed=None, steps=1)
    assert isinstance(first.config.seed, int) and first.seed == first.config.seed
    assert first.seed != second.seed  # no run directory was opened: nothing to reuse
    # Replaying a drawn seed reproduces the run.
    assert train(seed=first.seed, steps=3)[0] == train(seed=first.seed, steps=3)[0]


def test_a_retry_with_an_unset_seed_reproduces_the_first_attempt(tmp_path):
    def attempt():
        model = tiny_model()
        engine = cadence.Engine(
            model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_dataset(64),
            loss_fn=torch.nn.functional.cross_entropy, workspace=str(tmp_path / "ws"),
            device="cpu",
        )  # fmt: skip
        _ = engine.run_dir  # the first attempt records its drawn seed there
        order = [batch[0].sum().item() for batch in engine.data["train"].epoch_iter(0, fresh=True)]
        return engine.seed, order, torch.rand(3)

    assert attempt()[0] == attempt()[0]
    first, second = attempt(), attempt()
    assert first[1] == second[1]  # the same shuffling
    assert torch.equal(first[2], second[2])  # the same torch stream


def test_python_numpy_and_torch_are_seeded_with_the_seed():
    model = tiny_model()
    cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), seed=11, device="cpu")
    drawn = (random.random(), np.random.rand(), torch.rand(1))
    cadence.seed_everything(11)
    assert drawn == (random.random(), np.random.rand(), torch.rand(1))


def test_dataloader_workers_follow_the_seed():
    def batches(seed: int) -> list[torch.Tensor]:
        model = tiny_model(inputs=4, classes=2)
        engine = cadence.Engine(
            model, torch.optim.SGD(model.parameters(), lr=0.1), NoisyDataset(),
            loss_fn=torch.nn.functional.cross_entropy, seed=seed, train={"batch_size": 8, "num_workers": 2},
            device="cpu",
        )  # fmt: skip
        return [inputs for inputs, _ in engine.data["train"].epoch_iter(0, fresh=True)]

    a, b, c = batches(5), batches(5), batches(6)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, z) for x, z in zip(a, c, strict=True))


def _rank_draws(seed: int):
    model = tiny_model()
    engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="ddp", seed=seed, device="cpu")
    draws = (engine.backend.rank, random.random(), float(np.random.rand()), torch.rand(2).tolist())
    import torch.distributed as dist

    gathered = [None, None]
    dist.all_gather_object(gathered, draws)
    engine.close()
    return gathered


@pytest.mark.timeout(90)
def test_each_rank_is_seeded_with_seed_plus_rank():
    from cadence.launch import launch

    gathered = launch(_rank_draws, 21, nprocs=2, start_method="fork", timeout=80)
    for rank, py, npy, th in gathered:
        cadence.seed_everything(21 + rank)
        assert (py, npy, th) == (random.random(), float(np.random.rand()), torch.rand(2).tolist())
    assert gathered[0][1:] != gathered[1][1:]


# -- RNG across a stop and resume ------------------------------------------------------------


class DrawRandom(cadence.Callback):
    """At every step end, one draw from each global RNG the engine checkpoints."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.draws: list[tuple] = []

    def on_step_end(self, engine: cadence.Engine) -> None:
        draw = (engine.state.step, random.random(), float(np.random.rand()), torch.rand(1).item())
        if self.cuda:
            draw += (torch.rand(1, device="cuda").item(),)
        self.draws.append(draw)


def checkpointed_run(directory: Path, *, stop: int | None = None, resume: bool = False, cuda: bool = False):
    """8 steps saving a checkpoint every 4; `stop` ends the fit after that step, `resume` continues from latest."""
    from cadence.callbacks.checkpoint import Checkpoint

    model = tiny_model()
    recorder = DrawRandom(cuda)
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_dataset(64),
        loss_fn=torch.nn.functional.cross_entropy, seed=5, steps=8, log_interval=1000,
        device="cuda" if cuda else "cpu", train={"batch_size": 8},
        callbacks=[recorder, Checkpoint(dir=str(directory), interval=4, auto_resume=resume)],
    )  # fmt: skip
    if stop is not None:  # requested before the optimizer step of step `stop`, agreed in it
        engine.on(cadence.Event.ON_BEFORE_OPTIMIZER_STEP, once=stop)(lambda e: e.request_stop("test"))
    with engine:
        engine.fit()
        return engine.state.step, engine.restored_from, recorder.draws


def assert_resumed_draws_match(tmp_path: Path, cuda: bool = False) -> None:
    _, _, reference = checkpointed_run(tmp_path / "reference", cuda=cuda)
    step, _, first = checkpointed_run(tmp_path / "run", stop=4, cuda=cuda)
    assert step == 4 and (tmp_path / "run" / "latest").exists()
    # Whatever the process drew in between must not matter: the checkpoint's RNG state does.
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    step, restored_from, resumed = checkpointed_run(tmp_path / "run", resume=True, cuda=cuda)
    assert step == 8 and restored_from is not None and restored_from.endswith("latest")
    assert [d[0] for d in first + resumed] == list(range(1, 9))
    assert first + resumed == reference
    assert len({d[1] for d in reference}) == 8  # the draws differ from step to step: the check can fail


def test_resume_continues_the_python_numpy_and_torch_random_streams(tmp_path):
    assert_resumed_draws_match(tmp_path)


@pytest.mark.cuda  # the CUDA RNG exists, and is checkpointed, only with a CUDA device
def test_resume_continues_the_cuda_random_stream(tmp_path):
    assert_resumed_draws_match(tmp_path, cuda=True)


@pytest.fixture
def restore_determinism():
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    yield
    enabled, warn_only, cudnn_deterministic, benchmark, cublas = saved
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, benchmark
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


def test_deterministic_sets_the_torch_flags(restore_determinism):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    model = tiny_model()
    cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), seed=0, device="cpu")  # default: untouched
    assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), seed=0, deterministic=True, device="cpu"
    )
    assert engine.config.deterministic is True
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_deterministic_keeps_a_cublas_setting_the_user_chose(restore_determinism, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    model = tiny_model()
    cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), seed=0, deterministic=True, device="cpu")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
