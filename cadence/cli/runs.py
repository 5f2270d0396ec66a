"""`cadence runs` and `cadence plot`: the run directories of a workspace, one line each, and a run's curves."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from cadence.cli.common import UsageError, existing_dir, table


def _run_dirs(root: Path) -> list[Path]:
    """Run directories at `root` itself, one level down (a lineage) or two (a workspace)."""
    for pattern in ("metadata/run.yaml", "*/metadata/run.yaml", "*/*/metadata/run.yaml"):
        found = sorted(path.parent.parent for path in root.glob(pattern))
        if found:
            return found
    return []


def list_runs(args: argparse.Namespace) -> int:
    """Print one line per run directory of the workspace."""
    import yaml

    from cadence.run import lease, rundir

    root = existing_dir(args.workspace, "workspace")
    runs = _run_dirs(root)
    if not runs:
        raise UsageError(f"{root} is not a Cadence workspace: no run directory (*/*/metadata/{rundir.RUN_FILE}) in it")
    rows = []
    for path in runs:
        try:
            run = yaml.safe_load((path / rundir.METADATA / rundir.RUN_FILE).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            run = {"run_id": path.name, "lineage": "?", "code_id": f"unreadable run.yaml: {exc}"}
        records = rundir.read_attempts(path)
        last = records[-1] if records else {}
        best = next((r["best"] for r in reversed(records) if isinstance(r.get("best"), dict)), None)
        holder = lease.holder(path)
        rows.append(
            (
                str(last.get("time", "")),
                str(run.get("run_id", path.name)),
                str(run.get("lineage", "?")),
                str(run.get("code_id") or "-"),
                str(max((r.get("step", 0) for r in records), default="-")),
                _format_best(best),
                str(last.get("time", "-")).replace("T", " ")[:19],
                _state(last, holder, lease.lease_path(path).exists()),
                f"{holder.get('host', '?')}:{holder.get('pid', '?')}" if holder is not None else "-",
            )
        )
    rows.sort(key=lambda row: row[0])
    header = ("RUN ID", "LINEAGE", "CODE ID", "STEP", "BEST", "LAST ATTEMPT", "STATE", "HELD BY")
    print("\n".join(table([header, *(row[1:] for row in rows)], indent="")))
    return 0


def _format_best(best: dict[str, Any] | None) -> str:
    if not best:
        return "-"
    value = best.get("value")
    shown = f"{value:.6g}" if isinstance(value, float) else str(value)
    return f"{best.get('metric', 'score')}={shown}"


def _state(record: dict[str, Any], holder: dict[str, Any] | None, leased: bool) -> str:
    """The last recorded state; a `running` attempt whose process is gone is `lost`: no live process holds
    the run directory's lease (any host), or, for a directory without a lease file, the pid is gone on this host."""
    import socket

    state = str(record.get("state", "-"))
    if state == "running" and leased:
        return state if holder is not None else "lost"
    if state == "running" and record.get("host") == socket.gethostname():
        pid = record.get("pid")
        if isinstance(pid, int) and not _alive(pid):
            return "lost"
    return state


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def plot_run(args: argparse.Namespace) -> int:
    """Plot a run's metrics; prints the image file written."""
    folder = existing_dir(args.run_dir, "run directory")
    if not (folder / "metrics.jsonl").exists() and not (folder / "metadata").is_dir():
        raise UsageError(f"{folder} is not a Cadence run directory: it has neither metrics.jsonl nor metadata/")
    try:
        from cadence.plot import plot

        written = plot(folder, out=args.out)
    except ImportError as exc:  # matplotlib is an optional dependency
        raise UsageError(f"cannot plot: {exc}") from None
    except (FileNotFoundError, ValueError) as exc:  # no metrics.jsonl, or an empty one
        raise UsageError(str(exc).removeprefix("cadence plot: ")) from None
    print(written)
    return 0
