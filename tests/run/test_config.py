"""Tests for cadence.run.config (strict structuring, errors, files, hashing) and config_cli (overrides, CLI)."""

# Postponed annotations on purpose: the config module must resolve string annotations.
from __future__ import annotations

import enum
import json
import pickle
from pathlib import Path
from typing import Any, Literal, Optional

import attrs
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence.engine.data import DataConfig
from cadence.engine.engine import EngineConfig, EvalSetConfig
from cadence.run.config import (
    ConfigError,
    canonical_yaml,
    config_diff,
    config_hash,
    converter,
    load_file,
    merge,
    structure,
    unstructure,
)
from cadence.run.config_cli import build, field_help, parse_cli, parse_overrides

pytestmark = pytest.mark.timeout(30)


class Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


@attrs.define(kw_only=True)
class Optim:
    """Optimizer settings.

    Attributes:
        lr: Peak learning
            rate, after warmup.
        betas: Adam betas.
    """

    lr: float = attrs.field(default=1e-3, validator=attrs.validators.gt(0))
    betas: tuple[float, float] = (0.9, 0.999)


@attrs.define(kw_only=True)
class Split:
    batch_size: int = attrs.field(default=8, metadata={"help": "Samples per step."})
    shuffle: bool = True


@attrs.define(kw_only=True)
class Data:
    root: Path = Path("data")
    train: Split = attrs.field(factory=Split)
    val: Split = attrs.field(factory=lambda: Split(batch_size=16, shuffle=False))


@attrs.define(kw_only=True)
class Every:
    every: int = 1
    name: str = "log"


@attrs.define(kw_only=True)
class Train:
    """A training run.

    Attributes:
        steps: Optimizer steps to run.
        tags (list[str]): Free-form labels.
    """

    steps: int = 100
    epochs: int | None = None
    precision: Literal["fp32", "bf16"] = "fp32"
    tags: list[str] = attrs.field(factory=list)
    counts: dict[str, int] = attrs.field(factory=dict)
    compile: bool = False
    mode: Mode = Mode.FAST
    note: Optional[str] = None  # noqa: UP045 - typing.Optional must work too
    optim: Optim = attrs.field(factory=lambda: Optim(lr=0.1))
    data: Data = attrs.field(factory=Data)
    callbacks: list[Every] = attrs.field(factory=list)
    extra: Any = None


@attrs.define(kw_only=True)
class Required:
    name: str
    steps: int = 1


def config_error(cls: type, data: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        structure(cls, data)
    return info.value


# --- structuring and errors ----------------------------------------------------------------


def test_empty_mapping_gives_the_class_defaults() -> None:
    assert structure(Train, {}) == Train()
    assert build(Train) == Train()


def test_wrong_type_names_path_expected_type_and_value() -> None:
    err = config_error(Train, {"steps": "abc"})
    assert str(err) == "config error at 'steps': expected int, got 'abc' (str)"
    assert (err.path, err.expected, err.received) == ("steps", "int", "abc")


def test_unknown_key_lists_valid_keys_and_suggests_a_close_match() -> None:
    err = config_error(Train, {"stepz": 5})
    assert err.path == "stepz"
    assert err.received == 5
    assert "unknown key; valid keys are: callbacks, compile, counts" in str(err)
    assert "did you mean 'steps'?" in str(err)


@pytest.mark.parametrize(
    ("data", "path", "expected"),
    [
        ({"steps": True}, "steps", "int"),
        ({"steps": 3.0}, "steps", "int"),
        ({"steps": "3"}, "steps", "int"),
        ({"compile": 1}, "compile", "bool"),
        ({"compile": "true"}, "compile", "bool"),
        ({"optim": {"lr": "0.1"}}, "optim.lr", "float"),
        ({"optim": {"lr": False}}, "optim.lr", "float"),
        ({"callbacks": [{"name": 3}]}, "callbacks[0].name", "str"),
        ({"tags": "abc"}, "tags", "a list (list[str])"),
        ({"epochs": "x"}, "epochs", "int | None"),
        ({"data": {"root": 3}}, "data.root", "a path (str)"),
        ({"optim": 0.1}, "optim", "a mapping (Optim)"),
    ],
)
def test_scalars_are_strict(data: dict[str, Any], path: str, expected: str) -> None:
    err = config_error(Train, data)
    assert (err.path, err.expected) == (path, expected)
    assert f"config error at '{path}': expected {expected}, got {err.received!r}" in str(err)


def test_float_field_accepts_an_int_and_stores_a_float() -> None:
    lr = structure(Train, {"optim": {"lr": 2}}).optim.lr
    assert lr == 2.0
    assert type(lr) is float


def test_bad_literal_lists_the_allowed_values() -> None:
    err = config_error(Train, {"precision": "fp16"})
    assert err.path == "precision"
    assert "expected one of 'fp32', 'bf16', got 'fp16' (str)" in str(err)


def test_enum_is_structured_by_value_and_errors_list_values() -> None:
    assert structure(Train, {"mode": "safe"}).mode is Mode.SAFE
    err = config_error(Train, {"mode": "SAFE"})
    assert "expected one of 'fast', 'safe', got 'SAFE' (str)" in str(err)


def test_attrs_validator_failure_names_the_field_path() -> None:
    err = config_error(Train, {"optim": {"lr": -1.0}})
    assert err.path == "optim.lr"
    assert err.received == -1.0
    assert "config error at 'optim.lr'" in str(err)
    assert "-1.0 (float)" in str(err)
    assert "must be > 0" in str(err)


def test_nested_error_path() -> None:
    err = config_error(Train, {"data": {"train": {"batch_size": "big"}}})
    assert err.path == "data.train.batch_size"
    assert "expected int, got 'big' (str)" in str(err)


def test_list_index_in_path() -> None:
    err = config_error(Train, {"callbacks": [{"every": 2}, {"every": "often"}]})
    assert err.path == "callbacks[1].every"
    err = config_error(Train, {"callbacks": [{}, {}, {"evry": 5}]})
    assert err.path == "callbacks[2].evry"
    assert "did you mean 'every'?" in str(err)


def test_tuple_length_and_dict_values_are_checked() -> None:
    assert "expected 2 items" in str(config_error(Train, {"optim": {"betas": [0.9]}}))
    assert config_error(Train, {"counts": {"a": 1, "b": "x"}}).path == "counts.b"


def test_every_problem_is_in_one_message() -> None:
    err = config_error(Train, {"steps": "x", "compile": 2, "bogus": 1})
    assert err.path == "steps"
    for path in ("steps", "compile", "bogus"):
        assert f"'{path}'" in str(err)


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@attrs.define(kw_only=True)
class Unions:
    level: Level = Level.LOW
    either: int | str = 0
    number: float | int = 0
    choice: Literal[1, 2] = 1


def test_int_enums_unions_and_int_literals_stay_strict() -> None:
    cfg = structure(Unions, {"level": 2, "either": "x", "number": 3, "choice": 2})
    assert cfg == Unions(level=Level.HIGH, either="x", number=3, choice=2)
    assert type(cfg.number) is int  # the exact member type wins over float's int coercion
    assert config_error(Unions, {"level": True}).path == "level"
    assert config_error(Unions, {"choice": True}).expected == "one of 1, 2"
    assert config_error(Unions, {"either": 1.5}).expected == "int | str"
    assert unstructure(Unions(level=Level.HIGH)) == {"level": 2, "either": 0, "number": 0, "choice": 1}


def test_missing_required_key() -> None:
    err = config_error(Required, {})
    assert (err.path, err.expected) == ("name", "str")
    assert "required key missing" in str(err)


def test_structure_prefixes_paths() -> None:
    with pytest.raises(ConfigError, match=r"'callbacks\[2\]\.every'"):
        structure(Every, {"every": "x"}, path="callbacks[2]")


def test_unstructure_gives_plain_types() -> None:
    cfg = Train(mode=Mode.SAFE, data=Data(root=Path("/tmp/x")), extra=(1, Path("p")))
    data = unstructure(cfg)
    assert data["mode"] == "safe"
    assert data["data"]["root"] == "/tmp/x"
    assert data["optim"]["betas"] == [0.9, 0.999]
    assert data["extra"] == [1, "p"]
    assert converter.unstructure(cfg)["optim"]["betas"] == [0.9, 0.999]


def test_config_error_survives_pickling() -> None:
    err = config_error(Train, {"steps": "x"})
    copy = pickle.loads(pickle.dumps(err))
    assert (str(copy), copy.path, copy.expected, copy.received) == (
        str(err),
        "steps",
        "int",
        "x",
    )


# --- files ----------------------------------------------------------------------------------

FILE_TEXT = {
    "yaml": "steps: 5\noptim:\n  lr: 3e-4\n  betas: [0.8, 0.9]\ntags: [a, b]\n"
    "data:\n  root: /d\n  train: {batch_size: 4}\n",
    "toml": 'steps = 5\ntags = ["a", "b"]\n[optim]\nlr = 3e-4\nbetas = [0.8, 0.9]\n'
    '[data]\nroot = "/d"\n[data.train]\nbatch_size = 4\n',
    "json": json.dumps(
        {
            "steps": 5,
            "optim": {"lr": 3e-4, "betas": [0.8, 0.9]},
            "tags": ["a", "b"],
            "data": {"root": "/d", "train": {"batch_size": 4}},
        }
    ),
}


def test_yaml_toml_and_json_files_load_identically(tmp_path: Path) -> None:
    loaded = {}
    for ext, text in FILE_TEXT.items():
        path = tmp_path / f"run.{ext}"
        path.write_text(text)
        loaded[ext] = (load_file(path), build(Train, file=path))
    assert loaded["yaml"] == loaded["toml"] == loaded["json"]
    cfg = loaded["yaml"][1]
    assert cfg.optim == Optim(lr=3e-4, betas=(0.8, 0.9))
    assert cfg.data.train.batch_size == 4
    assert cfg.data.val == Split(batch_size=16, shuffle=False)


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("run.ini", "steps = 1", "unknown extension '.ini'"),
        ("run.yaml", "- 1\n- 2\n", "top level must be a mapping, got list"),
        ("run.json", "{not json", "is not valid JSON"),
        ("run.toml", "steps = = 1", "is not valid TOML"),
        ("run.yaml", "a: [1", "is not valid YAML"),
    ],
)
def test_bad_files_raise_config_error_naming_the_file(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_file(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml"):
        load_file(tmp_path / "nope.yaml")


def test_empty_yaml_file_is_an_empty_config(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    assert load_file(path) == {}


# --- overrides, merge, build ----------------------------------------------------------------


def test_overrides_are_typed_by_the_field() -> None:
    overrides = [
        "optim.lr=3e-4",
        "optim.betas=[0.5, 1e-2]",
        "data.train.batch_size=32",
        "data.root=/scratch/data",
        "compile=true",
        "epochs=None",
        "tags=[x, y]",
        "counts={a: 1}",
        "callbacks=[{every: 5}]",
        "precision=bf16",
        "mode=safe",
        "note=null",
        "extra=1e5",
    ]
    assert parse_overrides(Train, overrides) == {
        "optim": {"lr": 3e-4, "betas": [0.5, 0.01]},
        "data": {"train": {"batch_size": 32}, "root": "/scratch/data"},
        "compile": True,
        "epochs": None,
        "tags": ["x", "y"],
        "counts": {"a": 1},
        "callbacks": [{"every": 5}],
        "precision": "bf16",
        "mode": "safe",
        "note": None,
        "extra": 1e5,
    }
    cfg = build(Train, overrides=overrides)
    assert cfg.optim == Optim(lr=3e-4, betas=(0.5, 0.01))
    assert cfg.data.root == Path("/scratch/data")
    assert cfg.callbacks == [Every(every=5)]


def test_string_fields_keep_the_raw_text() -> None:
    parsed = parse_overrides(Train, ["note=123", "callbacks=[]", "data.root=true"])
    assert parsed["note"] == "123"
    assert parsed["data"]["root"] == "true"


def test_override_float_forms() -> None:
    for text, value in [("3e-4", 3e-4), ("1e5", 1e5), ("-2.5E+3", -2500.0), ("1", 1), (".5", 0.5)]:
        assert parse_overrides(Train, [f"optim.lr={text}"]) == {"optim": {"lr": value}}


def test_override_errors() -> None:
    with pytest.raises(ConfigError, match=r"'optim\.lrr'.*did you mean 'lr'") as info:
        parse_overrides(Train, ["optim.lrr=1"])
    assert info.value.path == "optim.lrr"
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(Train, ["steps"])
    with pytest.raises(ConfigError, match=r"'tags' is list\[str\]"):
        parse_overrides(Train, ["tags.0=x"])
    with pytest.raises(ConfigError, match=r"config error at 'steps': expected int, got 'x'"):
        build(Train, overrides=["steps=x"])


def test_merge_is_deep_and_does_not_mutate() -> None:
    base = {"a": {"b": 1, "c": [1]}, "d": 1}
    update = {"a": {"b": 2}, "e": {"f": 3}}
    merged = merge(base, update)
    assert merged == {"a": {"b": 2, "c": [1]}, "d": 1, "e": {"f": 3}}
    merged["a"]["c"].append(2)
    merged["e"]["f"] = 4
    assert base == {"a": {"b": 1, "c": [1]}, "d": 1}
    assert update == {"a": {"b": 2}, "e": {"f": 3}}


def test_build_precedence_data_then_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("steps: 2\ntags: [file]\noptim: {betas: [0.1, 0.2]}\n")
    cfg = build(Train, data={"steps": 1, "epochs": 3, "tags": ["data"]}, file=path, overrides=["steps=3"])
    assert (cfg.steps, cfg.epochs, cfg.tags) == (3, 3, ["file"])
    # A partial nested section merges over the parent's default, not the child class's.
    assert cfg.optim == Optim(lr=0.1, betas=(0.1, 0.2))


# --- help and CLI ---------------------------------------------------------------------------


def test_field_help_covers_every_leaf() -> None:
    rows = {path: (type_, default, help_) for path, type_, default, help_ in field_help(Train)}
    assert list(rows) == [
        *("steps", "epochs", "precision", "tags", "counts", "compile", "mode", "note"),
        *("optim.lr", "optim.betas", "data.root", "data.train.batch_size", "data.train.shuffle"),
        *("data.val.batch_size", "data.val.shuffle", "callbacks", "extra"),
    ]
    assert rows["steps"] == ("int", "100", "Optimizer steps to run.")
    assert rows["tags"] == ("list[str]", "[]", "Free-form labels.")
    assert rows["optim.lr"] == ("float", "0.1", "Peak learning rate, after warmup.")
    assert rows["optim.betas"] == ("tuple[float, float]", "[0.9, 0.999]", "Adam betas.")
    assert rows["data.val.batch_size"] == ("int", "16", "Samples per step.")
    assert rows["data.root"] == ("Path", "'data'", "")
    assert rows["precision"][0] == "'fp32' | 'bf16'"
    assert field_help(Required)[0] == ("name", "str", "required", "")


def test_cli_help_lists_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_cli(Train, ["steps=oops", "--help"], prog="train.py")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: train.py [--config FILE] [key=value ...]")
    lines = out.splitlines()
    for path, type_, default, help_ in field_help(Train):
        line = next(line for line in lines if line.split()[:1] == [path])
        assert type_ in line and default in line and help_ in line


def test_cli_bad_override_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_cli(Train, ["optim.lr=fast"], prog="train.py")
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("train.py: config error at 'optim.lr': expected float")


@pytest.mark.parametrize("argv", [["--bogus"], ["--config"], ["stepz=1"], ["x"]])
def test_cli_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_cli(Train, argv, prog="p")
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("p: config error")


def test_cli_reads_config_file_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("steps = 7\n[optim]\nlr = 0.5\n")
    assert parse_cli(Train, ["--config", str(path), "optim.lr=0.25"]).optim.lr == 0.25
    cfg = parse_cli(Train, [f"--config={path}", "compile=true"])
    assert (cfg.steps, cfg.compile, cfg.optim.lr) == (7, True, 0.5)


# --- canonical form, hash, diff -------------------------------------------------------------


def test_config_diff_holds_exactly_the_changed_values() -> None:
    cfg = Train(optim=Optim(lr=0.5), data=Data(train=Split(batch_size=2)))
    assert config_diff(cfg) == {"optim": {"lr": 0.5}, "data": {"train": {"batch_size": 2}}}
    assert config_diff(Train()) == {}
    assert config_diff(Required(name="x"), default=Required(name="y")) == {"name": "x"}
    with pytest.raises(TypeError, match="pass default="):
        config_diff(Required(name="x"))


def test_config_diff_reports_a_shrunk_dict_whole() -> None:
    default = Train(counts={"a": 1, "b": 2})
    assert config_diff(Train(counts={"a": 1}), default) == {"counts": {"a": 1}}
    assert config_diff(Train(counts={"a": 1, "b": 3}), default) == {"counts": {"b": 3}}


def test_config_hash_is_stable_and_sensitive() -> None:
    cfg = Train(counts={"a": 1, "b": 2})
    digest = config_hash(cfg)
    assert len(digest) == 10 and int(digest, 16) >= 0
    assert config_hash(cfg, length=64) == config_hash(cfg, length=64)
    assert config_hash(Train(counts={"b": 2, "a": 1})) == digest
    assert config_hash(Train(counts={"a": 1, "b": 2}, optim=Optim(lr=0.1))) == digest
    assert config_hash(Train(counts={"a": 1, "b": 2}, optim=Optim(lr=0.2))) != digest
    # An int on a float field is the same config as the float.
    assert config_hash(Optim(lr=1)) == config_hash(Optim(lr=1.0))


def test_config_hash_is_pinned() -> None:
    # Run directories are named from this hash: a format change must be deliberate.
    cfg = Optim(lr=3e-4)
    assert canonical_yaml(cfg) == "betas:\n- 0.9\n- 0.999\nlr: 0.0003\n"
    assert config_hash(cfg) == "58a85ffcdb"


def test_canonical_yaml_is_sorted_plain_and_quotes_float_like_strings(tmp_path: Path) -> None:
    cfg = Train(tags=["1e5", "true", "null"], note="3e-4", data=Data(root=Path("/r")))
    text = canonical_yaml(cfg)
    keys = [line.split(":")[0] for line in text.splitlines() if not line.startswith((" ", "-"))]
    assert keys == sorted(keys)
    assert "root: /r" in text
    path = tmp_path / "canonical.yaml"
    path.write_text(text)
    assert structure(Train, load_file(path)) == cfg
    assert structure(Train, yaml.safe_load(text)) == cfg


# --- property: every valid config round-trips -----------------------------------------------

finite = st.floats(allow_nan=False, allow_infinity=False)
text = st.text(max_size=12)
optims = st.builds(Optim, lr=st.floats(min_value=1e-12, max_value=1e6), betas=st.tuples(finite, finite))
splits = st.builds(Split, batch_size=st.integers(), shuffle=st.booleans())
datas = st.builds(Data, root=text.map(Path), train=splits, val=splits)
trains = st.builds(
    Train,
    steps=st.integers(),
    epochs=st.none() | st.integers(min_value=0),
    precision=st.sampled_from(["fp32", "bf16"]),
    tags=st.lists(text, max_size=4),
    counts=st.dictionaries(text, st.integers(), max_size=4),
    compile=st.booleans(),
    mode=st.sampled_from(Mode),
    note=st.none() | text,
    optim=optims,
    data=datas,
    callbacks=st.lists(st.builds(Every, every=st.integers(), name=text), max_size=3),
    extra=st.none() | st.integers() | text | st.lists(st.integers(), max_size=3),
)


@settings(max_examples=150, deadline=None, database=None)
@given(trains)
def test_valid_configs_round_trip(cfg: Train) -> None:
    assert structure(Train, unstructure(cfg)) == cfg
    text = canonical_yaml(cfg)
    assert structure(Train, yaml.safe_load(text)) == cfg
    assert canonical_yaml(structure(Train, yaml.safe_load(text))) == text


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(trains, trains)
def test_diff_applied_to_default_rebuilds_the_config(cfg: Train, default: Train) -> None:
    # merge() cannot delete keys, so a dict field that lost keys is out of scope here
    # (config_diff reports it whole; see test_config_diff_reports_a_shrunk_dict_whole).
    default = attrs.evolve(default, counts={k: v for k, v in default.counts.items() if k in cfg.counts})
    assert structure(Train, merge(unstructure(default), config_diff(cfg, default))) == cfg


# --- property: the real EngineConfig round-trips ----------------------------------------------

positive = st.integers(min_value=1, max_value=2**31)
natural = st.integers(min_value=0, max_value=2**31)
# lineage / run_id: one folder name (rundir.folder_name).
folder_names = st.text(min_size=1, max_size=12).filter(lambda v: v not in (".", "..") and not set(v) & set("/\\\0"))
DATA_FIELDS = {
    "batch_size": positive,
    "shuffle": st.none() | st.booleans(),
    "drop_last": st.booleans(),
    "num_workers": natural,
    "pin_memory": st.none() | st.booleans(),
    "persistent_workers": st.booleans(),
    "prefetch_factor": st.none() | positive,
    "multiprocessing_context": st.sampled_from([None, "fork", "spawn", "forkserver"]),
}
data_configs = st.builds(DataConfig, **DATA_FIELDS)
ENGINE_FIELDS = {
    "steps": st.none() | natural,
    "epochs": st.none() | natural,
    "grad_accum": positive,
    "eval_every_epochs": st.none() | positive,
    "eval_every_steps": st.none() | positive,
    "log_interval": positive,
    "precision": st.sampled_from(["fp32", "bf16", "fp16"]),
    "device": st.none() | st.sampled_from(["cpu", "cuda", "cuda:1", "mps"]) | text,
    "prefetch_to_device": st.none() | st.booleans(),
    # A known name or a `module:Class` target (any other name is a config error: test_loop.py).
    "backend": st.sampled_from(["auto", "local", "ddp", "mesh"]) | text.map(lambda v: f"my_package.backends:{v}"),
    "seed": st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1),
    "deterministic": st.booleans(),
    "workspace": text,
    "lineage": folder_names,
    "run_id": st.none() | folder_names,
    "train": data_configs,
    "eval": data_configs,
    "predict": data_configs,
    "eval_sets": st.dictionaries(
        st.sampled_from(["val", "test", "holdout"]),
        st.builds(
            EvalSetConfig,
            every_epochs=st.none() | natural,
            every_steps=st.none() | natural,
            data=st.none() | data_configs,
        ),
        max_size=2,
    ),
}
engine_configs = st.builds(EngineConfig, **ENGINE_FIELDS)


def test_the_engine_config_strategy_sets_every_field():
    # A field added to EngineConfig without a strategy here would only ever be tested at its default.
    assert sorted(ENGINE_FIELDS) == sorted(attrs.fields_dict(EngineConfig))
    assert sorted(DATA_FIELDS) == sorted(attrs.fields_dict(DataConfig))


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine_configs)
def test_engine_configs_round_trip(cfg: EngineConfig) -> None:
    plain = unstructure(cfg)
    assert isinstance(plain["train"], dict)  # nested DataConfig unstructured too
    assert structure(EngineConfig, plain) == cfg
    text = canonical_yaml(cfg)
    assert structure(EngineConfig, yaml.safe_load(text)) == cfg
    assert structure(EngineConfig, json.loads(json.dumps(plain))) == cfg
