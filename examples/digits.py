"""Train a small network on scikit-learn's bundled digits (no download).

    python examples/digits.py                 # 20 epochs, prints the final accuracy
    python examples/digits.py engine.epochs=5 optim.lr=0.01

Evaluates every epoch; the final validation accuracy is >= 0.95 in seconds on
2 CPU cores. What it leaves is what every Cadence run leaves: a progress bar
while it trains, and a run directory (`runs/default-<code>/<run_id>/`) with the
log, `metrics.jsonl`, the config as it ran (`metadata/`) and a checkpoint
every epoch. Stop it (Ctrl-C) and start it again: it says which step it
resumed from and ends with the same accuracy as a run never stopped. A run
already complete is evaluated again, not retrained.
"""

from __future__ import annotations

import sys
import time

import attrs
import torch
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

import cadence
from cadence.callbacks import Checkpoint
from cadence.callbacks.metrics import default_callbacks
from cadence.run.config_cli import parse_cli


@attrs.define(kw_only=True)
class OptimConfig:
    """Attributes:
    lr: AdamW learning rate.
    weight_decay: AdamW weight decay.
    """

    lr: float = 3e-3
    weight_decay: float = 1e-4


@attrs.define(kw_only=True)
class DigitsConfig:
    """Attributes:
    hidden: width of the hidden layers.
    engine: the loop's settings.
    optim: the optimizer's settings.
    """

    hidden: int = 128
    engine: cadence.EngineConfig = attrs.field(
        factory=lambda: cadence.EngineConfig(epochs=20, seed=0, train=cadence.DataConfig(batch_size=64))
    )
    optim: OptimConfig = attrs.field(factory=OptimConfig)


def digits_datasets(seed: int = 0) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """The 1,797 8x8 digit images, scaled to [0, 1], split 80/20."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, val = order[:cut], order[cut:]
    return torch.utils.data.TensorDataset(x[train], y[train]), torch.utils.data.TensorDataset(x[val], y[val])


def accuracy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    logits = model(inputs)
    return {"loss": F.cross_entropy(logits, targets), "accuracy": (logits.argmax(-1) == targets).float().mean()}


def main(argv: list[str] | None = None) -> float:
    cfg = parse_cli(DigitsConfig, argv, prog="examples/digits.py")
    torch.manual_seed(cfg.engine.seed or 0)
    model = nn.Sequential(
        nn.Linear(64, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, 10)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    train, val = digits_datasets()
    checkpoint = Checkpoint(auto_resume=True)
    engine = cadence.Engine(
        model,
        optimizer,
        train,
        loss_fn=F.cross_entropy,
        eval_fn=accuracy,
        eval_data=val,
        # Metrics, a progress bar, metrics.jsonl and the log, and a checkpoint every
        # epoch from which a second start of the same run (same code and config) resumes.
        callbacks=[*default_callbacks(), checkpoint],
        config=cfg.engine,
        run_config=cfg,
    )

    # Lines printed while the progress bar is open go through tqdm.write: above the bar, not into it.
    @engine.on(cadence.Event.ON_FIT_START, when=lambda engine: engine.backend.is_main)
    def announce(engine: cadence.Engine) -> None:
        if engine.restored_from is not None:
            tqdm.write(f"resumed from step {engine.state.step} (epoch {engine.state.epoch}): {engine.restored_from}")
        tqdm.write(f"run directory: {engine.run_dir}")

    # Evaluation metrics are already reduced across ranks: print them once.
    @engine.on(cadence.Event.ON_EVAL_END, when=lambda engine: engine.backend.is_main)
    def report(engine: cadence.Engine) -> None:
        val = engine.eval_results["val"]
        tqdm.write(
            f"epoch {engine.state.epoch:3d}  step {engine.state.step:5d}  val.loss {val['val.loss']:.4f}  val.accuracy {val['val.accuracy']:.4f}"
        )

    start = time.perf_counter()
    try:
        engine.fit()
    except KeyboardInterrupt:
        engine.close()
        if engine.backend.is_main:
            saved = checkpoint.last_saved is not None or engine.restored_from is not None
            print(
                "interrupted: run the same command again to resume from the last checkpoint"
                if saved
                else "interrupted before the first checkpoint: the same command starts the run over",
                file=sys.stderr,
            )
        raise SystemExit(130) from None
    if "val" not in engine.eval_results:  # resumed at its end: nothing left to train
        engine.evaluate()
    engine.close()
    final = engine.eval_results["val"]["val.accuracy"]
    if engine.backend.is_main:
        print(f"final accuracy {final:.4f} after {engine.state.step} steps in {time.perf_counter() - start:.1f} s")
    return final


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
