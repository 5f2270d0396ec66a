"""The walk of one checkpoint save through the code: how many frames down to the commit, how often it climbs back.

    python benchmarks/save_walk.py            # the file store (sync save) and the DCP store (async save)
    python benchmarks/save_walk.py --list     # also every frame of the walk, in call order
    python benchmarks/save_walk.py --check    # exit 1 past the target (8 stays, 1 climb)
    python benchmarks/save_walk.py --smoke    # the same (seconds; tests/test_benchmarks.py)

One process, a tiny model, `Checkpoint(interval=2, keep_latest_k=1)`: the save at
step 4 is traced (a `latest` with a history snapshot, and the step-2 snapshot
pruned). Every Python frame of `cadence/` is recorded (`sys.setprofile`, and
`threading.setprofile` for the threads the save starts) from entering
`Checkpoint._save` until it returns and, for an async save, until its background
commit is done (`Checkpoint.wait()`, not traced itself).

Layers, highest first: the policy (`cadence/callbacks/checkpoint.py`), the saver
(`cadence/checkpoint/saver.py`, `writer.py`), the rest of the checkpoint wing
(stores, payload, bytes), and everything else (`engine/`, `backends/`).

Building the payload is one frame (`build_payload`): what it calls (the
engine's counters, every callback's `state_dict`) is what is saved, not the walk.

- *stays*: the frames on the way down from `Checkpoint._save` to the store's
  commit of `latest` (the `commit_folder` frame that renames the written folder to
  `latest`): its `cadence/` ancestors, and for a commit in a thread the save
  started, the ancestors of the frame that started that thread as well.
- *climbs*: calls from a lower layer into a higher one (a store calling the
  saver or the callback back), plus each time the callback, having had control
  back from a call into a lower layer, calls down again (the callback
  re-entered to take the next step of the save).
- *visited*: for scale, every distinct function the save entered in the policy
  and saver layers, and every function they called directly (the entry points
  a reader follows), with the files they are in.

Target (issue 33): at most 8 stays and 1 climb on the file store and on the DCP store.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import cadence
from cadence.backends.local import LocalBackend
from cadence.callbacks.checkpoint import Checkpoint

PACKAGE = Path(cadence.__file__).resolve().parent
POLICY, SAVER, WING, OUTSIDE = 0, 1, 2, 3
LAYER_NAMES = {POLICY: "policy", SAVER: "saver", WING: "wing", OUTSIDE: "outside"}
TARGET_STAYS, TARGET_CLIMBS = 8, 1


def layer(path: str) -> int:
    relative = Path(path).resolve().relative_to(PACKAGE).as_posix()
    if relative == "callbacks/checkpoint.py":
        return POLICY
    if relative in ("checkpoint/saver.py", "checkpoint/writer.py"):
        return SAVER
    if relative.startswith("checkpoint/"):
        return WING
    return OUTSIDE


def ours(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(str(PACKAGE))


def name(frame: FrameType) -> str:
    relative = Path(frame.f_code.co_filename).resolve().relative_to(PACKAGE).as_posix()
    return f"{relative}:{frame.f_code.co_qualname}"


def ancestors(frame: FrameType | None) -> Iterator[FrameType]:
    """The `cadence/` frames from `frame` up (itself included)."""
    while frame is not None:
        if ours(frame):
            yield frame
        frame = frame.f_back


class DCPBackend(LocalBackend):
    """The local backend with the DCP store (one process, no process group: DCP's `no_dist`)."""

    def checkpoint_store(self, engine: Any) -> Any:
        from cadence.checkpoint.dcp_store import DCPStore

        return DCPStore.for_engine(engine)


class Walk:
    """What one traced save did (see the module docstring)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int, str, int]] = []  # (thread, depth, frame name, layer), in call order
        self.chain: list[str] | None = None
        self.climbs: list[str] = []
        self.visited: dict[str, int] = {}
        self._started: dict[int, list[str]] = {}  # thread object id -> the chain above the frame that started it
        self._descended = False  # the callback called down already in this save
        self._lock = threading.Lock()

    def _chain_of(self, frame: FrameType) -> list[str]:
        chain = []
        for f in ancestors(frame):
            chain.append(name(f))
            if f.f_code.co_qualname == "Checkpoint._save":
                return chain[::-1]
        return self._started.get(id(threading.current_thread()), []) + chain[::-1]

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        if frame.f_code.co_name == "start" and isinstance(frame.f_locals.get("self"), threading.Thread):
            caller = next(ancestors(frame.f_back), None)  # a thread this save starts: where it hangs in the walk
            if caller is not None:
                with self._lock:
                    self._started[id(frame.f_locals["self"])] = self._chain_of(caller)
            return
        if not ours(frame) or frame.f_code.co_name in ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"):
            return
        if any(f.f_code.co_name == "build_payload" for f in ancestors(frame.f_back)):
            return  # what is saved (every callback's `state_dict` among it), not the walk
        callee, depth = layer(frame.f_code.co_filename), sum(1 for _ in ancestors(frame.f_back))
        caller_frame = next(ancestors(frame.f_back), None)
        started = self._started.get(id(threading.current_thread()))
        caller_name = name(caller_frame) if caller_frame is not None else (started[-1] if started else None)
        caller = (
            layer(caller_frame.f_code.co_filename)
            if caller_frame is not None
            else (self._layer_of(started[-1]) if started else None)
        )
        with self._lock:
            self.events.append((threading.get_ident(), depth, name(frame), callee))
            if caller is not None and callee < caller:
                self.climbs.append(
                    f"{caller_name} -> {name(frame)} (up: {LAYER_NAMES[caller]} to {LAYER_NAMES[callee]})"
                )
            if caller == POLICY and callee > POLICY:
                if self._descended:
                    self.climbs.append(f"{caller_name} -> {name(frame)} (the callback calls down again)")
                self._descended = True
            if callee <= SAVER or (caller is not None and caller <= SAVER):
                self.visited.setdefault(name(frame), callee)
            if self.chain is None and frame.f_code.co_name == "commit_folder":
                final = frame.f_locals.get("final")
                if isinstance(final, Path) and final.name == "latest":
                    self.chain = self._chain_of(frame)

    @staticmethod
    def _layer_of(qualified: str) -> int:
        return layer(str(PACKAGE / qualified.partition(":")[0]))


def trace_save(store: str, folder: Path, at_step: int = 4) -> Walk:
    """Fit a tiny model for `at_step` steps, tracing the save at `at_step` (see the module docstring)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(at_step)]
    async_mode = "async" if store == "dcp" else "disabled"
    ckpt = Checkpoint(dir=str(folder), interval=2, keep_latest_k=1, async_mode=async_mode, save_on_fit_end=False)
    backend = DCPBackend(device="cpu") if store == "dcp" else LocalBackend(device="cpu")
    engine = cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        loss_fn=torch.nn.functional.mse_loss,
        callbacks=[ckpt],
        backend=backend,
        seed=0,
    )
    walk = Walk()
    original = Checkpoint._save

    def traced(self: Checkpoint, engine: Any, **kwargs: Any) -> None:
        if engine.state.step != at_step:
            return original(self, engine, **kwargs)
        threading.setprofile(walk.profile)
        sys.setprofile(walk.profile)
        try:
            original(self, engine, **kwargs)
        finally:
            sys.setprofile(None)
        self.wait()  # the background commit, traced in its thread
        threading.setprofile(None)  # type: ignore[arg-type]

    Checkpoint._save = traced  # type: ignore[method-assign]
    try:
        engine.fit(steps=at_step)
    finally:
        Checkpoint._save = original  # type: ignore[method-assign]
        engine.close()
    if walk.chain is None:
        raise RuntimeError(f"{store} store: no commit of 'latest' seen in the traced save")
    return walk


def report(store: str, walk: Walk, listing: bool) -> bool:
    files = {n.partition(":")[0] for n in walk.visited}
    assert walk.chain is not None
    print(
        f"\n{store} store: {len(walk.chain)} stays, {len(walk.climbs)} climbs "
        f"(visited: {len(walk.visited)} functions in {len(files)} files)"
    )
    print("  down to the commit:")
    for n, frame in enumerate(walk.chain, 1):
        print(f"    {n}. {frame}")
    for climb in walk.climbs:
        print(f"  climb: {climb}")
    if listing:
        print("  every frame, in call order (thread, depth):")
        threads = {t: i for i, t in enumerate(dict.fromkeys(t for t, *_ in walk.events))}
        for thread, depth, frame, _ in walk.events:
            print(f"    [{threads[thread]}] {'  ' * depth}{frame}")
    return len(walk.chain) <= TARGET_STAYS and len(walk.climbs) <= TARGET_CLIMBS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", choices=["file", "dcp", "both"], default="both")
    parser.add_argument("--list", action="store_true", help="print every frame of the walk")
    parser.add_argument("--check", action="store_true", help="exit 1 when a walk is past the target")
    parser.add_argument("--smoke", action="store_true", help="the same run (it takes seconds)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # DCP on one process without a process group says it assumes one process (in its writer thread too).
    warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
    ok = True
    for store in ["file", "dcp"] if args.store == "both" else [args.store]:
        with tempfile.TemporaryDirectory() as tmp:
            ok &= report(store, trace_save(store, Path(tmp)), args.list)
    print(f"\ntarget: at most {TARGET_STAYS} stays and {TARGET_CLIMBS} climb: {'met' if ok else 'NOT met'}")
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
