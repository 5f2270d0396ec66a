"""One TorchFT replica group (one process) for tests/backends/test_ft.py, run as `python ft_worker.py '<json>'`.

Replica groups run as plain `python` subprocesses: the test process holds the
in-process lighthouse, whose Rust threads make forking it risky.

It trains a tiny model with an LR scheduler and EMA through `DDPBackend(ft=...)`
(or, with `"backend": "mesh"`, `MeshBackend(ft=..., shard=1)`: FSDP2 on the group's one process)
and appends one JSON line per step to `out` (step, parameter digest,
participants, refused commits, heals, data position, pid), then a last line
`{"end": ...}` or `{"error": ...}`. Options (the JSON object):

- backend: "ddp" (default) or "mesh"; shard: the mesh's shard axis (a group of several processes runs under
  torchrun; rank r > 0 writes to `out` + ".rank<r>")
- lighthouse, replica_id, group_size, min_replica_size, quorum_timeout, port, out
- steps: the fit's step target (absolute); more_steps: train this many steps after the restored one
- pace: seconds slept per step (at its end, while the loop holds TorchFT's state lock)
- forward_sleep: seconds slept in the last layer's forward (under FSDP2 its parameters are unsharded
  there): a peer that heals reads this group's state at the step start, never beside this
- kill_after: SIGKILL this process during its next step once it has taken this
  many steps with every group in the quorum, after that step's quorum formed
  (so its peers see it die in the middle of a step)
- stop_after_join: once this group lost a commit or (restarted: true) healed,
  request a stop this many steps after the first step at which every replica
  group takes part again; both groups see that step, so both stop together
  (always_armed: true counts the first join too)
- refuse_at: report an error to the Manager before this step's commit (a refused commit)
- checkpoint: a checkpoint folder (Checkpoint(dir=..., interval=ckpt_interval, auto_resume=resume,
  async_mode=async_mode)); each rank records at every save point of the interval whether its group
  wrote the run's checkpoint (`{"save_point": step, "writes": bool}`)
- freeze: {"at": step, "dir": folder}: after the save at that step is committed, group rank 0 copies
  what its group wrote (`latest` if it wrote it, its own `replicas/replica-<id>`) to `dir`: a
  checkpoint of that step that later saves do not replace
- batch_size, samples: the training data (a TensorDataset)
- start_after: {"file": out of another worker, "steps": n} or {"file": ..., "end": true}: wait (after the
  imports, so a test can start this process early) until that worker took n steps, or ended
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

import cadence
from cadence.backends.ddp import DDPBackend
from cadence.backends.ft import FTConfig
from cadence.callbacks import EMA, Checkpoint
from cadence.checkpoint.folders import TEMP_PREFIXES


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(local(p.detach()).cpu().numpy().tobytes())
    return h.hexdigest()


class Record(cadence.Callback):
    order = 96  # after the scheduler and EMA (what a step leaves), before Checkpoint

    def __init__(self, options: dict, out) -> None:
        self.options, self.out = options, out
        self.saw_fewer = False
        self.stop_at: int | None = None
        self.full_steps = 0
        self.snapshot: dict | None = None

    def on_fit_start(self, engine) -> None:
        line = {"fit_start": engine.state.step, "pid": os.getpid(), "time": time.time()}
        line["batch_in_epoch"] = engine.state.batch_in_epoch
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()

    def on_forward(self, engine) -> None:
        kill_after = self.options.get("kill_after")
        if kill_after is not None and self.full_steps == kill_after:
            engine.backend.ft.manager.wait_quorum()  # the quorum of this step includes us: peers see us die mid-step
            os.kill(os.getpid(), signal.SIGKILL)

    def on_before_optimizer_step(self, engine) -> None:
        if self.options.get("refuse_at") == engine.state.step + 1:
            engine.backend.ft.manager.report_error(RuntimeError("test: refuse this commit"))
            self.snapshot = {
                "digest": digest(engine.model),
                "lr": engine.optimizers[0].param_groups[0]["lr"],
                "ema": digest_tensors(engine_ema(engine).shadow),
            }

    def on_step_end(self, engine) -> None:
        ft = engine.backend.ft
        state = engine.state
        line = {
            "step": state.step,
            "digest": digest(engine.model),
            "participants": ft.participants,
            "failures": ft.commit_failures,
            "heals": ft.heals,
            "skipped": state.skipped_steps,
            "epoch": state.epoch,
            "batch_in_epoch": state.batch_in_epoch,
            "lr": engine.optimizers[0].param_groups[0]["lr"],
            "ema": digest_tensors(engine_ema(engine).shadow),
            "batch": digest_tensors([engine.batch[0]]),
            "pid": os.getpid(),
            "time": time.time(),
            "dtensor": all(hasattr(p, "to_local") for p in engine.model.parameters()),
        }
        if self.snapshot is not None:
            line["before"], self.snapshot = self.snapshot, None
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()
        if ft.participants == ft.group_size:
            self.full_steps += 1
        every = self.options.get("stop_after_join")
        armed = self.options.get("always_armed") or ft.commit_failures > 0
        armed = armed or (ft.heals > 0 and self.options.get("restarted"))
        if every is not None and self.stop_at is None and armed:
            if ft.participants < ft.group_size:
                self.saw_fewer = True
            elif self.saw_fewer:
                self.stop_at = state.step + every
        if self.stop_at is not None and state.step == self.stop_at:  # once: a pending stop would be checkpointed
            engine.request_stop("test: both groups stop together")
        time.sleep(self.options.get("pace", 0.05))


class SavePoints(cadence.Callback):
    """After Checkpoint: which group wrote at each save of the interval; `freeze` copies one save."""

    order = 101

    def __init__(self, options: dict, out) -> None:
        self.options, self.out = options, out

    def on_save_point(self, engine) -> None:
        step, interval = engine.state.step, self.options.get("ckpt_interval", 2)
        if not engine.state.batch_in_epoch or step % interval:
            return
        writes = engine.backend.writes_checkpoint  # what the Checkpoint callback was told at this save
        self.out.write(json.dumps({"save_point": step, "writes": writes}) + "\n")
        self.out.flush()
        freeze = self.options.get("freeze")
        if freeze is None or step != freeze["at"]:
            return
        ckpt = next(c for c in engine.callbacks if isinstance(c, Checkpoint))
        assert ckpt.wait(60), "the save did not commit in 60 s"
        if engine.backend.rank == 0:
            source, target = Path(ckpt.store.directory), Path(freeze["dir"])
            own = Path("replicas") / f"replica-{engine.backend.ft.replica_id}"
            # Committed checkpoints only: a superseded data state waits in a `.tmp-`/`.old-` folder
            # until the store's reaper removes it in the background, maybe while this copies.
            transient = shutil.ignore_patterns(*(f"{prefix}*" for prefix in TEMP_PREFIXES))
            shutil.copytree(source / own, target / own, ignore=transient)
            if writes:
                shutil.copytree(source / "latest", target / "latest")
        engine.backend.barrier()


def engine_ema(engine):
    return next(c for c in engine.callbacks if isinstance(c, EMA))


def digest_tensors(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(local(t.detach()).cpu().numpy().tobytes())
    return h.hexdigest()


def make_backend(options: dict, ft: FTConfig):
    if options.get("backend") == "mesh":
        from cadence.backends.mesh import MeshBackend

        return MeshBackend(ft=ft, shard=options.get("shard", 1), units=["Linear"], timeout=10, device="cpu")
    return DDPBackend(ft=ft, timeout=10, device="cpu")


def wait_for(condition: dict) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            lines = [json.loads(line) for line in open(condition["file"]).read().splitlines() if line.strip()]
        except (OSError, ValueError):
            lines = []
        if condition.get("end") and any("end" in line or "error" in line for line in lines):
            return
        if "steps" in condition and sum("step" in line for line in lines) >= condition["steps"]:
            return
        time.sleep(0.05)
    raise TimeoutError(f"start_after: {condition} not met in 120 s")


def main() -> None:
    options = json.loads(sys.argv[1])
    # What setup imports, imported before waiting (seconds under load), so a late start is only the setup.
    import torch._dynamo
    import torchdata.stateful_dataloader  # noqa: F401

    from cadence.backends.ft import import_torchft

    import_torchft()  # as the backend imports it: its logs quiet

    if options.get("start_after"):
        for condition in options["start_after"]:
            wait_for(condition)
    # A plain python process is a group of one; under torchrun (a mesh group of several) its own values stay.
    defaults = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(options["port"]), "RANK": "0", "WORLD_SIZE": "1"}
    for name, value in {**defaults, "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(name, value)
    rank = int(os.environ["RANK"])
    if rank:
        options["out"] += f".rank{rank}"  # each rank records its own shards
    torch.manual_seed(options["replica_id"] * 10 + rank)  # replicas start different: the first quorum makes them equal
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if options.get("forward_sleep"):  # after FSDP2's own pre-forward hook (it is prepended): unsharded here
        model[2].register_forward_pre_hook(lambda module, args: time.sleep(options["forward_sleep"]))
    g = torch.Generator().manual_seed(1)
    samples = options.get("samples", 4096)
    data = torch.utils.data.TensorDataset(
        torch.randn(samples, 8, generator=g), torch.randint(0, 4, (samples,), generator=g)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
    ft = FTConfig(
        replica_id=options["replica_id"],
        group_size=options["group_size"],
        min_replica_size=options.get("min_replica_size", 1),
        lighthouse=options["lighthouse"],
        quorum_timeout=options.get("quorum_timeout", 60),
        process_group_timeout=options.get("pg_timeout", 5),
        timeout=options.get("timeout", 10),
        hostname="127.0.0.1",
    )
    callbacks = [EMA(decay=0.9)]
    if options.get("checkpoint"):
        callbacks.append(
            Checkpoint(
                dir=options["checkpoint"],
                interval=options.get("ckpt_interval", 2),
                auto_resume=bool(options.get("resume")),
                keep_latest_k=1,
                async_mode=options.get("async_mode", "disabled"),
            )
        )
    with open(options["out"], "a") as out:
        callbacks.append(Record(options, out))
        if options.get("checkpoint"):
            callbacks.append(SavePoints(options, out))
        try:
            with cadence.Engine(
                model,
                optimizer,
                data,
                loss_fn=torch.nn.functional.cross_entropy,
                scheduler=scheduler,
                backend=make_backend(options, ft),
                callbacks=callbacks,
                seed=0,
                steps=options.get("steps"),
                log_interval=1000,
                eval_every_epochs=None,
                train={"batch_size": options.get("batch_size", 8)},
                workspace=options.get("workspace", "runs"),
                run_id=f"replica-{options['replica_id']}",
                device="cpu",
            ) as engine:
                if options.get("more_steps"):
                    engine.fit(steps=options["more_steps"])  # counted from the restored step
                else:
                    engine.fit()  # to config steps: an absolute target, also after a resume
                out.write(json.dumps({"end": engine.state.step, "failures": engine.backend.ft.commit_failures}) + "\n")
        except BaseException as exc:
            out.write(
                json.dumps({"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__, "time": time.time()})
                + "\n"
            )
            out.flush()
            raise


if __name__ == "__main__":
    main()
