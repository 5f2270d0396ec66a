"""Pipeline parallel on the mesh (gloo, forked ranks): schedules equal one process, events, evaluation, resume.

Each launch groups several checks (a launch costs seconds): parameters after
12 AdamW steps with 4 micro-batches, clipping and a NaN on one stage against
the one-process reference; the loss logged from the last stage on every rank;
evaluation's exact mean over a partial last batch; prediction on the last
stage; a stopped-and-resumed run bitwise equal to the uninterrupted one; the
stages' states loading into the whole model and back.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.pipelining  # imported once here, not in every forked worker
from torch.nn import functional as F

import cadence
from cadence.backends.mesh import MeshBackend
from cadence.callbacks import GradClip, NonFiniteSkip, TrainMetrics
from cadence.checkpoint.payload import build_payload, restore
from cadence.launch import launch
from tests.conftest import tiny_dataset

pytestmark = pytest.mark.timeout(120)

STEPS, NAN_STEP, ACCUM, LR = 12, 5, 4, 1e-2
EVAL_SAMPLES = 65  # 16 batches of 4 and a partial one of 1
TWO = [["inp", "blocks.0", "blocks.1"], ["blocks.2", "head"]]
FOUR = [["inp", "blocks.0"], ["blocks.1"], ["blocks.2"], ["head"]]


class Block(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(torch.nn.Module):
    """An input layer, three residual blocks, a head; its forward skips what a stage does not hold."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x) if self.inp is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    def pipeline_split(self, parts: int) -> list[list[str]]:
        return {2: TWO, 4: FOUR}[parts]


class NaNOnRank(cadence.Callback):
    """A NaN in this rank's first gradient before the optimizer step of one step."""

    order = 5

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_before_optimizer_step(self, engine) -> None:
        if engine.state.step + 1 == self.step and engine.backend.rank == self.rank:
            engine.backend.local_gradients(engine)[0].view(-1)[0] = float("nan")


class Recorder(cadence.Callback):
    order = 90

    def __init__(self) -> None:
        self.logged: list[float] = []
        self.losses_seen: list[bool] = []
        self.norms: list[float] = []

    def on_forward(self, engine) -> None:
        self.losses_seen.append(engine.loss is not None)

    def on_step_end(self, engine) -> None:
        norm = getattr(engine, "grad_norm", None)
        if norm is not None:
            self.norms.append(float(norm))

    def on_log(self, engine) -> None:
        if "loss" in engine.logged:
            self.logged.append(engine.logged["loss"])


def named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def make_engine(model, backend, callbacks=(), **overrides):
    options = {
        "seed": 0,
        "grad_accum": ACCUM,
        "log_interval": 3,
        "eval_every_epochs": None,
        "train": {"batch_size": 4, "drop_last": True},
        "eval": {"batch_size": 4},
    }
    options.update(overrides)
    return cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR),
        tiny_dataset(400),
        eval_data=tiny_dataset(EVAL_SAMPLES, seed=5),
        predict_data=tiny_dataset(EVAL_SAMPLES, seed=5),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        backend=backend,
        **options,
        device="cpu",
    )


def reference() -> dict:
    recorder = Recorder()
    callbacks = [NonFiniteSkip(), NaNOnRank(0, NAN_STEP), GradClip(max_norm=0.3), TrainMetrics(), recorder]
    engine = make_engine(Net(), "local", callbacks)
    engine.fit(steps=STEPS)
    x, y = tiny_dataset(EVAL_SAMPLES, seed=5).tensors
    with torch.no_grad():
        exact = float(F.cross_entropy(engine.model(x), y))
    return {
        "params": named(engine.model),
        "logged": recorder.logged,
        "norms": recorder.norms,
        "val": engine.evaluate()["val.loss"],
        "exact": exact,
        "skipped": engine.state.skipped_steps,
        "predict": torch.cat(engine.predict()),
    }


def train_pipeline(schedule: str) -> dict:
    rank = int(os.environ["RANK"])
    recorder = Recorder()
    callbacks = [NonFiniteSkip(), NaNOnRank(1, NAN_STEP), GradClip(max_norm=0.3), TrainMetrics(), recorder]
    backend = MeshBackend(pipeline=2, shard=1, timeout=30, pipelining={"schedule": schedule}, device="cpu")
    # Ranks build different initial models: the backend starts every stage from rank 0's.
    with make_engine(Net(seed=rank), backend, callbacks) as engine:
        engine.fit(steps=STEPS)
        val = engine.evaluate()["val.loss"]
        predicted = engine.predict()
        b = engine.backend
        return {
            "params": b.all_gather_object(named(engine.model), domain="optimizer"),
            "logged": b.all_gather_object(recorder.logged, domain="optimizer"),
            "losses_seen": b.all_gather_object(sorted(set(recorder.losses_seen)), domain="optimizer"),
            "norms": b.all_gather_object(recorder.norms, domain="optimizer"),
            "val": b.all_gather_object(val, domain="optimizer"),
            "skipped": b.all_gather_object(engine.state.skipped_steps, domain="optimizer"),
            "predict": b.all_gather_object([p.clone() for p in predicted], domain="optimizer"),
            "stages": b.all_gather_object(b.pipeline.indices, domain="optimizer"),
        }


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference()


@pytest.mark.parametrize(
    "schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
)
def test_schedule_equals_one_process(schedule: str, ref: dict) -> None:
    got = launch(train_pipeline, schedule, nprocs=2, start_method="fork", timeout=100)
    stages = {"GPipe": [[0], [1]], "1F1B": [[0], [1]], "ZBVZeroBubble": [[0, 3], [1, 2]], "DualPipeV": [[0, 3], [1, 2]]}
    assert got["stages"] == stages.get(schedule, [[0, 2], [1, 3]])
    merged: dict[str, torch.Tensor] = {}
    for part in got["params"]:
        assert not set(part) & set(merged), "a parameter on two stages"
        merged.update(part)
    assert set(merged) == set(ref["params"])  # every FQN kept, none renumbered
    worst = max(float((merged[n] - p).abs().max()) for n, p in ref["params"].items())
    assert worst < 1e-6, worst
    # The NaN on stage 1's gradient: every rank skipped the same step.
    assert got["skipped"] == [ref["skipped"], ref["skipped"]] == [1, 1]
    # The loss exists on the last stage only, and every rank logs the last stage's value.
    v_shaped = schedule in ("ZBVZeroBubble", "DualPipeV")  # the last stage on rank 0
    assert got["losses_seen"] == ([[True], [False]] if v_shaped else [[False], [True]])
    assert len(ref["logged"]) == STEPS // 3
    for logged in got["logged"]:
        assert logged == pytest.approx(ref["logged"], abs=1e-6)
    # Clipping's norm is the total over both stages, on both.
    for norms in got["norms"]:
        assert norms == pytest.approx(ref["norms"], rel=1e-5, nan_ok=True)
    # Evaluation: the exact mean over 65 samples (a partial last batch), on every rank.
    assert got["val"][0] == got["val"][1]
    assert got["val"][0] == pytest.approx(ref["exact"], abs=1e-6)
    assert got["val"][0] == pytest.approx(ref["val"], abs=1e-6)
    # Prediction: outputs on the last stage only.
    last = 0 if v_shaped else 1
    assert got["predict"][1 - last] == []
    assert torch.allclose(torch.cat(got["predict"][last]), ref["predict"], atol=1e-6)


# -- resume and checkpoints -------------------------------------------------------


def resume_pipeline(workdir: str) -> dict:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")  # one group for the three engines (a backend that did not create it keeps it)
    with make_engine(Net(), MeshBackend(pipeline=2, timeout=30, device="cpu")) as engine:
        engine.fit(steps=STEPS)
        straight = named(engine.model)
    with make_engine(Net(), MeshBackend(pipeline=2, timeout=30, device="cpu")) as engine:
        engine.fit(steps=7)  # stopped mid-epoch (25 steps per epoch)
        torch.save(build_payload(engine), Path(workdir) / f"stage-{rank}.pt")
    with make_engine(Net(seed=9), MeshBackend(pipeline=2, timeout=30, device="cpu")) as engine:
        restore(engine, torch.load(Path(workdir) / f"stage-{rank}.pt", weights_only=False))
        engine.fit(steps=STEPS - 7)
        resumed = named(engine.model)
        state = {k: v.clone() for k, v in engine.backend.model_state_dict(engine).items()}  # it aliases the model
        # A one-process model's state loads into the stages (each takes its own keys).
        whole = Net(seed=3).state_dict()
        engine.backend.load_model_state_dict(engine, whole)
        loaded = all(torch.equal(p, whole[n]) for n, p in engine.model.named_parameters())
        b = engine.backend
        return {
            "equal": b.all_gather_object(
                all(torch.equal(straight[n], p) for n, p in resumed.items()), domain="optimizer"
            ),
            "states": b.all_gather_object(state, domain="optimizer"),
            "params": b.all_gather_object(resumed, domain="optimizer"),
            "loaded": b.all_gather_object(loaded, domain="optimizer"),
            "batch_in_epoch": engine.state.batch_in_epoch,
        }


def test_resume_bitwise_and_checkpoints_move_between_stages_and_whole_model(tmp_path: Path) -> None:
    got = launch(resume_pipeline, str(tmp_path), nprocs=2, start_method="fork", timeout=100)
    assert got["equal"] == [True, True]
    assert got["loaded"] == [True, True]
    assert got["batch_in_epoch"] == STEPS * ACCUM
    # The stages' states together load strictly into the whole model on one process.
    whole = Net(seed=4)
    state = {**got["states"][0], **got["states"][1]}
    whole.load_state_dict(state, strict=True)
    for part in got["params"]:
        for name, value in part.items():
            assert torch.equal(dict(whole.named_parameters())[name].detach(), value)


# -- refused configurations ----------------------------------------------------------


def refused(case: str) -> str:
    model = Net()
    options: dict = {"pipeline": 2, "timeout": 30}
    overrides: dict = {}
    if case == "no split":
        model.pipeline_split = None  # type: ignore[assignment]
    elif case == "missing fqn":
        options["pipelining"] = {"module_fqns_per_model_part": [["inp", "blocks.0"], ["blocks.7", "head"]]}
    elif case == "uncovered":
        options["pipelining"] = {"module_fqns_per_model_part": [["inp", "blocks.0"], ["blocks.2", "head"]]}
    elif case == "short step":
        overrides = {"grad_accum": 3}
    elif case == "partial batch":
        overrides = {"train": {"batch_size": 3, "drop_last": False}, "grad_accum": 2}  # 133 batches and 1 sample
    try:
        with make_engine(model, MeshBackend(**{"device": "cpu", **options}), **overrides) as engine:
            engine.fit(steps=2)
    except (ValueError, NotImplementedError) as error:
        import torch.distributed as dist

        return f"{dist.is_initialized()}|{error}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "initialized", "words"),
    [
        ("no split", "False", ["pipeline=2 needs a split", "module_fqns_per_model_part", "pipeline_split"]),
        ("missing fqn", "False", ["'blocks.7'", "named_modules"]),
        ("uncovered", "False", ["'blocks.1.fc1.weight' is in no model part"]),
        ("short step", "True", ["100 batches", "grad_accum=3", "drop_last"]),
        ("partial batch", "True", ["partial (1 of batch_size=3", "drop_last=True", "grad_accum=2"]),
    ],
)
def test_bad_pipeline_configs_fail_clearly(case: str, initialized: str, words: list[str]) -> None:
    got = launch(refused, case, nprocs=2, start_method="fork", timeout=60)
    done, _, message = got.partition("|")
    if initialized == "False":
        assert done == initialized, got  # split problems: raised before any process group exists
    for word in words:
        assert word in message, message


# -- pipeline x FSDP2 ------------------------------------------------------------------


def fsdp_reference() -> dict:
    engine = make_engine(
        Net(), "local", [GradClip(max_norm=0.3)], grad_accum=2, train={"batch_size": 8, "shuffle": False}
    )
    engine.fit(steps=8)
    return {"params": named(engine.model), "val": engine.evaluate()["val.loss"]}


def pipeline_fsdp(workdir: str) -> dict:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    options = {"pipeline": 2, "shard": 2, "units": ["Block"], "timeout": 60}
    train = {"batch_size": 4, "shuffle": False, "drop_last": True}

    def engine_for(seed: int):
        return make_engine(
            Net(seed=seed),
            MeshBackend(**{"device": "cpu", **options}),
            [GradClip(max_norm=0.3)],
            grad_accum=2,
            train=train,
        )

    with engine_for(rank) as engine:
        engine.fit(steps=3)
        torch.save(build_payload(engine), Path(workdir) / f"rank-{rank}.pt")
        engine.fit(steps=5)
        full = {n: p.full_tensor().detach().clone() for n, p in engine.model.named_parameters()}
        val = engine.evaluate()["val.loss"]
        sharded = type(engine.model).__name__
    with engine_for(7) as engine:
        restore(engine, torch.load(Path(workdir) / f"rank-{rank}.pt", weights_only=False))
        engine.fit(steps=5)
        resumed = all(torch.equal(p.full_tensor(), full[n]) for n, p in engine.model.named_parameters())
        b = engine.backend
        return {
            "params": b.all_gather_object(full, domain="optimizer"),
            "val": b.all_gather_object(val, domain="optimizer"),
            "resumed": b.all_gather_object(resumed, domain="optimizer"),
            "sharded": sharded,
            "data": b.all_gather_object((b.data_rank, b.data_size), domain="optimizer"),
        }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_2_x_shard_2_on_4_processes_trains_and_resumes(tmp_path: Path) -> None:
    ref = fsdp_reference()
    got = launch(pipeline_fsdp, str(tmp_path), nprocs=4, start_method="fork", timeout=280)
    assert got["sharded"].startswith("FSDP")
    assert got["data"] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    merged: dict[str, torch.Tensor] = {}
    for part in got["params"]:
        merged.update(part)
    worst = max(float((merged[n] - p).abs().max()) for n, p in ref["params"].items())
    assert worst < 1e-6, worst
    assert got["resumed"] == [True] * 4
    assert got["val"] == [got["val"][0]] * 4
    assert got["val"][0] == pytest.approx(ref["val"], abs=1e-6)
