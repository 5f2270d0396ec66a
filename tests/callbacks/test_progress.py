"""ProgressBar: totals and positions in step mode, epoch mode and after a resume; lines fallback."""

from __future__ import annotations

import io
import itertools
import re

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.backends.local import LocalBackend
from cadence.callbacks.checkpoint import Checkpoint
from cadence.callbacks.metrics import TrainMetrics
from cadence.callbacks.progress import ProgressBar
from tests.conftest import tiny_batches, tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(60)


def make_engine(callbacks, *, data=None, **kwargs):
    model = tiny_model()
    kwargs.setdefault("log_interval", 2)
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data if data is not None else tiny_batches(12),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        seed=0,
        **{"device": "cpu", **kwargs},
    )


def bar_states(text):
    """(description, position, total) of every state tqdm drew, in order."""
    return [
        (m.group(1).strip(), int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"(?:^|\r|\n)([^\r\n|]*?):?\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)", text)
    ]


def test_step_mode_total_and_position_across_two_fits():
    out = io.StringIO()
    bar = ProgressBar(mode="bar", stream=out)
    engine = make_engine([TrainMetrics(), bar])
    engine.fit(steps=6)
    states = bar_states(out.getvalue())
    assert states[0][1:] == (0, 6) and states[-1][1:] == (6, 6)
    assert "loss=" in out.getvalue() and "samples/s=" in out.getvalue()
    assert bar.bar is None  # closed at fit end

    out.truncate(0), out.seek(0)
    engine.fit(steps=4)  # re-entrant: the second bar counts 6 -> 10
    states = bar_states(out.getvalue())
    assert states[0][1:] == (6, 10) and states[-1][1:] == (10, 10)


def test_epoch_mode_one_bar_per_epoch_over_its_steps():
    out = io.StringIO()
    # 5 micro-batches per epoch, 2 per step: 3 optimizer steps per epoch.
    engine = make_engine(
        [ProgressBar(mode="bar", stream=out)], data=tiny_dataset(40), train={"batch_size": 8}, grad_accum=2
    )
    engine.fit(epochs=2)
    states = bar_states(out.getvalue())
    assert states[0] == ("epoch 1/2", 0, 3)
    assert ("epoch 1/2", 3, 3) in states
    assert ("epoch 2/2", 0, 3) in states
    assert states[-1] == ("epoch 2/2", 3, 3)
    assert engine.state.step == 6


def test_after_resume_the_bar_starts_at_the_restored_step(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    first = make_engine(
        [Checkpoint(dir=ckpt_dir, interval=4, unit="step", save_on_fit_end=False)], data=tiny_dataset(96),
        train={"batch_size": 8}, steps=10,
    )  # fmt: skip
    first.fit(steps=6)  # saved at step 4, stopped at 6

    out = io.StringIO()
    resumed = make_engine(
        [Checkpoint(dir=ckpt_dir, auto_resume=True), ProgressBar(mode="bar", stream=out)],
        data=tiny_dataset(96), train={"batch_size": 8}, steps=10,
    )  # fmt: skip
    resumed.fit()  # to the configured target
    states = bar_states(out.getvalue())
    assert states[0][1:] == (4, 10)
    assert states[-1][1:] == (10, 10)


def test_epoch_mode_resume_mid_epoch(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    first = make_engine(
        [Checkpoint(dir=ckpt_dir, interval=2, unit="step", save_on_fit_end=False)], data=tiny_dataset(48),
        train={"batch_size": 8},
    )  # fmt: skip
    first.fit(steps=8)  # epoch 0 has 6 steps; saved at 8 = epoch 1, step 2 of it

    out = io.StringIO()
    resumed = make_engine(
        [Checkpoint(dir=ckpt_dir, auto_resume=True), ProgressBar(mode="bar", stream=out)],
        data=tiny_dataset(48), train={"batch_size": 8}, epochs=2,
    )  # fmt: skip
    resumed.fit()
    states = bar_states(out.getvalue())
    assert states[0] == ("epoch 2/2", 2, 6)
    assert states[-1] == ("epoch 2/2", 6, 6)


def test_lines_when_the_output_is_not_a_terminal():
    out = io.StringIO()  # not a tty: auto mode falls back to lines
    bar = ProgressBar(stream=out, line_interval=0)  # a line at every log interval
    engine = make_engine([TrainMetrics(), bar], eval_data=tiny_batches(2), eval_every_steps=4)
    engine.fit(steps=4)
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == [
        "step 2/4 epoch 0",
        "step 4/4 epoch 0",
        "step 4/4 epoch 0 eval",
    ]
    assert "loss=" in lines[0] and "samples/s=" in lines[0] and "eta 0:00:00" in lines[0]
    assert "val.loss=" in lines[2]
    assert "\r" not in out.getvalue()


def test_lines_are_throttled_but_evaluations_and_the_last_state_are_written():
    out = io.StringIO()
    bar = ProgressBar(stream=out, line_interval=3600)
    engine = make_engine([TrainMetrics(), bar], eval_data=tiny_batches(2), eval_every_steps=6)
    engine.fit(steps=10)  # logs at 2, 4, 6 (+ eval), 8, 10
    assert [line.split(" |")[0] for line in out.getvalue().splitlines()] == [
        "step 2/10 epoch 0",  # the first log
        "step 6/10 epoch 0",  # held back, written before the evaluation that follows it
        "step 6/10 epoch 0 eval",
        "step 10/10 epoch 0",  # the fit's last state
    ]


def test_nothing_on_other_ranks():
    out = io.StringIO()
    backend = LocalBackend(device="cpu")
    backend.rank = 1  # a non-main process (collectives stay local)
    engine = make_engine([TrainMetrics(), ProgressBar(mode="bar", stream=out)], backend=backend)
    engine.fit(steps=4)
    assert out.getvalue() == ""


def test_config_errors():
    with pytest.raises(cadence.ConfigError, match="mode"):
        ProgressBar(mode="fancy")


def test_per_step_hooks_only_while_a_bar_is_shown():
    seen = []

    def count_step_hooks(engine):
        seen.append(len(engine.hooks(cadence.Event.ON_STEP_END)))

    lines = make_engine([ProgressBar(stream=io.StringIO(), mode="lines")])
    lines.on(cadence.Event.ON_FIT_END)(count_step_hooks)
    lines.fit(steps=2)
    bar = make_engine([ProgressBar(stream=io.StringIO(), mode="bar")])
    bar.on(cadence.Event.ON_FIT_END)(count_step_hooks)
    bar.fit(steps=2)
    assert seen == [0, 1]  # lines: nothing per step; a bar: one tick per step while fitting
    assert bar.hooks(cadence.Event.ON_STEP_END) == ()  # removed when the fit ends
    bar.fit(steps=2)  # and registered again for the next
    assert seen == [0, 1, 1]


@pytest.mark.parametrize("epochs", [False, True])
def test_after_its_first_step_a_bar_costs_one_hook_per_step(epochs):
    seen = []

    def step_hooks(engine):
        seen.append((engine.state.step, len(engine.hooks(cadence.Event.ON_STEP_START))))

    out = io.StringIO()
    engine = make_engine([ProgressBar(mode="bar", stream=out)], data=tiny_batches(4))
    engine.on(cadence.Event.ON_STEP_END)(step_hooks)
    if epochs:
        engine.fit(epochs=2)  # one bar per epoch: each opens at its epoch's first step
        assert seen == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (7, 0), (8, 0)]
        assert [s[0] for s in bar_states(out.getvalue()) if s[1] == 0] == ["epoch 1/2", "epoch 2/2"]
    else:
        engine.fit(steps=3)
        assert seen == [(1, 0), (2, 0), (3, 0)]  # the bar opened at step 1, then its opener went
        assert bar_states(out.getvalue())[-1][1:] == (3, 3)


@pytest.mark.parametrize("epochs", [False, True])
def test_fast_steps_move_the_bar_at_each_log_and_slow_ones_at_each_step(epochs):
    import time

    out = io.StringIO()
    bar = ProgressBar(mode="bar", stream=out)
    bar.per_step_below = 0.5  # an interval of 2 tiny steps is faster; one with a 0.3 s step is not
    engine = make_engine([TrainMetrics(), bar], data=tiny_batches(6))
    counting = []  # per step: whether the bar's per-step hook was registered

    def step_end(engine):
        counting.append(any(getattr(h, "__self__", None) is bar for h in engine.hooks(cadence.Event.ON_STEP_END)))
        if engine.state.step in (7, 8):
            time.sleep(0.3)

    engine.on(cadence.Event.ON_STEP_END, order=99)(step_end)
    engine.fit(epochs=2) if epochs else engine.fit(steps=12)
    # Per step until the first interval's pace is known, then at each log; the slow
    # interval (steps 7-8) brings the per-step count back, and the next fast one removes it.
    assert counting == [True, True, False, False, False, False, False, False, True, True, False, False]
    states = bar_states(out.getvalue())
    if epochs:
        assert ("epoch 1/2", 6, 6) in states and states[-1] == ("epoch 2/2", 6, 6)
    else:
        assert states[0][1:] == (0, 12) and states[-1][1:] == (12, 12)
        assert all(b[1] >= a[1] for a, b in itertools.pairwise(states))  # it never moves back
    assert not any(getattr(h, "__self__", None) is bar for h in engine.hooks(cadence.Event.ON_STEP_END))


def test_a_bar_counted_at_each_log_ends_at_the_fits_last_step():
    out = io.StringIO()
    bar = ProgressBar(mode="bar", stream=out)
    bar.per_step_below = 1e9  # every interval counts as fast: the bar moves only at logs and the end
    engine = make_engine([TrainMetrics(), bar], log_interval=4)
    engine.fit(steps=3)  # ends before its first log interval
    assert bar_states(out.getvalue())[-1][1:] == (3, 3)
    out.truncate(0), out.seek(0)
    engine.fit(steps=6)  # a log at step 4 and 8, the end at 9
    states = bar_states(out.getvalue())
    assert states[0][1:] == (3, 9) and states[-1][1:] == (9, 9)


def test_the_bars_last_state_shows_the_last_values_logged():
    out = io.StringIO()
    engine = make_engine([TrainMetrics(), ProgressBar(mode="bar", stream=out)], log_interval=1)
    engine.fit(steps=8)  # 8 logs within a fifth of a second: the postfix is formatted once, then at the end
    last = out.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert "8/8" in last and f"loss={engine.logged['loss']:.4g}" in last


def test_refresh_interval_sets_how_often_the_bar_redraws():
    draws = {}
    for interval in (1e-9, 60.0):
        out = io.StringIO()
        bar = ProgressBar(mode="bar", stream=out, refresh_interval=interval)
        bar.per_step_below = 0.0  # every step moves the bar
        make_engine([TrainMetrics(), bar], log_interval=1).fit(steps=8)
        draws[interval] = len(bar_states(out.getvalue()))
    assert draws[60.0] <= 3 and draws[1e-9] >= 8, draws  # opened and closed; or at every step
    with pytest.raises(cadence.ConfigError, match="refresh_interval"):
        ProgressBar(refresh_interval=0)


def test_each_epochs_bar_ends_full_when_the_epoch_ends_between_two_logs():
    out = io.StringIO()
    bar = ProgressBar(mode="bar", stream=out)
    bar.per_step_below = 1e9  # the bar moves only at logs: the epoch's end must complete it
    engine = make_engine([TrainMetrics(), bar], data=tiny_batches(6), log_interval=4)
    engine.fit(epochs=3)  # logs at steps 4, 8, 12, 16; epochs end at 6, 12, 18
    states = bar_states(out.getvalue())
    for epoch in (1, 2, 3):
        ends = [position for desc, position, total in states if desc == f"epoch {epoch}/3"]
        assert ends[-1] == 6, (epoch, ends)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (0.41213, "0.4121"),
        (2553.0, "2553"),
        (25534.2, "25.5k"),
        (1.234e6, "1.23M"),
        (-3.2e9, "-3.2G"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (7, "7"),
    ],
)
def test_values_are_short_and_rates_in_human_units(value, shown):
    from cadence.callbacks.progress import format_value

    assert format_value(value) == shown
