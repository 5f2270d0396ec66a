"""The contract harness for callback authors: one call that checks a callback.

`check_callback(MyCallback, config={...})` runs a tiny training run (a few
steps) and checks that the callback builds from its config, survives `fit`
twice, leaves no thread, signal handler or gc setting behind, round-trips its
state through a real checkpoint and resume, and behaves the same on 1 and 2
gloo ranks (same collectives, same decisions). `callback_contract(...)` is the
same as a pytest test. See docs/plugins.md.

Example:
    >>> from cadence.testing import PROPERTIES
    >>> "state_round_trip" in PROPERTIES
    True
"""

from __future__ import annotations

from cadence.testing.harness import (
    CHECKS,
    PROPERTIES,
    CheckResult,
    ContractError,
    Report,
    callback_contract,
    check_callback,
)
from cadence.testing.scenario import HarnessContext, Scenario

__all__ = [
    "CHECKS",
    "PROPERTIES",
    "CheckResult",
    "ContractError",
    "HarnessContext",
    "Report",
    "Scenario",
    "callback_contract",
    "check_callback",
]
