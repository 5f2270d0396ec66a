"""Which model keys a checkpoint holds: all, or only the trainable parameters (`Checkpoint(params="trainable")`).

An adapter-only checkpoint (LoRA-style fine-tuning) saves the parameters
with `requires_grad` and the optimizer state (which holds only those); its
manifest payload's `meta["params"]` says `"trainable"`, and a restore loads
those keys and leaves the frozen weights as the engine has them (from the
model's construction or `pretrained=`). Every payload records the trainable
keys in `meta["trainable"]` (`cadence export --params trainable` reads it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

PARAMS = ("all", "trainable")
#: Module names wrappers put into parameter names, absent from the backends' state-dict keys.
WRAPPERS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def trainable_keys(engine: Engine, keys: Iterable[str]) -> list[str]:
    """The state-dict `keys` of parameters with `requires_grad`, in `keys`' order.

    Raises `ValueError` when a trainable parameter has no key among `keys`
    (a wrapper that renames parameters): the save would silently miss it.
    """
    present = list(keys)
    known = set(present)
    wanted = set()
    for name, param in engine.model.named_parameters():
        if not param.requires_grad:
            continue
        key = name if name in known else _clean(name)
        if key not in known and key.startswith("module.") and key[len("module.") :] in known:
            key = key[len("module.") :]
        if key not in known:
            raise ValueError(
                f"trainable parameter {name!r} has no key in the model's state dict (keys like "
                f"{sorted(known)[:3]}): a wrapper renames it; save with Checkpoint(params='all')"
            )
        wanted.add(key)
    return [k for k in present if k in wanted]


def select(engine: Engine, model_state: Mapping[str, Any], params: str) -> dict[str, Any]:
    """`model_state` as a payload holds it under `params` (`"all"`: unchanged)."""
    if params == "all":
        return dict(model_state)
    if params != "trainable":
        raise ValueError(f"params={params!r}: expected one of {PARAMS}")
    keep = set(trainable_keys(engine, model_state))
    return {k: v for k, v in model_state.items() if k in keep}


def recorded(engine: Engine, keys: Iterable[str]) -> list[str] | None:
    """`trainable_keys` for the record in every payload's meta; None where a wrapper hides the names (a full
    save never fails over the record)."""
    try:
        return trainable_keys(engine, keys)
    except ValueError:
        return None
