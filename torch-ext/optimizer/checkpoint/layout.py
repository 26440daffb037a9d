"""The state layout: the keys every group and parameter carries, and how a live group is stamped
with them (the package docstring says what each means)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..adamw import ADAMW_STATE_KEYS
from ..qk_clip import QKClipConfig, config_record
from ..row_blocks import ROW_BLOCKS_KEY, row_blocks_for_checkpoint
from ..settings import GROUP_OPTIONS

LAYOUT_VERSION = 2
VERSION_KEY = "muon_state_version"
QK_CLIP_KEY = "qk_clip_settings"

MOMENTUM_KEY, ROW_STATE_KEY = "momentum_buffer", "normuon_v"
MUON_STATE_KEYS = frozenset({MOMENTUM_KEY})
NORMUON_STATE_KEYS = frozenset({MOMENTUM_KEY, ROW_STATE_KEY})
ADAMW_STATE_KEYS_SET = frozenset(ADAMW_STATE_KEYS)
# How this machine runs and stores the step: on load, the loading optimizer keeps its own value.
KEPT_GROUP_OPTIONS = tuple(dict.fromkeys(o.name for o in GROUP_OPTIONS if o.kept_on_load))
# State whose dtype is the optimizer's choice, not the parameter's: kept out of torch's cast on load.
KEPT_DTYPE_STATE = (MOMENTUM_KEY, ROW_STATE_KEY)


def qk_clip_record(cfg: QKClipConfig | None) -> dict[str, Any]:
    """The savable part of a QK-clip config (same keys whether it is on or off)."""
    return config_record(cfg)


# The keys layout version 1 wrote before fused QKV and MLA existed: still loadable.
OLD_QK_KEYS = frozenset({"threshold", "head_dim", "q_patterns", "k_patterns", "custom_classify"})


def stamp_group(group: dict, cfg: QKClipConfig | None) -> None:
    """Write the layout version and the current QK-clip settings into a live param group.

    A Muon group also always carries ``muon_row_blocks`` (None: whole matrices), because DCP
    loads only the keys the live state dict has: without it, a checkpoint's blocks would never
    be read back to be compared.
    """
    group[VERSION_KEY] = LAYOUT_VERSION
    group[QK_CLIP_KEY] = qk_clip_record(cfg)
    if group.get("use_muon"):
        group.setdefault(ROW_BLOCKS_KEY, None)


def with_plain_row_blocks(state: dict, live_groups: Sequence[Mapping], names: Sequence[str]) -> dict:
    """A state dict whose Muon groups hold their row blocks as plain strings, one per parameter
    (``row_blocks.row_blocks_for_checkpoint``; ``names``: every parameter's, in group order)."""
    start = 0
    for live, group in zip(live_groups, state["param_groups"]):
        mine = names[start: start + len(live["params"])]
        start += len(live["params"])
        if live["use_muon"]:
            group[ROW_BLOCKS_KEY] = row_blocks_for_checkpoint(live.get(ROW_BLOCKS_KEY), mine)
    return state
