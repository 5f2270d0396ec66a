"""Find backends and callbacks by name without importing them up front.

The engine never imports a concrete backend or callback: built-ins are listed
here as `module:attribute` strings, third-party packages add theirs through
entry points (`cadence.backends`, `cadence.callbacks`), and anything can also be
named directly as `module:attribute`.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import sys
from collections.abc import Mapping
from importlib import metadata
from typing import Any, NamedTuple


class Registry:
    """Names -> `module:attribute` targets, resolved lazily."""

    def __init__(self, kind: str, group: str, builtins: dict[str, str]) -> None:
        self.kind, self.group = kind, group
        self._builtins = dict(builtins)
        self._added: dict[str, str] = {}

    @property
    def builtins(self) -> dict[str, str]:
        """The built-in names and their targets (a copy)."""
        return dict(self._builtins)

    def add(self, name: str, target: str) -> None:
        """Register `name` -> `module:attribute`."""
        self._added[name] = target

    def entry_points(self) -> dict[str, metadata.EntryPoint]:
        return {ep.name: ep for ep in metadata.entry_points(group=self.group)}

    def names(self) -> dict[str, str]:
        """Every known name with its target (built-ins, added, entry points)."""
        found = dict(self._builtins)
        found.update(self._added)
        for name, ep in self.entry_points().items():
            found.setdefault(name, ep.value)
        return found

    def resolve(self, name: str) -> Any:
        """The object a name (or a `module:attribute` string) stands for."""
        known = self.names()
        target = known.get(name)
        if target is None and ":" in name:
            target = name
        if target is None:
            raise UnknownNameError(self.unknown(name, known))
        return load_target(target, what=f"{self.kind} {name!r}")

    def unknown(self, name: str, known: Mapping[str, str] | None = None) -> str:
        """Why `name` names nothing here: the closest known name, then every one."""
        known = self.names() if known is None else known
        close = difflib.get_close_matches(str(name), list(known), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return (
            f"unknown {self.kind} {name!r}; {hint}known {self.kind}s: {', '.join(sorted(known)) or 'none'} "
            "(or name one as 'module:Class')"
        )

    def is_known(self, name: str) -> bool:
        """Whether `name` is a known name or a `module:attribute` string (not imported)."""
        return name in self.names() or ":" in name


class UnknownNameError(KeyError):
    """A name no built-in, added name or entry point stands for; the message lists those that do."""

    def __str__(self) -> str:
        # KeyError would print the message quoted, as a key.
        return str(self.args[0]) if self.args else ""


def load_target(target: str, *, what: str) -> Any:
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{what}: cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attribute.split(".") if attribute else ():
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{what}: module {module_name!r} has no attribute {attribute!r}") from None
    return obj


backends = Registry(
    "backend",
    "cadence.backends",
    {
        "local": "cadence.backends.local:LocalBackend",
        "ddp": "cadence.backends.ddp:DDPBackend",
        "deepspeed": "cadence.backends.deepspeed:DeepSpeedBackend",
        "mesh": "cadence.backends.mesh:MeshBackend",
    },
)

callbacks = Registry(
    "callback",
    "cadence.callbacks",
    {
        "checkpoint": "cadence.callbacks.checkpoint:Checkpoint",
        "lr_scheduler": "cadence.callbacks.scheduler:LRScheduler",
        "non_finite_skip": "cadence.callbacks.non_finite:NonFiniteSkip",
        "grad_clip": "cadence.callbacks.grad_clip:GradClip",
        "ema": "cadence.callbacks.ema:EMA",
        "early_stopping": "cadence.callbacks.early_stopping:EarlyStopping",
        "garbage_collection": "cadence.callbacks.garbage_collection:GarbageCollection",
        "heartbeat": "cadence.callbacks.heartbeat:Heartbeat",
        "preemption": "cadence.callbacks.preemption:Preemption",
        "time_budget": "cadence.callbacks.time_budget:TimeBudget",
        "collective_guard": "cadence.callbacks.collective_guard:CollectiveGuard",
        "train_metrics": "cadence.callbacks.metrics:TrainMetrics",
        "progress_bar": "cadence.callbacks.progress:ProgressBar",
        "tensorboard": "cadence.callbacks.tensorboard:TensorBoard",
        "wandb": "cadence.callbacks.wandb:WandB",
        "jsonl": "cadence.callbacks.jsonl:JSONL",
        "text_log": "cadence.callbacks.text_log:TextLog",
        "profiler": "cadence.callbacks.profiler:Profiler",
        "metric_updates": "cadence.callbacks.metric_updates:MetricUpdates",
        "prediction_writer": "cadence.callbacks.prediction_writer:PredictionWriter",
    },
)


def require(module: str, extra: str) -> Any:
    """Import an optional dependency or fail naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module!r} is needed here but is not installed; install it with: pip install 'cadence[{extra}]'"
        ) from exc


# -- third-party callbacks ------------------------------------------------------


class CallbackInfo(NamedTuple):
    """One callback name that a config can use, and where it comes from."""

    name: str
    target: str  #: `module:attribute`
    package: str  #: the distribution that provides it
    version: str | None


def discover(group: str = "cadence.callbacks") -> list[CallbackInfo]:
    """Callbacks that installed packages publish under an entry-point group.

    Discovery only lists them: a discovered callback runs only when a config
    or a script names it.

    Example:
        >>> [info.name for info in discover("cadence.no-such-group")]
        []
    """
    found = []
    for ep in metadata.entry_points(group=group):
        dist = getattr(ep, "dist", None)
        package = dist.metadata["Name"] if dist is not None else ep.value.partition(":")[0].split(".")[0]
        found.append(CallbackInfo(ep.name, ep.value, package, dist.version if dist is not None else None))
    return sorted(found)


def describe_callbacks() -> list[CallbackInfo]:
    """Every callback name a config can use: built-ins, added names, then discovered ones.

    An entry point whose name a built-in already uses is left out: the built-in wins.

    Example:
        >>> "checkpoint" in [info.name for info in describe_callbacks()]
        True
    """
    from cadence import __version__

    rows = [CallbackInfo(name, target, "cadence", __version__) for name, target in sorted(callbacks._builtins.items())]
    rows += [CallbackInfo(name, t, t.split(".")[0], None) for name, t in sorted(callbacks._added.items())]
    seen = {row.name for row in rows}
    rows += [info for info in discover(callbacks.group) if info.name not in seen]
    return rows


def build_callback(spec: str | Mapping[str, Any], *, path: str = "callback") -> Any:
    """Build a callback from a config entry: `{"name": ..., **arguments}`, or just the name.

    The name is a built-in name, an entry-point name (group `cadence.callbacks`)
    or `module:Class` (from Python code, the class itself). When the class has an attrs config (a `Config` or
    `config_class` class attribute, or `<Class>Config` in its module), the
    arguments that are its fields are structured into it (errors name the dotted
    path) and passed as `config=` when the class takes one; other arguments are
    passed as keywords. A `state_key` entry sets the instance's key when the
    class does not take it itself.

    Raises:
        ConfigError: the entry is malformed, its name is unknown (the message
            lists the known names), or its arguments do not fit the class.

    Example:
        >>> cb = build_callback({"name": "cadence.engine.callback:Callback", "state_key": "mine"})
        >>> cb.state_key
        'mine'
    """
    from cadence.run.config import ConfigError

    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"{path}: a callback entry is a name or a mapping with a 'name' key, got {type(spec).__name__}",
            path=path,
            expected="str | mapping",
            received=spec,
        )
    arguments = dict(spec)
    name = arguments.pop("name", None)
    if isinstance(name, type):  # from Python code: the class itself
        target, name = name, name.__qualname__
    elif not isinstance(name, str) or not name:
        raise ConfigError(
            f"{path}.name: name the callback (a built-in name, an entry-point name or 'module:Class'), got {name!r}",
            path=f"{path}.name",
            expected="str",
            received=name,
        )
    else:
        try:
            target = callbacks.resolve(name)
        except UnknownNameError as exc:
            raise ConfigError(
                f"{path}.name: {exc}", path=f"{path}.name", expected="a known callback name", received=name
            ) from None
    if not callable(target):
        raise ConfigError(
            f"{path}.name: {name!r} resolves to {target!r}, which is not a class or factory",
            path=f"{path}.name",
            received=name,
        )
    # `state_key` goes to the class only when it names that parameter (not through **kwargs).
    named = _parameters(target)
    state_key = arguments.pop("state_key", None) if named is None or "state_key" not in named else None
    arguments = _with_config(target, arguments, path)
    _check_arguments(target, arguments, name, path)
    callback = target(**arguments)
    if state_key is not None:
        callback.state_key = state_key
    return callback


def config_class(cls: Any) -> type | None:
    """The attrs config class of a callback class, or None."""
    import attrs

    for attribute in ("Config", "config_class", "config"):
        candidate = getattr(cls, attribute, None)
        if isinstance(candidate, type) and attrs.has(candidate):
            return candidate
    module = sys.modules.get(getattr(cls, "__module__", ""), None)
    candidate = getattr(module, f"{getattr(cls, '__name__', '')}Config", None)
    return candidate if isinstance(candidate, type) and attrs.has(candidate) else None


def _parameters(target: Any) -> dict[str, inspect.Parameter] | None:
    """Keyword parameters of a callable; None when it takes **kwargs (anything goes)."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {n: p for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _accepts(target: Any, name: str) -> bool:
    params = _parameters(target)
    return params is None or name in params


def _with_config(target: Any, arguments: dict[str, Any], path: str) -> dict[str, Any]:
    """Structure the arguments that belong to the target's attrs config."""
    import attrs

    from cadence.run.config import structure

    cls = config_class(target) if isinstance(target, type) else None
    if cls is None:
        return arguments
    fields = {a.alias for a in attrs.fields(cls) if a.init}
    given = arguments.pop("config", None) if isinstance(arguments.get("config"), Mapping) else None
    data = dict(given or {})
    data.update({k: arguments.pop(k) for k in list(arguments) if k in fields and k not in data})
    if _accepts(target, "config") and (given is not None or data):
        arguments["config"] = structure(cls, data, path=path)
    elif data:  # keyword-argument style: validate through the config, pass the structured values
        config: Any = structure(cls, data, path=path)
        arguments.update({a.alias: getattr(config, a.name) for a in attrs.fields(cls) if a.alias in data})
    return arguments


def _check_arguments(target: Any, arguments: dict[str, Any], name: str, path: str) -> None:
    from cadence.run.config import ConfigError

    params = _parameters(target)
    if params is None:
        return
    unknown = sorted(set(arguments) - set(params))
    if unknown:
        raise ConfigError(
            f"{path}.{unknown[0]}: callback {name!r} takes no argument {unknown[0]!r}; it takes: {', '.join(sorted(params)) or 'none'}",
            path=f"{path}.{unknown[0]}",
            received=arguments[unknown[0]],
        )
    missing = [n for n, p in params.items() if p.default is p.empty and n not in arguments]
    if missing:
        raise ConfigError(
            f"{path}: callback {name!r} needs the argument(s) {', '.join(missing)}",
            path=f"{path}.{missing[0]}",
            expected="a value",
        )
