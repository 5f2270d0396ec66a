"""Per-layer gradient norms and histograms, recorded on intervals."""

from __future__ import annotations

import json
from typing import Any

import attrs
import torch

import cadence
from cadence import Order


@attrs.define(kw_only=True)
class GradientHistogramConfig:
    """How `GradientHistogram` records gradients.

    Attributes:
        interval: record every N optimizer steps; None: the engine's `log_interval`.
        bins: histogram bins over log10 of the gradient magnitudes.
        low: log10 of the smallest magnitude binned (smaller ones land in the first bin).
        high: log10 of the largest magnitude binned (larger ones land in the last bin).
        depth: a layer is the first `depth` parts of a parameter's name
            (`depth=1` groups `0.weight` and `0.bias` of a Sequential as layer `0`).
        file: JSON-lines file in the run directory for the histograms; "" keeps
            them in memory only (`GradientHistogram.latest`).
    """

    interval: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    bins: int = attrs.field(default=20, validator=attrs.validators.ge(1))
    low: float = -8.0
    high: float = 2.0
    depth: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    file: str = "gradstats.jsonl"

    def __attrs_post_init__(self) -> None:
        if self.low >= self.high:
            raise ValueError(f"GradientHistogramConfig: low ({self.low}) must be below high ({self.high})")


class GradientHistogram(cadence.Callback):
    """Logs each layer's gradient norm and a histogram of its gradient magnitudes.

    Every `interval` steps, right before the optimizer step (gradients synced
    and unscaled, not yet clipped), it logs `grad_norm/<layer>` through
    `engine.log`, so every sink (progress bar, TensorBoard, JSONL) shows it,
    and keeps a histogram of log10 |gradient| per layer. The values stay on
    the device until the next `on_log`, where the main process appends them to
    `run_dir/gradstats.jsonl`: no host sync and no I/O on other steps.

    Order: 15, after `NonFiniteSkip` (10) and before `GradClip` (20), so the
    norms are the pre-clip ones. It has no state to checkpoint.

    Example:
        >>> import torch, cadence
        >>> from cadence_gradstats import GradientHistogram
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1))] * 4
        >>> grads = GradientHistogram(interval=2, file="")
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...                         loss_fn=torch.nn.functional.mse_loss, callbacks=[grads], seed=0)
        >>> engine.fit(steps=4)
        >>> sorted(grads.latest)
        ['0', '2']
        >>> len(grads.latest["0"]["counts"])
        20
    """

    order = Order.NON_FINITE + 5
    requests_in_step = False  # reads gradients; requests nothing
    raises_requests = False

    def __init__(self, config: GradientHistogramConfig | None = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise TypeError(f"GradientHistogram: pass config= or keyword arguments, not both (got {sorted(kwargs)})")
        self.config = config if config is not None else GradientHistogramConfig(**kwargs)
        #: The last histograms recorded: layer -> {"step", "norm", "counts"}.
        self.latest: dict[str, dict[str, Any]] = {}
        self._layers: list[tuple[str, list[torch.nn.Parameter]]] = []
        self._interval = 1
        self._pending: list[tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = []

    def edges(self) -> list[float]:
        """The histogram's bin edges, as log10 of gradient magnitudes."""
        return torch.linspace(self.config.low, self.config.high, self.config.bins + 1).tolist()

    def on_fit_start(self, engine: cadence.Engine) -> None:
        self._interval = self.config.interval or engine.config.log_interval
        layers: dict[str, list[torch.nn.Parameter]] = {}
        for name, parameter in engine.model.named_parameters():
            if parameter.requires_grad:
                layers.setdefault(".".join(name.split(".")[: self.config.depth]), []).append(parameter)
        self._layers = list(layers.items())

    def on_before_optimizer_step(self, engine: cadence.Engine) -> None:
        step = engine.state.step + 1  # the step being completed
        if step % self._interval:
            return
        cfg, main = self.config, engine.backend.is_main
        record: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, params in self._layers:
            grads = [p.grad.detach() for p in params if p.grad is not None]
            if not grads:
                continue
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            # Every rank logs the same names: the reduction at the log interval needs them all.
            engine.log(f"grad_norm/{layer}", norm)
            if main:
                magnitudes = torch.cat([g.float().abs().flatten() for g in grads]).clamp_min(10.0**cfg.low)
                counts = torch.histc(magnitudes.log10().clamp(cfg.low, cfg.high), cfg.bins, cfg.low, cfg.high)
                record[layer] = (norm, counts)
        if record:
            self._pending.append((step, record))

    def on_log(self, engine: cadence.Engine) -> None:
        self._flush(engine)

    def on_fit_end(self, engine: cadence.Engine) -> None:
        self._flush(engine)

    def on_load(self, engine: cadence.Engine) -> None:
        # A resumed run records the steps after the checkpoint again: drop the old ones.
        path = engine.run_dir / self.config.file if self.config.file else None
        if path is None or not engine.backend.is_main or not path.exists():
            return
        kept = [
            line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= engine.state.step
        ]
        path.write_text("".join(line + "\n" for line in kept))

    def on_teardown(self, engine: cadence.Engine) -> None:
        self._pending.clear()

    def _flush(self, engine: cadence.Engine) -> None:
        if not self._pending:
            return
        lines = []
        for step, record in self._pending:  # the host sync happens here, on log intervals only
            layers = {
                layer: {"norm": float(norm), "counts": counts.int().tolist()}
                for layer, (norm, counts) in record.items()
            }
            self.latest = {layer: {"step": step, **values} for layer, values in layers.items()}
            lines.append(json.dumps({"step": step, "layers": layers}))
        self._pending.clear()
        if self.config.file:
            path = engine.run_dir / self.config.file
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as fh:
                fh.write("\n".join(lines) + "\n")
