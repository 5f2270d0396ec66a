"""Third-party callbacks: discovered through entry points, built from config entries, never auto-activated."""

from __future__ import annotations

import textwrap

import pytest
import torch

import cadence
from cadence.run import registry
from cadence.run.config import ConfigError
from cadence.run.registry import UnknownNameError, build_callback, describe_callbacks, discover

pytestmark = pytest.mark.timeout(60)

THROWAWAY = """
import attrs
import cadence


@attrs.define(kw_only=True)
class ThrowawayConfig:
    threshold: float = 1.0
    every: int = 1


class Throwaway(cadence.Callback):
    def __init__(self, config=None, **kwargs):
        self.config = config if config is not None else ThrowawayConfig(**kwargs)
        self.calls = 0

    def on_step_end(self, engine):
        self.calls += 1


class Plain(cadence.Callback):
    def __init__(self, label, *, repeat=1):
        self.label, self.repeat = label, repeat
"""


@pytest.fixture
def throwaway(tmp_path, monkeypatch):
    """A package installed the way pip leaves one: a module plus its dist-info on sys.path."""
    site = tmp_path / "site"
    (site / "throwaway_cb").mkdir(parents=True)
    (site / "throwaway_cb" / "__init__.py").write_text(textwrap.dedent(THROWAWAY))
    info = site / "throwaway_cb-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: throwaway-cb\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(
        "[cadence.callbacks]\nthrowaway = throwaway_cb:Throwaway\nplain = throwaway_cb:Plain\n"
        "checkpoint = throwaway_cb:Throwaway\n"
    )
    monkeypatch.syspath_prepend(str(site))
    yield site
    import sys

    sys.modules.pop("throwaway_cb", None)


def _engine(callbacks=()):
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1))] * 3
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        loss_fn=torch.nn.functional.mse_loss,
        callbacks=callbacks,
        seed=0,
        device="cpu",
    )


def test_an_installed_package_is_discovered_with_its_distribution(throwaway):
    found = {info.name: info for info in discover()}
    assert found["throwaway"] == registry.CallbackInfo("throwaway", "throwaway_cb:Throwaway", "throwaway-cb", "1.2.3")
    assert "throwaway" in registry.callbacks.names()


def test_discovered_callbacks_are_never_activated(throwaway):
    engine = _engine()
    engine.fit(steps=2)
    assert not any(type(cb).__module__ == "throwaway_cb" for cb in engine.callbacks)
    assert "throwaway_cb" not in __import__("sys").modules  # not even imported


def test_a_config_entry_naming_it_builds_it_with_its_attrs_config(throwaway):
    callback = build_callback({"name": "throwaway", "threshold": 0.5, "state_key": "mine"})
    assert type(callback).__name__ == "Throwaway"
    assert type(callback.config).__name__ == "ThrowawayConfig"
    assert callback.config.threshold == 0.5 and callback.config.every == 1
    assert callback.state_key == "mine"
    # The engine builds entries given in callbacks=[...] the same way.
    engine = _engine(callbacks=[{"name": "throwaway", "every": 3}])
    engine.fit(steps=2)
    (built,) = [cb for cb in engine.callbacks if type(cb).__name__ == "Throwaway"]
    assert built.config.every == 3 and built.calls == 2


def test_module_colon_class_and_plain_keyword_classes(throwaway):
    plain = build_callback({"name": "throwaway_cb:Plain", "label": "x", "repeat": 2})
    assert (plain.label, plain.repeat) == ("x", 2)
    assert build_callback({"name": "plain", "label": "y"}).label == "y"


def test_config_errors_name_the_dotted_path(throwaway):
    with pytest.raises(ConfigError) as info:
        build_callback({"name": "throwaway", "threshold": "high"}, path="callbacks[2]")
    assert info.value.path == "callbacks[2].threshold"
    assert "high" in str(info.value)
    with pytest.raises(
        ConfigError,
        match=r"callbacks\[0\].colour: callback 'plain' takes no argument 'colour'; it takes: label, repeat",
    ):
        build_callback({"name": "plain", "label": "x", "colour": 1}, path="callbacks[0]")
    with pytest.raises(ConfigError, match="needs the argument"):
        build_callback({"name": "plain"})
    with pytest.raises(ConfigError, match="'name' key"):
        build_callback(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"callback\.name"):
        build_callback({"threshold": 1.0})


def test_an_unknown_name_lists_the_known_ones(throwaway):
    with pytest.raises(ConfigError) as info:
        build_callback({"name": "throwawy"})
    message = str(info.value)
    assert "unknown callback 'throwawy'" in message
    for known in ("throwaway", "plain", "checkpoint", "grad_clip", "ema"):
        assert known in message
    with pytest.raises(UnknownNameError) as raw:
        registry.callbacks.resolve("throwawy")
    assert isinstance(raw.value, KeyError)
    assert str(raw.value).startswith("unknown callback 'throwawy'")  # not quoted like a KeyError


def test_describe_lists_builtins_and_discovered_and_builtins_win(throwaway):
    rows = {row.name: row for row in describe_callbacks()}
    assert rows["grad_clip"].package == "cadence" and rows["grad_clip"].version == cadence.__version__
    assert rows["throwaway"].package == "throwaway-cb" and rows["throwaway"].version == "1.2.3"
    # The package's 'checkpoint' entry point is shadowed by the built-in.
    assert rows["checkpoint"].target == "cadence.callbacks.checkpoint:Checkpoint"
    assert sum(1 for row in describe_callbacks() if row.name == "checkpoint") == 1
