"""The digits example trained by DDP on two processes (gloo on CPU).

    python examples/ddp_digits.py                      # started by cadence.launch
    python examples/ddp_digits.py engine.epochs=5      # the same overrides as digits.py
    torchrun --nproc_per_node 2 examples/digits.py     # or the unchanged script under torchrun

`digits.main` builds its engine with `backend="auto"`, which becomes DDP when
`WORLD_SIZE` > 1: the dataset is sharded across the ranks, so each epoch has
half the steps and the global batch is twice `train.batch_size`.

The backend and the world size are part of a run's identity: this is a run of
its own (`runs/default-<code>/<code>-<config>-ddp2/`), trained from scratch
even after `digits.py` finished the one-process run of the same config. To
continue that run on two processes instead, name it:
`python examples/ddp_digits.py engine.run_id=<code>-<config>-local1`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import digits

from cadence.launch import launch
from cadence.run.config_cli import parse_cli


def main(argv: list[str] | None = None, nprocs: int = 2) -> float:
    """Run `digits.main(argv)` on `nprocs` processes; returns rank 0's final accuracy."""
    argv = argv if argv is not None else sys.argv[1:]
    # Parsed here first: --help is printed once, and a bad override is one error, before any worker starts.
    parse_cli(digits.DigitsConfig, argv, prog="examples/ddp_digits.py")
    return launch(digits.main, argv, nprocs=nprocs, timeout=600)


if __name__ == "__main__":
    print(f"rank 0 final accuracy {main():.4f}")
