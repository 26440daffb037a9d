"""torchtitan's ``ParamGroupConfig`` list as ``optimizer.Muon`` param groups for one model part."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from ...row_blocks import ROW_BLOCKS_KEY
from ...settings import ADAMW, MUON, options_of
from ._torchtitan import ParamGroupConfig, canonical_fqn

# What a group's optimizer_kwargs may set: every per-group option of its kind (settings.GROUP_OPTIONS,
# so an option added there is accepted here too), except the row blocks this container sets itself
# (``fused_qkv_orthogonalization``).
MUON_GROUP_KEYS = frozenset(o.name for o in options_of(MUON) if o.name != ROW_BLOCKS_KEY)
ADAMW_GROUP_KEYS = frozenset(o.name for o in options_of(ADAMW))


def muon_param_groups(part: nn.Module, configs: Sequence[ParamGroupConfig], part_index: int,
                      row_blocks: Mapping[str, Any]) -> list[dict]:
    """Muon param groups for one model part: torchtitan's first-match-wins regex grouping."""
    claimed: set[int] = set()
    groups = []
    named = [(n, p) for n, p in part.named_parameters() if p.requires_grad]
    for pg in configs:
        if pg.optimizer_name not in ("Muon", "AdamW"):
            raise ValueError(
                f"MuonOptimizersContainer: param group '{pg.pattern}' has optimizer_name "
                f"{pg.optimizer_name!r}; use 'Muon' for matrices or 'AdamW' for the rest (one Muon runs both)."
            )
        allowed = MUON_GROUP_KEYS if pg.optimizer_name == "Muon" else ADAMW_GROUP_KEYS
        unknown = sorted(set(pg.optimizer_kwargs) - allowed)
        if unknown:
            raise ValueError(
                f"MuonOptimizersContainer: param group '{pg.pattern}' ({pg.optimizer_name}) has unknown "
                f"optimizer_kwargs {unknown}; allowed: {sorted(allowed)}."
            )
        pattern = re.compile(pg.pattern)
        matched = [(n, p) for n, p in named if id(p) not in claimed and pattern.search(n)]
        if not matched:
            raise ValueError(
                f"MuonOptimizersContainer: param group pattern '{pg.pattern}' matched no parameter of model "
                f"part {part_index}; remove it or fix the pattern."
            )
        claimed.update(id(p) for _, p in matched)
        names = [canonical_fqn(n) for n, _ in matched]
        group = {"params": [p for _, p in matched], "param_names": names,
                 "use_muon": pg.optimizer_name == "Muon", **pg.optimizer_kwargs}
        blocks = {n: row_blocks[n] for n in names if n in row_blocks}
        if group["use_muon"] and blocks:
            group[ROW_BLOCKS_KEY] = blocks
        groups.append(group)
    missing = [canonical_fqn(n) for n, p in named if id(p) not in claimed]
    if missing:
        raise ValueError(
            f"MuonOptimizersContainer: no param group pattern matches {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} (model part {part_index}); end the list with a catch-all "
            "pattern '.*'."
        )
    return groups
