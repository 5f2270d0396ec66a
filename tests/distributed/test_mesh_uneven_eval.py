"""Evaluation and prediction with unequal shards on meshes whose forward runs collectives (gloo, forked ranks).

Every mixture-of-experts forward runs all-to-alls on the expert group, so the
data ranks must run the same number of forwards even when the exact
evaluation shards differ by a batch (33 samples in batches of 2: 9 batches on
rank 0, 8 on rank 1). The backend asks for it (`Backend.eval_lockstep`); the
rank with fewer batches runs stand-in forwards counted nowhere, so the loss is
the one-process dataset mean and every prediction comes back once, in order.
A context axis needs nothing of the kind: evaluation runs whole sequences on
each context rank, and FSDP2's gathers are held by `MeshBackend.evaluation()`.
"""

from __future__ import annotations

import os

import pytest
import torch

import cadence
from cadence.backends.mesh import MeshBackend
from cadence.launch import launch
from tests.distributed.test_mesh_context_expert import (
    _collect_before_forking,  # noqa: F401  (an autouse fixture: collect before each launch forks)
    lm,
    model_config,
    token_data,
)

pytestmark = pytest.mark.timeout(120)

SAMPLES, BATCH = 33, 2  # rank 0: 17 samples, 9 batches; rank 1: 16 samples, 8 batches


def make_engine(backend, seed: int, **model) -> cadence.Engine:
    torch.manual_seed(seed)
    model = lm.Transformer(model_config(**(model or {"n_experts": 4})))
    return cadence.Engine(
        model,
        None,
        loss_fn=lm.training_loss(model),
        eval_data=token_data(SAMPLES),
        predict_data=token_data(SAMPLES),
        backend=backend,
        seed=0,
        eval={"batch_size": BATCH},
        predict={"batch_size": BATCH},
        device="cpu",
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = token_data(SAMPLES).tensors
    return [(x[i : i + 3], y[i : i + 3]) for i in range(0, 15, 3)]


def own_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches()[rank::2]


class Counts(cadence.Callback):
    def __init__(self) -> None:
        self.eval_batches = self.predict_batches = 0

    def on_eval_batch(self, engine) -> None:
        self.eval_batches += 1

    def on_predict_batch(self, engine) -> None:
        self.predict_batches += 1


def evaluate_experts(options: dict) -> dict:
    rank = int(os.environ["RANK"])
    # Each rank builds its model from its own seed: the backend starts them as rank 0's (seed 0).
    with make_engine(MeshBackend(**options, timeout=30, device="cpu"), seed=rank) as engine:
        counts = Counts()
        engine.add_callback(counts)
        results = engine.evaluate()
        eval_batches = counts.eval_batches
        again = engine.evaluate()  # a second evaluation agrees again and gives the same
        own = engine.predict()
        gathered = engine.predict(gather=True)
        # Batches without a length (a generator): agreed batch by batch; 3 batches here, 2 on rank 1.
        streamed = engine.evaluate(data=(b for b in own_batches(rank)))
        try:  # a rank with no batch to stand in while the other has one: the same error on both
            engine.evaluate(data=own_batches(rank)[:1] if rank == 0 else [])
            stranded = ""
        except ValueError as exc:
            stranded = str(exc)
        return {
            "results": results,
            "again": again,
            "eval_batches": engine.backend.all_gather_object(eval_batches),
            "predict_batches": engine.backend.all_gather_object(counts.predict_batches),  # two predictions
            "own": engine.backend.all_gather_object(sum(o.shape[0] for o in own)),
            "gathered": gathered,
            "lockstep": engine.backend.eval_lockstep(engine),
            "streamed": streamed["val.loss"],
            "stranded": engine.backend.all_gather_object(stranded),
        }


@pytest.fixture(scope="module")
def reference() -> dict:
    with make_engine("local", seed=0) as engine:
        results = engine.evaluate()
        predictions = torch.cat(engine.predict())
        assert engine.backend.eval_lockstep(engine) is None  # the plain path: no agreement
        streamed = engine.evaluate(data=batches())["val.loss"]
    return {"loss": results["val.loss"], "predictions": predictions, "streamed": streamed}


@pytest.mark.parametrize("axes", [{"expert": 2}, {"expert_tensor": 2}], ids=["expert=2", "expert_tensor=2"])
def test_unequal_shards_evaluate_and_predict_exactly_on_expert_axes(axes, reference):
    got = launch(evaluate_experts, {"shard": 2, **axes}, nprocs=2, start_method="fork", timeout=100)
    assert got["lockstep"] == "data"
    # The shards really are unequal; stand-in forwards fire no on_eval_batch / on_predict_batch.
    assert got["eval_batches"] == [9, 8] and got["predict_batches"] == [18, 16]
    assert got["own"] == [17, 16]
    # The dataset mean, as on one process (the stand-in batch is counted nowhere).
    assert got["results"]["val.loss"] == pytest.approx(reference["loss"], abs=1e-6)
    assert got["again"]["val.loss"] == pytest.approx(reference["loss"], abs=1e-6)
    # Every sample once, in dataset order.
    assert got["gathered"].shape == reference["predictions"].shape
    torch.testing.assert_close(got["gathered"], reference["predictions"], rtol=0, atol=1e-5)
    # Without a length: the mean over every rank's batches.
    assert got["streamed"] == pytest.approx(reference["streamed"], abs=1e-6)
    assert all("a rank has no batch while others have some" in message for message in got["stranded"])


def evaluate_context(options: dict) -> dict:
    rank = int(os.environ["RANK"])
    with make_engine(MeshBackend(**options, timeout=30, device="cpu"), seed=rank, causal=False) as engine:
        counts = Counts()
        engine.add_callback(counts)
        results = engine.evaluate()
        return {
            "loss": results["val.loss"],
            "eval_batches": engine.backend.all_gather_object(counts.eval_batches),
            "lockstep": engine.backend.eval_lockstep(engine),
        }


def test_unequal_shards_evaluate_exactly_with_a_context_axis():
    got = launch(evaluate_context, {"shard": 2, "context": 2}, nprocs=4, start_method="fork", timeout=100)
    with make_engine("local", seed=0, causal=False) as engine:
        reference = engine.evaluate()["val.loss"]
    # No agreement needed: 9 and 8 batches on the data ranks, and the one-process mean.
    assert got["lockstep"] is None and got["eval_batches"] == [9, 8]
    assert got["loss"] == pytest.approx(reference, abs=1e-6)
