"""A seeded Cadence run equals the hand-written loop bitwise."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torchdata.stateful_dataloader import StatefulDataLoader

import cadence
from tests.conftest import tiny_batches, tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(60)


def test_plain_loop_equivalence_with_adam():
    data = tiny_batches(20)
    model = tiny_model(seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        for x, y in data:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())

    ours = tiny_model(seed=3)
    engine = cadence.Engine(
        ours, torch.optim.Adam(ours.parameters(), lr=1e-2), data, loss_fn=F.cross_entropy, seed=0, device="cpu"
    )
    our_losses = []
    engine.on(cadence.Event.ON_STEP_END)(lambda e: our_losses.append(e.loss.item()))
    engine.fit(epochs=2)
    assert our_losses == losses
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ours.parameters()))


def test_shuffled_dataset_with_accumulation_equivalence():
    seed, accum, epochs = 7, 2, 2
    dataset = tiny_dataset(40)

    model = tiny_model(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator()
    loader = StatefulDataLoader(dataset, batch_size=6, shuffle=True, generator=generator)
    for epoch in range(epochs):
        generator.manual_seed(seed + epoch)  # the engine's documented per-epoch seeding
        batches = list(loader)
        for i in range(0, len(batches), accum):
            group = batches[i : i + accum]
            for x, y in group:
                (
                    F.cross_entropy(model(x), y) / len(group) if len(group) > 1 else F.cross_entropy(model(x), y)
                ).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    ours = tiny_model(seed=3)
    engine = cadence.Engine(
        ours,
        torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9),
        dataset,
        loss_fn=F.cross_entropy,
        seed=seed,
        grad_accum=accum,
        train=cadence.DataConfig(batch_size=6),
        device="cpu",
    )
    engine.fit(epochs=epochs)
    assert engine.state.step == 2 * 4  # 7 batches of 6 per epoch -> 4 steps (last one partial)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ours.parameters()))
