"""Weights a checkpoint lacks are never left at their initialization silently (issue 34, defect 6).

`strict=False` used to turn "missing from the checkpoint" into a warning, and
the error suggested it: a load then exited 0 with those weights random. Now a
missing key is refused in every mode, naming the keys, unless the user
excludes them explicitly (`pretrained_exclude`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cadence.checkpoint import CheckpointError
from tests.callbacks.test_checkpoint import make, setup_only, trained

pytestmark = pytest.mark.timeout(60)


def wider() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4), torch.nn.Linear(4, 4))


@pytest.mark.parametrize("mode", ["pretrained", "resume"])
@pytest.mark.parametrize("strict", [True, False])
def test_missing_model_keys_are_refused_in_every_mode_naming_what_would_stay_initialized(
    tmp_path: Path, mode: str, strict: bool
) -> None:
    trained(tmp_path / "a", 3)
    model = wider()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine, _ = make(tmp_path / "b", model=model, checkpoint={mode: str(tmp_path / "a" / "latest"), "strict": strict})
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \[3.weight, 3.bias\]") as caught:
        setup_only(engine)
    assert "2 tensor(s) of this model would stay at their initialization" in str(caught.value)
    assert "strict=False" not in str(caught.value)  # the suggestion that led to untrained weights
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_excluded_keys_stay_initialized_and_the_rest_loads(tmp_path: Path) -> None:
    source = trained(tmp_path / "a", 3)
    model = wider()
    head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("3.")}
    engine, _ = make(
        tmp_path / "b",
        model=model,
        checkpoint={"pretrained": str(tmp_path / "a" / "latest"), "pretrained_exclude": ["3.*"]},
    )
    setup_only(engine)
    for key, value in source.model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert all(torch.equal(model.state_dict()[k], v) for k, v in head.items())


def test_unexpected_keys_are_an_error_when_strict_and_left_out_when_not(tmp_path: Path) -> None:
    trained(tmp_path / "a", 3, model=wider())
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    checkpoint = {"pretrained": str(tmp_path / "a" / "latest")}
    engine, _ = make(tmp_path / "b", model=model, checkpoint=checkpoint)
    with pytest.raises(CheckpointError, match=r"unexpected \[3.weight, 3.bias\]"):
        setup_only(engine)
    engine, _ = make(tmp_path / "c", model=model, checkpoint={**checkpoint, "strict": False})
    setup_only(engine)
