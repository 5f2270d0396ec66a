"""Curves of a run's `metrics.jsonl` in one PNG (the `[plot]` extra: matplotlib).

`cadence plot RUN_DIR` on the command line, `cadence.plot(run_dir)` in a notebook.
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cadence.run.registry import require

#: Keys of a metrics.jsonl line that are not metrics.
RESERVED = frozenset({"step", "epoch", "time", "split"})
#: Families drawn first, in this order; others follow alphabetically.
FAMILY_ORDER = ("loss", "lr", "grad_norm", "throughput", "mfu", "time")


def families(records: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Panel title -> metric names, one panel per family.

    Training metrics group by the part of the name before the first dot
    (`time.step`, `time.data_wait` -> `time`); every split's evaluation
    metrics form one panel (`eval: val`), and the split's loss is also
    drawn on the `loss` panel, next to the training loss.

    Example:
        >>> families([{"step": 1, "loss": 1.0, "lr": 0.1}, {"step": 1, "split": "val", "val.loss": 2.0}])
        {'loss': ['loss', 'val.loss'], 'lr': ['lr'], 'eval: val': ['val.loss']}
    """
    train: dict[str, list[str]] = {}
    evals: dict[str, list[str]] = {}
    for record in records:
        split = record.get("split")
        for name in record:
            if name in RESERVED:
                continue
            if split is not None:
                _add(evals, f"eval: {split}", name)
                if name == f"{split}.loss":
                    _add(train, "loss", name)
            else:
                _add(train, name.partition(".")[0], name)
    ordered = {f: train[f] for f in FAMILY_ORDER if f in train}
    ordered.update({f: train[f] for f in sorted(train) if f not in ordered})
    ordered.update({f: evals[f] for f in sorted(evals)})
    return ordered


def _add(groups: dict[str, list[str]], family: str, name: str) -> None:
    names = groups.setdefault(family, [])
    if name not in names:
        names.append(name)


def figure(records: Sequence[Mapping[str, Any]], *, title: str | None = None) -> Any:
    """A matplotlib `Figure` with one panel (axes) per family of `records`."""
    require("matplotlib", "plot")
    from matplotlib.figure import Figure

    groups = families(records)
    if not groups:
        raise ValueError("no metrics to plot: the records hold no metric values")
    columns = 2 if len(groups) > 1 else 1
    rows = math.ceil(len(groups) / columns)
    fig = Figure(figsize=(6.0 * columns, 3.2 * rows), layout="constrained")
    if title:
        fig.suptitle(title)
    for index, (family, names) in enumerate(groups.items()):
        axes = fig.add_subplot(rows, columns, index + 1)
        axes.set_title(family)
        axes.set_xlabel("step")
        lows, highs = [], []
        for name in names:
            points = [
                (r["step"], r[name])
                for r in records
                if name in r and isinstance(r[name], (int, float)) and math.isfinite(r[name])
            ]
            if not points:
                continue
            xs, ys = zip(*points)
            is_eval = any(name in r and "split" in r for r in records)
            axes.plot(
                xs, ys, label=name, marker="o" if is_eval else None, markersize=3, linestyle="--" if is_eval else "-"
            )
            lows.append(min(ys))
            highs.append(max(ys))
        if lows and min(lows) > 0 and max(highs) / min(lows) > 100:
            axes.set_yscale("log")  # samples/s next to tokens/s, or a loss falling by decades
        if len(names) > 1:
            axes.legend(fontsize="small")
        else:
            axes.set_ylabel(names[0])
        axes.grid(alpha=0.3)
    return fig


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw `run_dir/metrics.jsonl` into a PNG, one panel per metric family; returns its path.

    The PNG's metadata (`Description`) lists the panels, e.g.
    `panels: loss; lr; throughput; time; eval: val`.

    Args:
        run_dir: a run directory (or a `metrics.jsonl` file).
        out: the PNG to write; default `run_dir/metrics.png`.

    Example:
        >>> import cadence
        >>> cadence.plot("runs/default/my-run")  # doctest: +SKIP
        PosixPath('runs/default/my-run/metrics.png')
    """
    from cadence.callbacks.jsonl import read_jsonl

    run_dir = Path(run_dir)
    source = run_dir if run_dir.is_file() else run_dir / "metrics.jsonl"
    if not source.exists():
        raise FileNotFoundError(
            f"cadence plot: no metrics file at {source}; is {run_dir} a run directory with JSONL logging?"
        )
    records = read_jsonl(source)
    if not records:
        raise ValueError(f"cadence plot: {source} holds no records yet")
    fig = figure(records, title=str(source.parent))
    target = Path(out) if out is not None else source.parent / "metrics.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    panels = "; ".join(axes.get_title() for axes in fig.axes)
    fig.savefig(target, dpi=100, metadata={"Description": f"panels: {panels}", "Software": "cadence"})
    return target


class _CallableModule(types.ModuleType):
    # `import cadence.plot` binds `cadence.plot` to this module, shadowing the
    # lazily exported function: make the module call `plot` so
    # `cadence.plot(run_dir)` works either way.
    def __call__(self, run_dir: str | Path, out: str | Path | None = None) -> Path:
        return plot(run_dir, out)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["families", "figure", "plot"]
