"""Model transforms on the local backend: activation checkpointing and torch.compile keep the plain module's keys."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.backends.ddp import DDPBackend
from cadence.backends.local import LocalBackend
from cadence.backends.transforms import ActivationCheckpointConfig, apply_activation_checkpointing, find_units
from cadence.callbacks import Checkpoint
from cadence.checkpoint import from_checkpoint
from cadence.launch import launch
from tests.conftest import tiny_dataset, tiny_model
from tests.distributed.test_mesh import Block, Net


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for _, p in sorted(model.named_parameters())])


def train(backend, steps: int = 4, model: torch.nn.Module | None = None, callbacks=(), batch_size=8) -> cadence.Engine:
    model = model if model is not None else Net(seed=0)
    engine = cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        tiny_dataset(64),
        loss_fn=F.cross_entropy,
        backend=backend,
        callbacks=callbacks,
        seed=0,
        train={"batch_size": batch_size, "shuffle": False},
        device="cpu",
    )
    engine.fit(steps=steps)
    return engine


@pytest.mark.parametrize(
    "checkpointing",
    [{"mode": "full"}, {"mode": "full", "every": 2}, {"mode": "selective"}],
    ids=["every-block", "every-2nd-block", "selective"],
)
def test_activation_checkpointing_trains_like_no_checkpointing(checkpointing):
    plain = train(LocalBackend(device="cpu"))
    engine = train(LocalBackend(activation_checkpointing=checkpointing, device="cpu"))
    assert torch.equal(flat(engine.model), flat(plain.model))
    marked = [getattr(b, "_cadence_checkpointed", False) for b in engine.model.blocks]
    assert marked == ([False, True] if checkpointing.get("every") == 2 else [True, True])
    assert list(engine.model.state_dict()) == list(plain.model.state_dict())  # names unchanged


def ddp_with_transforms() -> tuple[torch.Tensor, list[bool]]:
    backend = DDPBackend(
        activation_checkpointing={"mode": "selective"}, compile={"enabled": True, "backend": "eager"}, device="cpu"
    )
    with train(backend, batch_size=4) as engine:
        marks = [b._cadence_checkpointed and b._cadence_compiled for b in engine.model.blocks]
        return flat(engine.model), marks


@pytest.mark.timeout(150)
def test_ddp_checkpoints_and_compiles_blocks_before_wrapping():
    params, marks = launch(ddp_with_transforms, nprocs=2, start_method="fork", timeout=140)
    assert marks == [True, True]
    torch.testing.assert_close(params, flat(train(LocalBackend(device="cpu"), batch_size=8).model), rtol=0, atol=1e-6)


def test_activation_checkpointing_recomputes_in_backward():
    calls = []
    model = Net(seed=0)
    model.blocks[0].fc1.register_forward_hook(lambda *args: calls.append(1))
    apply_activation_checkpointing(find_units(model), ActivationCheckpointConfig(mode="full"))
    model(torch.randn(2, 8)).sum().backward()
    assert len(calls) == 2  # forward, then again in backward


def test_units_come_from_the_model_class_names_or_a_function():
    model = Net()
    assert find_units(model) == list(model.blocks)
    assert find_units(model, ["Block"]) == list(model.blocks)
    assert find_units(model, fn=lambda m: [m.blocks[1], m.head]) == [model.blocks[1], model.head]
    with pytest.raises(ValueError, match=r"no module of class \['Blok'\].*Block"):
        find_units(model, ["Blok"])
    with pytest.raises(ValueError, match="needs the model's blocks"):
        LocalBackend(activation_checkpointing={"mode": "full"}, device="cpu").setup(_Holder(torch.nn.Linear(2, 2)))
    with pytest.raises(cadence.ConfigError, match="activation_checkpointing"):
        LocalBackend(activation_checkpointing={"mode": "sometimes"}, device="cpu")
    assert isinstance(model.blocks[0], Block)


class _Holder:
    def __init__(self, model):
        self.model = model
        self.wrapped_model = model


@pytest.mark.timeout(240)
def test_compiled_model_resumes_bitwise_and_its_checkpoint_loads_into_an_uncompiled_model(tmp_path, monkeypatch):
    # Inductor's cache in the (ignored) .pytest_cache: ~50 s cold under load, ~13 s warm.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).parents[2] / ".pytest_cache" / "torchinductor"))
    # A model without blocks: one compiled forward per engine (inductor's cache serves the later ones).
    compiled = {"compile": {"enabled": True}}
    first = tmp_path / "first"
    # 3 steps, saved at the end of that fit, then 3 more: the uninterrupted run. A fresh engine resumes at 3.
    whole = train(
        LocalBackend(**{"device": "cpu", **compiled}),
        steps=3,
        model=tiny_model(seed=0),
        callbacks=[Checkpoint(dir=str(first), interval=0)],
    )
    assert whole.model._cadence_compiled
    part = flat(whole.model)
    shutil.copytree(first, tmp_path / "at-3", symlinks=True)  # the next fit's end saves over `latest`
    whole.fit(steps=3)
    whole.close()
    resumed = train(
        LocalBackend(**{"device": "cpu", **compiled}),
        steps=3,
        model=tiny_model(seed=1),
        callbacks=[Checkpoint(resume=str(tmp_path / "at-3"), dir=str(tmp_path / "second"), interval=0)],
    )
    assert resumed.state.step == 6
    assert torch.equal(flat(resumed.model), flat(whole.model))  # bitwise
    # The compiled run's checkpoint loads into a plain model (no `_orig_mod.` keys) ...
    plain = tiny_model(seed=1)
    assert not any("_orig_mod" in k for k in plain.state_dict())
    loaded = from_checkpoint(
        tmp_path / "at-3", plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), tiny_dataset(64),
        loss_fn=F.cross_entropy, backend=LocalBackend(device="cpu"), seed=0, train={"batch_size": 8, "shuffle": False},
        callbacks=[Checkpoint(interval=0, save_on_fit_end=False)],
    )  # fmt: skip
    assert loaded.state.step == 3 and torch.equal(flat(plain), part)
    # ... and a model the user compiled with torch.compile(model) saves plain keys, and loads them back.
    user = torch.compile(Net(seed=2), backend="eager")
    engine = train(
        LocalBackend(device="cpu"), steps=1, model=user, callbacks=[Checkpoint(dir=str(tmp_path / "third"), interval=0)]
    )
    assert engine.model is user._orig_mod and engine.wrapped_model is user
    assert list(engine.backend.model_state_dict(engine)) == list(Net().state_dict())
    engine.close()
    back = torch.compile(Net(seed=3), backend="eager")
    again = from_checkpoint(
        tmp_path / "third", back, torch.optim.AdamW(back.parameters(), lr=1e-2), tiny_dataset(64),
        loss_fn=F.cross_entropy, backend=LocalBackend(device="cpu"), seed=0, train={"batch_size": 8, "shuffle": False},
        callbacks=[Checkpoint(interval=0, save_on_fit_end=False)],
    )  # fmt: skip
    assert torch.equal(flat(again.model), flat(engine.model))
