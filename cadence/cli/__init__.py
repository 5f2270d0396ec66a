"""The `cadence` command: what is installed, which runs exist, what a checkpoint holds.

    cadence info                  versions, devices, backends that can run here, callbacks
    cadence runs [WORKSPACE]      one line per run directory (default workspace: ./runs)
    cadence inspect CHECKPOINT    step, epoch, config, tensors, callback keys, manifest check
    cadence export CKPT --to F OUT  a checkpoint as torch.save, safetensors, a Hugging Face folder or DCP
    cadence plot RUN_DIR          plot a run's metrics (needs the `plot` extra)
    cadence hang RUN_DIR          which rank is where, and which collective the others wait in
    cadence --version             the installed version

Usage errors and a missing or foreign path print one line on stderr and exit
with status 2. Nothing imports torch until a subcommand needs it, so
`cadence --help` is quick. See docs/run-directory.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cadence.cli.checkpoint import inspect_checkpoint
from cadence.cli.common import UsageError, version
from cadence.cli.export import add_export
from cadence.cli.hang import hang
from cadence.cli.info import show_info
from cadence.cli.runs import list_runs, plot_run


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `cadence` command; returns the exit status.

    Example:
        >>> main(["runs", "/no/such/folder"])  # doctest: +SKIP
        2
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except UsageError as exc:
        print(f"cadence {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `cadence runs | head`
        sys.stderr.close()
        return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cadence", description="Cadence: inspect the environment, runs and checkpoints."
    )
    from cadence import __version__

    parser.add_argument("--version", action="version", version=f"cadence {version('cadence') or __version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = commands.add_parser("info", help="versions, devices, backends that can run here, callbacks")
    info.set_defaults(run=show_info)
    runs = commands.add_parser("runs", help="list the runs of a workspace, one line each")
    runs.add_argument("workspace", nargs="?", default="runs", help="workspace folder (default: ./runs)")
    runs.set_defaults(run=list_runs)
    inspect = commands.add_parser("inspect", help="what a checkpoint holds, and whether it is complete")
    inspect.add_argument("checkpoint", help="a checkpoint directory (or a run's checkpoints/ folder: its latest)")
    inspect.set_defaults(run=inspect_checkpoint)
    add_export(commands)
    plot = commands.add_parser("plot", help="plot a run's metrics (needs cadence[plot])")
    plot.add_argument("run_dir", help="a run directory")
    plot.add_argument("--out", default=None, help="image file to write (default: inside the run directory)")
    plot.set_defaults(run=plot_run)
    report = commands.add_parser("hang", help="which rank is where, and which collective the others wait in")
    report.add_argument("run_dir", help="a run directory (or its heartbeat folder)")
    report.add_argument("--dump", action="store_true", help="ask the running ranks for fresh dumps first")
    report.add_argument("--wait", type=float, default=30.0, help="seconds to wait for those dumps (default 30)")
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    report.set_defaults(run=hang)
    return parser


__all__ = ["UsageError", "main"]
