"""fit() is re-entrant, survives KeyboardInterrupt, and engines are collectable."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence import Event
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)


def make_engine(**kwargs):
    model = tiny_model()
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_batches(10),
        loss_fn=F.cross_entropy,
        seed=0,
        **{"device": "cpu", **kwargs},
    )


def losses_of(engine):
    losses = []
    engine.on(Event.ON_STEP_END)(lambda e: losses.append(e.loss.item()))
    return losses


def test_two_fits_train_the_sum_of_their_steps():
    engine = make_engine()
    engine.fit(steps=7)
    engine.fit(steps=7)
    assert engine.state.step == 14 and engine.state.epoch == 1 and engine.state.batch_in_epoch == 4


def test_split_fits_equal_one_fit_bitwise():
    a, b = make_engine(), make_engine()
    la, lb = losses_of(a), losses_of(b)
    a.fit(steps=13)
    for n in (5, 1, 7):
        b.fit(steps=n)
    assert la == lb
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_keyboard_interrupt_from_a_callback_then_fit_continues_at_the_same_step():
    reference = make_engine()
    ref_losses = losses_of(reference)
    reference.fit(steps=12)

    engine = make_engine()
    engine_losses = losses_of(engine)

    def interrupt(e):
        raise KeyboardInterrupt

    handle = engine.add_handler(Event.ON_BACKWARD, interrupt, once=6)  # in the middle of step 6
    with pytest.raises(KeyboardInterrupt):
        engine.fit(steps=12)
    assert engine.state.step == 5 and engine.state.micro_step == 5
    handle.remove()
    engine.fit(steps=7)
    assert engine.state.step == 12
    # The interrupted step's batch was kept and retried: same losses, same parameters.
    assert engine_losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(reference.model.parameters(), engine.model.parameters()))


def test_interrupt_at_step_end_continues_from_that_step():
    engine = make_engine()

    def interrupt(e):
        raise KeyboardInterrupt

    handle = engine.add_handler(Event.ON_STEP_END, interrupt, once=5)
    with pytest.raises(KeyboardInterrupt):
        engine.fit(steps=10)
    assert engine.state.step == 5
    handle.remove()
    engine.fit(steps=5)
    assert engine.state.step == 10


def test_finished_engine_is_garbage_collected():
    engine = make_engine(eval_data=tiny_batches(2))
    engine.on(Event.ON_STEP_END, every=2)(lambda e: None)
    engine.fit(epochs=1)
    engine.evaluate()
    ref = weakref.ref(engine)
    model_ref = weakref.ref(engine.model)
    del engine
    gc.collect()
    assert ref() is None
    assert model_ref() is None


def test_engines_live_side_by_side():
    a, b = make_engine(), make_engine(grad_accum=2)
    a.fit(steps=2)
    b.fit(steps=3)
    a.fit(steps=1)
    assert (a.state.step, b.state.step) == (3, 3)
    assert b.state.micro_step == 6


def test_no_side_effects_at_import():
    import signal
    import subprocess
    import sys

    code = (
        "import gc, signal, threading\n"
        "before = (gc.isenabled(), signal.getsignal(signal.SIGTERM), threading.active_count())\n"
        "import cadence, cadence.callbacks, cadence.backends.local\n"
        "after = (gc.isenabled(), signal.getsignal(signal.SIGTERM), threading.active_count())\n"
        "assert before == after, (before, after)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert signal.getsignal(signal.SIGTERM) is not None
