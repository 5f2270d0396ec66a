"""Checkpoint saves to object storage against the server's own raw PUT of the same bytes.

    python benchmarks/object_storage.py                 # ~200 MB payload, 5 repeats
    python benchmarks/object_storage.py --mb 400 --repeats 7
    python benchmarks/object_storage.py --smoke         # seconds (tests/test_benchmarks.py)

A local S3 server (moto's server mode on 127.0.0.1, in its own process:
`cadence.testing.s3`) takes both sides, alternated in each repeat:

- *save*: `ObjectFileStore.write("latest", payload)`, the whole commit of a
  checkpoint save to `s3://...`: the file store stages the files locally
  (hashing every byte), they are uploaded under the save's own prefix, then
  the manifest, then the `latest` pointer moves and the superseded save is
  deleted (cadence/checkpoint/object_store.py);
- *raw*: `s3fs.pipe_file` of one object of as many random bytes (the bytes
  already in memory: no staging, no checksum, no commit).

The figure is the save's upload rate over the raw PUT's (raw time / save
time) per repeat: the median and the range over the repeats. 1.0 is the
server's own speed; below it is what the commit protocol costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from cadence.checkpoint.file_store import FileStore
from cadence.checkpoint.object_file import ObjectFileStore
from cadence.testing.s3 import s3_server

REQUIRES = {"s3fs": "s3", "moto": "dev"}


def payload(mb: float) -> dict:
    """Model and AdamW-like optimizer state of `mb` MB in all (a third model, two thirds optimizer)."""
    n = max(1, int(mb * 2**20 / 4 / 3))
    torch.manual_seed(0)
    return {
        "format": "cadence-checkpoint",
        "version": 1,
        "meta": {"step": 1, "epoch": 0},
        "model": {"weight": torch.randn(n)},
        "optimizers": [{"state": {0: {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}}, "param_groups": []}],
    }


def nbytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, list):
        return sum(nbytes(v) for v in obj)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=200.0, help="payload size in MB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny and once: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.mb, args.repeats = 2.0, 1
    data = payload(args.mb)
    size = nbytes(data)
    raw_bytes = os.urandom(size)
    with s3_server() as server, tempfile.TemporaryDirectory() as scratch:
        fs = server.filesystem()
        store = ObjectFileStore(FileStore(), server.url("bench/checkpoints"), scratch=scratch)
        store.write("latest", data)  # warm: the connection pool, the staging folder
        fs.pipe_file(server.url("bench/raw"), raw_bytes)
        ratios, saves, raws = [], [], []
        for repeat in range(args.repeats):
            order = ("save", "raw") if repeat % 2 == 0 else ("raw", "save")
            took = {}
            for side in order:
                start = time.perf_counter()
                if side == "save":
                    store.write("latest", data)
                else:
                    fs.pipe_file(server.url("bench/raw"), raw_bytes)
                took[side] = time.perf_counter() - start
            saves.append(took["save"])
            raws.append(took["raw"])
            ratios.append(took["raw"] / took["save"])
            print(
                f"repeat {repeat}: save {took['save']:.3f} s, raw PUT {took['raw']:.3f} s, rate ratio {ratios[-1]:.3f}",
                flush=True,
            )
        assert store.names() == ["latest"] and store.read("latest")["meta"]["step"] == 1
    mb = size / 2**20
    print(
        f"\n{mb:.0f} MB, {args.repeats} repeats: save {mb / statistics.median(saves):.0f} MB/s, "
        f"raw PUT {mb / statistics.median(raws):.0f} MB/s; save rate / raw PUT rate: median "
        f"{statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}; "
        f"load {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    sys.exit(main())
