"""DeepSpeedBackend on DeepSpeed's CPU accelerator: real gloo groups, 2 forked ranks, real DeepSpeed engines.

`deepspeed.initialize` costs seconds, so each launch groups several checks:
one launch per ZeRO stage trains 10 steps (accumulation 2) against the local
backend on the same global batches, with that stage's skip (a NaN or an
agreed skip), clipping, EMA and a mid-epoch checkpoint resumed bitwise. No
DeepSpeed op is compiled (no shm op, torch optimizers only).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: no GPU probing

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed", reason="the DeepSpeed backend tests need cadence[deepspeed]")

import cadence  # noqa: E402
from cadence.backends.deepspeed import DeepSpeedBackend, DeepSpeedConfig, build_config  # noqa: E402
from cadence.callbacks import EMA, Checkpoint, GradClip, NonFiniteSkip  # noqa: E402
from cadence.checkpoint.deepspeed_store import DeepSpeedStore  # noqa: E402
from cadence.checkpoint.store import CheckpointError  # noqa: E402
from cadence.launch import launch  # noqa: E402
from tests.conftest import tiny_dataset, tiny_model  # noqa: E402

pytestmark = pytest.mark.timeout(150)

STEPS = 10  # one epoch: 160 samples, 2 ranks x batch 4 x grad_accum 2 per step
CLIP = 0.1


def ds_backend(stage, timeout=60):
    # ZeRO-3 keeps parameters below a size threshold whole on every rank: 0 partitions all of them,
    # so every forward gathers (the tiny test model would otherwise never do).
    raw = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else {}
    return DeepSpeedBackend(zero_stage=stage, timeout=timeout, deepspeed=raw, device="cpu")


def run(fn, *args, nprocs=2):
    return launch(fn, *args, nprocs=nprocs, start_method="fork", timeout=120)


class SkipAt(cadence.Callback):
    """Requests a skip at the given (1-based) steps; counts the skips the loop agreed (its state)."""

    def __init__(self, steps=()):
        self.steps, self.seen = set(steps), 0

    def on_before_optimizer_step(self, engine):
        if engine.state.step + 1 in self.steps:
            engine.request_skip("test")

    def on_step_end(self, engine):
        self.seen += bool(engine.agreed("skip"))

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


class NaNAt(cadence.Callback):
    """Makes one rank's first micro-batch of a step NaN."""

    def __init__(self, step, rank):
        self.step, self.rank = step, rank

    def on_batch(self, engine):
        if engine.state.step + 1 == self.step and engine.backend.rank == self.rank:
            inputs, targets = engine.batch
            engine.batch = (inputs * float("nan"), targets)


class EvaluateAt(cadence.Callback):
    """Evaluates once inside fit (EMA swaps its average in and out around it)."""

    def __init__(self, step):
        self.step, self.loss = step, None

    def on_step_end(self, engine):
        if engine.state.step == self.step:
            self.loss = engine.evaluate()["val.loss"]


class LoadedWeights(cadence.Callback):
    """The whole weights right after a restore."""

    def __init__(self):
        self.params = None

    def on_load(self, engine):
        self.params = {k: v.clone() for k, v in engine.backend.model_state_dict(engine).items()}


class Record(cadence.Callback):
    """Per step: whether it was skipped, the LR after it, the clipping norm; what `local_gradients` held."""

    def __init__(self):
        self.rows = []
        self.gradient_elements = []

    def on_before_optimizer_step(self, engine):
        self.gradient_elements.append(sum(g.numel() for g in engine.backend.local_gradients(engine)))

    def on_step_end(self, engine):
        norm = getattr(engine, "grad_norm", None)
        self.rows.append(
            (
                bool(engine.agreed("skip")),
                engine.optimizers[0].param_groups[0]["lr"],
                None if norm is None else float(norm),
            )
        )


def make_engine(backend, batch_size, callbacks=(), precision="fp32", samples=160):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return cadence.Engine(
        model,
        optimizer,
        tiny_dataset(samples),
        loss_fn=torch.nn.functional.cross_entropy,
        scheduler=scheduler,
        eval_data=tiny_dataset(32, seed=2),
        backend=backend,
        callbacks=list(callbacks),
        seed=0,
        grad_accum=2,
        precision=precision,
        eval_every_epochs=None,
        log_interval=5,
        steps=STEPS,
        train={"batch_size": batch_size, "shuffle": False},
        eval={"batch_size": batch_size},
        device="cpu",
    )


def reference(callbacks, samples=160):
    """The local backend on the same global batches (8 = 2 ranks x 4)."""
    record = Record()
    engine = make_engine("local", 8, [*callbacks, record], samples=samples)
    engine.fit()
    shadow = next((dict(zip(c.names, c.shadow)) for c in engine.callbacks if isinstance(c, EMA)), None)
    return {
        "params": {k: v.clone() for k, v in engine.model.state_dict().items()},
        "rows": record.rows,
        "skipped": engine.state.skipped_steps,
        "scheduler": engine.schedulers[0].last_epoch,
        "ema": shadow,
        "eval": next((c.loss for c in engine.callbacks if isinstance(c, EvaluateAt)), None),
    }


def train_stage(stage, callbacks, directory=None, resume_from=None, samples=160):
    """One DeepSpeed engine: fit STEPS (or the rest after a resume); what the checks need."""
    record = Record()
    extra = []
    if directory is not None:
        extra.append(
            Checkpoint(dir=directory, interval=6, unit="step", keep_latest_k=1, save_on_fit_end=False)
            if resume_from is None
            else Checkpoint(dir=directory, resume=resume_from, interval=0, save_on_fit_end=False)
        )
    engine = make_engine(ds_backend(stage), 4, [*callbacks, record, *extra], samples=samples)
    try:
        engine.fit()  # to config.steps: a resumed engine trains the rest
        backend = engine.backend
        ema = next((c for c in engine.callbacks if isinstance(c, EMA)), None)
        out = {
            "params": {k: v.clone() for k, v in backend.model_state_dict(engine).items()},  # gathered at ZeRO-3
            "rows": record.rows,
            "gradient_elements": record.gradient_elements,
            "state": engine.state.state_dict(),
            "scheduler": engine.schedulers[0].last_epoch,
            "callbacks": {
                c.state_key: c.state_dict() for c in engine.callbacks if isinstance(c, (SkipAt, NonFiniteSkip))
            },
            "ema": backend.all_gather_object([s.clone() for s in ema.shadow]) if ema else None,
            "ema_names": ema.names if ema else None,
            "partition": [p.ds_tensor.numel() for p in engine.model.parameters()] if stage == 3 else None,
            "describe": backend.describe(),
            "eval": next((c.loss for c in engine.callbacks if isinstance(c, EvaluateAt)), None),
            "saved": sorted(os.listdir(directory)) if directory and resume_from is None else None,
        }
    finally:
        engine.close()
    return out


def stage_worker(stage, callbacks, directory, samples=160):
    import torch.distributed as dist

    dist.init_process_group("gloo")  # one group for every engine of this launch
    try:
        first = train_stage(stage, callbacks(), directory, samples=samples)
        resumed = None
        if directory is not None:
            loaded = LoadedWeights()
            snapshot = os.path.join(directory, "ckpt-s000000000006")
            resumed = train_stage(stage, [*callbacks(), loaded], directory, resume_from=snapshot)
            resumed["loaded"] = loaded.params
            if stage == 3:  # pretrained: the same weights, module only (rebuilt from the partitions)
                engine = make_engine(ds_backend(stage), 4, [Checkpoint(dir=directory + "-2", pretrained=snapshot)])
                engine.fit(steps=0)
                resumed["pretrained"] = (engine.state.step, engine.backend.model_state_dict(engine))
                engine.close()
        return first, resumed
    finally:
        dist.destroy_process_group()


def check_damaged_checkpoint_is_refused(directory):
    """One flipped byte in a copy of `latest`: its manifest's checksum refuses it (no DeepSpeed needed)."""
    store = DeepSpeedStore(directory, backend=SimpleNamespace(is_main=True, world_size=1))
    assert store.names() == ["ckpt-s000000000006", "ckpt-s000000000009", "latest"]  # keep_latest_k=2 of 3, 6, 9
    manifest = store.verify("latest")
    assert manifest["zero_stage"] == 2 and manifest["data_size"] == 2 and manifest["step"] == STEPS
    assert all(entry["algorithm"] == "xxh3-64" for entry in manifest["files"].values())
    shutil.copytree(directory / "latest", directory / "damaged")
    victim = next(f for f in sorted(manifest["files"]) if "optim_states" in f)
    with open(directory / "damaged" / victim, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=f"{victim}: checksum mismatch"):
        store.verify("damaged")


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def check_equal_to_reference(out, ref):
    assert max_diff(out["params"], ref["params"]) < 1e-6
    # Callbacks that check gradients see this rank's part of them at every stage, never nothing.
    assert min(out["gradient_elements"]) > 0
    assert [r[0] for r in out["rows"]] == [r[0] for r in ref["rows"]]  # the same steps skipped
    assert [r[1] for r in out["rows"]] == pytest.approx([r[1] for r in ref["rows"]])  # the LR stepped alike
    assert out["state"]["skipped_steps"] == ref["skipped"]
    assert out["scheduler"] == ref["scheduler"] == STEPS - ref["skipped"]


def check_resumed_bitwise(first, resumed):
    assert "ckpt-s000000000006" in first["saved"]
    for key, value in first["params"].items():
        assert torch.equal(value, resumed["params"][key]), key
    assert resumed["state"] == first["state"]
    assert resumed["callbacks"] == first["callbacks"]
    # The steps after the checkpoint, skips included (their norms NaN: compared as text).
    assert repr(resumed["rows"]) == repr(first["rows"][6:])
    if first["ema"] is not None:
        for mine, theirs in zip(first["ema"], resumed["ema"]):
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_zero0_nan_is_cadences_skip_and_clipping():
    # ZeRO-0 does not check gradients itself: NonFiniteSkip sees the NaN and the step is skipped on both ranks.
    first, _ = run(stage_worker, 0, lambda: [NonFiniteSkip(), NaNAt(3, rank=1), GradClip(max_norm=CLIP)], None)
    ref = reference([SkipAt({3}), GradClip(max_norm=CLIP)])
    check_equal_to_reference(first, ref)
    check_norms(first, ref)  # ZeRO-0 keeps no global norm: the backend records the one its clipping computes
    assert first["callbacks"]["NonFiniteSkip"] == {"consecutive": 0, "total": 1}
    assert "zero=0" in first["describe"]


def test_zero1_agreed_skip_clipping_and_a_short_last_step():
    # 152 samples: 19 micro-batches per rank, so the 10th step is short (one micro-batch, averaged over one).
    first, _ = run(stage_worker, 1, lambda: [SkipAt({3}), GradClip(max_norm=CLIP)], None, 152)
    ref = reference([SkipAt({3}), GradClip(max_norm=CLIP)], samples=152)
    assert first["state"]["micro_step"] == 19
    check_equal_to_reference(first, ref)
    check_norms(first, ref)


def check_norms(out, ref):
    ref_norms = [r[2] for r in ref["rows"] if not r[0]]
    norms = [r[2] for r in out["rows"] if not r[0]]
    assert max(ref_norms) > CLIP  # clipping did something
    assert norms == pytest.approx(ref_norms, rel=1e-5)  # DeepSpeed's global pre-clip norm
    assert all(r[2] != r[2] for r in out["rows"] if r[0])  # NaN: no norm for a skipped step


def test_zero2_own_overflow_skip_agreed_skip_and_bitwise_resume(tmp_path):
    # The NaN at step 3 is DeepSpeed's own skip (no NonFiniteSkip): counted by Cadence, LR not stepped.
    # Its logged norm is NaN as for an agreed skip (DeepSpeed's get_global_grad_norm() reads inf there).
    directory = str(tmp_path / "ckpt")
    first, resumed = run(stage_worker, 2, lambda: [NaNAt(3, rank=1), SkipAt({7}), GradClip(max_norm=CLIP)], directory)
    ref = reference([SkipAt({3, 7}), GradClip(max_norm=CLIP)])
    check_equal_to_reference(first, ref)
    check_norms(first, ref)
    assert [i for i, row in enumerate(first["rows"]) if row[0]] == [2, 6]  # steps 3 and 7
    assert first["callbacks"]["SkipAt"] == {"seen": 2}
    check_resumed_bitwise(first, resumed)


def test_zero3_agreed_skip_clipping_ema_and_bitwise_resume(tmp_path):
    directory = str(tmp_path / "ckpt")

    def callbacks():
        return [SkipAt({3}), NonFiniteSkip(), GradClip(max_norm=CLIP), EMA(decay=0.9), EvaluateAt(5)]

    first, resumed = run(stage_worker, 3, callbacks, directory)
    ref = reference([SkipAt({3}), GradClip(max_norm=CLIP), EMA(decay=0.9), EvaluateAt(5)])
    # Evaluating with EMA's average (written into the partitions) at step 5 leaves training as it was.
    check_equal_to_reference(first, ref)
    assert first["eval"] == pytest.approx(ref["eval"], abs=1e-6)
    check_norms(first, ref)
    check_resumed_bitwise(first, resumed)
    step, pretrained = resumed["pretrained"]
    assert step == 0 and all(torch.equal(v, pretrained[k]) for k, v in resumed["loaded"].items())
    # EMA averaged each rank's partition (ds_tensor), never empty tensors: rank r holds slice r of the flat average.
    for rank, shadows in enumerate(first["ema"]):
        for name, shadow, size in zip(first["ema_names"], shadows, first["partition"]):
            assert shadow.numel() == size > 0
            flat = ref["ema"][name].flatten()[rank * size : (rank + 1) * size]
            assert (shadow[: flat.numel()] - flat).abs().max().item() < 1e-6


def resume_on_one_rank(directory):
    # No group is set up here: the backend makes its own (the launcher's environment, one rank).
    engine = make_engine(
        DeepSpeedBackend(zero_stage=2, timeout=30, device="cpu"),
        4,
        [Checkpoint(dir=directory, resume=directory + "/latest")],
    )
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    try:
        engine.fit()
    except CheckpointError as exc:  # a documented error reaches the caller as itself
        return str(exc), max_diff(engine.model.state_dict(), before), engine.state.step
    finally:
        engine.close()
    return None, None, engine.state.step


def test_bf16_zero2_and_zero3_agree_store_auto_resume_pretrained_damage_and_changed_degree(tmp_path):
    def worker(directory):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        out = {}
        for name, stage, precision in (("fp32", 0, "fp32"), ("bf16-2", 2, "bf16"), ("bf16-3", 3, "bf16")):
            callbacks = [Checkpoint(dir=directory, interval=3, keep_latest_k=2)] if name == "bf16-2" else []
            engine = make_engine(ds_backend(stage), 4, callbacks, precision=precision)
            engine.fit()
            out[name] = {
                "loss": engine.evaluate()["val.loss"],
                "params": {k: v.clone() for k, v in engine.backend.model_state_dict(engine).items()},
                "dtype": str(next(engine.model.parameters()).dtype),
            }
            engine.close()
        # auto_resume with a collective store: the main rank picks `latest` by its checksums, every rank reads it.
        engine = make_engine(ds_backend(2), 4, [Checkpoint(dir=directory, auto_resume=True)], precision="bf16")
        engine.fit()  # restored at step 10 = config.steps: nothing left to train
        out["auto"] = {"step": engine.state.step, "params": engine.backend.model_state_dict(engine)}
        engine.close()
        # pretrained: module weights only, through DeepSpeed (load_module_only); the run starts at step 0.
        engine = make_engine(
            ds_backend(2), 4, [Checkpoint(dir=directory + "-2", pretrained=directory + "/latest")], precision="bf16"
        )
        engine.fit(steps=0)
        out["pretrained"] = {"step": engine.state.step, "params": engine.backend.model_state_dict(engine)}
        engine.close()
        engine = make_engine(ds_backend(0), 4, [Checkpoint(dir=directory + "-3", async_mode="async")])
        try:
            engine.fit(steps=1)
        except Exception as exc:
            out["async"] = str(exc)
        finally:
            engine.close()
        dist.destroy_process_group()
        return out

    directory = str(tmp_path / "bf16")
    out = run(worker, directory)
    assert out["bf16-2"]["dtype"] == out["bf16-3"]["dtype"] == "torch.bfloat16"
    assert max_diff(out["bf16-2"]["params"], out["bf16-3"]["params"]) < 1e-3
    assert out["bf16-2"]["loss"] == pytest.approx(out["bf16-3"]["loss"], abs=1e-3)
    for name in ("bf16-2", "bf16-3"):
        assert out[name]["loss"] == pytest.approx(out["fp32"]["loss"], rel=1e-2)

    for name in ("auto", "pretrained"):
        assert all(torch.equal(v, out[name]["params"][k]) for k, v in out["bf16-2"]["params"].items()), name
    assert out["auto"]["step"] == STEPS and out["pretrained"]["step"] == 0
    assert "async_mode='async'" in out["async"] and "background thread" in out["async"]
    check_damaged_checkpoint_is_refused(Path(directory))

    # The ZeRO-2 checkpoint of 2 ranks on 1 rank: Cadence's error naming both degrees, before anything loads.
    error, changed, step = run(resume_on_one_rank, directory, nprocs=1)
    assert error is not None, "a checkpoint of 2 ranks at ZeRO-2 was resumed on 1 rank"
    assert changed == 0.0 and step == 0  # nothing was loaded, no step was taken
    assert "data-parallel degree of 2" in error and "this run has 1 rank" in error
    assert "ds_to_universal" in error and "step 10" in error


# -- errors raised before DeepSpeed starts (one process, no group) ----------------------------


def test_config_conflicts_are_reported_field_by_field():
    options = DeepSpeedConfig(
        zero_stage=2,
        deepspeed={
            "zero_optimization": {"stage": 3, "overlap_comm": False},
            "gradient_accumulation_steps": 4,
            "bf16": {"enabled": True},
            "optimizer": {"type": "Adam"},
            "scheduler": {"type": "WarmupLR"},
        },
    )
    with pytest.raises(ValueError) as info:
        build_config(options, "fp32", grad_accum=2, micro_batch=4)
    text = str(info.value)
    assert "zero_optimization.stage: DeepSpeed config 3, Cadence 2 (from zero_stage)" in text
    assert "gradient_accumulation_steps: DeepSpeed config 4, Cadence 2 (from the engine's grad_accum)" in text
    assert "bf16.enabled: DeepSpeed config True, Cadence False (from precision='fp32')" in text
    assert "optimizer: set in the DeepSpeed config; pass a torch optimizer" in text
    assert "scheduler: set in the DeepSpeed config; pass the scheduler to Engine(scheduler=...)" in text
    # Keys that agree or that Cadence does not set are merged as given.
    config = build_config(
        DeepSpeedConfig(zero_stage=2, deepspeed={"zero_optimization": {"stage": 2, "overlap_comm": False}}),
        "bf16",
        grad_accum=2,
        micro_batch=4,
    )
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": False}
    assert config["managed_gradient_accumulation"] is False and config["bf16"] == {"enabled": True}
    assert config["gradient_accumulation_steps"] == 2 and config["train_micro_batch_size_per_gpu"] == 4


def test_engine_reports_a_conflict_before_joining_a_group():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps: DeepSpeed config 8, Cadence 2"):
        cadence.Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            backend=DeepSpeedBackend(deepspeed={"gradient_accumulation_steps": 8}, device="cpu"),
            grad_accum=2,
        )
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    ("clip", "raw", "message"),
    [
        (
            GradClip(max_norm=1.0),
            {"gradient_clipping": 0.5},
            "GradClip(max_norm=1.0) and the DeepSpeed config's gradient_clipping=0.5 disagree",
        ),
        (GradClip(max_norm=1.0, norm_type="inf"), {}, "DeepSpeed clips by the 2-norm only"),
    ],
)
def test_a_clipping_deepspeed_cannot_follow_is_an_error_at_construction(clip, raw, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=re.escape(message)):
        cadence.Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            backend=DeepSpeedBackend(deepspeed=raw),
            callbacks=[clip],
        )
    assert not torch.distributed.is_initialized()  # before any group, not a HookError at step 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_fp16_without_cuda_fails_before_anything_starts():
    model = tiny_model()
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        DeepSpeedBackend(precision="fp16", device="cpu")
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        cadence.Engine(
            model, torch.optim.SGD(model.parameters(), lr=0.1), backend="deepspeed", precision="fp16", device="cpu"
        )
    with pytest.raises(ValueError, match=r"fp16.enabled: DeepSpeed config True"):
        cadence.Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            backend=DeepSpeedBackend(deepspeed={"fp16": {"enabled": True}}, device="cpu"),
        )
    assert not torch.distributed.is_initialized()


def test_missing_deepspeed_names_the_extra():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["deepspeed"] = None  # as if DeepSpeed were not installed
        import cadence.backends, cadence.run.registry
        import torch, cadence
        assert "deepspeed" in cadence.run.registry.backends.names()
        model = torch.nn.Linear(2, 1)
        try:
            cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="deepspeed", device="cpu")
        except ImportError as exc:
            print(exc)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert "pip install 'cadence[deepspeed]'" in result.stdout


def test_import_cadence_backends_does_not_import_deepspeed():
    code = "import sys, cadence, cadence.backends, cadence.run.registry; assert 'deepspeed' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# -- the contract harness on this backend -------------------------------------------------------

# The built-ins that act on the step, the parameters or the checkpoint (sinks and watchdogs do
# not depend on the backend): ZeRO-0 is quick to set up; ZeRO-3 (partitions, gathered states)
# costs 5-20 s per callback and is marked slow.
HARNESSED = ["checkpoint", "lr_scheduler", "non_finite_skip", "grad_clip", "ema", "early_stopping", "train_metrics"]


@pytest.mark.parametrize(
    ("stage", "name"),
    [(0, name) for name in HARNESSED]
    + [pytest.param(3, name, marks=pytest.mark.slow) for name in ("checkpoint", "non_finite_skip", "grad_clip", "ema")],
)
def test_the_harness_passes_builtin_callbacks(stage, name, tmp_path):
    from cadence.testing import PROPERTIES, check_callback
    from tests.testing.test_harness import BUILTINS

    report = check_callback(BUILTINS[name], workdir=tmp_path, timeout=90, backend=lambda: ds_backend(stage))
    assert report.ok, str(report)
    assert {r.name for r in report.results} == set(PROPERTIES)


@pytest.mark.timeout(120)
def test_one_process_without_a_launcher_leaves_nothing_behind():
    """What a lone ZeRO-3 process changes process-wide is taken back at close: the launcher variables
    DeepSpeed needs, and ZeRO-3's replacement of `torch.nn.functional.linear`."""
    script = textwrap.dedent(
        """
        import os, torch, cadence
        from cadence.backends.deepspeed import DeepSpeedBackend
        from tests.conftest import tiny_dataset, tiny_model
        torch.set_num_threads(1)
        before = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        linear = torch.nn.functional.linear
        model = tiny_model()
        with cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_dataset(16),
                            loss_fn=torch.nn.functional.cross_entropy, backend=DeepSpeedBackend(zero_stage=3, device="cpu"),
                            seed=0) as engine:
            engine.fit(steps=1)
            during = os.environ.get("WORLD_SIZE")
        after = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        print("RESULT", during, before == after, torch.nn.functional.linear is linear, after)
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=110)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT")), done.stdout + done.stderr)
    assert line.startswith("RESULT 1 True True"), line


# -- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_zero2_bf16_on_one_gpu_trains(tmp_path):
    """DeepSpeed's CUDA accelerator, ZeRO-2 in bf16 with a torch optimizer, one process without a launcher.

    In its own interpreter: this test process chose DeepSpeed's CPU accelerator when it imported it.
    """
    script = textwrap.dedent(
        """
        import json, torch, cadence
        from cadence.backends.deepspeed import DeepSpeedBackend
        from tests.conftest import tiny_dataset, tiny_model
        model = tiny_model()
        losses = []
        with cadence.Engine(model, torch.optim.AdamW(model.parameters(), lr=0.02), tiny_dataset(128),
                            loss_fn=torch.nn.functional.cross_entropy, seed=0, grad_accum=2,
                            backend=DeepSpeedBackend(zero_stage=2, precision="bf16", device="cuda"),
                            train={"batch_size": 8}) as engine:
            engine.on(cadence.Event.ON_FORWARD)(lambda e: losses.append(float(e.loss)))
            engine.fit(steps=8)
            weights = engine.backend.model_state_dict(engine)
            print("RESULT", json.dumps([str(engine.backend.device), torch.distributed.get_backend(),
                  engine.state.skipped_steps, sorted({str(w.device) for w in weights.values()}),
                  sorted({str(w.dtype) for w in weights.values()}), losses[0], sum(losses[-4:]) / 4]))
        """
    )
    env = {**os.environ, "DS_ACCELERATOR": "cuda", "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT"))
    device, group, skipped, devices, dtypes, first, last = json.loads(line.split(" ", 1)[1])
    assert (device, group, skipped) == ("cuda:0", "nccl", 0), line
    assert "cuda:0" in devices and "torch.bfloat16" in dtypes, line
    assert last < first, line
