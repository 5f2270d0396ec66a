"""`check_callback`: run a callback through the engine's contract and say what it breaks."""

from __future__ import annotations

import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from cadence.testing import checkpoint as checkpoint_checks
from cadence.testing import ranks as rank_checks
from cadence.testing.compare import ProcessSnapshot, settled_snapshot
from cadence.testing.scenario import Factory, Scenario, build_engine, callback_maker, describe

#: The groups of checks, each one run (select with `check_callback(checks=...)`).
CHECKS: tuple[str, ...] = ("constructible", "fit_twice", "checkpoint", "ranks")

#: The properties the checks establish; a `ContractError` names the broken ones.
PROPERTIES: dict[str, str] = {
    "constructible": "builds from its factory or config and registers on an engine",
    "fit_twice": "survives two fit() calls and an evaluate() in one process",
    "hygiene": "leaves no thread, signal handler, gc setting, logging handler or grad mode behind",
    "state_round_trip": "state_dict() after a resume from a real checkpoint equals the one saved",
    "resume_matches": "a resumed run ends like the uninterrupted one (parameters and callback state)",
    "same_collectives": "every rank calls the same collectives in the same order",
    "same_decisions": "every rank ends with the same parameters, engine state and agreed requests",
    "same_across_world_sizes": "1 and 2 ranks take the same decisions and end with the same parameters",
    "runs_on_ranks": "trains on every world size without raising or hanging",
}


@attrs.define
class CheckResult:
    """The outcome of one property."""

    name: str
    passed: bool
    message: str = ""
    seconds: float = 0.0


@attrs.define
class Report:
    """What `check_callback` found; `str(report)` is a readable table.

    Attributes:
        callback: the name of the checked callback.
        results: one `CheckResult` per property checked.
        details: figures gathered on the way (collectives per rank, ...).
    """

    callback: str
    results: list[CheckResult] = attrs.field(factory=list)
    details: dict[str, Any] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def add(self, name: str, message: str | None, started: float) -> None:
        self.results.append(CheckResult(name, message is None, message or "", time.perf_counter() - started))

    def __str__(self) -> str:
        lines = [f"contract of {self.callback}:"]
        for r in self.results:
            mark = "ok  " if r.passed else "FAIL"
            lines.append(f"  {mark} {r.name:<24} {r.seconds:6.2f} s  {r.message}".rstrip())
        return "\n".join(lines)


class ContractError(AssertionError):
    """A callback breaks the engine's contract; the message names each broken property.

    Attributes:
        property: the first broken property (a key of `PROPERTIES`).
        report: the full `Report`.
    """

    def __init__(self, report: Report) -> None:
        self.report = report
        self.property = report.failures[0].name
        broken = "\n".join(f"  - {r.name}: {r.message}" for r in report.failures)
        super().__init__(f"callback {report.callback} breaks the contract:\n{broken}\n{report}")


def check_callback(
    factory: Factory,
    *,
    config: Mapping[str, Any] | None = None,
    world_sizes: Sequence[int] = (1, 2),
    checks: Sequence[str] | None = None,
    steps: int = 3,
    engine_options: Mapping[str, Any] | None = None,
    volatile: Sequence[str] = (),
    allow_threads: Sequence[str] = (),
    timeout: float = 60.0,
    workdir: str | Path | None = None,
    raise_on_failure: bool = True,
    backend: Callable[[], Any] | None = None,
    checkpoint_params: str = "all",
) -> Report:
    """Check a callback against the engine's contract on a tiny run.

    Args:
        factory: the callback class (built from `config` like a config entry),
            a registry name or config entry (`{"name": ..., **arguments}`), or a
            function returning a new instance; a function taking one argument
            gets a `HarnessContext` (workdir, rank, model, optimizer).
        config: arguments for a class or a name, as a config file would give them.
        world_sizes: gloo world sizes for the rank checks (fork workers).
        checks: which groups of `CHECKS` to run (default: all).
        steps: optimizer steps per `fit` call.
        engine_options: more `Engine` keyword arguments for the run.
        volatile: dotted keys of the callback's state that legitimately differ
            between a resumed and an uninterrupted run (timings).
        allow_threads: name prefixes of threads a library keeps for the whole
            process by design (not counted as leaked).
        timeout: seconds before a multi-rank run counts as hung.
        workdir: where runs write (default: a temporary directory, removed after).
        raise_on_failure: raise `ContractError` when a property is broken.
        backend: a function returning a fresh, not yet set up backend for each
            engine (e.g. `lambda: DeepSpeedBackend(zero_stage=2)`), in one
            process and on every rank; None: local in one process, DDP on ranks,
            both on the CPU (`engine_options={"device": ...}` moves the one-process runs).
        checkpoint_params: what the checkpoint check saves and restores: "all", or "trainable"
            (`Checkpoint(params="trainable")`: freeze parameters in the factory to check adapters).

    Returns:
        The `Report` (also when everything passed).

    Raises:
        ContractError: a property is broken; the message names it.

    Example:
        >>> import cadence
        >>> from cadence.testing import check_callback
        >>> class CountSteps(cadence.Callback):
        ...     def __init__(self):
        ...         self.steps = 0
        ...     def on_step_end(self, engine):
        ...         self.steps += 1
        ...     def state_dict(self):
        ...         return {"steps": self.steps}
        ...     def load_state_dict(self, state):
        ...         self.steps = state["steps"]
        >>> report = check_callback(CountSteps)   # about a second: 1 and 2 gloo ranks
        >>> report.ok, [r.name for r in report.results][:3]
        (True, ['constructible', 'fit_twice', 'hygiene'])
    """
    selected = tuple(checks) if checks is not None else CHECKS
    unknown = sorted(set(selected) - set(CHECKS))
    if unknown:
        raise ValueError(f"check_callback(checks=...): unknown {unknown}; choose from {list(CHECKS)}")
    make = callback_maker(factory, config)
    scenario = Scenario(
        steps=steps, engine_options=dict(engine_options or {}), backend=backend, checkpoint_params=checkpoint_params
    )
    report = Report(describe(factory))
    with _workdir(workdir) as root:
        started = time.perf_counter()
        message = _check_constructible(make, root / "construct", scenario)
        report.add("constructible", message, started)
        if message is None:
            if "fit_twice" in selected:
                _check_fit_twice(make, root / "fit-twice", scenario, report, allow_threads)
            if "checkpoint" in selected:
                checkpoint_checks.check(make, root / "checkpoint", scenario, report, volatile=volatile)
            if "ranks" in selected and world_sizes:
                rank_checks.check(make, root / "ranks", scenario, report, world_sizes=world_sizes, timeout=timeout)
    if raise_on_failure and not report.ok:
        raise ContractError(report)
    return report


@contextmanager
def _workdir(workdir: str | Path | None) -> Iterator[Path]:
    if workdir is not None:
        path = Path(workdir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="cadence-harness-") as tmp:
        yield Path(tmp)


def failure_text(exc: BaseException) -> str:
    """One readable paragraph for an exception: its message and where it came from."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _check_constructible(make: Callable[..., Any], workdir: Path, scenario: Scenario) -> str | None:
    try:
        engine, callback, _ = build_engine(make, workdir, scenario)
    except Exception as exc:
        return f"could not build it and register it on an engine: {failure_text(exc)}"
    try:
        if not isinstance(getattr(callback, "order", 50), int):
            return f"order must be an int, got {callback.order!r}"
        if not isinstance(getattr(callback, "state_key", None), str):
            return f"state_key must be a str, got {getattr(callback, 'state_key', None)!r}"
        if callable(getattr(callback, "state_dict", None)):
            state = callback.state_dict()
            if not isinstance(state, Mapping):
                return f"state_dict() must return a mapping, got {type(state).__name__}"
    finally:
        engine.close()
    return None


def _check_fit_twice(
    make: Callable[..., Any], workdir: Path, scenario: Scenario, report: Report, allow_threads: Sequence[str]
) -> None:
    baseline = ProcessSnapshot.take()
    started = time.perf_counter()
    message = None
    engine = None
    try:
        engine, _, probe = build_engine(make, workdir, scenario)
        engine.fit(steps=scenario.steps)
        first = engine.state.step
        if first == 0 and not probe.agreed:
            message = "the first fit() took no step"
        engine.fit(steps=scenario.steps)
        stopped = any(values[engine.requests.index["stop"]] for _, values in probe.agreed)
        if message is None and engine.state.step <= first and not stopped:
            message = f"the second fit() took no step (step {engine.state.step} after {first}) and no stop was agreed"
        engine.evaluate()
    except Exception as exc:
        message = f"{failure_text(exc)}"
    finally:
        if engine is not None:
            engine.close()
        del engine
    report.add("fit_twice", message, started)
    started = time.perf_counter()
    leaks = baseline.leaks(settled_snapshot(baseline, 5.0, allow_threads), allow_threads)
    report.add("hygiene", "; ".join(leaks) if leaks else None, started)


def callback_contract(
    factory: Factory,
    *,
    checks: Sequence[str] | None = None,
    timeout: float = 120.0,
    **options: Any,
) -> Callable[..., None]:
    """A pytest test function that runs `check_callback` once per group of checks.

    Assign it to a module-level name starting with `test_`; each group of
    `CHECKS` becomes one parametrized test, with a timeout when pytest-timeout
    is installed.

    Example:
        >>> from cadence.testing import callback_contract
        >>> from cadence.callbacks import GradClip
        >>> test_grad_clip = callback_contract(GradClip, config={"max_norm": 1.0})
    """
    import pytest

    selected = tuple(checks) if checks is not None else CHECKS

    def test_callback_contract(check: str, tmp_path: Path) -> None:
        check_callback(factory, checks=(check,), workdir=tmp_path, **options)

    test_callback_contract.__name__ = f"test_contract_of_{describe(factory)}".replace(".", "_")
    test = pytest.mark.parametrize("check", selected)(test_callback_contract)
    try:
        import pytest_timeout  # noqa: F401
    except ImportError:
        return test
    return pytest.mark.timeout(timeout)(test)
