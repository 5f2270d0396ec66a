"""Adapter-only checkpoints: `Checkpoint(params="trainable")` saves and restores only trainable parameters (issue 34).

The contract harness's checkpoint check, with its checkpoint adapter-only and
the first layer frozen, on each backend that runs on the CPU (local, FSDP2
on the mesh, DeepSpeed): the resumed run equals the uninterrupted one, bit
for bit, while the frozen weights come from the model's construction. On 2
ranks (FSDP2 over the DCP store, DDP over the file store) the same, against
an uninterrupted run, with the checkpoint holding only the trainable keys.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import cadence
from cadence.checkpoint.export import read_source
from cadence.launch import launch
from cadence.testing import check_callback

pytestmark = pytest.mark.timeout(180)


class FreezeFirst(cadence.Callback):
    """The subject of the harness runs: it freezes the harness model's first layer when built."""

    def __init__(self, model: torch.nn.Module) -> None:
        for param in model[0].parameters():  # type: ignore[index]
            param.requires_grad_(False)


def _backends() -> dict:
    from cadence.backends.mesh import MeshBackend

    out = {"local": None, "mesh": lambda: MeshBackend(shard=-1, device="cpu")}
    if importlib.util.find_spec("deepspeed") is not None:  # a broken import of the backend fails, not skips
        from cadence.backends.deepspeed import DeepSpeedBackend

        out["deepspeed"] = lambda: DeepSpeedBackend(zero_stage=2, device="cpu")
    return out


@pytest.mark.parametrize("backend", ["local", "mesh", "deepspeed"])
def test_the_harness_resumes_an_adapter_only_checkpoint_bitwise(tmp_path: Path, backend: str) -> None:
    backends = _backends()
    if backend not in backends:
        pytest.skip("needs deepspeed: pip install 'cadence[deepspeed]'")
    report = check_callback(
        lambda context: FreezeFirst(context.model),
        checks=["checkpoint"],
        workdir=tmp_path,
        backend=backends[backend],
        checkpoint_params="trainable",
    )
    assert report.ok, str(report)
    latest = next(tmp_path.rglob("harness-checkpoints/latest"))
    payload = read_source(latest).payload
    assert payload["meta"]["params"] == "trainable"
    if backend == "deepspeed":  # DeepSpeed's own file holds its module, frozen parameters left out
        payload = {"model": torch.load(latest / "mp_rank_00_model_states.pt", weights_only=False)["module"]}
    assert set(payload["model"]) == {"2.weight", "2.bias"}


def adapter_worker(directory: str, backend_name: str) -> dict:
    from cadence.backends.mesh import MeshBackend
    from cadence.callbacks import Checkpoint
    from tests.distributed.test_mesh import Net, _full, make_engine

    def backend():
        return MeshBackend(shard=2, timeout=60, device="cpu") if backend_name == "mesh" else "ddp"

    def frozen(seed: int) -> Net:
        net = Net(seed=seed)
        net.inp.requires_grad_(False)
        return net

    def full(engine) -> dict:
        return {k: _full(v).clone() for k, v in engine.backend.model_state_dict(engine).items()}

    with make_engine(frozen(0), backend(), batch_size=2) as engine:
        engine.fit(steps=6)
        straight = full(engine)
    saver = Checkpoint(dir=directory, interval=0, params="trainable")
    with make_engine(frozen(0), backend(), batch_size=2, callbacks=[saver]) as engine:
        engine.fit(steps=3)
        assert saver.wait(60)
    # Frozen weights from the same construction; the trainable ones start elsewhere and come from the checkpoint.
    resumed_net = frozen(0)
    torch.manual_seed(5)
    for block in [*resumed_net.blocks, resumed_net.head]:
        for param in block.parameters():
            param.data.normal_()
    loader = Checkpoint(dir=directory, resume=str(Path(directory) / "latest"), interval=0, params="trainable")
    with make_engine(resumed_net, backend(), batch_size=2, callbacks=[loader]) as engine:
        engine.fit(steps=3)
        return {"straight": straight, "resumed": full(engine)}


@pytest.mark.parametrize("backend", ["mesh", "ddp"])
def test_two_ranks_resume_an_adapter_only_checkpoint_bitwise(tmp_path: Path, backend: str) -> None:
    got = launch(adapter_worker, str(tmp_path), backend, nprocs=2, start_method="fork", timeout=150)
    assert set(got["straight"]) == set(got["resumed"])
    for key, value in got["straight"].items():
        assert torch.equal(got["resumed"][key], value), key
    saved = read_source(tmp_path / "latest").payload
    assert saved["meta"]["params"] == "trainable"
    assert not any(key.startswith("inp.") for key in saved["model"])
    assert any(key.startswith("head.") for key in saved["model"])


def test_export_params_trainable_writes_the_adapter_alone(tmp_path: Path) -> None:
    from cadence.checkpoint.export import export_checkpoint, read_export
    from tests.callbacks.test_checkpoint import make

    engine, _ = make(tmp_path / "run", checkpoint={})
    engine.model[0].requires_grad_(False)
    with engine:
        engine.fit(steps=2)  # a full checkpoint: every key, with the trainable ones recorded
        head = {k: v.clone() for k, v in engine.model.state_dict().items() if k.startswith("2.")}
    out = tmp_path / "adapter.safetensors"
    export_checkpoint(tmp_path / "run" / "latest", out, to="safetensors", params="trainable")
    back = read_export(out)["model"]
    assert set(back) == set(head) and all(torch.equal(back[k], v) for k, v in head.items())
