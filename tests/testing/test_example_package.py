"""The example third-party package (examples/cadence-gradstats), as CI installs it with pip."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from cadence.run.registry import build_callback, describe_callbacks, discover
from cadence.testing import PROPERTIES, check_callback

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not any(d.metadata["Name"] == "cadence-gradstats" for d in metadata.distributions()),
        reason="the example package is not installed: pip install ./examples/cadence-gradstats (the README's test command does)",
    ),
]

PACKAGE = Path(__file__).resolve().parents[2] / "examples" / "cadence-gradstats"


def test_cadence_discovers_the_installed_package():
    found = {info.name: info for info in discover()}
    version = metadata.version("cadence-gradstats")
    assert found["gradient_histogram"].package == "cadence-gradstats"
    assert found["gradient_histogram"].version == version
    assert found["lr_finder"].target == "cadence_gradstats:LRFinder"
    # `cadence info` lists them with their package and version.
    rows = {row.name: row for row in describe_callbacks()}
    assert rows["lr_finder"].package == "cadence-gradstats" and rows["lr_finder"].version == version


def test_its_callbacks_build_from_config_entries():
    histogram = build_callback({"name": "gradient_histogram", "bins": 7, "interval": 5})
    assert type(histogram).__name__ == "GradientHistogram"
    assert (histogram.config.bins, histogram.config.interval) == (7, 5)
    finder = build_callback({"name": "lr_finder", "config": {"num_steps": 9}})
    assert finder.config.num_steps == 9


@pytest.mark.parametrize(
    "entry",
    [{"name": "gradient_histogram", "interval": 2, "bins": 8}, {"name": "lr_finder", "num_steps": 5}],
    ids=lambda entry: entry["name"],
)
def test_the_harness_passes_on_its_callbacks(entry, tmp_path):
    report = check_callback(entry, workdir=tmp_path, timeout=90)
    assert report.ok and {r.name for r in report.results} == set(PROPERTIES)


def test_its_own_test_suite_passes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"), "tests"],
        cwd=PACKAGE,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
