"""Run directories: `workspace/lineage[-code_id]/run_id/`, and what they record.

A run directory says what ran: the config (in full, canonical, and as a diff
from the defaults), the code (git sha, branch, remote, dirty flag, uncommitted
diff) and the seed; `metadata/attempts.jsonl` gets one line per state change of
each attempt. A retry of the same run (same code, same config) lands in the
same directory; only the attempt timestamp, which names `logs/{timestamp}.log`
and `tensorboard/{timestamp}/`, changes. See docs/run-directory.md.

Ids:
    code_id: the first 7 hex of the git sha of HEAD, plus `-d` and the first
        10 hex of the sha256 of `git diff HEAD` when tracked files differ from
        HEAD; absent outside git. The repository is the one containing
        `$CADENCE_CODE_DIR`, else the current working directory (as git does).
    config_id: `config_hash` of the run config with the fields that place a run
        rather than define it (`EngineConfig.workspace`, `lineage`, `run_id`)
        reset, and a seed the engine drew left unset.
    launch: the backend's name and world size (`local1`, `ddp8`): another launch is another run.
    run_id: `code_id-config_id-launch` (no `code_id` outside git); `EngineConfig.run_id` overrides it.

Nothing is read or written until something needs the directory: the first
access of `engine.run_dir` creates it and, on the main process only, writes
the metadata. An engine that never touches `run_dir` runs without a writable
workspace.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import yaml

from cadence.engine.callback import BestScore, Callback
from cadence.engine.order import Order
from cadence.run import config as config_module
from cadence.run import lease
from cadence.run.determinism import enable_determinism as enable_determinism
from cadence.run.git import CODE_DIR_ENV as CODE_DIR_ENV
from cadence.run.git import GitInfo as GitInfo
from cadence.run.git import code_directory
from cadence.run.git import git_info as git_info

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence")

METADATA = "metadata"
ATTEMPTS_FILE = "attempts.jsonl"
RUN_FILE = "run.yaml"
_PLACEMENT_FIELDS = ("workspace", "lineage", "run_id")


# --- the config: identity and ids -------------------------------------------------------------


def identity_config(engine: Engine) -> Any:
    """The run config that defines the run: the input of `config_id` and `config.canonical.yaml`.

    Every `EngineConfig` inside has `workspace`, `lineage` and `run_id` reset to their defaults
    (they say where a run goes, not what it is), and the engine's own config has the seed it
    was given (None when the engine drew one), so a drawn seed never changes the id of a retry.
    """
    run_config = engine.run_config
    if not (attrs.has(type(run_config)) or isinstance(run_config, dict)):
        raise TypeError(f"run_config must be an attrs instance or a dict, got {type(run_config).__name__}")
    return _normalize(run_config, engine)


def _normalize(obj: Any, engine: Engine | None) -> Any:
    from cadence.engine.engine import EngineConfig

    if isinstance(obj, EngineConfig):
        placement: dict[str, Any] = {
            f.name: f.default for f in attrs.fields(EngineConfig) if f.name in _PLACEMENT_FIELDS
        }
        drawn = engine is not None and obj is engine.config and engine.seed_was_drawn
        seed = None if drawn else obj.seed
        return attrs.evolve(obj, seed=seed, **placement)
    if not attrs.has(type(obj)):
        return obj
    changes = {}
    for field in attrs.fields(type(obj)):
        value = getattr(obj, field.name)
        if field.init and (new := _normalize(value, engine)) is not value:
            changes[field.alias] = new
    return attrs.evolve(obj, **changes) if changes else obj


def _identity_diff(identity: Any) -> dict[str, Any]:
    """What the identity config changes from its class's defaults (all of it when there are none)."""
    try:
        default = type(identity)() if attrs.has(type(identity)) else None
    except TypeError:  # required fields
        default = None
    if default is None:
        return config_module.unstructure(identity)
    return config_module.config_diff(identity, _normalize(default, None))


def folder_name(instance: Any, attribute: Any, value: str) -> None:
    """attrs validator of `EngineConfig.lineage` / `run_id`: one folder name, not a path."""
    if not isinstance(value, str) or not value or value in (".", "..") or any(c in value for c in "/\\\0"):
        raise ValueError(f"'{attribute.name}' must be a single folder name (no '/'), got {value!r}")


@attrs.frozen
class RunInfo:
    """Where a run lives and what identifies it (see the module docstring for the ids).

    Attributes:
        path: the run directory, absolute.
        run_id, config_id, code_id: the ids (`code_id` is None outside git).
        lineage: the group of runs it belongs to.
        timestamp: this attempt's start, `YYYYmmdd-HHMMSS` local time (meaningful on the main process).
        git: the repository's state, or None outside git.
        launch: the backend's name and world size, part of the run's identity (`ddp2`).
    """

    path: Path
    run_id: str
    config_id: str
    code_id: str | None
    lineage: str
    timestamp: str
    git: GitInfo | None = attrs.field(repr=False)
    identity: Any = attrs.field(repr=False)
    launch: str = ""


def resolve_run(engine: Engine) -> RunInfo:
    """Compute the run's ids and directory; reads git and (main process) the attempt record, writes nothing."""
    cfg = engine.config
    identity = identity_config(engine)
    config_id = config_module.config_hash(identity)
    git = git_info()
    code_id = git.code_id if git is not None else None
    launch = f"{getattr(engine.backend, 'name', type(engine.backend).__name__)}{engine.backend.world_size}"
    run_id = cfg.run_id or "-".join(part for part in (code_id, config_id, launch) if part)
    folder = f"{cfg.lineage}-{code_id}" if code_id else cfg.lineage
    path = Path(cfg.workspace).expanduser().absolute() / folder / run_id
    timestamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if engine.backend.is_main:
        # Two attempts within one second (tests, fast crashes) must not share log files.
        used = {record.get("attempt") for record in read_attempts(path)}
        base, n = timestamp, 1
        while timestamp in used:
            n += 1
            timestamp = f"{base}-{n}"
    return RunInfo(path, run_id, config_id, code_id, cfg.lineage, timestamp, git, identity, launch)


def draw_seed(engine: Engine) -> int:
    """The seed for an engine whose config has none: the one an earlier attempt of this run
    recorded in `metadata/run.yaml` (so a retry reproduces it), else a fresh random one.

    Called on every rank; the engine broadcasts the main process's answer.
    """
    identity_config(engine)  # a bad run_config fails on every rank, leaving none waiting in the broadcast
    if not engine.backend.is_main:
        return 0
    try:
        info = engine.run_info
        recorded = yaml.safe_load((info.path / METADATA / RUN_FILE).read_text(encoding="utf-8"))
        seed = recorded.get("seed") if isinstance(recorded, dict) else None
    except (OSError, yaml.YAMLError):
        seed = None
    if isinstance(seed, int) and not isinstance(seed, bool):
        logger.info("seed %d: drawn by an earlier attempt of run %s, reused", seed, info.run_id)
        return seed
    return secrets.randbelow(2**31)


# --- writing ------------------------------------------------------------------------------------


def _write(path: Path, data: str | bytes) -> None:
    """Write through a temporary file and a rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(tmp, path)


def _dump(data: Any, *, sort_keys: bool = True) -> str:
    return yaml.dump(data, Dumper=config_module.Dumper, sort_keys=sort_keys, default_flow_style=False)


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _versions() -> dict[str, str]:
    from importlib import metadata

    import torch

    found = {"python": sys.version.split()[0], "torch": str(torch.__version__)}
    try:
        found["cadence"] = metadata.version("cadence")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        found["cadence"] = "unknown"
    return found


def write_metadata(engine: Engine, info: RunInfo) -> None:
    """Write `metadata/` (config, git, run.yaml). Main process only; raises OSError when unwritable."""
    meta = info.path / METADATA
    meta.mkdir(parents=True, exist_ok=True)
    canonical = config_module.canonical_yaml(info.identity)
    previous = meta / "config.canonical.yaml"
    if previous.exists() and previous.read_text(encoding="utf-8") != canonical:
        # Only possible with an explicit run_id: same folder, another config.
        logger.warning(
            "run %s: the config differs from the earlier attempt's; metadata/ now holds this one", info.run_id
        )
    header = "# The run config as it ran, defaults included (see config.canonical.yaml for the hash input).\n"
    _write(meta / "config.full.yaml", header + _dump(config_module.unstructure(engine.run_config), sort_keys=False))
    _write(previous, canonical)
    _write(meta / "config.diff.yaml", _dump(_identity_diff(info.identity)))
    timestamp = _now()
    if info.git is None:
        where = str(code_directory())
        git: dict[str, Any] = {"available": False, "reason": f"not in a git repository with commits: {where}",
                               "directory": where, "timestamp": timestamp}  # fmt: skip
    else:
        git = info.git.to_yaml_dict(timestamp)
    _write(meta / "git.yaml", _dump(git, sort_keys=False))
    diff_file = meta / "git.diff"
    if info.git is not None and info.git.dirty:
        _write(diff_file, info.git.diff)
    elif diff_file.exists():
        diff_file.unlink()
    backend = engine.backend
    run = {
        "run_id": info.run_id, "config_id": info.config_id, "code_id": info.code_id, "lineage": info.lineage,
        "path": str(info.path), "seed": engine.config.seed, "seed_drawn": engine.seed_was_drawn,
        "attempt": info.timestamp, "backend": getattr(backend, "name", type(backend).__name__),
        "world_size": backend.world_size, "host": socket.gethostname(), "command": list(sys.argv),
        "cwd": os.getcwd(), "versions": _versions(),
    }  # fmt: skip
    _write(meta / RUN_FILE, _dump(run, sort_keys=False))


def open_run_dir(engine: Engine) -> Path:
    """Resolve the run directory and, on the main process, create it, write its metadata and
    start recording this attempt (the engine's `RunRecorder`). Returns the path on every rank."""
    info = engine.run_info
    if engine.backend.is_main:
        try:
            lease.acquire(info.path, engine, info.timestamp)  # before any write: one live launch per directory
            write_metadata(engine, info)
        except OSError as exc:
            raise OSError(
                f"cannot write the run directory {info.path}: {exc.strerror or exc}; "
                "point EngineConfig.workspace (workspace=...) at a writable folder"
            ) from exc
        recorder = engine.callbacks.find(RunRecorder)
        if recorder is not None:
            recorder.start(engine)
    return info.path


def release_run_dir(engine: Engine) -> None:
    """Give up this engine's hold on its run directory's lease (`Engine.close`); a no-op where it holds none."""
    lease.release_all(engine)


# --- the attempt record -----------------------------------------------------------------------


def read_attempts(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of `metadata/attempts.jsonl`, oldest first ([] when there is none).

    A line cut short by a crash is skipped.
    """
    try:
        lines = (Path(run_dir) / METADATA / ATTEMPTS_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _preempted(engine: Engine) -> bool:
    return "preempt" in engine.requests.index and bool(engine.agreed("preempt"))


class RunRecorder(Callback):
    """Appends this attempt's state changes to `metadata/attempts.jsonl` (main process only).

    States: `created` (the run directory was opened outside a run), `running`
    (fit started, or a checkpoint was saved), `finished`, `failed` (with the
    error), `preempted`. Every engine registers one when it is built; it
    records nothing until `open_run_dir` starts it on the main process (an
    engine that never opens its run directory writes none), and a `running`
    record that repeats the last one at the same step is not written. It only
    listens to fit start, save, exception and teardown, never to per-step
    events. Order: just before `Order.PREEMPTION`, whose teardown may end the
    process.
    """

    order = Order.PREEMPTION - 1
    raises_requests = False

    def __init__(self) -> None:
        self.state_key = "cadence.RunRecorder"
        self.last: str | None = None
        self.last_step = -1
        self.started = False
        self.preempted = False

    def start(self, engine: Engine) -> None:
        """Begin recording (the run directory is open): `running` inside a run, else `created`."""
        self.started = True
        self.record(engine, "running" if engine.running else "created")

    def record(self, engine: Engine, state: str, **extra: Any) -> None:
        """Append one record of `state` (a no-op before `start`, or for a `running` that repeats the last)."""
        step = engine.state.step
        if not self.started or (state == "running" == self.last and step == self.last_step):
            return
        info = engine.run_info
        line = {
            "attempt": info.timestamp, "state": state, "time": _now(), "step": step,
            "epoch": engine.state.epoch, "host": socket.gethostname(), "pid": os.getpid(),
            "world_size": engine.backend.world_size, **extra,
        }  # fmt: skip
        best = _best_score(engine)
        if best is not None:
            line["best"] = best
        if (restarts := os.environ.get("TORCHELASTIC_RESTART_COUNT", "")).isdigit():  # torchrun --max-restarts
            line["torchelastic_restart_count"] = int(restarts)
        try:
            with open(info.path / METADATA / ATTEMPTS_FILE, "a", encoding="utf-8") as file:
                file.write(json.dumps(line, default=str) + "\n")
        except OSError as exc:  # a full or vanished disk must not stop training: the record is a courtesy
            logger.warning("run %s: cannot append to %s: %s", info.run_id, ATTEMPTS_FILE, exc)
        self.last, self.last_step = state, step

    def on_fit_start(self, engine: Engine) -> None:
        self.record(engine, "running")

    def on_save(self, engine: Engine) -> None:
        # Preemption agrees "preempt" and forces a save at that step: latch it, the loop may stop later.
        self.preempted = self.preempted or _preempted(engine)
        self.record(engine, "running")

    def on_exception(self, engine: Engine) -> None:
        exc = engine.exception
        if self.preempted or _preempted(engine) or "preempt" in type(exc).__name__.lower():
            self.record(engine, "preempted")
        elif isinstance(exc, SystemExit) and exc.code in (0, None):
            self.record(engine, "finished")
        else:
            self.record(engine, "failed", error=f"{type(exc).__name__}: {exc}"[:500])

    def on_teardown(self, engine: Engine) -> None:
        if self.last in ("running", "created"):
            self.record(engine, "preempted" if self.preempted or _preempted(engine) else "finished")


def _best_score(engine: Engine) -> dict[str, Any] | None:
    """The best score of the first callback that tracks one (the best-score protocol, `cadence.engine.callback.BestScore`)."""
    for callback in engine.callbacks:
        if isinstance(callback, BestScore):
            score = callback.best_score
            if isinstance(score, (int, float)) and not isinstance(score, bool):
                return {"metric": callback.best_metric, "value": float(score), "step": callback.best_step}
    return None
