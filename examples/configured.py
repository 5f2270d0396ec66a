"""A script whose whole configuration comes from one attrs class and the command line.

    python examples/configured.py                               # the defaults
    python examples/configured.py optim.lr=3e-4 engine.steps=50
    python examples/configured.py --config run.yaml model.hidden=[64,64] model.dropout=None
    python examples/configured.py --help                        # every field, type, default, help

The config is built from the class defaults, then `--config FILE` (YAML, TOML
or JSON), then dotted `key=value` overrides; a wrong key or type exits with
status 2 and one line naming the dotted path. The run lands in
`workspace/lineage[-code_id]/run_id/`, whose `metadata/` records this config.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
from torch import nn

import cadence
from cadence.run.config_cli import parse_cli


@attrs.define(kw_only=True)
class ModelConfig:
    """A small multi-layer perceptron.

    Attributes:
        hidden: widths of the hidden layers.
        activation: non-linearity between layers.
        dropout: dropout probability after each hidden layer (None: no dropout layer).
    """

    hidden: list[int] = attrs.field(factory=lambda: [32, 32])
    activation: Literal["relu", "gelu", "tanh"] = "relu"
    dropout: float | None = None


@attrs.define(kw_only=True)
class OptimConfig:
    """AdamW settings.

    Attributes:
        lr: learning rate.
        weight_decay: decoupled weight decay.
        betas: Adam's moment decay rates.
        amsgrad: use the AMSGrad variant.
    """

    lr: float = attrs.field(default=1e-2, validator=attrs.validators.gt(0))
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    amsgrad: bool = False


@attrs.define(kw_only=True)
class TrainConfig:
    """Everything this script reads.

    Attributes:
        engine: the loop (steps, seed, workspace, data loading, ...).
        optim: the optimizer.
        model: the network.
        samples: size of the synthetic regression dataset.
    """

    engine: cadence.EngineConfig = attrs.field(
        factory=lambda: cadence.EngineConfig(steps=200, log_interval=20, lineage="configured")
    )
    optim: OptimConfig = attrs.field(factory=OptimConfig)
    model: ModelConfig = attrs.field(factory=ModelConfig)
    samples: int = attrs.field(default=512, validator=attrs.validators.ge(1))


def build_model(cfg: ModelConfig, inputs: int = 8) -> nn.Module:
    activation = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}[cfg.activation]
    layers: list[nn.Module] = []
    for width in cfg.hidden:
        layers += [nn.Linear(inputs, width), activation()]
        if cfg.dropout is not None:
            layers.append(nn.Dropout(cfg.dropout))
        inputs = width
    layers.append(nn.Linear(inputs, 1))
    return nn.Sequential(*layers)


def synthetic_data(samples: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """y = sin(x . w) + noise: a fixed target whatever the run's seed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=generator)
    w = torch.randn(8, 1, generator=generator)
    y = torch.sin(x @ w) + 0.05 * torch.randn(samples, 1, generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def main(argv: list[str] | None = None) -> cadence.Engine:
    cfg = parse_cli(TrainConfig, argv, prog="examples/configured.py")
    # Weights are drawn before the engine seeds everything: seed them here so they follow the config.
    torch.manual_seed(cfg.engine.seed if cfg.engine.seed is not None else 0)
    model = build_model(cfg.model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
        betas=cfg.optim.betas, amsgrad=cfg.optim.amsgrad,
    )  # fmt: skip
    engine = cadence.Engine(
        model, optimizer, synthetic_data(cfg.samples), loss_fn=nn.functional.mse_loss,
        config=cfg.engine, run_config=cfg,
    )  # fmt: skip
    print(f"run directory: {engine.run_dir} (seed {engine.seed})")

    @engine.on(cadence.Event.ON_STEP_END, every=cfg.engine.log_interval)
    def report(engine: cadence.Engine) -> None:
        print(f"step {engine.state.step:5d}  loss {float(engine.loss.detach()):.4f}")  # a sync, only every log_interval

    engine.fit()
    if engine.loss is not None:
        print(f"final loss {float(engine.loss.detach()):.4f} after {engine.state.step} steps")
    return engine


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
