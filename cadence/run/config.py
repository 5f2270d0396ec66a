"""Configuration: attrs classes from dicts and files, and back.

Every component owns an attrs class next to its code; this module turns user
input into those classes. Scalars are strict (``"3"`` is not an int, ``1`` is not
a bool) and every error names the dotted path, the expected type and the value
received, so a bad config fails before any process group starts. A config's
canonical YAML, its hash and its diff from the defaults (what a run directory
records) live here too. Command lines (``--config FILE`` and ``key=value``
overrides) are `cadence.run.config_cli`.

Example:
    >>> @attrs.define(kw_only=True)
    ... class Train:
    ...     steps: int = 100
    ...     lr: float = 3e-4
    >>> structure(Train, {"steps": 5, "lr": 1e-3})
    Train(steps=5, lr=0.001)
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import re
import sys
import types
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import attrs
import cattrs
import yaml
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn

__all__ = [
    "ConfigError", "canonical_yaml", "config_diff", "config_hash", "converter",
    "load_file", "merge", "structure", "unstructure",
]  # fmt: skip

T = TypeVar("T")
NONE = type(None)
MISSING: Any = object()
_SEQUENCES: dict[Any, type] = {list: list, MutableSequence: list, Sequence: tuple, tuple: tuple}
MAPPINGS: tuple[Any, ...] = (dict, Mapping, MutableMapping)


class ConfigError(ValueError):
    """A configuration value is wrong; the message says where, what and how to fix it.

    Attributes:
        path: Dotted path of the offending value (``""`` when not about one value).
        expected: What was expected there, or None.
        received: The value received, or None.
    """

    def __init__(self, message: str, *, path: str = "", expected: str | None = None, received: Any = None) -> None:
        super().__init__(message)
        self.path, self.expected, self.received = path, expected, received

    def __reduce__(self) -> Any:
        # Keyword-only fields would be lost when the error crosses a process boundary.
        return _rebuild_error, (str(self), self.path, self.expected, self.received)


def _rebuild_error(message: str, path: str, expected: str | None, received: Any) -> ConfigError:
    return ConfigError(message, path=path, expected=expected, received=received)


class _MismatchError(TypeError):
    """Raised by the strict hooks; carries what was expected and what was received."""

    def __init__(self, expected: str, value: Any) -> None:
        super().__init__(f"expected {expected}, got {value!r} ({type(value).__name__})")
        self.expected, self.value = expected, value


def type_origin(t: Any) -> Any:
    return get_origin(t) or t


def is_enum(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, Enum)


def is_union(t: Any) -> bool:
    return get_origin(t) in (Union, types.UnionType)


def type_name(t: Any) -> str:
    """Readable annotation: ``list[str]``, ``int | None``, ``'fp32' | 'bf16'``."""
    origin, args = get_origin(t), get_args(t)
    if t is Any or t is None or t is NONE:
        return "Any" if t is Any else "None"
    if origin is Literal or is_enum(t):
        return " | ".join(repr(getattr(a, "value", a)) for a in (args or t))
    if is_union(t):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', origin)}[{inner}]" if args else origin.__name__
    return t.__name__ if isinstance(t, type) else str(t)


class ConfigLoader(yaml.SafeLoader):
    """Safe YAML that also reads ``1e5`` and ``3e-4`` as floats, like JSON, TOML and YAML 1.2.

    A key given twice in one mapping is an error (PyYAML keeps the last one silently).
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` entries may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                first = seen.setdefault(key, key_node.start_mark.line)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first != key_node.start_mark.line:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r} (first on line {first + 1}); give each key once",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)  # type: ignore[no-untyped-call]


class Dumper(yaml.SafeDumper):
    """Safe YAML dumper that quotes the *string* ``"1e5"`` so `ConfigLoader` reads it back as str."""


for _yaml_cls in (ConfigLoader, Dumper):
    _yaml_cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )


# --- structure hooks: strict scalars, and containers that keep per-item paths -------------


def _structure_choice(value: Any, t: Any) -> Any:
    """Literal[...] and Enum (by value); ``True`` never matches ``1``."""
    choices = list(get_args(t) or t)
    for choice in choices:
        plain = getattr(choice, "value", choice)
        if value is choice or (type(value) is type(plain) and value == plain):
            return choice
    raise _MismatchError("one of " + ", ".join(repr(getattr(c, "value", c)) for c in choices), value)


def _strict(expected: str, accepts: Callable[[Any], bool]) -> Callable[[Any, type], Any]:
    def hook(value: Any, cl: type) -> Any:
        if is_enum(cl):  # IntEnum/StrEnum land here: cattrs dispatches on the MRO first
            return _structure_choice(value, cl)
        if not accepts(value):
            raise _MismatchError(expected, value)
        return cl(value)

    return hook


def _structure_items(t: Any, items: Any) -> list[Any]:
    """Structure ``(index, type, value)`` triples, collecting errors the way cattrs does."""
    out, errors = [], []
    for index, item_type, value in items:
        try:
            out.append(converter.structure(value, item_type))
        except Exception as exc:
            note = IterableValidationNote(f"Structuring {t} @ index {index!r}", index, item_type)
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
            errors.append(exc)
    if errors:
        raise IterableValidationError(f"While structuring {t!r}", errors, t)
    return out


def _sequence_hook(t: Any) -> Callable[[Any, Any], Any]:
    origin, args = type_origin(t), get_args(t)
    fixed = origin is tuple and bool(args) and args[-1] is not Ellipsis

    def hook(value: Any, _: Any) -> Any:
        # cattrs alone would iterate a string's characters or a mapping's keys.
        if not isinstance(value, (list, tuple)):
            raise _MismatchError(f"a list ({type_name(t)})", value)
        if fixed and len(value) != len(args):
            raise _MismatchError(f"{len(args)} items ({type_name(t)})", value)
        item_types = args if fixed else [args[0] if args else Any] * len(value)
        return _SEQUENCES[origin](_structure_items(t, [(i, item_types[i], v) for i, v in enumerate(value)]))

    return hook


def _mapping_hook(t: Any) -> Callable[[Any, Any], Any]:
    key_type, value_type = get_args(t) or (Any, Any)

    def hook(value: Any, _: Any) -> dict[Any, Any]:
        if not isinstance(value, Mapping):
            raise _MismatchError(f"a mapping ({type_name(t)})", value)
        keys = _structure_items(t, ((k, key_type, k) for k in value))
        values = _structure_items(t, ((k, value_type, v) for k, v in value.items()))
        return dict(zip(keys, values, strict=True))

    return hook


def _union_hook(t: Any) -> Callable[[Any, Any], Any]:
    members = [a for a in get_args(t) if a is not NONE]
    nullable = len(members) < len(get_args(t))

    def hook(value: Any, _: Any) -> Any:
        if value is None and nullable:
            return None
        if len(members) == 1:  # Optional[X]: nested errors keep their own path
            try:
                return converter.structure(value, members[0])
            except _MismatchError:
                raise _MismatchError(type_name(t), value) from None
        # An exact type match wins, so `float | int` keeps an int an int.
        for member in [m for m in members if m is type(value)] + members:
            try:
                return converter.structure(value, member)
            except Exception:  # the next member may fit
                continue
        raise _MismatchError(type_name(t), value)

    return hook


def _attrs_hook(cl: type) -> Callable[[Any, Any], Any]:
    attrs.resolve_types(cl)  # classes written with `from __future__ import annotations`
    inner: Callable[[Any, Any], Any] = make_dict_structure_fn(
        cl, converter, _cattrs_forbid_extra_keys=True, _cattrs_detailed_validation=True
    )

    def hook(value: Any, t: Any) -> Any:
        if isinstance(value, cl):  # already built, hence already validated
            return value
        if not isinstance(value, Mapping):
            raise _MismatchError(f"a mapping ({cl.__name__})", value)
        return inner(value, t)

    return hook


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    number = (int, float)
    conv.register_structure_hook(int, _strict("int", lambda v: isinstance(v, int) and not isinstance(v, bool)))
    conv.register_structure_hook(float, _strict("float", lambda v: isinstance(v, number) and not isinstance(v, bool)))
    conv.register_structure_hook(bool, _strict("bool", lambda v: isinstance(v, bool)))
    conv.register_structure_hook(str, _strict("str", lambda v: isinstance(v, str)))
    conv.register_structure_hook(Path, _strict("a path (str)", lambda v: isinstance(v, (str, os.PathLike))))
    conv.register_structure_hook_func(lambda t: is_enum(t) or get_origin(t) is Literal, _structure_choice)
    conv.register_structure_hook_factory(lambda t: type_origin(t) in _SEQUENCES, _sequence_hook)
    conv.register_structure_hook_factory(lambda t: type_origin(t) in MAPPINGS, _mapping_hook)
    conv.register_structure_hook_factory(is_union, _union_hook)
    conv.register_structure_hook_factory(lambda t: isinstance(t, type) and attrs.has(t), _attrs_hook)
    conv.register_unstructure_hook(Path, str)
    conv.register_unstructure_hook_factory(
        lambda t: type_origin(t) in (tuple, Sequence),
        lambda _: lambda value: [conv.unstructure(v) for v in value],
    )
    return conv


converter: cattrs.Converter = _make_converter()
"""The strict converter behind `structure` and `unstructure`; register extra hooks here."""


# --- cattrs exception trees -> one ConfigError ----------------------------------------------


def _join(prefix: str, parts: Sequence[Any]) -> str:
    out = prefix
    for part in parts:
        if isinstance(part, str) and re.fullmatch(r"[\w-]+", part):
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out or "<root>"


def _lookup(data: Any, parts: Sequence[Any]) -> Any:
    for part in parts:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def init_fields(cl: type) -> dict[str, Any]:
    attrs.resolve_types(cl)
    return {a.name: a for a in attrs.fields(cl) if a.init}


def field_default(a: Any) -> Any:
    default = a.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return MISSING if default.takes_self else default.factory()
    return MISSING if default is attrs.NOTHING else default


def unknown_key(cl: type, key: str, path: str, received: Any) -> ConfigError:
    valid = sorted(init_fields(cl))
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    message = f"unknown key; valid keys are: {', '.join(valid)}{hint}"
    return ConfigError(message, path=path, expected="one of: " + ", ".join(valid), received=received)


def _failed_validator(cl: type, raw: Any, path: tuple[Any, ...], exc: Exception, prefix: str) -> ConfigError:
    """Find the field whose attrs validator failed by running each validator again."""
    for name, a in init_fields(cl).items() if isinstance(raw, Mapping) else ():
        try:
            value = converter.structure(raw[name], a.type) if name in raw else field_default(a)
        except Exception:  # a structuring problem is reported on its own
            continue
        try:
            if a.validator is not None and value is not MISSING:
                a.validator(None, a, value)  # type: ignore[arg-type]
        except (ValueError, TypeError) as found:
            reason = found.args[0] if found.args else str(found)
            message = f"invalid value {value!r} ({type(value).__name__}): {reason}"
            return ConfigError(message, path=_join(prefix, (*path, name)), expected=str(reason), received=value)
        except Exception:  # a validator that needs a real instance
            continue
    # No single field to blame: a cross-field check such as __attrs_post_init__.
    return ConfigError(f"invalid {cl.__name__}: {exc}", path=_join(prefix, path), received=raw)


def _problems(exc: Exception, data: Any, prefix: str, path: tuple[Any, ...] = (), t: Any = None) -> list[ConfigError]:
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        found: list[ConfigError] = []
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            step = note.name if isinstance(note, AttributeValidationNote) else note.index
            found += _problems(sub, data, prefix, (*path, step), note.type)
        for sub in without:
            if isinstance(sub, ForbiddenExtraKeysError):
                for key in sorted(sub.extra_fields):
                    at = (*path, key)
                    found.append(unknown_key(sub.cl, key, _join(prefix, at), _lookup(data, at)))
            elif isinstance(exc, ClassValidationError):
                found.append(_failed_validator(exc.cl, _lookup(data, path), path, sub, prefix))
            else:
                found += _problems(sub, data, prefix, path, exc.cl)
        return found
    where, expected = _join(prefix, path), (None if t is None else type_name(t))
    if isinstance(exc, _MismatchError):
        return [ConfigError(str(exc), path=where, expected=exc.expected, received=exc.value)]
    if isinstance(exc, KeyError):
        return [ConfigError(f"required key missing (expected {expected})", path=where, expected=expected)]
    received = _lookup(data, path)
    message = f"{exc}; got {received!r} ({type(received).__name__})"
    return [ConfigError(message, path=where, expected=expected, received=received)]


def config_error(problems: list[ConfigError]) -> ConfigError:
    first, rest = problems[0], problems[1:]
    message = f"config error at '{first.path}': {first}"
    if rest:
        message += f" (and {len(rest)} more: " + "; ".join(f"'{p.path}': {p}" for p in rest) + ")"
    return ConfigError(message, path=first.path, expected=first.expected, received=first.received)


# --- public API -----------------------------------------------------------------------------


def structure(cls: type[T], data: Any, *, path: str = "") -> T:
    """Build ``cls`` from plain data, strictly.

    Args:
        cls: An attrs class (or any type the converter handles).
        data: Plain data, usually a dict.
        path: Dotted prefix for error messages, e.g. ``"callbacks[2]"``.

    Raises:
        ConfigError: Naming the first problem; the message lists every problem.
    """
    try:
        return converter.structure(data, cls)
    except ConfigError:
        raise
    except Exception as exc:
        raise config_error(_problems(exc, data, path)) from exc


def unstructure(obj: Any) -> dict[str, Any]:
    """Turn a config into plain JSON/YAML-safe data (Paths as str, enums as values)."""
    data = plain_value(converter.unstructure(obj))
    if not isinstance(data, dict):
        raise TypeError(f"expected an attrs instance or a mapping, got {type(obj).__name__}")
    return data


def plain_value(value: Any) -> Any:
    """Normalize what hides behind ``Any`` fields, which cattrs passes through as is."""
    if isinstance(value, Mapping):
        return {k: plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if isinstance(value, Enum):
        return plain_value(value.value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return plain_value(converter.unstructure(value)) if attrs.has(type(value)) else value


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``.yaml``/``.yml``, ``.toml`` or ``.json`` config file into a dict.

    Raises:
        ConfigError: The file is missing, unreadable, malformed or not a mapping.
    """
    file, suffix = Path(path), Path(path).suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise ConfigError(f"config file '{file}': unknown extension '{suffix}'; use .yaml, .toml or .json")
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file '{file}' cannot be read: {exc.strerror or exc}") from exc
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            data = yaml.load(text, Loader=ConfigLoader) or {}  # ConfigLoader is a SafeLoader
    except (yaml.YAMLError, ValueError) as exc:  # JSON and TOML decode errors are ValueErrors
        reason = " ".join(str(exc).split())
        raise ConfigError(f"config file '{file}' is not valid {suffix[1:].upper()}: {reason}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{file}': top level must be a mapping, got {type(data).__name__}")
    return data


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}; give each key once")
        result[key] = value
    return result


def merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge two dicts: ``update`` wins, nested mappings merge, inputs stay untouched."""
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def canonical_yaml(obj: Any) -> str:
    """Dump the config as deterministic YAML (sorted keys, plain types): the input to hashing.

    An attrs instance is first re-validated through its class, so ``lr=1`` and
    ``lr=1.0`` on a float field give the same text.

    Raises:
        ConfigError: ``obj`` holds a value its class does not accept.
    """
    if attrs.has(type(obj)):
        obj = structure(type(obj), unstructure(obj))
    # ASCII only: PyYAML writes some code points (e.g. U+0085) raw and then reads them back as line breaks.
    return yaml.dump(unstructure(obj), Dumper=Dumper, sort_keys=True, default_flow_style=False, allow_unicode=False)


def config_hash(obj: Any, length: int = 10) -> str:
    """First ``length`` hex characters of the sha256 of `canonical_yaml`."""
    return hashlib.sha256(canonical_yaml(obj).encode("utf-8")).hexdigest()[:length]


def config_diff(obj: Any, default: Any = None) -> dict[str, Any]:
    """Nested dict of the leaves of ``obj`` that differ from ``default`` (``type(obj)()``).

    Lists are leaves; a dict that lost keys is reported whole.

    Raises:
        TypeError: ``default`` is None and ``type(obj)`` has required fields.
    """
    if default is None:
        try:
            default = type(obj)()
        except TypeError as exc:
            raise TypeError(f"{type(obj).__name__} has required fields; pass default=") from exc
    return _diff(unstructure(obj), unstructure(default))


def _diff(new: Mapping[str, Any], old: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in new.items():
        before = old.get(key, MISSING)
        if isinstance(value, dict) and isinstance(before, dict) and before.keys() <= value.keys():
            if nested := _diff(value, before):
                out[key] = nested
        # type() and repr() so that 1 vs 1.0 and True vs 1 differ and nan equals nan.
        elif type(value) is not type(before) or (value != before and repr(value) != repr(before)):
            out[key] = value
    return out


def configure(cls: type[T], config: Any, kwargs: Mapping[str, Any], path: str) -> T:
    """A component's config from `config=` (an instance or a mapping) and keyword arguments.

    Every built-in callback takes `Callback(config=...)` or `Callback(**fields)`;
    a mapping and keyword arguments merge (keywords win), an instance must come
    alone. Errors name `path` (the component) and the field.

    Example:
        >>> import attrs
        >>> @attrs.define
        ... class ClipConfig:
        ...     max_norm: float = 1.0
        >>> configure(ClipConfig, {"max_norm": 2}, {}, "grad_clip")
        ClipConfig(max_norm=2.0)
    """
    if isinstance(config, cls):
        if kwargs:
            raise TypeError(f"{path}: pass config= or keyword arguments, not both (got {sorted(kwargs)})")
        return config
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"{path}: config must be a {cls.__name__} or a mapping, got {type(config).__name__}")
    return structure(cls, {**(config or {}), **kwargs}, path=path)
