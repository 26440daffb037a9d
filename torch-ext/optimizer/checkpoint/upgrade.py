"""Checkpoints of earlier layouts and of ``torch.optim.Muon`` in today's layout, and options a
checkpoint predates filled from the live group."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..qk_clip import QKClipConfig
from ..row_blocks import ROW_BLOCKS_KEY
from ..settings import held_options, kind_of, resolve_adjust_lr_fn
from .layout import LAYOUT_VERSION, QK_CLIP_KEY, VERSION_KEY, qk_clip_record

logger = logging.getLogger("optimizer.muon")


def is_torch_muon(state_dict: Mapping) -> bool:
    """A ``torch.optim.Muon`` state dict: groups with its keys, none of ours."""
    groups = state_dict.get("param_groups") or []
    return bool(groups) and all(
        isinstance(g, Mapping) and "adjust_lr_fn" in g and "ns_steps" in g and "use_muon" not in g
        and VERSION_KEY not in g for g in groups)


def upgrade(state_dict: Any, live_groups: Sequence[Mapping], qk_clip: QKClipConfig | None) -> Any:
    """``state_dict`` in this layout version: a ``torch.optim.Muon`` state dict's groups become Muon
    groups (``adjust_lr_fn`` read as torch reads it), a version-1 checkpoint's Muon groups get
    their Newton–Schulz ``eps`` (module docstring), and options a checkpoint predates take the
    live group's values (of any checkpoint: the options every group holds, as torch's optimizers
    give a state dict from before a flag its default).  Anything else is returned as it is, for
    :func:`check_loadable` to judge."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("param_groups"), list):
        return state_dict
    saved = state_dict["param_groups"]
    torch_muon = is_torch_muon(state_dict)
    if not torch_muon and not any(isinstance(g, Mapping) and g.get(VERSION_KEY) == 1 for g in saved):
        return {**state_dict, "param_groups": [_with_held_options(g, live_groups[gi] if gi < len(live_groups) else {})
                                               for gi, g in enumerate(saved)]}
    groups = []
    for gi, group in enumerate(saved):
        group = dict(group)
        live = live_groups[gi] if gi < len(live_groups) else {}
        if torch_muon:
            resolve_adjust_lr_fn(group, f"torch.optim.Muon checkpoint param_groups[{gi}]")
            group.update({"use_muon": True, VERSION_KEY: LAYOUT_VERSION, QK_CLIP_KEY: qk_clip_record(qk_clip),
                          ROW_BLOCKS_KEY: None})
            logger.info("Muon.load_state_dict: param_groups[%d] is torch.optim.Muon's; its momentum carries over", gi)
        elif group.get(VERSION_KEY) == 1:
            if group.get("use_muon") and "eps" in live:
                group["eps"] = live["eps"]  # version 1 kept AdamW's eps here; NS eps was not saved
            group[VERSION_KEY] = LAYOUT_VERSION
        for key, value in live.items():
            if key not in group and key != "params":
                group[key] = value
        groups.append(group)
    return {**state_dict, "param_groups": groups}


def _with_held_options(saved: Any, live: Mapping) -> Any:
    """A checkpoint group with the options every group of its kind holds that it lacks (saved
    before them) taken from the live group; any other value as it is."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("use_muon"), bool):
        return saved
    missing = {name: live[name] for name in held_options(kind_of(saved)) if name not in saved and name in live}
    return {**saved, **missing} if missing else saved


def upgrade_pickled_groups(param_groups: list[dict], ns_eps: float) -> None:
    """A pickled (not state-dict) optimizer from before version 2: its Muon groups' ``eps`` is the
    Newton–Schulz eps it kept as an attribute."""
    for group in param_groups:
        if group.get("use_muon"):
            group["eps"] = ns_eps
        if VERSION_KEY in group:
            group[VERSION_KEY] = LAYOUT_VERSION
