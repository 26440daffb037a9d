"""Why a Dion2 group or parameter cannot be stepped, with errors that name the culprit and the fix.

Checked when a group is added (``Muon._check_group``) and again at every step before anything
changes (``step/context.py``, agreed by the ranks like every problem).  Dion2 runs on plain tensors
and DTensors (every placement), with QK-clip and row blocks (each block its own matrix); never
with a split Newton–Schulz (``docs/dion2.md``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..named_params import NamedParam
from ..row_blocks import ROW_BLOCKS_KEY, RowBlocks, resolve_row_blocks, spec_for
from ..settings import DION2, kind_of


def is_dion2(group: Mapping) -> bool:
    """Whether a param group is a Dion2 (or NorDion2) group."""
    return bool(group.get("use_muon")) and kind_of(group) == DION2


def dion2_group_problem(group: Mapping, where: str) -> str | None:
    """What a Dion2 group asks for that Dion2 does not build, or None: ``ns_split="always"``."""
    if group.get("ns_split") == "always":
        return (f"Muon: {where} sets `ns_split`='always' but is a Dion2 group "
                f"(dion2_fraction={group.get('dion2_fraction')!r}): `ns_split` cuts a whole matrix's "
                "Newton–Schulz over its shard group, while Dion2 orthogonalises only the chosen k-slice submatrix, "
                "whole, on one rank (its cost is already about the fraction squared of the matrix's). Remove "
                "`ns_split` (or set 'never'/'auto'), or make this group a Muon group (dion2_fraction=None)")
    return None


def dion2_row_blocks(e: NamedParam, group: Mapping, where: str) -> tuple[RowBlocks | None, str | None]:
    """The row blocks of Dion2 parameter ``e`` of ``group`` (``where``), each stepped as its own
    matrix (``rule.dion2_blocks_step_``, on a mesh a unit per block; None: the whole matrix), or why
    they cannot be: a spec that does not fit the weight (``row_blocks.resolve_row_blocks``' error)."""
    if group.get(ROW_BLOCKS_KEY) is None:
        return None, None
    try:
        blocks = resolve_row_blocks(spec_for(group[ROW_BLOCKS_KEY], e.name, f"Muon: {where}"), e.name, e.shape)
    except ValueError as err:
        return None, str(err)
    return blocks, None


def dion2_errors(entries: Sequence[NamedParam], groups: Sequence[Mapping]) -> tuple[list[RowBlocks | None], list[str]]:
    """Each Dion2 parameter's row blocks (:func:`dion2_row_blocks`), and this rank's problems with
    the Dion2 parameters of a step (found before anything changes): a parameter that is no matrix,
    what the groups ask for, row blocks that cannot be used."""
    errors, blocks = [], []
    for e in entries:
        where = f"param_groups[{e.group}]"
        b, blocks_problem = dion2_row_blocks(e, groups[e.group], where)
        blocks.append(b)
        problem = dion2_param_problem(e.name, e.param, where) or dion2_group_problem(groups[e.group], where)
        for p in (problem, blocks_problem):
            if p and p not in errors:
                errors.append(p)
    return blocks, errors


def dion2_param_problem(name: str, param: torch.Tensor, where: str) -> str | None:
    """Why a parameter of a Dion2 group (``where``) cannot be stepped, or None: Dion2 updates
    matrices (``dion2_rule.check_matrix``)."""
    if param.dim() < 2:
        return (f"Muon: parameter '{name}' has shape {tuple(param.shape)} but is in a Dion2 group ({where}); Dion2 "
                "updates matrices [..., m, n] (2-D weights, 3-D expert stacks): put it in a group with "
                "use_muon=False (dion's algorithm='adamw' or 'lion')")
    return None
