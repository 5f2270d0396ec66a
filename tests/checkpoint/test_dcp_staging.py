"""The DCP store's async staging: what the store hands DCP, and the stager that copies it (CPU; CUDA where marked).

The async DCP save failed on the GPU machine (torch 2.11) at its second save with
`KeyError: <class 'type'>`, inside torch's `DefaultStager`, which deep-copies the
state dict with a copy table its `close()` clears (cadence/checkpoint/dcp_staging.py).
The store now hands DCP string keys and tensors only, and copies them with its own
`DCPStager`: no object is deep-copied, buffers are kept from save to save.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cadence.checkpoint import dcp_io
from cadence.checkpoint.dcp_staging import DCPStager
from cadence.checkpoint.dcp_store import DCPStore
from tests.checkpoint.test_dcp_store import equal, payload

pytestmark = pytest.mark.timeout(60)

without_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned staging)")

PLAIN = (str, int, float, bool, bytes, type(None))


def walk(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from walk(value, f"{path}.{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from walk(value, f"{path}.{i}")
    else:
        yield path, obj


def test_the_store_hands_dcp_only_tensors_under_string_keys_and_keeps_the_rest_in_its_objects() -> None:
    saved = payload()
    saved["config"]["run"] = {"lr": 0.1, "betas": (0.9, 0.95), "name": None}
    skeleton, tensors = dcp_io.split(saved)
    assert tensors and all(type(k) is str and type(v) is torch.Tensor for k, v in tensors.items()), tensors
    assert (
        "model.weight" in tensors
        and "optimizers.0.state.0.exp_avg" in tensors
        and "callbacks.ema.shadow.weight" in tensors
    )
    # What DCP does not get (engine state, RNG, config, param groups) is plain data or a per-rank tensor (the
    # RNG's ByteTensor), saved in the store's objects file with torch.save: nothing there for a stager to copy.
    for path, leaf in walk(skeleton):
        if isinstance(leaf, torch.Tensor):
            assert path.startswith(".rng."), path
        else:
            assert isinstance(leaf, PLAIN), (path, type(leaf))


def test_each_key_keeps_its_buffer_and_every_save_holds_the_values_at_its_call() -> None:
    stager = DCPStager()
    live = {"model.w": torch.randn(5, 3), "optimizers.0.state.0.step": torch.tensor(1.0)}
    seen: list[dict[str, torch.Tensor]] = []
    pointers: dict[str, int] = {}
    for _ in range(3):  # the second save is where torch's DefaultStager failed on the GPU machine
        staged = stager.stage(live)
        seen.append({k: v.clone() for k, v in staged.items()})
        pointers = pointers or {k: v.data_ptr() for k, v in staged.items()}
        assert {k: v.data_ptr() for k, v in staged.items()} == pointers  # reused, not reallocated
        equal({k: v.clone() for k, v in live.items()}, staged)
        assert all(staged[k].data_ptr() != live[k].data_ptr() for k in live)
        live["model.w"].add_(1.0)  # the loop goes on: the staged copy is not the live tensor
        live["optimizers.0.state.0.step"] += 1
    assert [float(s["optimizers.0.state.0.step"]) for s in seen] == [1.0, 2.0, 3.0]
    live["model.w"] = torch.randn(6, 3)  # another shape: a new buffer; a key gone: its buffer goes
    del live["optimizers.0.state.0.step"]
    staged = stager.stage(live)
    assert staged["model.w"].shape == (6, 3) and set(staged) == {"model.w"} and stager.nbytes == 6 * 3 * 4
    stager.close()
    equal({"model.w": live["model.w"]}, stager.stage(live))  # closed, then used again: stages (torch's did not)


def test_anything_but_tensors_under_string_keys_is_refused_naming_the_entry() -> None:
    with pytest.raises(TypeError, match=r"entry 'rng' is a dict; the store hands DCP only tensors"):
        DCPStager().stage({"model.w": torch.ones(2), "rng": {"torch": torch.ones(2)}})
    with pytest.raises(TypeError, match=r"entry 0 is a Tensor"):
        DCPStager().stage({0: torch.ones(2)})  # type: ignore[dict-item]


def test_a_dtensor_stages_as_a_cpu_dtensor_of_the_same_mesh_and_placements(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        live = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
        stager = DCPStager()
        staged = stager.stage({"model.w": live})["model.w"]
        assert dcp_io.is_dtensor(staged) and staged.placements == live.placements and staged.device_mesh == mesh
        assert torch.equal(staged.to_local(), live.to_local())
        assert staged.to_local().data_ptr() != live.to_local().data_ptr()
        live.to_local().add_(1.0)
        again = stager.stage({"model.w": live})["model.w"]
        assert again.to_local().data_ptr() == staged.to_local().data_ptr()
        assert torch.equal(again.to_local(), torch.arange(12.0).reshape(4, 3) + 1)
    finally:
        dist.destroy_process_group()


def cuda_payload(step: int) -> dict[str, Any]:
    saved = payload(step=step, seed=step)
    for section in ("model", "callbacks", "optimizers"):
        saved[section] = _to_cuda(saved[section])
    return saved


def _to_cuda(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cuda()
    if isinstance(obj, dict):
        return {k: _to_cuda(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cuda(v) for v in obj]
    return obj


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


@pytest.mark.cuda
@without_cuda
def test_cuda_tensors_stage_into_pinned_buffers_copied_after_the_queued_work_three_saves_in_a_row() -> None:
    stager = DCPStager()
    live = {"model.w": torch.randn(1 << 20, device="cuda"), "optimizers.0.state.0.step": torch.tensor(1.0)}
    for save in range(3):
        live["model.w"].mul_(2.0)  # queued on the loop's stream: the copy must see it
        expected = live["model.w"].cpu()
        staged = stager.stage(live)
        assert staged["model.w"].device.type == "cpu" and staged["model.w"].is_pinned()
        assert not staged["optimizers.0.state.0.step"].is_pinned()  # a CPU source: plain memory
        assert torch.equal(staged["model.w"], expected), save
        live["model.w"].add_(1.0)  # after stage returns, the staged values stay
        assert torch.equal(staged["model.w"], expected), save


@pytest.mark.cuda
@without_cuda
def test_the_dcp_store_writes_cuda_state_asynchronously_three_saves_in_a_row(tmp_path: Path) -> None:
    """tests/checkpoint/test_dcp_store.py's async test with the state on the GPU (it failed there at save 2)."""
    store = DCPStore(tmp_path)
    saved = [cuda_payload(step) for step in (1, 2, 3)]
    pending = [store.write_async("latest", p) for p in saved]
    assert [p.result()["step"] for p in pending] == [1, 2, 3]  # type: ignore[index]
    store.wait()
    read = store.read("latest")
    equal(_to_cpu(saved[2]["model"]), read["model"])
    equal(_to_cpu(saved[2]["optimizers"]), read["optimizers"])
    store.close()


@pytest.mark.cuda
@without_cuda
def test_a_cuda_dtensor_stages_into_a_pinned_cpu_dtensor_on_a_one_process_nccl_mesh() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        live = distribute_tensor(torch.arange(4096.0, device="cuda").reshape(64, 64), mesh, [Shard(0)])
        stager = DCPStager()
        for save in range(3):
            staged = stager.stage({"model.w": live})["model.w"]
            local = staged.to_local()
            assert local.device.type == "cpu" and local.is_pinned() and staged.placements == live.placements
            assert torch.equal(local, live.to_local().cpu()), save
            live.to_local().add_(1.0)
    finally:
        dist.destroy_process_group()
