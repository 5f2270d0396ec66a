"""One device choice for every backend (`cadence.backends.device`): `cuda` is the local-rank GPU."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.backends.device import choose_device, choose_process_group_backend, resolve_device
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)

CPU, MPS = torch.device("cpu"), torch.device("mps")


def cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


@pytest.mark.parametrize(
    ("requested", "local_rank", "gpus", "mps", "group", "expected"),
    [
        ("cuda", 0, 1, False, None, cuda(0)),
        ("cuda", 1, 2, False, "nccl", cuda(1)),  # `cuda` is this process's local-rank GPU on every backend
        ("cuda", 1, 2, False, "gloo", cuda(1)),
        ("cuda:1", 0, 2, False, "nccl", cuda(1)),  # an index is taken as given
        (torch.device("cuda", 0), 3, 4, False, "nccl", cuda(0)),
        ("cpu", 0, 8, True, "nccl", CPU),
        ("mps", 0, 0, True, None, MPS),
        # None: one process takes its local-rank GPU, else MPS, else the CPU ...
        (None, 0, 2, True, None, cuda(0)),
        (None, 1, 2, False, None, cuda(1)),
        (None, 0, 0, True, None, MPS),
        (None, 0, 0, False, None, CPU),
        # ... a distributed backend its local-rank GPU under NCCL, else the CPU
        (None, 1, 2, False, "nccl", cuda(1)),
        (None, 0, 2, False, "cpu:gloo,cuda:nccl", cuda(0)),
        (None, 0, 2, True, "gloo", CPU),
        ("", 0, 0, False, "gloo", CPU),
    ],
)
def test_the_choice(requested, local_rank, gpus, mps, group, expected):
    got = choose_device(requested, local_rank=local_rank, cuda_devices=gpus, mps=mps, process_group=group)
    assert got == expected


@pytest.mark.parametrize(
    ("requested", "group", "match"),
    [
        ("cuda", None, r"device 'cuda' was requested on rank 3 \(local rank 1\): cuda:1 is out of range, "
         r"this process sees 1 CUDA device\(s\) \(cuda:0\.\.cuda:0"),
        ("cuda:2", "nccl", r"device 'cuda:2' was requested on rank 3 \(local rank 1\): cuda:2 is out of range, "
         r"this process sees 1 CUDA device"),
        (None, "nccl", r"the default device of a nccl process group \(the local-rank GPU\) on rank 3 \(local rank 1\): "
         r"cuda:1 is out of range, this process sees 1 CUDA device\(s\).*start at most 1 process\(es\) per node"),
        (None, None, r"the default device \(the local-rank GPU\) on rank 3 \(local rank 1\): cuda:1 is out of range"),
    ],
)  # fmt: skip
def test_an_index_out_of_range_names_the_rank_the_local_rank_and_the_visible_count(requested, group, match):
    with pytest.raises(ValueError, match=match):
        choose_device(requested, local_rank=1, rank=3, cuda_devices=1, process_group=group)


def test_cuda_or_mps_where_there_is_none_is_a_clear_error():
    with pytest.raises(ValueError, match=r"device 'cuda' was requested on rank 0 \(local rank 0\), but CUDA is not "
                       r"available here .*pass device='cpu'"):  # fmt: skip
        choose_device("cuda", cuda_devices=0)
    with pytest.raises(ValueError, match=r"the default device of a nccl process group .* but CUDA is not available"):
        choose_device(None, cuda_devices=0, process_group="nccl")
    with pytest.raises(ValueError, match=r"device 'mps' was requested on rank 0 \(local rank 0\), but MPS is not"):
        choose_device("mps", mps=False)


def test_a_device_torch_does_not_know_is_named():
    with pytest.raises(ValueError, match=r"device 'gpu' on rank 0 \(local rank 0\): not a device torch knows"):
        choose_device("gpu")


def test_the_process_group_backend_follows_the_device():
    assert choose_process_group_backend(None, cuda(1)) == "nccl"
    assert choose_process_group_backend(None, CPU) == "gloo"
    assert choose_process_group_backend(None, MPS) == "gloo"
    assert choose_process_group_backend("gloo", cuda(0)) == "gloo"  # as given


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("backend", ["local", "ddp", "mesh"])
def test_requesting_cuda_without_cuda_fails_before_any_group_on_every_backend(backend, monkeypatch):
    import torch.distributed as dist

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    if backend == "ddp":  # a launcher's environment of one process
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29999")
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
    model = tiny_model()
    with pytest.raises(ValueError, match=r"device 'cuda' was requested on rank 0 \(local rank 0\), but CUDA is not"):
        cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(2), loss_fn=F.cross_entropy,
                       backend=backend, device="cuda", seed=0)  # fmt: skip
    assert not dist.is_initialized()


@pytest.mark.default_device  # checks the default on purpose (CADENCE_TEST_EXPLICIT_DEVICE does not apply)
def test_the_default_device_here_is_the_local_rank_gpu_else_the_cpu(monkeypatch):
    from cadence.backends.local import LocalBackend

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps = torch.backends.mps.is_available()
    expected = cuda(0) if gpus else MPS if mps else CPU
    assert LocalBackend().device == expected == resolve_device(None, current=False)
    assert resolve_device(None, process_group="gloo", current=False) == CPU


def test_resolve_device_reads_the_local_rank_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "5")
    assert resolve_device("cpu") == CPU
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < 2:
        with pytest.raises(ValueError, match=r"on rank 5 \(local rank 1\)"):
            resolve_device("cuda", current=False)


# -- on a GPU ---------------------------------------------------------------------


def _one_process_engine(backend, **kwargs):
    model = tiny_model()
    return cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(4), loss_fn=F.cross_entropy,
        backend=backend, seed=0, **kwargs,
    )  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("device", ["cuda", None, "cuda:0"])
def test_mesh_on_one_gpu_takes_the_local_rank_gpu(device, monkeypatch):
    from cadence.backends import MeshBackend

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with _one_process_engine(MeshBackend(device=device)) as engine:  # a one-process NCCL mesh
        assert engine.backend.device == cuda(0)
        assert torch.cuda.current_device() == 0
        assert torch.distributed.get_backend() == "nccl"
        engine.fit(steps=2)
        assert all(p.device == cuda(0) for p in engine.model.parameters())
    assert not torch.distributed.is_initialized()


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["local", "ddp"])
def test_cuda_is_the_local_rank_gpu_on_the_local_and_ddp_backends(backend, monkeypatch):
    from cadence.launch import free_port

    if backend == "ddp":  # a launcher's environment of one process
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            monkeypatch.setenv(name, value)
    with _one_process_engine(backend, device="cuda") as engine:
        assert engine.backend.device == cuda(0)
        engine.fit(steps=2)
        assert all(p.device == cuda(0) for p in engine.model.parameters())
