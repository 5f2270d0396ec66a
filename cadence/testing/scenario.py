"""The tiny training run every check of the harness is made of."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.nn import functional as F

from cadence.engine.callback import Callback
from cadence.engine.engine import Engine
from cadence.run.registry import build_callback

#: What `check_callback` accepts as the callback to check.
Factory = Callable[..., Any] | type | str | Mapping[str, Any]

PROBE_KEY = "cadence.testing.probe"


@attrs.define(kw_only=True)
class HarnessContext:
    """What a factory taking one argument receives, to build its callback.

    Attributes:
        workdir: a fresh directory for this engine (put files there).
        rank: this process's rank.
        world_size: number of processes.
        model: the model the engine will train.
        optimizer: its optimizer (to build a scheduler on, for instance).
    """

    workdir: Path
    rank: int = 0
    world_size: int = 1
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


@attrs.define(kw_only=True)
class Scenario:
    """The run: a two-layer regression network, 32 samples, 4 steps per epoch.

    Attributes:
        steps: optimizer steps per `fit` call (two calls make an epoch and a half).
        batch_size: global batch size, split across ranks.
        log_interval: the engine's log interval (so `on_log` fires).
        engine_options: more `Engine` keyword arguments (config fields, `grad_accum`, ...).
        backend: builds a fresh backend for each engine (one process and every rank
            of the rank checks); None: the local backend in one process, DDP (gloo) on
            ranks, both on the CPU.
        checkpoint_params: what the harness's checkpoint saves and restores: "all", or
            "trainable" (adapter-only checkpoints: `Checkpoint(params="trainable")`).
    """

    steps: int = 3
    batch_size: int = 8
    log_interval: int = 2
    engine_options: Mapping[str, Any] = attrs.field(factory=dict)
    backend: Callable[[], Any] | None = None
    checkpoint_params: str = "all"


def callback_maker(factory: Factory, config: Mapping[str, Any] | None) -> Callable[[HarnessContext], Any]:
    """Normalize the accepted forms of a factory to `make(context) -> callback`."""
    if isinstance(factory, (str, Mapping)) or isinstance(factory, type):
        if isinstance(factory, type):
            spec: dict[str, Any] = {"name": factory}
        elif isinstance(factory, str):
            spec = {"name": factory}
        else:
            spec = dict(factory)
        spec.update(config or {})
        return lambda context: build_callback({k: v if k == "name" else copy.deepcopy(v) for k, v in spec.items()})
    if config:
        raise TypeError("check_callback(config=...) applies to a class or a registry name, not to a factory function")
    if not callable(factory):
        raise TypeError(f"check_callback: expected a callback class, a registry name or a factory, got {factory!r}")
    if _takes_an_argument(factory):
        return factory
    return lambda context: factory()


def _takes_an_argument(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return bool(positional) and positional[0].default is inspect.Parameter.empty


def describe(factory: Factory) -> str:
    if isinstance(factory, type):
        return factory.__qualname__
    if isinstance(factory, str):
        return factory
    if isinstance(factory, Mapping):
        return str(factory.get("name"))
    return getattr(factory, "__qualname__", repr(factory))


class Probe(Callback):
    """Runs last on every event; records what the checks compare."""

    order = 10**9
    requests_in_step = False
    raises_requests = False

    def __init__(self, subject: Any) -> None:
        self.subject = subject
        self.state_key = PROBE_KEY
        self.saved: tuple[int, Any] | None = None  # (step, subject state) at the last save
        self.loaded: Any = None  # subject state right after the last restore
        self.agreed: list[tuple[int, tuple[int, ...]]] = []  # (step, agreed values) when any was set

    def on_forward(self, engine: Engine) -> None:
        # A metric to reduce, so on_log fires on log intervals as in any real run.
        if engine.loss is not None:
            engine.log("harness.loss", engine.loss.detach())

    def on_step_end(self, engine: Engine) -> None:
        agreed = engine.requests.agreed
        if any(agreed):
            self.agreed.append((engine.state.step, tuple(agreed)))

    def on_save(self, engine: Engine) -> None:
        self.saved = (engine.state.step, snapshot_state(self.subject))

    def on_load(self, engine: Engine) -> None:
        self.loaded = snapshot_state(self.subject)


def snapshot_state(callback: Any) -> Any:
    """A deep copy of the callback's state; None when it has none (as checkpoints see it)."""
    has_state = getattr(callback, "has_state", None)
    state_dict = getattr(callback, "state_dict", None)
    if not callable(state_dict) or (callable(has_state) and not has_state()):
        return None
    return copy.deepcopy(state_dict())


def dataset(samples: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(samples, 4, generator=g), torch.randn(samples, 2, generator=g))


def build_engine(
    make: Callable[[HarnessContext], Any],
    workdir: Path,
    scenario: Scenario,
    *,
    backend: Any = "local",
    rank: int = 0,
    world_size: int = 1,
    extra: Sequence[Any] = (),
    make_extra: Callable[[HarnessContext, Any], Sequence[Any]] | None = None,
) -> tuple[Engine, Any, Probe]:
    """A fresh engine on the scenario's model and data with the callback, a probe and `extra`."""
    workdir.mkdir(parents=True, exist_ok=True)
    if isinstance(backend, str) and backend == "local" and scenario.backend is not None:
        backend = scenario.backend()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    context = HarnessContext(workdir=workdir, rank=rank, world_size=world_size, model=model, optimizer=optimizer)
    callback = make(context)
    if isinstance(callback, type):
        raise TypeError(f"the factory returned the class {callback.__qualname__}, not an instance")
    probe = Probe(callback)
    extra = [*extra, *(make_extra(context, callback) if make_extra else ())]
    if scenario.batch_size % world_size:
        raise ValueError(f"batch_size {scenario.batch_size} does not split over {world_size} ranks")
    options: dict[str, Any] = {
        "loss_fn": F.mse_loss,
        "eval_data": dataset(16, seed=2),
        "seed": 0,
        "log_interval": scenario.log_interval,
        "workspace": str(workdir / "runs"),
        "lineage": "harness",
        "run_id": "run",
        "train": {"batch_size": scenario.batch_size // world_size},
        "eval": {"batch_size": 4},
        "device": "cpu",  # the same on every machine; the rank checks fork gloo workers
    }
    options.update(scenario.engine_options)
    engine = Engine(
        model,
        optimizer,
        dataset(32, seed=1),
        callbacks=[callback, *extra, probe],
        backend=backend,
        **options,
    )
    return engine, callback, probe


def parameters(engine: Engine) -> dict[str, torch.Tensor]:
    # Through the backend: whole tensors also where parameters are partitioned (DeepSpeed ZeRO-3; a collective).
    # A mesh's are DTensors: gathered whole (a collective every rank runs, in name order).
    return {k: _whole(v).detach().cpu().clone() for k, v in engine.backend.model_state_dict(engine).items()}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def engine_state(engine: Engine) -> dict[str, Any]:
    state = engine.state.state_dict()
    state.pop("last_loss", None)  # each rank's own batch
    return state
