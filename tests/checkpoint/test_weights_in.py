"""`Checkpoint(pretrained=...)` from safetensors written by the `safetensors` library itself (issue 34, weights in).

One file, a folder with an index (two shards), a Hugging Face folder through
a key mapping, exclusions; on a 2-rank FSDP mesh and a 2-rank tensor-parallel
mesh, each rank reads its shard and the model equals the file's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cadence.checkpoint import CheckpointError
from cadence.launch import launch
from tests.callbacks.test_checkpoint import make, setup_only

safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors: pip install 'cadence[hf]'")
pytestmark = pytest.mark.timeout(120)


def weights(seed: int = 7) -> dict[str, torch.Tensor]:
    """Weights for `tiny_model()` (Linear(8, 16), ReLU, Linear(16, 4)), unlike any it initializes with."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"0.weight": (16, 8), "0.bias": (16,), "2.weight": (4, 16), "2.bias": (4,)}
    return {k: torch.randn(s, generator=generator) for k, s in shapes.items()}


def write_sharded(folder: Path, tensors: dict[str, torch.Tensor], prefix: str = "") -> None:
    """Two files and Hugging Face's index, by the safetensors library."""
    folder.mkdir(parents=True)
    keys = sorted(tensors)
    halves = {"a.safetensors": keys[:2], "b.safetensors": keys[2:]}
    weight_map = {}
    for file, names in halves.items():
        safetensors_torch.save_file({prefix + k: tensors[k] for k in names}, str(folder / file))
        weight_map.update({prefix + k: file for k in names})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def loaded(tmp_path: Path, pretrained: Path, **options) -> dict[str, torch.Tensor]:
    engine, _ = make(tmp_path / "run", checkpoint={"pretrained": str(pretrained), **options})
    setup_only(engine)
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


@pytest.mark.parametrize("layout", ["file", "index", "hf"])
def test_pretrained_reads_safetensors_written_by_the_library(tmp_path: Path, layout: str) -> None:
    expected = weights()
    options = {}
    if layout == "file":
        target = tmp_path / "w.safetensors"
        safetensors_torch.save_file(expected, str(target))
    elif layout == "index":
        target = tmp_path / "sharded"
        write_sharded(target, expected)
    else:
        target = tmp_path / "hf"
        write_sharded(target, expected, prefix="model.")
        (target / "config.json").write_text("{}")
        options = {"pretrained_mapping": "tests.checkpoint.test_export:Prefixed"}
    got = loaded(tmp_path, target, **options)
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_exclusions_and_missing_keys(tmp_path: Path) -> None:
    expected = weights()
    partial = {k: v for k, v in expected.items() if not k.startswith("2.")}
    target = tmp_path / "partial.safetensors"
    safetensors_torch.save_file(partial, str(target))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \[2.weight, 2.bias\]"):
        loaded(tmp_path / "a", target, strict=False)
    got = loaded(tmp_path / "b", target, pretrained_exclude=["2.*"])
    assert all(torch.equal(got[k], v) for k, v in partial.items())
    assert not torch.equal(got["2.weight"], expected["2.weight"])
    with pytest.raises(Exception, match="key mappings apply to safetensors"):  # a HookError naming on_setup
        torch.save(expected, tmp_path / "w.pt")
        loaded(tmp_path / "c", tmp_path / "w.pt", pretrained_mapping="tests.checkpoint.test_export:Prefixed")


def sharded_worker(folder: str, options: dict) -> dict:
    from cadence.backends.mesh import MeshBackend
    from cadence.callbacks import Checkpoint
    from tests.distributed.test_mesh import Net, _full, make_engine

    pretrained = Checkpoint(dir=folder + "/run", pretrained=folder + "/net.safetensors", interval=0)
    backend = MeshBackend(**options, timeout=60, device="cpu")
    with make_engine(Net(seed=3), backend, batch_size=2, callbacks=[pretrained]) as engine:
        engine.fit(steps=0)  # the launch mode applies at setup
        state = engine.backend.model_state_dict(engine)
        local = {k: v.to_local().numel() for k, v in state.items() if hasattr(v, "to_local")}
        return {"full": {k: _full(v).clone() for k, v in state.items()}, "local": local}


@pytest.mark.parametrize("options", [{"shard": 2}, {"tensor": 2}], ids=["fsdp", "tensor"])
def test_a_sharded_model_loads_each_ranks_shard(tmp_path: Path, options: dict) -> None:
    from tests.distributed.test_mesh import Net

    generator = torch.Generator().manual_seed(11)
    expected = {k: torch.randn(v.shape, generator=generator) for k, v in Net().state_dict().items()}
    safetensors_torch.save_file(expected, str(tmp_path / "net.safetensors"))
    got = launch(sharded_worker, str(tmp_path), options, nprocs=2, start_method="fork", timeout=100)
    assert all(torch.equal(got["full"][k], v) for k, v in expected.items())
    assert any(n < expected[k].numel() for k, n in got["local"].items())  # some tensors really are sharded


@pytest.mark.parametrize("to", ["safetensors", "hf", "torch"])
def test_an_export_loads_back_as_pretrained_bitwise(tmp_path: Path, to: str) -> None:
    from cadence.checkpoint.export import export_checkpoint
    from tests.callbacks.test_checkpoint import trained

    source = trained(tmp_path / "a", 3)
    options = {"pretrained_mapping": "tests.checkpoint.test_export:Prefixed"} if to == "hf" else {}
    out = tmp_path / ("out.pt" if to == "torch" else "out")
    mapping = options.get("pretrained_mapping")
    export_checkpoint(tmp_path / "a" / "latest", out, to=to, mapping=mapping, max_shard_bytes=300)
    got = loaded(tmp_path / "b", out, **options)
    assert all(torch.equal(got[k], v) for k, v in source.model.state_dict().items())
