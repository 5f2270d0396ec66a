"""Weights & Biases logging (the `[wandb]` extra), online or offline, resumable."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs

from cadence.callbacks.metrics import is_main
from cadence.callbacks.tensorboard import tag
from cadence.engine.callback import Callback
from cadence.engine.order import Order
from cadence.run import config as config_module
from cadence.run.registry import require

if TYPE_CHECKING:
    from cadence.engine.engine import Engine


@attrs.define(kw_only=True)
class WandBConfig:
    """The W&B run `WandB` logs to (see `wandb.init`).

    Attributes:
        project: the W&B project (None: W&B's default / `WANDB_PROJECT`).
        entity: the team or user (None: your default).
        group: groups runs (e.g. the lineage) in the UI.
        name: the run's display name (None: the run directory's name).
        tags: run tags.
        mode: `online`, `offline` (nothing leaves the machine; `wandb sync` later)
            or `disabled`; None: W&B's default / `WANDB_MODE`.
        dir: where W&B writes its files (None: the run directory).
        resume: how a checkpoint resume reattaches to the saved run id:
            `allow` (continue it, or create it if unknown), `must` (fail if unknown; needs the server)
            or `rewind` (continue it from the checkpoint's step: W&B drops what the stopped run
            logged after it; `wandb.init(resume_from=...)`, a W&B preview feature the server must allow).
        init_timeout: seconds `wandb.init` may take before failing (no endless hang on a dead network).
    """

    project: str | None = None
    entity: str | None = None
    group: str | None = None
    name: str | None = None
    tags: tuple[str, ...] = ()
    mode: Literal["online", "offline", "disabled"] | None = None
    dir: str | None = None
    resume: Literal["allow", "must", "rewind"] = "allow"
    init_timeout: float = attrs.field(default=90.0, validator=attrs.validators.gt(0))


class WandB(Callback):
    """Logs `engine.logged` to a W&B run at `step = state.step` (main process only).

    The run starts at the first `on_log` (after any checkpoint restore) with
    the unstructured run config, and finishes at teardown. Its id is kept in
    the callback state, so a resumed run calls `wandb.init(id=..., resume=...)`
    and continues the same W&B run. W&B keeps a run's steps increasing: with
    `resume="allow"` the steps the stopped run logged after its checkpoint keep
    its values (the resumed run's logs at those steps are dropped by W&B); with
    `resume="rewind"` the run is rewound to the restored step
    (`resume_from="{id}?_step={step}"`), so the resumed run's values replace
    them. Metric names map to W&B keys with dots
    as slashes (`val.loss` -> `val/loss`), which W&B groups into sections.
    Offline mode needs no network: the run is written under `dir` and can be
    uploaded later with `wandb sync`.

    Order: `Order.LOGGER` (90).

    Example:
        >>> from cadence.callbacks.wandb import WandB
        >>> WandB(project="demo", mode="offline", tags=["baseline"]).config.tags
        ('baseline',)
    """

    order = Order.LOGGER
    raises_requests = False

    def __init__(self, config: WandBConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(WandBConfig, config, kwargs, "WandB")
        require("wandb", "wandb")
        self.run: Any = None
        self.run_id: str | None = None
        self._restored_step: int | None = None  # the step of a checkpoint restore, to rewind to

    # -- state --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")

    # -- events -------------------------------------------------------------------

    def on_load(self, engine: Engine) -> None:
        self._restored_step = engine.state.step
        # A restore inside a live run: reattach to the checkpoint's run id (rewound) at the next log.
        if self.run is not None and (self.run.id != self.run_id or self.config.resume == "rewind"):
            self._finish()

    def on_log(self, engine: Engine) -> None:
        if not is_main(engine) or not engine.logged:
            return
        run = self.run or self._start(engine)
        run.log({tag(name): value for name, value in engine.logged.items()}, step=engine.state.step)

    def on_exception(self, engine: Engine) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)
            self.run = None

    def on_teardown(self, engine: Engine) -> None:
        self._finish()

    # -- the run -----------------------------------------------------------------

    def _start(self, engine: Engine) -> Any:
        wandb = require("wandb", "wandb")
        config = self.config
        directory = config.dir if config.dir is not None else str(engine.run_dir)
        os.makedirs(directory, exist_ok=True)
        try:
            run_config = config_module.unstructure(engine.run_config)
        except TypeError:
            run_config = {}
        resume, resume_from = None, None
        if self.run_id is not None:  # a checkpoint resume or a second fit: the same W&B run
            resume = config.resume
            if resume == "rewind":
                # Only a checkpoint restore has a step to go back to; a second fit just continues.
                if self._restored_step is not None:
                    resume, resume_from = None, f"{self.run_id}?_step={self._restored_step}"
                else:
                    resume = "allow"
        self._restored_step = None
        self.run = wandb.init(
            project=config.project,
            entity=config.entity,
            group=config.group,
            name=config.name or engine.run_dir.name,
            tags=list(config.tags) or None,
            mode=config.mode,
            dir=directory,
            config=run_config,
            id=self.run_id,
            resume=resume,
            resume_from=resume_from,
            reinit="create_new",  # several engines in one process each get their own run
            settings=wandb.Settings(init_timeout=config.init_timeout),
        )
        self.run_id = self.run.id
        return self.run

    def _finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


__all__ = ["WandB", "WandBConfig"]
