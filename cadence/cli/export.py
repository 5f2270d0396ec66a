"""`cadence export CHECKPOINT --to {torch,safetensors,hf,dcp} OUT`: a checkpoint of any store, out of Cadence.

Verifies every checksum first, then writes the model's weights whole (and,
with `--with-optimizer`, the optimizer state). Exit status 0 when written,
1 when the checkpoint is damaged or cannot be exported (the message names the
file and step), 2 for a usage error. See docs/checkpoints.md, "Moving checkpoints".
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cadence.cli.common import UsageError, human_size


def add_export(commands: Any) -> None:
    """Register the `export` subcommand on the `cadence` parser's subcommands."""
    parser = commands.add_parser(
        "export", help="write a checkpoint as torch.save, safetensors, a Hugging Face folder or DCP"
    )
    parser.add_argument("checkpoint", help="a checkpoint folder of any store (or a folder holding latest)")
    parser.add_argument("out", help="the file or folder to write")
    parser.add_argument("--to", required=True, choices=["torch", "safetensors", "hf", "dcp"], help="the format")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="cast floating weights")
    parser.add_argument(
        "--params", choices=["all", "trainable"], default="all", help="all parameters, or the trainable ones"
    )
    parser.add_argument("--with-optimizer", action="store_true", help="the optimizer state too (not --to hf)")
    parser.add_argument(
        "--mapping", default=None, help="Hugging Face key mapping, module:NAME or file.py:NAME (--to hf)"
    )
    parser.add_argument(
        "--max-shard-size",
        type=int,
        default=None,
        help="bytes per safetensors file before the weights are split (5 GiB)",
    )
    parser.set_defaults(run=export)


def export(args: argparse.Namespace) -> int:
    from cadence.checkpoint.export import export_checkpoint
    from cadence.checkpoint.safetensors_io import DEFAULT_SHARD_BYTES
    from cadence.checkpoint.store import CheckpointError

    try:
        written = export_checkpoint(
            args.checkpoint,
            args.out,
            to=args.to,
            dtype=args.dtype,
            params=args.params,
            with_optimizer=args.with_optimizer,
            mapping=args.mapping,
            max_shard_bytes=args.max_shard_size or DEFAULT_SHARD_BYTES,
        )
    except CheckpointError as exc:
        print(f"cadence export: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, ImportError) as exc:
        raise UsageError(str(exc)) from exc
    total = sum(path.stat().st_size for path in written if path.is_file())
    print(f"exported {args.checkpoint} to {args.out} ({args.to}, {len(written)} file(s), {human_size(total)})")
    return 0
