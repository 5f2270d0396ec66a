"""What a user gets from the wheel alone: a save, a resume and a 2-rank fit.

Run by `.ci/wheel` in a fresh venv holding torch and the built wheel with only
its declared dependencies (no [dev] extras), from outside the
repository so the installed package is the one imported. Exits non-zero on
any failure.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from torch.nn import functional as F

import cadence
from cadence.callbacks import Checkpoint


def make_engine(workspace: Path, **overrides):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))
    return cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        data,
        loss_fn=F.cross_entropy,
        seed=0,
        workspace=str(workspace),
        train=cadence.DataConfig(batch_size=8),
        **overrides,
    )


def fit_on_two_ranks(workspace: str) -> int:
    with make_engine(Path(workspace), backend="ddp") as engine:
        engine.fit(epochs=1)  # each rank sees 32 of the 64 samples: 4 steps
        return engine.state.step


def main() -> int:
    assert Path(cadence.__file__).parent.parent != Path(__file__).resolve().parent.parent, "imported the checkout"
    with tempfile.TemporaryDirectory() as tmp:
        workspace = Path(tmp)
        with make_engine(workspace, callbacks=[Checkpoint()]) as engine:
            engine.fit(steps=6)
        latest = engine.run_dir / "checkpoints" / "latest"
        assert latest.exists(), f"no checkpoint at {latest}"
        with make_engine(workspace, callbacks=[Checkpoint(resume=str(latest))]) as resumed:
            assert resumed.state.step == 0
            resumed.fit(steps=2)
            assert resumed.state.step == 8, resumed.state.step
        steps = cadence.launch(fit_on_two_ranks, tmp, nprocs=2, start_method="fork", timeout=120)
        assert steps == 4, steps
    print("wheel smoke: save, resume and a 2-rank fit passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
