"""Compose a loop step by step, the way a notebook user does.

    python examples/compose.py

Fit a little, evaluate, add a callback and a function handler, fit more: the
engine keeps its place between calls, so two `fit(steps=50)` train 100 steps.
"""

from __future__ import annotations

import torch
from digits import accuracy, digits_datasets
from torch.nn import functional as F

import cadence


class BestAccuracy(cadence.Callback):
    """Remembers the best validation accuracy; its state goes into checkpoints."""

    order = cadence.Order.DEFAULT

    def __init__(self) -> None:
        self.best = 0.0

    def on_eval_end(self, engine: cadence.Engine) -> None:
        self.best = max(self.best, engine.eval_results["val"]["val.accuracy"])

    def state_dict(self) -> dict[str, float]:
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.best = state["best"]


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train, val = digits_datasets()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    engine = cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        train,
        loss_fn=F.cross_entropy,
        eval_fn=accuracy,
        eval_data=val,
        seed=0,
        eval_every_epochs=None,
    )

    engine.fit(steps=50)  # a first look
    print("after 50 steps:", engine.evaluate())

    best = BestAccuracy()
    engine.add_callback(best)  # add behaviour between fits

    @engine.on(cadence.Event.ON_STEP_END, every=25)
    def progress(engine: cadence.Engine) -> None:
        print(f"  step {engine.state.step}: loss {engine.loss.item():.4f}")

    engine.fit(steps=50)  # continues at step 50
    print("after 100 steps:", engine.evaluate(), "best:", best.best)

    engine.remove_handler(progress)  # the decorator returned the function itself; this unregisters it
    engine.fit(epochs=3)
    print(f"after {engine.state.step} steps / {engine.state.epoch} epochs:", engine.evaluate())
    print("callbacks in order:", engine.callbacks)


if __name__ == "__main__":
    main()
