"""DDPBackend on real gloo process groups (2 forked workers)."""

from __future__ import annotations

import os
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch._dynamo  # DDP imports it (~1.5 s): once here, not in every forked worker
import torch.distributed as dist

import cadence
from cadence.backends.ddp import DEFAULT_TIMEOUT, DDPBackend, OverlappedAllReduce
from cadence.engine.control import Requests
from cadence.launch import launch
from tests.conftest import CollectivesPerStep, count_collectives, tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(90)


def run(fn, *args, nprocs=2):
    return launch(fn, *args, nprocs=nprocs, start_method="fork", timeout=60)


def engine_on(backend=None, **kwargs):
    model = tiny_model()
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_dataset(32),
        loss_fn=torch.nn.functional.cross_entropy,
        backend=backend or DDPBackend(timeout=20, device="cpu"),
        seed=0,
        **kwargs,
        device="cpu",
    )


def test_setup_places_wraps_and_shards():
    def check():
        with engine_on(backend="auto", train={"batch_size": 4}) as engine:
            backend = engine.backend
            assert isinstance(backend, DDPBackend) and backend.created_group
            assert isinstance(engine.wrapped_model, torch.nn.parallel.DistributedDataParallel)
            assert engine.wrapped_model.module is engine.model
            assert not any(k.startswith("module.") for k in backend.model_state_dict(engine))
            sampler = engine.data["train"].sampler
            info = (
                backend.rank,
                backend.world_size,
                backend.local_rank,
                backend.data_rank,
                backend.data_size,
                str(backend.device),
                sampler.rank,
                sampler.num_replicas,
                len(engine.data["train"]),
            )
            gathered = backend.all_gather_object(info)
        assert not dist.is_initialized()  # close() destroyed the group it created
        return gathered

    assert run(check) == [(0, 2, 0, 0, 2, "cpu", 0, 2, 4), (1, 2, 1, 1, 2, "cpu", 1, 2, 4)]


def test_close_releases_the_process_group():
    # destroy_process_group() only shuts the group down; a reference the engine
    # kept would free it at interpreter exit, where gloo can abort the process.
    def check():
        engine = engine_on(train={"batch_size": 4})
        engine.fit(steps=2)
        group, wrapper = weakref.ref(engine.backend.group), weakref.ref(engine.wrapped_model)
        engine.close()
        assert group() is None and wrapper() is None, "the engine kept the process group alive after close()"
        assert engine.wrapped_model is engine.model
        return True

    assert run(check) is True


def test_collectives():
    def check():
        with engine_on() as engine:
            backend, rank = engine.backend, engine.backend.rank
            value = torch.tensor([1.0 + rank, 10.0 * rank])
            out = {op: backend.reduce(value, op).tolist() for op in ("sum", "mean", "max", "min")}
            out["int_mean"] = backend.reduce(torch.tensor([rank + 2]), "mean").tolist()
            assert value.tolist() == [1.0 + rank, 10.0 * rank]  # the input is left alone
            gathered = backend.all_gather(torch.full((2, 3), float(rank)), domain="optimizer")
            out["gather"] = (tuple(gathered.shape), gathered[:, 0, 0].tolist())
            out["objects"] = backend.all_gather_object({"rank": rank})
            out["broadcast"] = backend.broadcast_object(f"from {rank}", src=1)
            backend.barrier(timeout=10)
            return out

    out = run(check)
    assert out["sum"] == [3.0, 10.0] and out["mean"] == [1.5, 5.0]
    assert out["max"] == [2.0, 10.0] and out["min"] == [1.0, 0.0] and out["int_mean"] == [2.5]
    assert out["gather"] == ((2, 2, 3), [0.0, 1.0])
    assert out["objects"] == [{"rank": 0}, {"rank": 1}] and out["broadcast"] == "from 1"


def test_agree_takes_the_max_of_every_rank_in_one_reused_buffer():
    def check():
        with engine_on() as engine:
            backend, requests, rank = engine.backend, engine.requests, engine.backend.rank
            seen = []
            if rank == 1:
                engine.request_skip("rank one only")
            backend.agree(requests)
            seen.append((engine.agreed("skip"), engine.agreed("stop"), requests.any_pending))
            buffer = backend._agree_host.data_ptr()
            backend.agree(requests)  # nothing pending any more: agreed values reset
            seen.append((engine.agreed("skip"), backend._agree_host.data_ptr() == buffer))
            requests.register("preempt")  # a callback's own request kind: the buffer grows
            engine.request("preempt", value=2 - rank)  # lowest requesting rank wins under MAX
            if rank == 0:
                engine.request_save()
            backend.agree(requests)
            seen.append((engine.agreed("preempt"), engine.agreed("save"), backend._agree_host.numel()))
            return backend.all_gather_object(seen)

    per_rank = run(check)
    assert per_rank[0] == per_rank[1] == [(1, 0, False), (0, True), (2, 1, 4)]


class ReadsInStep(cadence.Callback):
    requests_in_step = False

    def __init__(self, refuse_at=None):
        self.in_step, self.refuse_at = [], refuse_at

    def on_forward(self, engine):
        self.in_step.append(engine.requests.in_step)
        if engine.state.step + 1 == self.refuse_at:
            engine.request_save("inside the step")


def test_the_overlapped_agreement_agrees_the_same_step_on_every_rank():
    """Sent after on_step_start, awaited before the optimizer step; blocking when a callback requests in the step."""

    def check():
        out = {}
        reads = ReadsInStep()
        with engine_on(callbacks=[reads], train={"batch_size": 4}) as engine:
            rank = engine.backend.rank
            # Rank 0 asks for a save at the end of step 1, rank 1 for a stop in on_step_start of step 3.
            engine.on(cadence.Event.ON_STEP_END, once=1, when=lambda e: rank == 0)(lambda e: e.request_save("r0"))
            engine.on(cadence.Event.ON_STEP_START, once=3, when=lambda e: rank == 1)(lambda e: e.request_stop("r1"))
            engine.requests.register("flag")
            engine.on(cadence.Event.ON_STEP_START, once=2)(lambda e: e.request("flag", 5 + rank))
            seen = []
            engine.on(cadence.Event.ON_SAVE_POINT)(lambda e: seen.append((e.state.step, tuple(e.requests.agreed))))
            engine.fit(steps=8)
            out["overlapped"] = (engine.state.step, list(seen), list(reads.in_step))
            # Both ranks raise inside an overlapped step: refused on each as itself, no rank left waiting.
            reads.refuse_at = engine.state.step + 2
            try:
                engine.fit(steps=4)
            except cadence.RequestTimingError as error:
                out["refused"] = (engine.state.step, "'save' raised inside the step" in str(error))
            reads.refuse_at = None
            engine.fit(steps=1)  # the ranks are still in step with each other
            out["after"] = engine.state.step
            # Rank 1 only adds a function on on_before_optimizer_step (which may request there): from the next
            # fit every rank agrees after that hook, and rank 1's skip is taken in its step on both.
            if rank == 1:
                engine.on(cadence.Event.ON_BEFORE_OPTIMIZER_STEP, once=7)(lambda e: e.request_skip("r1"))
            del reads.in_step[:]
            engine.fit(steps=3)
            out["blocking"] = (engine.state.step, engine.state.skipped_steps, reads.in_step)
            # The agreement rides training's own gloo group (left alive by close); own_group=True makes one.
            out["groups"] = []
            for own in (False, True):
                agreement = OverlappedAllReduce(own_group=own)
                agreement.join(engine.backend.group, timedelta(seconds=20))
                requests = Requests()
                requests.request("save", 1 + rank)
                agreement.start(requests)
                agreement.finish(requests)
                shared = agreement.group is engine.backend.group
                out["groups"].append((shared, agreement.owned, requests.get("save")))
                agreement.close(destroy=True)
            return engine.backend.all_gather_object(out)

    for out in run(check):
        step, seen, in_step = out["overlapped"]
        assert step == 3 and in_step == [True, True, True]
        # (skip, stop, save, flag): the save and the flag's MAX agreed at step 2, the stop at step 3.
        assert seen == [(1, (0, 0, 0, 0)), (2, (0, 0, 1, 6)), (3, (0, 1, 0, 0))]
        assert out["refused"] == (4, True) and out["after"] == 5
        assert out["blocking"] == (8, 1, [False, False, False])
        assert out["groups"] == [(True, False, 2), (False, True, 2)]


class StopsAnyway(cadence.Callback):
    """Declares that it requests nothing, then requests a stop at the end of a fit's second step."""

    raises_requests = False

    def on_fit_start(self, engine):
        self.at = engine.state.step + 2

    def on_step_end(self, engine):
        if engine.state.step == self.at:
            engine.request_stop("undeclared")


def test_a_fit_where_no_callback_requests_runs_no_agreement():
    """No per-step collective unless a registered callback may request; a request then is refused, named."""

    def check():
        from cadence.callbacks.grad_clip import GradClip
        from cadence.callbacks.metrics import TrainMetrics

        out = {}
        counter = CollectivesPerStep(count_collectives())
        with engine_on(callbacks=[counter, TrainMetrics(), GradClip(max_norm=1.0)], train={"batch_size": 4}) as engine:
            rank = engine.backend.rank
            engine.fit(steps=3)  # only callbacks that request nothing: DDP's own all-reduce, in C++, and nothing else
            out["quiet"] = counter.per_step[:]
            # A handler of a callback's bound method speaks for it: still nothing per step.
            engine.on(cadence.Event.ON_STEP_END)(counter.on_step_end)
            del counter.per_step[:]
            engine.fit(steps=2)
            out["bound"] = counter.per_step[::2]
            # A plain function may request (on rank 1 only): every rank agrees, one all-reduce per step.
            handle = engine.add_handler(cadence.Event.ON_SAVE_POINT, lambda e: None) if rank == 1 else None
            del counter.per_step[:]
            engine.fit(steps=2)
            out["agreeing"] = counter.per_step[::2]
            if handle is not None:
                handle.remove()
            # A request pending when the fit starts (rank 0's): agreed at the fit's first step on both.
            if rank == 0:
                engine.request_stop("between fits")
            engine.fit(steps=5)
            out["pending"] = engine.state.step
            # A callback that declares it requests nothing and does: refused on every rank, naming the request.
            engine.add_callback(StopsAnyway())
            try:
                engine.fit(steps=3)
            except cadence.RequestTimingError as error:
                out["refused"] = (engine.state.step, "'stop' raised in a fit that agrees no requests" in str(error))
            return engine.backend.all_gather_object(out)

    for out in run(check):
        assert out["quiet"] == [0, 0, 0] and out["bound"] == [0, 0]
        assert out["agreeing"] == [1, 1]
        assert out["pending"] == 8  # 3 + 2 + 2 steps, then the stop agreed at the first of these 5
        assert out["refused"] == (10, True)  # raised at the end of the fit's second step, on each rank


def test_barrier_names_the_rank_that_never_arrives():
    def check():
        with engine_on() as engine:
            if engine.backend.rank == 1:
                time.sleep(4)  # never joins the barrier
                return None
            start = time.monotonic()
            try:
                engine.backend.barrier(timeout=1)
            except RuntimeError as error:
                return str(error), time.monotonic() - start
            return "no error", 0.0

    message, elapsed = run(check)
    assert "Ranks 1 failed to pass monitoredBarrier in 1000 ms" in message
    assert elapsed < 4


def test_user_initialized_group_is_left_alone():
    def check():
        dist.init_process_group("gloo", timeout=timedelta(seconds=20))
        with engine_on() as engine:
            created = engine.backend.created_group
        alive = dist.is_initialized()
        dist.destroy_process_group()
        return created, alive

    assert run(check) == (False, True)


def test_bf16_autocast_on_cpu():
    def check():
        with engine_on(backend=DDPBackend(precision="bf16", timeout=20, device="cpu")) as engine:
            dtypes = []
            engine.on(cadence.Event.ON_FORWARD)(lambda e: dtypes.append(e.outputs.dtype))
            engine.fit(steps=2)
            return dtypes, engine.model[0].weight.dtype

    assert run(check) == ([torch.bfloat16, torch.bfloat16], torch.float32)


def test_no_process_group_and_no_environment_is_a_clear_error(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"torchrun --nproc_per_node N.*cadence.launch"):
        engine_on()


def test_configuration_errors_and_defaults():
    with pytest.raises(ValueError, match=r"checkpoint='zip'.*'file' or 'dcp'"):
        DDPBackend(checkpoint="zip", device="cpu")
    with pytest.raises(ValueError, match="precision"):
        DDPBackend(precision="fp8", device="cpu")
    assert DDPBackend(device="cpu").timeout == DEFAULT_TIMEOUT == timedelta(seconds=300)
    assert DDPBackend(timeout=2.5, device="cpu").timeout == timedelta(seconds=2.5)
    config = cadence.EngineConfig(precision="bf16", device="cpu")
    backend = DDPBackend.from_engine_config(config)
    assert (backend.precision_name, backend.requested_device) == ("bf16", "cpu")


def test_auto_backend_is_local_on_one_process():
    assert "WORLD_SIZE" not in os.environ or os.environ["WORLD_SIZE"] == "1"
    engine = engine_on(backend="auto")
    assert engine.backend.name == "local"
