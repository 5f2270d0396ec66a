"""The walk of a save stays short: the callback decides, the saver writes, and nothing climbs back.

`benchmarks/save_walk.py` traces one save (a `latest` with a history snapshot
and pruning) from `Checkpoint._save` down to the store's commit of `latest`:
at most 8 frames on the way down and 1 call back up, on the file store (sync)
and on the DCP store (async), as issue 33 set. Before the saver the callback
was called back or re-entered 16 times per sync save.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "save_walk.py"


def _save_walk():
    spec = importlib.util.spec_from_file_location("save_walk", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["save_walk"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:torch.distributed is (disabled, )?unavailable or uninitialized")
@pytest.mark.parametrize("store", ["file", "dcp"])
def test_a_save_walks_down_to_the_commit_in_at_most_8_frames_and_climbs_back_at_most_once(tmp_path, store):
    walk_module = _save_walk()
    walk = walk_module.trace_save(store, tmp_path)
    assert walk.chain is not None and walk.chain[0] == "callbacks/checkpoint.py:Checkpoint._save"
    assert walk.chain[-1].endswith(".commit_folder"), walk.chain  # the rename that commits `latest`
    assert len(walk.chain) <= walk_module.TARGET_STAYS, "\n".join(walk.chain)
    assert len(walk.climbs) <= walk_module.TARGET_CLIMBS, "\n".join(walk.climbs)
    assert not any("callbacks/checkpoint.py" in climb.split(" -> ")[1] for climb in walk.climbs), walk.climbs
