"""`cadence export`: every store's checkpoint to every format and back, bitwise (issue 34).

Sources: a file-store checkpoint (one process), a DCP checkpoint of a 2-rank
FSDP mesh, a DeepSpeed ZeRO-3 checkpoint of 2 ranks (each written once per
module by a real gloo launch). Each is exported to torch, safetensors
(sharded and not), a Hugging Face folder and DCP; what was written is read
back and compared with the weights the run had, bit for bit; with the
optimizer, its state equals the source's. An exported DCP checkpoint is a
source again (DCP -> torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence.checkpoint import CheckpointError
from cadence.checkpoint.export import export_checkpoint, read_export, read_source
from cadence.cli import main
from cadence.launch import launch
from tests.callbacks.test_checkpoint import trained

pytest.importorskip("safetensors", reason="needs safetensors: pip install 'cadence[hf]'")
pytestmark = pytest.mark.timeout(240)


class Prefixed:
    """A key mapping for the tests: every key under `model.` (the LM example's is tested below)."""

    def to_hf(self, key: str) -> str | None:
        return f"model.{key}"

    def from_hf(self, name: str) -> str | None:
        return name.removeprefix("model.") if name.startswith("model.") else None

    def hf_config(self, payload: Any) -> dict[str, Any]:
        return {"model_type": "test", "step": payload["meta"]["step"]}


def fsdp_worker(directory: str) -> dict[str, torch.Tensor]:
    from cadence.backends.mesh import MeshBackend
    from cadence.callbacks import Checkpoint
    from tests.distributed.test_mesh import Net, _full, make_engine

    saver = Checkpoint(dir=directory, interval=0)
    with make_engine(Net(), MeshBackend(shard=2, timeout=60, device="cpu"), batch_size=2, callbacks=[saver]) as engine:
        engine.fit(steps=3)
        assert saver.wait(60)
        return {k: _full(v).clone() for k, v in engine.backend.model_state_dict(engine).items()}


def zero3_worker(directory: str) -> dict[str, torch.Tensor]:
    from cadence.callbacks import Checkpoint
    from tests.backends.test_deepspeed import ds_backend, make_engine

    engine = make_engine(ds_backend(3), 4, [Checkpoint(dir=directory, interval=0)])
    try:
        engine.fit(steps=3)
        return {k: v.clone() for k, v in engine.backend.model_state_dict(engine).items()}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """`{store: (checkpoint folder, the run's whole weights)}` for the three stores."""
    root = tmp_path_factory.mktemp("sources")
    engine = trained(root / "file", 3)
    out = {"file": (root / "file" / "latest", {k: v.clone() for k, v in engine.model.state_dict().items()})}
    weights = launch(fsdp_worker, str(root / "dcp"), nprocs=2, start_method="fork", timeout=150)
    out["dcp"] = (root / "dcp" / "latest", weights)
    if _has_deepspeed():
        weights = launch(zero3_worker, str(root / "deepspeed"), nprocs=2, start_method="fork", timeout=150)
        out["deepspeed"] = (root / "deepspeed" / "latest", weights)
    return out


def _has_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


def same(a: Any, b: Any) -> bool:
    """Nested states equal, tensors bitwise (dtype, shape, bytes); tuples and lists alike (JSON has no tuples)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


FORMATS = [("torch", "model.pt"), ("safetensors", "model.safetensors"), ("safetensors", "sharded"), ("hf", "hf")]
FORMATS += [("dcp", "dcp-export")]


@pytest.mark.parametrize("store", ["file", "dcp", "deepspeed"])
@pytest.mark.parametrize(("to", "name"), FORMATS)
def test_every_store_exports_to_every_format_and_reads_back_bitwise(
    sources: dict, tmp_path: Path, store: str, to: str, name: str
) -> None:
    if store not in sources:
        pytest.skip("deepspeed is not installed")
    checkpoint, weights = sources[store]
    optimizer = to != "hf" and store != "deepspeed"
    out = tmp_path / name
    shard = 600 if name == "sharded" else 5 << 30
    mapping = Prefixed() if to == "hf" else None
    written = export_checkpoint(
        checkpoint, out, to=to, with_optimizer=optimizer, mapping=mapping, max_shard_bytes=shard
    )
    assert all(path.exists() for path in written)
    back = read_export(out, mapping=mapping)
    assert same(back["model"], weights)
    if optimizer:
        assert same(back["optimizers"], read_source(checkpoint).payload["optimizers"])
    if name == "sharded":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert index["metadata"]["source_store"] == store
    if to == "safetensors":
        assert back["metadata"]["source_store"] == store
        assert back["metadata"]["step"] == "3"
        assert back["metadata"]["format"] == "cadence-export"
        assert set(back["metadata"]) >= {"code_id", "config_hash", "source"}
    if to == "hf":
        assert json.loads((out / "config.json").read_text()) == {"model_type": "test", "step": 3}
    if to == "dcp":  # an exported DCP checkpoint is a source again
        again = export_checkpoint(out, tmp_path / "again.pt", to="torch", with_optimizer=optimizer)
        assert same(read_export(again[0])["model"], weights)


def test_dtype_cast_and_the_command_line(sources: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    checkpoint, weights = sources["file"]
    out = tmp_path / "bf16.safetensors"
    assert main(["export", str(checkpoint), str(out), "--to", "safetensors", "--dtype", "bf16"]) == 0
    assert "exported" in capsys.readouterr().out
    back = read_export(out)["model"]
    assert same(back, {k: v.to(torch.bfloat16) for k, v in weights.items()})


def test_a_damaged_checkpoint_is_refused_before_anything_is_written(sources: dict, tmp_path: Path) -> None:
    import shutil

    checkpoint, _ = sources["dcp"]
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    data = sorted(p for p in copy.iterdir() if p.suffix == ".distcp")[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{data.name}: checksum mismatch"):
        export_checkpoint(copy, tmp_path / "out.pt", to="torch")
    assert not (tmp_path / "out.pt").exists()
    assert main(["export", str(copy), str(tmp_path / "out.pt"), "--to", "torch"]) == 1
    assert main(["export", str(copy), str(tmp_path / "x"), "--to", "hf"]) == 2  # no mapping: a usage error


def test_the_lm_examples_mapping_names_every_weight_of_a_dense_decoder(tmp_path: Path) -> None:
    from cadence.checkpoint.hf import load_mapping

    root = Path(__file__).resolve().parents[2]
    mapping = load_mapping(f"{root / 'examples' / 'lm.py'}:HFLlama")
    module = __import__("sys").modules["cadence_mapping_lm"]
    model = module.Transformer(module.ModelConfig(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32))
    keys = list(model.state_dict())
    names = [mapping.to_hf(k) for k in keys]
    assert None not in names and len(set(names)) == len(keys)
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert [mapping.from_hf(n) for n in names] == keys
    config = mapping.hf_config({"config": {"run": {"model": {"dim": 16, "n_layers": 2}}}})
    assert config["hidden_size"] == 16 and config["num_hidden_layers"] == 2


def test_a_dcp_export_with_the_optimizer_resumes_bitwise(sources: dict, tmp_path: Path) -> None:
    """The exported DCP checkpoint is a whole Cadence checkpoint: `from_checkpoint` restores weights and optimizer."""
    from cadence.callbacks import Checkpoint
    from cadence.checkpoint import from_checkpoint
    from tests.conftest import tiny_dataset, tiny_model

    checkpoint, weights = sources["file"]
    export_checkpoint(checkpoint, tmp_path / "dcp" / "latest", to="dcp", with_optimizer=True)
    model = tiny_model()
    engine = from_checkpoint(
        tmp_path / "dcp" / "latest",
        model,
        torch.optim.AdamW(model.parameters(), lr=0.05),
        tiny_dataset(),
        loss_fn=torch.nn.functional.cross_entropy,
        callbacks=[Checkpoint(dir=str(tmp_path / "next"), interval=0)],  # the saved run had one (its state)
        seed=0,
        train={"batch_size": 8},
        device="cpu",
    )
    with engine:
        assert engine.state.step == 3
        assert same(engine.model.state_dict(), weights)
        saved = read_source(checkpoint).payload["optimizers"][0]["state"]
        assert same(engine.optimizers[0].state_dict()["state"], saved)
