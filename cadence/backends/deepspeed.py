"""DeepSpeed ZeRO 0-3 behind the same loop, callbacks and checkpoints.

The engine's loop stays in charge: gradient accumulation is Cadence's
(`"managed_gradient_accumulation": false`: each micro-batch's
`ds.backward(loss / n, scale_wrt_gas=False)` only accumulates, one `ds.step()`
per optimizer step reduces, clips and updates), so micro-batch events fire as
on every other backend and a short last step still averages over the
micro-batches it has. The optimizer is the user's torch optimizer; LR
schedulers stay with Cadence's `LRScheduler` (DeepSpeed never steps them).

What DeepSpeed does itself and how Cadence sees it (docs/backends.md, "DeepSpeed"):

- ZeRO >= 1 skips a step whose gradients are not finite: `optimizer_step`
  returns False, the loop counts it as an agreed skip (the LR scheduler does
  not step, EMA does not average, `state.skipped_steps` counts it).
- A skip Cadence agreed (NonFiniteSkip, a callback's request) clears what
  DeepSpeed accumulated, per ZeRO stage, through DeepSpeed internals: the
  DeepSpeed version is pinned exactly (`cadence[deepspeed]`).
- Clipping happens inside `ds.step()`, after DeepSpeed's reduction;
  `GradClip` sets its `max_norm` at run time and gets back a 0-d tensor that
  the step fills with DeepSpeed's global pre-clip norm.
- Checkpoints are DeepSpeed engine checkpoints (`DeepSpeedStore`) with
  Cadence's payload in the client state.

DeepSpeed is imported when the backend is built, never at `import cadence`.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs
import torch
import torch.distributed as dist

from cadence.backends.ddp import DEFAULT_TIMEOUT, DDPBackend
from cadence.backends.flight_recorder import DEFAULT_ENTRIES
from cadence.backends.process_group import GroupSettings
from cadence.engine.backend import NULL_CONTEXT, LocalParameter, move_to
from cadence.engine.step import Step, nothing
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine, EngineConfig

#: `steps_per_print` Cadence sets: DeepSpeed's own progress lines stay out of the way.
QUIET_STEPS = 2**31 - 1


def _clipping_conflict(max_norm: float, norm_type: float, configured: Any) -> str | None:
    """Why DeepSpeed cannot clip as a callback asks (its `clipping`: max_norm, norm_type), or None."""
    if norm_type != 2.0:
        return f"DeepSpeed clips by the 2-norm only; GradClip(norm_type={norm_type!r}) asks for another"
    if configured and configured != max_norm:
        return (
            f"GradClip(max_norm={max_norm}) and the DeepSpeed config's gradient_clipping={configured} disagree; "
            "set one of them"
        )
    return None


@attrs.define(kw_only=True)
class DeepSpeedConfig:
    """How the DeepSpeed backend configures DeepSpeed.

    Cadence's own settings become DeepSpeed keys: `zero_stage` ->
    `zero_optimization.stage`, `precision` -> `bf16.enabled` / `fp16.enabled`,
    the engine's `grad_accum` -> `gradient_accumulation_steps`, the train
    `batch_size` -> `train_micro_batch_size_per_gpu`, GradClip's `max_norm` ->
    `gradient_clipping` (set at run time). `deepspeed` holds any other raw
    DeepSpeed key (`zero_optimization.overlap_comm`, `bf16.immediate_grad_update`,
    ...); a raw key that contradicts one Cadence sets is an error naming both.

    Attributes:
        zero_stage: ZeRO stage 0 (data parallel), 1 (optimizer states partitioned), 2 (+ gradients), 3 (+ parameters).
        precision: "fp32", "bf16" (DeepSpeed keeps bf16 weights with fp32 masters; batches' floating tensors are
            cast to bf16) or "fp16" (CUDA only); None: the engine's `precision`.
        deepspeed: raw DeepSpeed config keys merged into the generated config.
        shm_comm: let `deepspeed.init_distributed` build DeepSpeed's shared-memory op on CPU (a JIT compile of
            about a minute the first time; it serves only inference all-reduce, training collectives go through
            torch.distributed either way).
        timeout: collective timeout in seconds, in steady state.
        init_timeout, init_steps, flight_recorder: how the process group starts, as `DDPBackend`'s
            (`cadence.backends.process_group.GroupSettings`).
        device: `"cuda"` is `cuda:LOCAL_RANK`; None: that GPU with CUDA, else the CPU (`cadence.backends.device`).
    """

    zero_stage: int = attrs.field(default=0, validator=attrs.validators.in_((0, 1, 2, 3)))
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    deepspeed: dict[str, Any] = attrs.field(factory=dict)
    shm_comm: bool = False
    timeout: float = attrs.field(default=DEFAULT_TIMEOUT.total_seconds(), validator=attrs.validators.gt(0))
    init_timeout: float | None = None
    init_steps: int = 1
    flight_recorder: int = DEFAULT_ENTRIES
    device: str | None = None


class DeepSpeedBackend(DDPBackend):
    """DeepSpeed's engine (ZeRO 0-3) over a torch.distributed process group.

    Collectives, agreement and domains are DDP's (data and optimizer domains
    are the world); placement, backward, the optimizer step, skips, clipping
    and checkpoints go through DeepSpeed. One process works too (a gloo group
    of one is created when no launcher set the environment).

    Args:
        config: a `DeepSpeedConfig` or a mapping of its fields.
        **kwargs: `DeepSpeedConfig` fields (`zero_stage=2`, `deepspeed={...}`).

    Raises:
        ImportError: DeepSpeed is not installed (install `cadence[deepspeed]`).
        ValueError: fp16 without CUDA, or conflicting settings (at setup,
            before DeepSpeed starts).

    Example:
        >>> engine = cadence.Engine(model, torch.optim.AdamW(model.parameters()), data,   # doctest: +SKIP
        ...     loss_fn=loss_fn, backend=DeepSpeedBackend(zero_stage=2), precision="bf16")
    """

    name = "deepspeed"

    def __init__(
        self, config: DeepSpeedConfig | Mapping[str, Any] | None = None, *, ft: Any = None, **kwargs: Any
    ) -> None:
        if ft is not None:  # TorchFT: refused before anything starts (cadence.backends.ft)
            from cadence.backends.ft import check_deepspeed

            check_deepspeed()
        self.options = config_module.configure(DeepSpeedConfig, config, kwargs, "deepspeed")
        self._deepspeed = _require_deepspeed()
        precision = self.options.precision or "fp32"
        self._check_fp16(precision, self.options.device)
        super().__init__(device=self.options.device, precision="fp32", checkpoint="file")
        self.group_settings = GroupSettings.of("deepspeed", self.options)  # timeouts, flight recorder
        self.precision_name = precision
        self.zero_stage = self.options.zero_stage
        self.ds: Any = None  # the DeepSpeed engine
        self.ds_config: dict[str, Any] = {}
        self._dtype: torch.dtype | None = None
        self._norm: torch.Tensor | None = None  # the deferred clipping norm (see clip_grad_norm_)
        self._clip: float | None = None
        self._zero0_norm: Any = None
        self._groups_before: dict[str, Any] | None = None
        self._env_set: list[str] = []  # launcher variables this backend set for a process without one

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> DeepSpeedBackend:
        return cls(device=config.device, precision=config.precision)

    @staticmethod
    def _check_fp16(precision: str, device: str | None) -> None:
        if precision == "fp16" and (not torch.cuda.is_available() or (device and torch.device(device).type != "cuda")):
            raise ValueError(
                "DeepSpeedBackend(precision='fp16'): DeepSpeed's fp16 needs a CUDA device and none is used here "
                "(DeepSpeed's CPU accelerator refuses it at initialize); use precision='bf16' or 'fp32'"
            )

    # -- lifecycle --------------------------------------------------------

    def setup(self, engine: Engine) -> None:
        if len(engine.optimizers) != 1:
            raise ValueError(
                f"DeepSpeedBackend: DeepSpeed drives exactly one optimizer, the engine has {len(engine.optimizers)}; "
                "pass one torch optimizer to Engine(...)"
            )
        if self.options.precision is None and engine.config.precision != self.precision_name:
            self.precision_name = engine.config.precision
        self._check_fp16(self.precision_name, self.options.device)
        self.ds_config = build_config(
            self.options, self.precision_name, engine.config.grad_accum, engine.config.train.batch_size
        )
        for callback in engine.callbacks:  # a clipping callback (GradClip) that DeepSpeed cannot follow: now
            clipping = getattr(callback, "clipping", None)  # (max_norm, norm_type)
            if clipping is not None:
                conflict = _clipping_conflict(clipping[0], clipping[1], self.ds_config.get("gradient_clipping"))
                if conflict:
                    raise ValueError(f"DeepSpeedBackend: {conflict}")
        if self._fp16_in(self.ds_config) and not torch.cuda.is_available():
            raise ValueError(
                "DeepSpeedBackend: the DeepSpeed config enables fp16 (fp16.enabled) but there is no CUDA device; "
                "DeepSpeed's CPU accelerator refuses fp16: use bf16 or fp32"
            )
        if not dist.is_initialized():
            self._join_group()
        self.group = dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.data_rank, self.data_size = self.rank, self.world_size
        self.device = self.rank_device()  # `cuda` is this rank's local GPU (cadence.backends.device)
        self._init_deepspeed_comm()
        deepspeed = self._deepspeed
        if self.created_group:
            self._groups_before = _deepspeed_group_state()
        ds, _, _, _ = deepspeed.initialize(
            model=engine.model, optimizer=engine.optimizers[0], config=self.ds_config, dist_init_required=False
        )
        self.ds = ds
        self._dtype = torch.bfloat16 if self.precision_name == "bf16" else None
        engine.wrapped_model = ds
        if self.zero_stage == 0 and hasattr(ds, "clip_fp32_gradients"):
            # ZeRO-0 with a torch optimizer keeps no global norm: record the one its clipping computes.
            ds.clip_fp32_gradients = self._clip_zero0

    def _join_group(self) -> None:
        if all(name in os.environ for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
            self.start_process_group()
            return
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            self.start_process_group()  # raises, naming what is missing
        # One process without a launcher: a group of one on an in-memory store. DeepSpeed reads the launcher's
        # variables itself (LOCAL_RANK is required): set those of one process. Set only for this engine and taken
        # back at teardown: left in the process, they would make a later engine (or a child) believe it was launched.
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            if name not in os.environ:
                os.environ[name] = value
                self._env_set.append(name)
        dist.init_process_group(
            self.process_group_backend_name(), store=dist.HashStore(), rank=0, world_size=1, timeout=self.timeout
        )
        self.created_group = True

    def _init_deepspeed_comm(self) -> None:
        """`deepspeed.init_distributed` on the existing group, without the shm op unless asked for."""
        import importlib

        # `import deepspeed.comm.torch as m` would bind torch itself (deepspeed.comm has a `torch` attribute).
        ds_torch: Any = importlib.import_module("deepspeed.comm.torch")
        build = ds_torch.build_shm_op
        if not self.options.shm_comm:
            ds_torch.build_shm_op = lambda: None
        try:
            self._deepspeed.init_distributed(
                dist_backend=dist.get_backend(), timeout=self.timeout, dist_init_required=False, verbose=False
            )
        finally:
            ds_torch.build_shm_op = build

    def teardown(self) -> None:
        self.ds = None
        for name in self._env_set:
            os.environ.pop(name, None)
        self._env_set = []
        _restore_linear()
        if self.created_group:
            # The group is destroyed below: DeepSpeed's module-level handles on it (its comm
            # backend, the groups it derived) go back to what they were, so that a later engine
            # in this process starts DeepSpeed on a fresh group.
            import importlib

            ds_comm: Any = importlib.import_module("deepspeed.comm.comm")
            ds_comm.cdb = None
            groups = importlib.import_module("deepspeed.utils.groups")
            for name, value in (self._groups_before or {}).items():
                setattr(groups, name, value)
            self._groups_before = None
        super().teardown()

    @staticmethod
    def _fp16_in(config: Mapping[str, Any]) -> bool:
        fp16 = config.get("fp16")
        return isinstance(fp16, Mapping) and bool(fp16.get("enabled"))

    # -- the step ---------------------------------------------------------

    def build_step(self, engine: Engine) -> Step:
        self.arm_timeout_switch(engine)  # init_timeout until the first steps end (cadence.backends.process_group)
        return Step(
            optimizer_step=self._step,
            to_device=self.to_device if self.moves_batches else None,
            backward=self.backward,
            skip_step=self._skip,
            zero_grad=nothing,  # DeepSpeed zeroes in its step
        )

    def agreement_mode(self, engine: Engine) -> Literal["inline", "blocking", "overlapped"]:
        return "inline" if self.world_size == 1 else super().agreement_mode(engine)

    @property
    def moves_batches(self) -> bool:
        return self.device.type != "cpu" or self._dtype is not None

    def to_device(self, batch: Any) -> Any:
        """Move a batch to the device; under bf16, cast its floating tensors to bf16 (DeepSpeed's weights are)."""
        batch = move_to(batch, self.device, non_blocking=self.device.type == "cuda")
        return batch if self._dtype is None else _cast_floating(batch, self._dtype)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return NULL_CONTEXT  # DeepSpeed's bf16 keeps bf16 weights: nothing to autocast

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        # Cadence's own scaling: the feed's last step may have fewer than grad_accum micro-batches.
        self.ds.backward(loss / micro_batches if micro_batches > 1 else loss, scale_wrt_gas=False)

    def _step(self) -> bool | None:
        ds = self.ds
        ds.step()
        applied = ds.was_step_applied()
        norm = self._norm
        if norm is not None and self._clip is not None:
            value = ds.get_global_grad_norm() if self._zero0_norm is None else self._zero0_norm
            self._zero0_norm = None
            if not applied:  # DeepSpeed's own skip: it computed no norm (get_global_grad_norm() reads inf)
                norm.fill_(math.nan)
            elif isinstance(value, torch.Tensor):
                norm.copy_(value.detach().reshape(()))
            else:
                norm.fill_(math.nan if value is None else float(value))
        return None if applied else False

    def optimizer_step(self, engine: Engine) -> bool | None:
        return self._step()

    def _skip(self) -> None:
        clear_accumulated(self.ds, self.zero_stage)
        if self._norm is not None and self._clip is not None:
            self._norm.fill_(math.nan)  # no norm was computed for a skipped step

    def skip_step(self, engine: Engine) -> None:
        self._skip()

    def zero_grad(self, engine: Engine) -> None:
        if self.ds is not None:
            clear_accumulated(self.ds, self.zero_stage)

    def clip_grad_norm_(self, engine: Engine, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Have DeepSpeed clip to `max_norm` inside its step; returns the pre-clip norm, filled by that step.

        The returned 0-d tensor is the same every step and holds DeepSpeed's
        global 2-norm over all gradients (after its reduction) once
        `optimizer_step` ran; NaN for a skipped step. Only the 2-norm.
        """
        ds = self.ds
        if self._clip != max_norm or norm_type != 2.0:
            conflict = _clipping_conflict(max_norm, norm_type, self.ds_config.get("gradient_clipping"))
            if conflict:  # checked at setup for the callbacks registered then; here for one added later
                raise ValueError(f"DeepSpeedBackend: {conflict}")
            ds._config.gradient_clipping = max_norm
            if hasattr(ds.optimizer, "clip_grad"):
                ds.optimizer.clip_grad = max_norm
            self._clip = max_norm
        if self._norm is None:
            self._norm = torch.full((), math.nan, dtype=torch.float32, device=self.device)
        return self._norm

    def _clip_zero0(self) -> None:
        from deepspeed.runtime.utils import clip_grad_norm_

        ds = self.ds
        self._zero0_norm = clip_grad_norm_(
            parameters=ds.module.parameters(), max_norm=ds.gradient_clipping(), mpu=ds.mpu
        )

    # -- what callbacks see ------------------------------------------------

    def local_parameters(self, engine: Engine) -> list[LocalParameter]:
        """ZeRO-3: each parameter's partition on this rank (`ds_tensor`); else the parameters themselves."""
        found = []
        for name, param in engine.model.named_parameters():
            if not param.requires_grad:
                continue
            local = getattr(param, "ds_tensor", None) if self.zero_stage == 3 else None
            found.append(LocalParameter(name, param, param if local is None else local))
        return found

    def local_gradients(self, engine: Engine) -> list[torch.Tensor]:
        """This rank's gradients before the step: ZeRO 0/1 the (unreduced) `.grad`, ZeRO-2 its partitioned buffers, ZeRO-3 its partitions."""
        if self.zero_stage <= 1:
            return [p.grad for p in engine.model.parameters() if p.grad is not None]
        if self.zero_stage == 3:
            from deepspeed.utils import safe_get_local_grad

            grads = (safe_get_local_grad(p) for p in engine.model.parameters() if p.requires_grad)
            return [g for g in grads if g is not None]
        # ZeRO-2 before the step: the reduced, accumulated gradients of the parameters that
        # overlap this rank's partition (`all_grad_tensors`, one list per group); after
        # `finalize_gradient_accumulation_boundary`, the flat partitions (`averaged_gradients`).
        optimizer = self.ds.optimizer
        found: list[torch.Tensor] = []
        for store in (optimizer.all_grad_tensors, optimizer.averaged_gradients):
            for group in store.values():
                if group is not None:
                    found.extend(t for t in (group if isinstance(group, (list, tuple)) else [group]) if t is not None)
            if found:
                break
        return found

    @property
    def checks_gradients_itself(self) -> bool:
        """True at ZeRO >= 1: DeepSpeed's ZeRO optimizer skips non-finite steps itself."""
        return self.zero_stage >= 1

    def evaluation(self, engine: Engine) -> contextlib.AbstractContextManager[Any]:
        """ZeRO-3: gathered parameters are released around evaluation; otherwise nothing.

        ZeRO-3 keeps gathered copies of parameters between forwards. A callback
        that writes the local partitions for evaluation (EMA's swap, through
        `local_parameters`) needs the evaluation forwards to gather them anew,
        and training after it to gather the restored ones.
        """
        if self.zero_stage != 3 or self.ds is None:
            return NULL_CONTEXT
        return self._regathered()

    @contextlib.contextmanager
    def _regathered(self) -> Any:
        self.ds.empty_partition_cache()
        try:
            yield
        finally:
            self.ds.empty_partition_cache()

    # -- state ------------------------------------------------------------

    def model_state_dict(self, engine: Engine) -> dict[str, Any]:
        """The plain module's state; under ZeRO-3 gathered from every rank (a collective, a full copy)."""
        if self.zero_stage != 3:
            return engine.model.state_dict()
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters(list(engine.model.parameters())):
            return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}

    def load_model_state_dict(self, engine: Engine, state: dict[str, Any], strict: bool = True) -> Any:
        return self.load_module_weights(engine.model, state, strict=strict)

    def load_module_weights(self, module: torch.nn.Module, state: Mapping[str, Any], strict: bool = True) -> Any:
        """Load whole weights into the module DeepSpeed wraps (ZeRO-3: gathered, rank 0's values
        partitioned), then refresh the optimizer's fp32 master copies from them."""
        if self.zero_stage != 3:
            result = module.load_state_dict(state, strict=strict)
        else:
            from deepspeed.runtime.zero.partition_parameters import GatheredParameters

            with GatheredParameters(list(module.parameters()), modifier_rank=0):
                result = module.load_state_dict(state, strict=strict)
        if self.ds is not None and (self.zero_stage >= 1 or self._dtype is not None):
            # The optimizer's fp32 master copies must follow the new weights.
            refresh = getattr(self.ds.optimizer, "refresh_fp32_params", None)
            if callable(refresh):
                refresh()
        return result

    def checkpoint_store(self, engine: Engine) -> Any:
        from cadence.checkpoint.deepspeed_store import DeepSpeedStore

        return DeepSpeedStore(backend=self)

    def describe(self) -> str:
        return f"deepspeed(rank={self.rank}/{self.world_size}, zero={self.zero_stage}, {self.precision_name}, device={self.device})"


# -- config -----------------------------------------------------------------------------


def build_config(options: DeepSpeedConfig, precision: str, grad_accum: int, micro_batch: int) -> dict[str, Any]:
    """The DeepSpeed config: Cadence's settings as DeepSpeed keys, merged with the raw ones.

    Raises:
        ValueError: listing every raw key that contradicts Cadence's value
            (`key: DeepSpeed config X, Cadence Y (from ...)`), and keys Cadence
            owns (`optimizer`, `scheduler`).
    """
    ours: dict[str, tuple[Any, str]] = {
        "train_micro_batch_size_per_gpu": (micro_batch, "the train batch_size"),
        "gradient_accumulation_steps": (grad_accum, "the engine's grad_accum"),
        "managed_gradient_accumulation": (False, "Cadence's loop accumulates"),
        "zero_optimization.stage": (options.zero_stage, "zero_stage"),
        "bf16.enabled": (precision == "bf16", f"precision={precision!r}"),
        "fp16.enabled": (precision == "fp16", f"precision={precision!r}"),
    }
    raw = options.deepspeed
    problems = []
    for key, why in (
        ("optimizer", "pass a torch optimizer to Engine(...) instead"),
        ("scheduler", "pass the scheduler to Engine(scheduler=...): Cadence's LRScheduler steps it"),
    ):
        if key in raw:
            problems.append(f"{key}: set in the DeepSpeed config; {why}")
    for key, (value, source) in ours.items():
        given = _get(raw, key)
        if given is not _MISSING and given != value:
            problems.append(f"{key}: DeepSpeed config {given!r}, Cadence {value!r} (from {source})")
    if "train_batch_size" in raw and isinstance(raw["train_batch_size"], int):
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        expected = micro_batch * grad_accum * world
        if raw["train_batch_size"] != expected:
            problems.append(
                f"train_batch_size: DeepSpeed config {raw['train_batch_size']}, Cadence {expected} "
                f"(batch_size {micro_batch} x grad_accum {grad_accum} x {world} ranks)"
            )
    if problems:
        raise ValueError(
            "DeepSpeedBackend: the DeepSpeed config contradicts Cadence's settings:\n  - "
            + "\n  - ".join(problems)
            + "\nchange the Cadence setting or drop the key from DeepSpeedConfig.deepspeed"
        )
    # Any torch optimizer is the user's to choose (DeepSpeed otherwise refuses all but its Adam-likes under ZeRO).
    config: dict[str, Any] = {"steps_per_print": QUIET_STEPS, "zero_allow_untested_optimizer": True}
    for key, (value, _) in ours.items():
        if key == "fp16.enabled" and not value and _get(raw, key) is _MISSING:
            continue
        _set(config, key, value)
    return _merge(config, raw)


_MISSING = object()


def _get(data: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return _MISSING
        data = data[part]
    return data


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[last] = value


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _deepspeed_group_state() -> dict[str, Any]:
    """DeepSpeed's module-level process-group handles (`deepspeed.utils.groups`), copied."""
    import importlib

    groups = importlib.import_module("deepspeed.utils.groups")
    state = {}
    for name, value in vars(groups).items():
        if name in ("mesh_device", "mpu") or (name.startswith("_") and name[1:2].isupper()):
            if callable(value) or isinstance(value, type(groups)):
                continue
            state[name] = dict(value) if isinstance(value, dict) else value
    return state


def _require_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(
            f"the DeepSpeed backend needs DeepSpeed, which is not installed ({exc}); install it with: "
            "pip install 'cadence[deepspeed]'"
        ) from exc
    return deepspeed


def _cast_floating(batch: Any, dtype: torch.dtype) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() and batch.dtype != dtype else batch
    if isinstance(batch, tuple):
        cast = [_cast_floating(x, dtype) for x in batch]
        return type(batch)(*cast) if hasattr(batch, "_fields") else tuple(cast)
    if isinstance(batch, list):
        return [_cast_floating(x, dtype) for x in batch]
    if isinstance(batch, dict):
        return type(batch)((k, _cast_floating(v, dtype)) for k, v in batch.items())
    return batch


# -- skipping a step ----------------------------------------------------------------------


def clear_accumulated(ds: Any, stage: int) -> None:
    """Drop the gradients DeepSpeed accumulated for this step, so the next step is as if it never ran.

    There is no public API for this: the sequence per stage mirrors what
    DeepSpeed's own overflow path clears (deepspeed==0.19.8, pinned), plus
    the micro-step id at stages 1-2 (without it the next backward adds onto
    the dropped buffer).
    """
    optimizer = ds.optimizer
    if stage in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

        optimizer.zero_grad(set_to_none=True)
        optimizer._release_preflattened_grad_buffers()
        if getattr(optimizer, "cpu_offload", False):
            optimizer.reset_cpu_buffers()
        else:
            # Every group, not only those `averaged_gradients` lists: right after `load_checkpoint` it is
            # empty while `all_grad_tensors` already holds this step's accumulation (DeepSpeed's own
            # overflow path runs after `finalize_gradient_accumulation_boundary` filled it; a skip here
            # comes before).
            for k in set(optimizer.averaged_gradients) | set(optimizer.all_grad_tensors):
                optimizer.averaged_gradients[k] = None
                optimizer.all_grad_tensors[k] = None
        optimizer.micro_step_id = INITIAL_MICRO_STEP_ID
    elif stage == 3:
        optimizer.zero_grad(set_to_none=True)
    else:
        clear = getattr(optimizer, "clear_hp_grads", None)  # bf16 at ZeRO-0 keeps fp32 gradient copies
        if callable(clear):
            clear()
    ds.zero_grad()
    if hasattr(ds, "_unmanaged_backward_count"):
        ds._unmanaged_backward_count = 0


def _restore_linear() -> None:
    """Put back `torch.nn.functional.linear` where ZeRO-3 replaced it for the whole process.

    DeepSpeed swaps in its memory-efficient linear at ZeRO-3 ("This will persist
    unless manually reset"): left there, every later model in the process runs
    through it, and a wrong input then fails with its AttributeError instead of
    torch's TypeError.
    """
    import sys

    partition = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if partition is None:
        return
    original = getattr(partition.InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None and torch.nn.functional.linear is getattr(partition, "zero3_linear_wrap", None):
        torch.nn.functional.linear = original
