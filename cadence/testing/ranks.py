"""Multi-rank checks: the same collectives and the same decisions on every rank and world size."""

from __future__ import annotations

import faulthandler
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from cadence.testing.compare import first_difference, max_parameter_difference
from cadence.testing.scenario import Scenario, build_engine, engine_state, parameters

if TYPE_CHECKING:
    from cadence.testing.harness import Report

#: Largest parameter difference allowed between world sizes (float sums in another order).
WORLD_SIZE_TOLERANCE = 1e-5


@attrs.define
class RankRun:
    """What one world size left behind: per-rank collective logs and results, and its failure."""

    world_size: int
    logs: list[list[dict[str, Any]]]
    results: list[dict[str, Any] | None]
    error: str | None
    stacks: dict[int, str]


def check(
    make: Callable[..., Any],
    workdir: Path,
    scenario: Scenario,
    report: Report,
    *,
    world_sizes: Sequence[int],
    timeout: float,
) -> None:
    started = time.perf_counter()
    runs = [_run(make, workdir / f"world-{n}", scenario, n, timeout) for n in world_sizes]
    report.details["collectives"] = {run.world_size: [_collectives(log) for log in run.logs] for run in runs}
    divergences = [d for d in (_collective_divergence(run) for run in runs) if d]
    report.add("same_collectives", "; ".join(divergences) or None, started)
    failed = [f"on {run.world_size} rank(s): {run.error}{_stuck(run)}" for run in runs if run.error]
    report.add("runs_on_ranks", "; ".join(failed) or None, started)
    finished = [run for run in runs if run.error is None and all(r is not None for r in run.results)]
    started = time.perf_counter()
    problems = [p for p in (_decision_difference(run) for run in finished) if p]
    report.add("same_decisions", "; ".join(problems) or None, started)
    if len(finished) > 1:
        started = time.perf_counter()
        report.add("same_across_world_sizes", _world_size_difference(finished), started)


def _collectives(log: list[dict[str, Any]]) -> int:
    from cadence.testing.collectives import MARK

    return sum(1 for line in log if not line["op"].startswith(MARK))


def _run(make: Callable[..., Any], workdir: Path, scenario: Scenario, world_size: int, timeout: float) -> RankRun:
    from cadence.launch import launch
    from cadence.testing.harness import failure_text

    workdir.mkdir(parents=True, exist_ok=True)
    error = None
    try:
        launch(_worker, make, str(workdir), scenario, timeout, nprocs=world_size, start_method="fork", timeout=timeout)
    except TimeoutError:
        error = f"hung: still running after {timeout:g} s (a collective one rank never joined?)"
    except Exception as exc:
        error = str(exc).split("\n\nTraceback", 1)[0] if type(exc).__name__ == "WorkerError" else failure_text(exc)
    from cadence.testing.collectives import read_log

    logs = [read_log(workdir / f"rank-{r}.jsonl") for r in range(world_size)]
    results = [_load(workdir / f"rank-{r}.pt") for r in range(world_size)]
    stacks = {
        r: (workdir / f"rank-{r}.stacks").read_text()
        for r in range(world_size)
        if (workdir / f"rank-{r}.stacks").exists()
    }
    return RankRun(world_size, logs, results, error, {r: s for r, s in stacks.items() if s.strip()})


def _load(path: Path) -> dict[str, Any] | None:
    return torch.load(path, weights_only=False) if path.exists() else None


def _worker(make: Callable[..., Any], workdir: str, scenario: Scenario, timeout: float) -> None:
    from cadence.testing.collectives import CollectiveLog, CountingDDPBackend, EventMarker, counting

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    root = Path(workdir)
    peers = {r: root / f"rank-{r}.jsonl" for r in range(world_size) if r != rank}
    log = CollectiveLog(root / f"rank-{rank}.jsonl", peers)
    # Dump every thread's stack shortly before the launcher kills a hung rank; a rank
    # that aborts on a mismatched collective needs no dump of the parent's stack.
    faulthandler.disable()
    stacks = (root / f"rank-{rank}.stacks").open("w")
    faulthandler.dump_traceback_later(max(1.0, timeout - 3.0), file=stacks)
    try:
        with log.patch_torch_distributed():
            if scenario.backend is not None:
                backend = counting(scenario.backend(), log)
            else:
                backend = CountingDDPBackend(log, timeout=timeout, device="cpu")
            engine, _, probe = build_engine(
                make, root, scenario, backend=backend, rank=rank, world_size=world_size, extra=[EventMarker(log)]
            )
            log.engine = engine
            try:
                engine.fit(steps=scenario.steps)
                engine.fit(steps=scenario.steps)
                engine.evaluate()
                result = {"params": parameters(engine), "state": engine_state(engine), "agreed": probe.agreed}
                torch.save(result, root / f"rank-{rank}.pt")
            finally:
                engine.close()
    finally:
        faulthandler.cancel_dump_traceback_later()
        stacks.close()


def _entry(line: dict[str, Any]) -> str:
    from cadence.testing.collectives import describe_call

    return describe_call(line)


def _collective_divergence(run: RankRun) -> str | None:
    """The first collective the ranks disagree on, naming the rank(s) that called it alone."""
    logs = run.logs
    if len(logs) < 2:
        return None
    counts = ", ".join(f"rank {r}: {_collectives(log)}" for r, log in enumerate(logs))
    for i in range(max(len(log) for log in logs)):
        calls = {r: log[i] if i < len(log) else None for r, log in enumerate(logs)}
        if len({_kind(c) for c in calls.values()}) == 1:
            continue
        if run.error and run.error.startswith("hung") and None in calls.values():
            return None  # a rank stopped calling anything: the hang report says where it was stuck
        extra = _called_alone(logs, i)
        if extra:
            call = logs[extra[0]][i]
            others = sorted(set(calls) - set(extra))
            return (
                f"on {run.world_size} ranks, {_entry(call)} was called on rank(s) {extra} only; "
                f"rank(s) {others} never called it (collectives per rank: {counts})"
            )
        described = "; ".join(f"rank {r}: {_entry(c) if c else 'nothing'}" for r, c in calls.items())
        return (
            f"on {run.world_size} ranks, call #{i} differs between ranks: {described} (collectives per rank: {counts})"
        )
    return None


def _kind(call: dict[str, Any] | None) -> tuple[str, str] | None:
    return (call["op"], call["sig"]) if call else None


def _called_alone(logs: list[list[dict[str, Any]]], i: int) -> list[int]:
    """The ranks whose collective #i the others did not call, when that can be told.

    Either the other ranks' #i is these ranks' #i+1 (an extra call), or only
    these ranks' #i comes from a callback hook: the engine's own collectives
    are the same on every rank by construction, so a mismatch with one of them
    is the callback's.
    """
    calls = {r: log[i] if i < len(log) else None for r, log in enumerate(logs)}
    for call in {_kind(c) for c in calls.values()}:
        ranks = [r for r, c in calls.items() if _kind(c) == call]
        rest = [r for r in calls if r not in ranks]
        if call is None or not rest:
            continue
        shifted = {_kind(logs[r][i + 1]) if i + 1 < len(logs[r]) else None for r in ranks}
        if len(shifted) == 1 and shifted == {_kind(calls[r]) for r in rest}:
            return ranks
    hooked = [r for r, c in calls.items() if c is not None and ".on_" in c["where"]]
    if hooked and len({_kind(calls[r]) for r in hooked}) == 1 and len(hooked) < len(calls):
        return hooked
    return []


def _stuck(run: RankRun) -> str:
    if not run.error or not run.error.startswith("hung"):
        return ""
    where = []
    for r, log in enumerate(run.logs):
        last = f"its last call was #{log[-1]['i']} {_entry(log[-1])}" if log else "it called no collective"
        frame = _innermost_frame(run.stacks.get(r, ""))
        where.append(f"rank {r}: {last}" + (f", stuck at {frame}" if frame else ""))
    return " (" + "; ".join(where) + ")"


def _innermost_frame(stacks: str) -> str | None:
    """The innermost frame of the first thread faulthandler dumped (the current one), with its caller
    outside torch and the harness when the innermost frame is inside them."""
    from cadence.testing.collectives import PLUMBING

    frames = []
    for line in stacks.splitlines():
        line = line.strip()
        if line.startswith("File "):
            frames.append(line)
        elif frames:  # the end of the first thread's frames
            break
    if not frames:
        return None
    outside = next((f for f in frames if not f.split('"')[1].startswith(PLUMBING)), None)
    return frames[0] if outside in (None, frames[0]) else f"{outside} (in {frames[0]})"


def _decision_difference(run: RankRun) -> str | None:
    results = run.results
    first = results[0]
    assert first is not None
    for rank, other in enumerate(results[1:], start=1):
        assert other is not None
        worst = max_parameter_difference(first["params"], other["params"])
        if worst != 0.0:
            return f"on {run.world_size} ranks, rank {rank}'s parameters differ from rank 0's by up to {worst:.3g}"
        difference = first_difference(first["state"], other["state"])
        if difference:
            return f"on {run.world_size} ranks, engine state differs between rank 0 and rank {rank}: {difference}"
        difference = first_difference(first["agreed"], other["agreed"])
        if difference:
            return f"on {run.world_size} ranks, agreed requests differ between rank 0 and rank {rank}: {difference}"
    return None


def _world_size_difference(runs: list[RankRun]) -> str | None:
    base = runs[0]
    base_result = base.results[0]
    assert base_result is not None
    for run in runs[1:]:
        result = run.results[0]
        assert result is not None
        pair = f"{base.world_size} and {run.world_size} ranks"
        for key in ("step", "epoch", "skipped_steps"):
            if base_result["state"][key] != result["state"][key]:
                return f"{pair} end at different {key}: {base_result['state'][key]} vs {result['state'][key]}"
        difference = first_difference(base_result["agreed"], result["agreed"])
        if difference:
            return f"{pair} agreed different requests (step, values): {difference}"
        worst = max_parameter_difference(base_result["params"], result["params"])
        if worst > WORLD_SIZE_TOLERANCE:
            return f"{pair} end with parameters differing by up to {worst:.3g} (> {WORLD_SIZE_TOLERANCE:g})"
    return None
