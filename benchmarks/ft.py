"""TorchFT: what fault tolerance costs per step, and how long a survivor pauses when its peer dies.

    python benchmarks/ft.py                        # 3 alternated pairs + 2 kills (a few minutes on 2 cores)
    python benchmarks/ft.py --repeats 1 --steps 60 --heartbeats 1000   # a quick run
    python benchmarks/ft.py --smoke                # seconds: both parts at tiny sizes (tests/test_benchmarks.py)

1. Cost per step: Cadence's ddp backend on two processes (one launch,
   `WORLD_SIZE=2`, gloo) against the same backend with `ft` on two replica
   groups of one process each (two launches, an in-process lighthouse on
   127.0.0.1): the same model (W2 of benchmarks/overhead.py: an MLP with four
   1024-wide layers, Adam), the same batch per process (64), the same gradient
   all-reduce between two processes; FT adds the per-step quorum (started in
   zero_grad, overlapping the step's end and the next batch's loading), the commit vote and TorchFT's DDP
   (its buckets are never rebuilt). The two variants alternate so machine drift
   hits both alike. Reports the median step time of the first process and the
   ratio (target <= 1.05).
2. The survivor's pause: two replica groups, the second SIGKILLs itself in the
   middle of a step; reports the survivor's longest step after the kill (its
   refused commit, then the wait until the lighthouse drops the dead group,
   `heartbeat_timeout_ms`) against its median step, per heartbeat timeout.

Every process is a fresh `python` (`subprocess`, not fork: the lighthouse runs
Rust threads in this process).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's cadence, here and in the workers (PYTHONPATH)
SIZES = [1024, 1024, 1024, 1024, 10]
BATCH, WARMUP = 64, 10
#: What tests/test_benchmarks.py needs installed to run this file: module -> the extra that installs it.
REQUIRES = {"torchft": "ft"}
SMOKE = False  # --smoke, passed on to the workers


def smoke() -> None:
    """--smoke: a 64-wide MLP, 3 warm-up steps (here and in every worker)."""
    global SIZES, WARMUP, SMOKE
    SIZES, WARMUP, SMOKE = [64, 64, 10], 3, True


def worker(options: dict) -> None:
    """One process: train, time each step, print one JSON line."""
    import torch

    import cadence
    from cadence.backends.ddp import DDPBackend

    torch.set_num_threads(1)
    together = options.get("together")
    if together is not None:  # --smoke: both groups start here, not as far apart as their imports end
        Path(together, f"ready-{options['index']}").touch()
        deadline = time.monotonic() + 120
        while len(list(Path(together).glob("ready-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(SIZES):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    steps = options["steps"]
    g = torch.Generator().manual_seed(1 + options["index"])
    data = [(torch.randn(BATCH, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (BATCH,), generator=g))] * 8
    times: list[float] = []
    ends: list[tuple[float, int]] = []  # wall time at each step's end, and whether it was skipped
    votes: list[float] = []
    kill_after = options.get("kill_after")

    class Clock(cadence.Callback):
        order = 99
        awaits_peer = options.get("await_peer", False)  # until the other group was seen in a quorum

        def on_forward(self, engine) -> None:
            if kill_after is not None and engine.state.step >= kill_after and engine.backend.ft.participants == 2:
                engine.backend.ft.manager.wait_quorum()  # the others are in this step with us
                print(json.dumps({"killed_at": time.time()}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_step_end(self, engine) -> None:
            times.append(time.perf_counter())
            ends.append((time.time(), engine.agreed("skip")))
            if self.awaits_peer:  # --smoke's tiny steps: slow down until the other group has joined
                self.awaits_peer = engine.backend.ft.participants < 2
                if self.awaits_peer:
                    time.sleep(0.05)

    ft = options.get("ft")
    backend = DDPBackend(timeout=60, ft=ft)
    if backend.ft is not None:  # time the commit vote (TorchFT's should_commit) on its own
        commit = backend.ft.commit

        def timed_commit() -> bool:
            start = time.perf_counter()
            try:
                return commit()
            finally:
                votes.append(time.perf_counter() - start)

        backend.ft.commit = timed_commit  # type: ignore[method-assign]
    with cadence.Engine(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-3),
        data * ((steps + WARMUP) // 8 + 1),
        loss_fn=torch.nn.functional.cross_entropy,
        backend=backend,
        callbacks=[Clock()],
        seed=0,
        log_interval=10_000,
        eval_every_epochs=None,
    ) as engine:
        engine.fit(steps=steps + WARMUP)
        failures = backend.ft.commit_failures if backend.ft is not None else 0
    intervals = [b - a for a, b in itertools.pairwise(times)]
    print(
        json.dumps({"intervals": intervals[WARMUP - 1 :], "failures": failures, "ends": ends, "votes": votes[WARMUP:]}),
        flush=True,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(options: dict, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--worker", json.dumps(options), *(["--smoke"] if SMOKE else [])],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def result(process: subprocess.Popen, timeout: float = 600) -> dict:
    out, _ = process.communicate(timeout=timeout)
    merged: dict = {}
    for line in out.splitlines():
        if line.startswith("{"):
            merged.update(json.loads(line))
    return merged


def run_ddp(steps: int) -> float:
    port = free_port()
    procs = [
        spawn(
            {"steps": steps, "index": rank},
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2"},
        )
        for rank in range(2)
    ]
    results = [result(p) for p in procs]
    return statistics.median(results[0]["intervals"])


def group_env(port: int) -> dict:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}


def run_ft(steps: int, address: str, heartbeat_ms: int = 1000, kill_after: int | None = None) -> tuple[dict, ...]:
    import tempfile

    procs = []
    # --smoke's steps are tiny: one group could be done before the other starts, so both start together.
    together = tempfile.mkdtemp(prefix="cadence-ft-bench-") if kill_after is not None and SMOKE else None
    for replica in range(2):
        ft = {
            "replica_id": replica,
            "group_size": 2,
            "lighthouse": address,
            "hostname": "127.0.0.1",
            "process_group_timeout": 10,
            "quorum_timeout": 60,
        }
        options = {"steps": steps, "index": replica, "ft": ft}
        if replica == 1 and kill_after is not None:
            options["kill_after"] = kill_after
        if together is not None:
            options["together"], options["await_peer"] = together, True
        procs.append(spawn(options, group_env(free_port())))
    try:
        return tuple(result(p) for p in procs)
    finally:
        if together is not None:
            shutil.rmtree(together, ignore_errors=True)


def cost(repeats: int, steps: int) -> None:
    from cadence.backends.ft import local_lighthouse

    ddp, ft = [], []
    for _ in range(repeats):
        ddp.append(run_ddp(steps))
        # min_replicas=2: the first step waits for both groups, so every timed step has two.
        with local_lighthouse(min_replicas=2) as address:
            first, _ = run_ft(steps, address)
        ft.append(statistics.median(first["intervals"]))
        vote = statistics.median(first["votes"])
        print(
            f"  pair: ddp {ddp[-1] * 1e3:.1f} ms, ft {ft[-1] * 1e3:.1f} ms, ratio {ft[-1] / ddp[-1]:.3f} "
            f"(ft's commit vote {vote * 1e3:.2f} ms of it)",
            flush=True,
        )
    a, b = statistics.median(ddp), statistics.median(ft)
    print(
        f"cost per step: ddp (2 processes) {a * 1e3:.1f} ms, ft (2 replica groups) {b * 1e3:.1f} ms, ratio {b / a:.3f}"
    )


def pause(heartbeats: list[int], steps: int) -> None:
    from cadence.backends.ft import local_lighthouse

    for heartbeat in heartbeats:
        with local_lighthouse(min_replicas=1, heartbeat_timeout_ms=heartbeat) as address:
            survivor, victim = run_ft(steps, address, heartbeat, kill_after=WARMUP + 5)
        killed = victim["killed_at"]  # printed just before the SIGKILL
        typical = statistics.median(survivor["intervals"])
        # The survivor's first committed step after the kill: the step it died in is refused, the
        # next one waits until the lighthouse stops counting the dead group (its heartbeat timeout).
        back = next(end for end, skipped in survivor["ends"] if end > killed and not skipped)
        pause = back - killed - typical
        print(
            f"pause: heartbeat_timeout {heartbeat} ms -> the survivor's next committed step ended "
            f"{(back - killed) * 1e3:.0f} ms after the kill, {pause * 1e3:.0f} ms more than a step "
            f"(median {typical * 1e3:.1f} ms; {survivor['failures']} refused commit(s)); "
            f"pause / heartbeat = {pause * 1e3 / heartbeat:.2f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--heartbeats", type=int, nargs="*", default=[1000, 2000])
    parser.add_argument("--smoke", action="store_true", help="seconds-long run of both parts at tiny sizes")
    args = parser.parse_args()
    if args.smoke:
        smoke()
        args.repeats, args.steps, args.heartbeats = 1, 60, [500]
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.smoke:
        print("--smoke: tiny sizes, to see every part run; the figures are not measurements", flush=True)
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    start = time.time()
    cost(args.repeats, args.steps)
    pause(args.heartbeats, args.steps)
    print(f"load average at end: {os.getloadavg()[0]:.1f} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
