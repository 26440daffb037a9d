"""torchtitan's ``ParamGroupConfig`` list as ``optimizer.Muon`` param groups for one model part."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from ...model_facts import ModelFacts
from ...param_groups import muon_choice_problems
from ...roles import RoleRow, RoleTable, decide
from ...row_blocks import ROW_BLOCKS_KEY
from ...settings import ADAMW, DION2, MUON, options_of
from ._torchtitan import ParamGroupConfig, canonical_fqn

logger = logging.getLogger(__name__)

# What a group's optimizer_kwargs may set: every per-group option of its kind (settings.GROUP_OPTIONS,
# so an option added there is accepted here too), except the row blocks this container sets itself
# (``fused_qkv_orthogonalization``).  A "Muon" group is Muon or Dion2 (with ``dion2_fraction``): the
# options of both; the optimizer refuses what does not fit the kind the group is (``momentum`` with
# ``dion2_fraction``, ``dion2_ef_decay`` without it), naming it.
MUON_GROUP_KEYS = frozenset(o.name for kind in (MUON, DION2) for o in options_of(kind) if o.name != ROW_BLOCKS_KEY)
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
    _check_roles(part, part_index, groups, [pg.pattern for pg in configs])
    return groups


def _check_roles(part: nn.Module, part_index: int, groups: Sequence[dict], patterns: Sequence[str]) -> None:
    """The roles' rule over the patterns' choice (``optimizer.roles``): a Muon pattern may not claim
    what Muon cannot read as a matrix (a convolution's kernel, a vector in disguise); the table of
    where each parameter went, with its role, is logged at DEBUG level."""
    facts = ModelFacts(part)
    problems = [problem for g, pattern in zip(groups, patterns) if g["use_muon"]
                for problem in muon_choice_problems(part, list(zip(g["param_names"], g["params"])),
                                                    f"param group pattern '{pattern}'", facts)]
    if problems:
        raise ValueError("MuonOptimizersContainer: " + "\n".join(problems) + "\nMatch these parameters with an AdamW "
                         "ParamGroupConfig placed before the Muon one (first match wins).")
    if logger.isEnabledFor(logging.DEBUG):
        table = RoleTable(
            RoleRow(name, tuple(p.shape), gi, "muon" if g["use_muon"] else "adamw", d.role,
                    f"pattern '{pattern}'; the role's rule: {d.rule}")
            for gi, (g, pattern) in enumerate(zip(groups, patterns)) for name, p in zip(g["param_names"], g["params"])
            for d in [decide(name, p, facts)])
        logger.debug("MuonOptimizersContainer: model part %d, where each parameter went\n%s", part_index, table)
