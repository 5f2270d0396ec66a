"""Where a run's files go. Placeholder resolution; the run-directory issue extends it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cadence.engine import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine


def resolve_run_dir(engine: Engine) -> Path:
    """`workspace/lineage/run_id`, run_id from the config hash when not given."""
    cfg = engine.config
    run_id = cfg.run_id or config_module.config_hash(engine.run_config)
    return Path(cfg.workspace) / cfg.lineage / run_id
