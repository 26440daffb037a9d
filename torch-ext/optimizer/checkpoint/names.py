"""Parameter names as torch.distributed.checkpoint compares them (without wrapper segments), and
what differs between a checkpoint's and a live group's."""

from __future__ import annotations

from collections.abc import Mapping


# The segments torch.distributed.checkpoint drops from parameter names (``_get_fqns`` in
# torch/distributed/checkpoint/state_dict.py; torchtitan's ``canonical_fqn`` drops the second).
# DDP's ``module.`` prefix is not among them: from a name alone it cannot be told from a
# submodule called ``module``.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def canonical_name(name: str) -> str:
    """``name`` without wrapper segments: ``_orig_mod.layers.0._checkpoint_wrapped_module.w`` -> ``layers.0.w``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def _shown(names: list[str], limit: int = 5) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(f"'{n}'" for n in names[:limit]) + more


def names_mismatch(saved_names: list[str], live_names: list[str]) -> str | None:
    """What differs between a checkpoint group's parameter names and a live group's, or None.

    Names are compared without wrapper segments (:func:`canonical_name`). The answer says
    whether the same parameters come in another order, or which names only one side has.
    """
    saved = [canonical_name(n) for n in saved_names]
    live = [canonical_name(n) for n in live_names]
    if saved == live:
        return None
    saved_set, live_set = set(saved), set(live)
    only_saved = [n for n in saved if n not in live_set]
    only_live = [n for n in live if n not in saved_set]
    if not only_saved and not only_live and len(saved) == len(live):
        j = next(j for j, (a, b) in enumerate(zip(saved, live)) if a != b)
        return (
            f"the same parameters in another order (position {j} is '{saved[j]}' in the checkpoint but "
            f"'{live[j]}' here); build the param groups in the same order as the run that saved it"
        )
    parts = []
    if only_saved:
        parts.append(f"only the checkpoint has {_shown(only_saved)}")
    if only_live:
        parts.append(f"only this optimizer has {_shown(only_live)}")
    if not parts:  # same names, repeated a different number of times
        parts.append(f"the checkpoint lists {len(saved)} names and this optimizer {len(live)}")
    return (
        "; ".join(parts) + " (names compared without the wrapper segments "
        f"{', '.join(WRAPPER_SEGMENTS)}); build the optimizer from the same model, with the same "
        "param groups, as the run that saved it"
    )


def canonical_keys(row_blocks_value):
    """A ``{param_name: spec}`` value keyed by :func:`canonical_name`; any other value as it is."""
    if isinstance(row_blocks_value, Mapping):
        return {canonical_name(k): v for k, v in row_blocks_value.items()}
    return row_blocks_value
