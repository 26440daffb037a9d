"""Why a Dion2 group or parameter cannot be stepped, with errors that name the culprit and the fix.

Checked when a group is added (``Muon._check_group``) and again at every step before anything
changes (``step/context.py``, agreed by the ranks like every problem).  Dion2 runs on plain tensors
and DTensors (every placement), without row blocks, a split Newton–Schulz or QK-clip
(``docs/dion2.md``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..named_params import NamedParam
from ..row_blocks import ROW_BLOCKS_KEY
from ..settings import DION2, MuonSettings, kind_of


def is_dion2(group: Mapping) -> bool:
    """Whether a param group is a Dion2 (or NorDion2) group."""
    return bool(group.get("use_muon")) and kind_of(group) == DION2


def dion2_group_problem(group: Mapping, where: str, settings: MuonSettings) -> str | None:
    """What a Dion2 group asks for that single-device Dion2 does not build, or None: row blocks,
    ``ns_split="always"`` (a split Newton–Schulz needs a shard group; Dion2 here runs whole matrices),
    and QK-clip (it scales the q/k rows of Muon's updated weights; not defined for a sparse update)."""
    name = f"dion2_fraction={group.get('dion2_fraction')!r}"
    if group.get(ROW_BLOCKS_KEY) is not None:
        return (f"Muon: {where} sets `{ROW_BLOCKS_KEY}` but is a Dion2 group ({name}): row blocks (per head) are "
                f"not built for Dion2 yet. Remove `{ROW_BLOCKS_KEY}`, or put those weights in a Muon group "
                "(dion2_fraction=None)")
    if group.get("ns_split") == "always":
        return (f"Muon: {where} sets `ns_split`='always' but is a Dion2 group ({name}): Dion2 orthogonalises each "
                "chosen submatrix whole. Remove `ns_split` (or set 'never'/'auto')")
    if settings.qk_clip is not None:
        return (f"Muon: `qk_clip` is configured and {where} is a Dion2 group ({name}): QK-clip is not built for "
                "Dion2 yet. Set qk_clip=None, or make this group a Muon group (dion2_fraction=None)")
    return None


def dion2_errors(entries: Sequence[NamedParam], groups: Sequence[Mapping], settings: MuonSettings) -> list[str]:
    """This rank's problems with the Dion2 parameters of a step (found before anything changes):
    a parameter that is no matrix, and what the groups ask for."""
    errors = []
    for e in entries:
        where = f"param_groups[{e.group}]"
        problem = dion2_param_problem(e.name, e.param, where) or dion2_group_problem(groups[e.group], where, settings)
        if problem and problem not in errors:
            errors.append(problem)
    return errors


def dion2_param_problem(name: str, param: torch.Tensor, where: str) -> str | None:
    """Why a parameter of a Dion2 group (``where``) cannot be stepped, or None: Dion2 updates
    matrices (``dion2_rule.check_matrix``)."""
    if param.dim() < 2:
        return (f"Muon: parameter '{name}' has shape {tuple(param.shape)} but is in a Dion2 group ({where}); Dion2 "
                "updates matrices [..., m, n] (2-D weights, 3-D expert stacks): put it in a group with "
                "use_muon=False (dion's algorithm='adamw' or 'lion')")
    return None
