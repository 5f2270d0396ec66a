"""`cadence hang RUN_DIR`: which rank is where, and which collective the others wait in.

Reads the heartbeat folder of a run (`RUN_DIR/heartbeat`, or the folder
itself) and prints one report (`cadence.cli.hang_report`): for each rank its
step, event and the callback its main thread is in (from its stack dump),
the collective it waits in, and what the ranks' flight recorders say about
each process group. With `--dump`, first asks the running ranks for fresh
dumps (their heartbeat watchdogs see the request within a poll) and waits for
them. See docs/observability.md, "When a run hangs".
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import attrs

from cadence.backends.flight_recorder import DUMP_PREFIX
from cadence.cli.common import UsageError, existing_dir
from cadence.cli.hang_report import HangReport, RankView, build_report


def heartbeat_folder(path: str) -> Path:
    """The heartbeat folder of a run directory, or `path` itself when it is one."""
    folder = existing_dir(path, "run directory")
    for candidate in (folder / "heartbeat", folder):
        if any(candidate.glob("rank-*.json")):
            return candidate
    raise UsageError(
        f"{folder} has no heartbeat records (heartbeat/rank-*.json): the run needs the Heartbeat callback "
        "(callbacks=[Heartbeat()] or the `heartbeat` config entry)"
    )


def hang(args: argparse.Namespace) -> int:
    """Print the hang report of a run (with --dump: after asking its running ranks for fresh dumps)."""
    folder = heartbeat_folder(args.run_dir)
    if args.dump:
        _request_and_wait(folder, args.wait)
    report = build_report(folder)
    if args.json:
        print(json.dumps(attrs.asdict(report, value_serializer=lambda _, __, v: str(v) if isinstance(v, Path) else v)))
    else:
        print("\n".join(render(report)))
    return 0


def _request_and_wait(folder: Path, wait: float) -> None:
    from cadence.callbacks.heartbeat_dump import request_dumps

    asked = time.time()
    request_dumps(folder, "cadence hang --dump")
    running = [
        int(p.stem.split("-")[1]) for p in folder.glob("rank-*.json") if not json.loads(p.read_text()).get("finished")
    ]
    deadline = asked + wait
    while time.time() < deadline:
        fresh = [r for r in running if _mtime(folder / f"stacks-rank-{r}.txt") >= asked]
        if len(fresh) == len(running):
            return
        time.sleep(0.2)
    print(f"(not every running rank dumped within {wait:g} s: the report uses what is there)")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def render(report: HangReport) -> list[str]:
    """The report as lines of text."""
    lines = [f"hang report: {report.folder} ({len(report.ranks)} rank{'s' if len(report.ranks) != 1 else ''})", ""]
    for view in report.ranks.values():
        lines += _rank_lines(view)
    lines += ["", "what the flight recorders say:"]
    lines += [f"  - {finding.text}" for finding in report.findings] or [
        "  - nothing conclusive: no rank waits in a collective that another rank did not issue"
    ]
    lines += [
        "",
        f"files: {report.folder}/stacks-rank-*.txt (every thread's stack), {DUMP_PREFIX}* (torch's format: "
        f"python -m torch.distributed.flight_recorder.fr_trace {report.folder} -p {DUMP_PREFIX})",
    ]
    return lines


def _rank_lines(view: RankView) -> list[str]:
    record, failure = view.record, view.record.get("failure")
    step, event = view.position
    done = record.get("finished") and not failure
    state = "finished" if done else f"step {step}, {event}" + (f", in {view.where}" if view.where else "")
    lines = [f"rank {view.rank} ({record.get('host')}, pid {record.get('pid')}): {state}"]
    if failure:
        lines.append(f"    the fit raised there: {failure.get('error')}")
    elif not done:
        quiet = float(record.get("written", 0)) - float(record.get("time", 0))
        timeout = record.get("timeout")
        lines.append(f"    no progress for {quiet:.1f} s when its heartbeat was last written (timeout {timeout} s)")
    waiting = view.waiting()
    if waiting is not None:
        lines.append(f"    waits in {waiting.describe()}, issued by {waiting.issued_by}")
    elif view.collectives:
        last = max(view.collectives, key=lambda c: c.time_ns)
        lines.append(f"    last collective: {last.describe()} (completed, or failed on a timeout)")
    if view.recorder:
        lines.append(f"    {view.recorder}")
    if view.stack:
        lines.append(f"    stack ({view.stack_header or 'last dump'}), innermost first:")
        lines += [f"      {frame}" for frame in view.stack[:6]]
    return lines
