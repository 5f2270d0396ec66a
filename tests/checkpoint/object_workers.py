"""Training processes for the object-storage kill tests, saving to S3 at every step until killed.

The file store's, run as a script in a fresh interpreter (the test SIGKILLs it mid-upload)::

    python tests/checkpoint/object_workers.py URL OUT ASYNC_MODE

and the DCP store's 2 ranks (`dcp_loop`, forked). Each auto-resumes and writes the
step it resumed from to OUT before training.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import cadence
from cadence.callbacks import Checkpoint


class Report(cadence.Callback):
    """Writes the step the run starts from (after the launch modes applied) to a file."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_start(self, engine: cadence.Engine) -> None:
        Path(self.out).write_text(f"{engine.state.step} {engine.restored_from}")


def main(url: str, out: str, async_mode: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 4096)  # 4 M parameters: 16 MB, and 32 MB of AdamW state
    data = torch.utils.data.TensorDataset(torch.randn(64, 1024), torch.randn(64, 4096))
    checkpoint = Checkpoint(dir=url, interval=1, keep_latest_k=1, auto_resume=True, async_mode=async_mode)
    with cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        data,
        loss_fn=torch.nn.functional.mse_loss,
        callbacks=[checkpoint, Report(out)],
        device="cpu",
        seed=0,
        steps=10_000,
        log_interval=10_000,
        train=cadence.DataConfig(batch_size=8),
    ) as engine:
        engine.fit()


if __name__ == "__main__":
    main(*sys.argv[1:4])


def dcp_rank(url: str, out: str, async_mode: str) -> None:
    """One rank of a DDP run with the DCP store on S3, saving ~48 MB at every step until killed."""
    from cadence.backends.ddp import DDPBackend

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 4096)
    data = [(torch.randn(4, 1024), torch.randn(4, 4096))] * 8
    checkpoint = Checkpoint(dir=url, interval=1, keep_latest_k=1, auto_resume=True, async_mode=async_mode)
    engine = cadence.Engine(
        model, torch.optim.AdamW(model.parameters()), data, loss_fn=torch.nn.functional.mse_loss, seed=0,
        backend=DDPBackend(checkpoint="dcp", timeout=60, device="cpu"), log_interval=10**6,
        callbacks=[checkpoint, Report(out)] if os.environ["RANK"] == "0" else [checkpoint],
    )  # fmt: skip
    engine.fit(steps=10**9)


def dcp_loop(url: str, out: str, async_mode: str) -> None:
    """A new session (one signal kills the launcher and both ranks, as a lost node) running 2 ranks of `dcp_rank`."""
    import signal
    import time

    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cadence.launch(dcp_rank, url, out, async_mode, nprocs=2, start_method="fork", timeout=600)
    time.sleep(600)
