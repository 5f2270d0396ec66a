"""Bad input: one clear error naming it, before any process group and any training step.

Every case of the table runs the same way: errors raised by `Engine()` are
checked with the DDP backend on a real one-rank gloo group (the group must not
have started, so nothing is left to leak); errors raised by `fit()` are checked
to come before the first optimizer step.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import cadence
from cadence.backends.ddp import DDPBackend
from cadence.callbacks import Checkpoint, GradClip
from cadence.run import config as config_module
from cadence.run.config_cli import parse_overrides
from tests.conftest import tiny_dataset, tiny_model


@pytest.fixture
def one_rank(monkeypatch):
    """The environment of a one-rank DDP run; a group left behind is destroyed (and fails the test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_RANK", "0")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class Steps(cadence.Callback):
    """Counts optimizer steps."""

    def __init__(self) -> None:
        self.optimizer_steps = 0

    def on_optimizer_step(self, engine):
        self.optimizer_steps += 1


def make(*, model=None, data: Any = "dataset", callbacks=(), steps: Steps | None = None, **kwargs) -> cadence.Engine:
    model = tiny_model() if model is None else model
    data = tiny_dataset(32) if data == "dataset" else data
    kwargs.setdefault("loss_fn", F.cross_entropy)
    if isinstance(data, torch.utils.data.Dataset):
        kwargs.setdefault("train", cadence.DataConfig(batch_size=8))
    callbacks = [*callbacks, *([steps] if steps is not None else [])]
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        callbacks=callbacks,
        seed=0,
        **{"device": "cpu", **kwargs},
    )


def fails_at_build(**kwargs) -> Callable[[Path, Steps], Any]:
    """`Engine(**kwargs)` under DDP (one rank) raises."""
    return lambda tmp, steps: make(backend="ddp", steps=steps, **kwargs)


def fails_at_fit(fit: dict[str, Any] | None = None, **kwargs) -> Callable[[Path, Steps], Any]:
    """`Engine(**kwargs)` builds; `fit(**fit)` raises before the first optimizer step."""

    def run(tmp: Path, steps: Steps) -> None:
        engine = make(steps=steps, **kwargs)
        with engine:
            engine.fit(**(fit or {"steps": 2}))

    return run


def a_file(tmp: Path) -> str:
    (tmp / "taken").write_text("not a folder")
    return str(tmp / "taken")


def duplicate_yaml_key(tmp: Path, steps: Steps) -> None:
    (tmp / "run.yaml").write_text("steps: 3\nlog_interval: 5\nsteps: 30\n")
    config_module.load_file(tmp / "run.yaml")


class Named(cadence.Callback):
    def __init__(self, key: str, after: tuple[str, ...] = ()) -> None:
        self.state_key, self.after = key, after


def one_pass():
    return ((x, y) for x, y in torch.utils.data.DataLoader(tiny_dataset(32), batch_size=8))


def frozen_model() -> torch.nn.Module:
    return tiny_model().requires_grad_(False)


def loader():
    return torch.utils.data.DataLoader(tiny_dataset(32), batch_size=8)


# (id, what is done, error type, text naming the input)
CASES = [
    ("fit steps=True", fails_at_fit(fit={"steps": True}), ValueError, r"fit\(steps=\.\.\.\) must be an int >= 0, got True"),
    ("empty override", lambda tmp, steps: parse_overrides(cadence.EngineConfig, ["steps="]), cadence.ConfigError, r"'steps=': no value after '=' for steps \(to clear it, write steps=null\)"),
    ("duplicate yaml key", duplicate_yaml_key, cadence.ConfigError, r"run\.yaml.*duplicate key 'steps' \(first on line 1\)"),
    ("after= names nothing", fails_at_fit(callbacks=[Named("first"), Named("second", after=("frist",))]), cadence.OrderError, r"'second' has after=\('frist',\).*did you mean 'first'"),
    ("grad_clip norm_type fro", fails_at_build(callbacks=[{"name": "grad_clip", "max_norm": 1.0, "norm_type": "fro"}]), cadence.ConfigError, r"'callback\.norm_type': expected float, got 'fro'"),
    ("GradClip norm_type fro", lambda tmp, steps: GradClip(max_norm=1.0, norm_type="fro"), cadence.ConfigError, r"grad_clip\.norm_type.*got 'fro'"),
    ("empty dataset", fails_at_build(data=torch.utils.data.TensorDataset(torch.empty(0, 8), torch.empty(0))), ValueError, r"train_data is empty \(TensorDataset of length 0\)"),
    ("model without parameters", fails_at_build(model=frozen_model()), ValueError, r"model Sequential has no parameter that requires a gradient"),
    ("non-scalar loss", fails_at_fit(loss_fn=partial(F.cross_entropy, reduction="none")), TypeError, r"loss_fn returned a loss of shape \(8,\); the loss must be a scalar"),
    ("scheduler name", fails_at_build(scheduler="cosine"), TypeError, r"scheduler must be an LR scheduler instance .*got str 'cosine'"),
    ("checkpoint dir is a file", lambda tmp, steps: make(backend="ddp", callbacks=[Checkpoint(dir=a_file(tmp))]), cadence.ConfigError, r"checkpoint\.dir.*taken' is an existing file, not a folder"),
    ("no loss_fn", fails_at_fit(loss_fn=None), TypeError, r"without loss_fn or step_fn the model is called on the whole batch.*Pass loss_fn="),
    ("data= keyword", lambda tmp, steps: cadence.Engine(tiny_model(), None, data=tiny_dataset(), backend="ddp", device="cpu"), TypeError, r"unexpected keyword argument 'data': pass training data as train_data="),
    ("generator over epochs", fails_at_fit(data=one_pass(), fit={"epochs": 2}), ValueError, r"train_data is a one-shot iterator \(generator\).*trains 2 epochs"),
    ("train settings next to a DataLoader", fails_at_build(data=loader(), train={"batch_size": 8}), ValueError, r"train=\{'batch_size': 8\} is set, but train_data is a DataLoader"),
    # What DDP used to raise after starting its process group (issue 16, defect 4):
    ("unknown callback name", fails_at_build(callbacks=["no_such_callback"]), cadence.ConfigError, r"unknown callback 'no_such_callback'"),
    ("duplicate state key", fails_at_build(callbacks=[Named("same"), Named("same")]), ValueError, r"two callbacks with state_key 'same'"),
    ("order cycle", fails_at_build(callbacks=[Named("a", after=("b",)), Named("b", after=("a",))]), cadence.OrderError, r"cycle: (a -> b -> a|b -> a -> b)"),
    ("train data not iterable", fails_at_build(data=42), TypeError, r"train_data must be a torch Dataset.*got int 42"),
    ("fp16 on CPU", fails_at_build(precision="fp16", device="cpu"), ValueError, r"precision 'fp16' needs a CUDA device"),
    ("cuda device without CUDA", fails_at_build(device="cuda:0"), ValueError, r"device 'cuda:0' was requested on rank 0 \(local rank 0\), but CUDA is not available here"),
    ("config key typo", fails_at_build(precison="bf16"), TypeError, r"unexpected keyword argument 'precison': did you mean precision=\?"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "error", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_error_before_any_group_or_step(case, error, match, tmp_path, one_rank):
    if match.startswith("device 'cuda") and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    steps = Steps()
    with pytest.raises(error, match=match):
        case(tmp_path, steps)
    assert not dist.is_initialized(), "a process group was started (and left behind) before the error"
    assert steps.optimizer_steps == 0, "a training step ran before the error"


def unsharded_loader(out: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = make(data=loader(), backend="ddp")
        engine.close()
    found = [str(w.message) for w in caught if "distributed sampler" in str(w.message)]
    Path(out, f"rank-{dist.get_rank() if dist.is_initialized() else os.environ['RANK']}").write_text("\n".join(found))


@pytest.mark.timeout(120)
def test_a_plain_dataloader_under_ddp_is_one_warning_per_rank(tmp_path):
    cadence.launch(unsharded_loader, str(tmp_path), nprocs=2, start_method="fork", timeout=100)
    for rank in (0, 1):
        lines = (tmp_path / f"rank-{rank}").read_text().splitlines()
        assert len(lines) == 1 and "each of the 2 data ranks iterates the whole dataset" in lines[0], lines


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="counts file descriptors in /proc")
def test_a_failed_engine_leaves_no_group_and_the_retry_owns_and_releases_its_own(one_rank):
    make(backend="ddp").close()  # the first group of a process leaves some things for later groups
    before = open_fds()
    with pytest.raises(ValueError, match="two callbacks with state_key"):
        make(backend="ddp", callbacks=[Named("same"), Named("same")])
    assert not dist.is_initialized()
    engine = make(backend="ddp", callbacks=[Named("same")])  # the corrected retry
    assert dist.is_initialized()
    engine.fit(steps=1)
    engine.close()
    assert not dist.is_initialized(), "the retry did not own the group it runs on"
    assert open_fds() == before


class FailsAfterJoining(DDPBackend):
    """A backend whose setup fails once the group is up (a device or a wrapper that fails)."""

    def setup(self, engine):
        super().setup(engine)
        raise RuntimeError("the model does not fit on this device")


def test_construction_failing_after_the_group_started_releases_it(one_rank):
    with pytest.raises(RuntimeError, match="does not fit"):
        make(backend=FailsAfterJoining(device="cpu"))
    assert not dist.is_initialized(), "Engine() failed and left its process group behind"
