"""The Dion2 half of a step: tensors held whole by the rule, DTensors by the owner of their chosen slices.

Every parameter of a Dion2 group (a ``use_muon`` group with ``dion2_fraction``; NorDion2 with
``normuon_beta2`` too) held whole is stepped by ``dion2_rule.dion2_step_`` on the whole matrix it
holds; the DTensor parameters all together by ``parallel/execution/dion2_step.py`` (the exact
selection, only the chosen slices travelling to an owner and back, every rank stepping its own
piece exactly as one device steps the whole; ``docs/dion2.md``).

What the step reads of a group is Muon's: the momentum buffer (``momentum_buffer``, in
``momentum_dtype``), NorMuon's ``normuon_v`` (``normuon_beta2``), ``lr`` and ``adjust_lr`` (of the
matrix's own shape, never the chosen submatrix's), ``weight_decay``, ``cautious_wd``,
``maximize``, the ``[out, in]`` view of a ``muon_transposed`` weight, and Newton–Schulz's options
(``ns_steps``, ``ns_coefficients``, ``ns_method``, ``eps``, ``ns_kernels``), which orthogonalise
the chosen ``k``-slice submatrix.  A plain tensor with row blocks (``muon_row_blocks``) steps each
block as its own matrix (``dion2_rule.dion2_blocks_step_``), a DTensor each block as a unit of the
distributed step; QK-clip scales the q/k rows of every
updated weight after the update (:func:`clip_updated_`).  What it does not build is refused
(``checks.dion2_group_problem``, ``checks.dion2_row_blocks``).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import torch

from . import rule as dion2_rule
from ..checkpoint import MOMENTUM_KEY, ROW_STATE_KEY
from ..matrix_view import local_matrix
from ..named_params import NamedParam
from ..newton_schulz.group import NewtonSchulz  # Newton–Schulz's one entry point here
from ..newton_schulz.implementation import Implementation
from ..rule import adjust_lr, normuon_on, work_dtype
from ..settings import GROUP_OPTIONS, MuonSettings
from ..parallel.execution.dion2_step import Dion2Item, dion2_dtensor_update_
from ..qk_clip.step import apply_clip_
from ..row_blocks import RowBlocks
from ..step.muon_update import momentum_buffers, row_states
from ..tensors import is_dtensor, local_view

#: ``dion2_ef_decay``'s declared default (an optional option at its default is not held by a group).
EF_DECAY_DEFAULT = next(o.default for o in GROUP_OPTIONS if o.name == "dion2_ef_decay")


def orthogonalizers(groups: Sequence[Mapping], implementations: Sequence[Implementation],
                    settings: MuonSettings) -> list[NewtonSchulz]:
    """Each Dion2 parameter's Newton–Schulz this step (``groups[i]`` its group as it is now,
    ``implementations[i]`` its resolved ``ns_kernels``).  Built where the step runs eagerly
    (``Muon._begin_step``): torch 2.10's dynamo cannot trace the construction of this frozen
    dataclass inside ``torch.compile(opt.step)`` (``AttributeError: 'NewtonSchulz' object has no
    attribute 'ns_steps'``, the compatibility run of 2026-11-29)."""
    return [NewtonSchulz(g["ns_steps"], g["ns_coefficients"], g.get("ns_method", "auto"), g["eps"],
                         settings.compute_dtype, implementation) for g, implementation in zip(groups, implementations)]


def dion2_update(entries: Sequence[NamedParam], groups: Sequence[Mapping], orthogonalize: Sequence[NewtonSchulz],
                 state: MutableMapping, row_blocks: Sequence[RowBlocks | None] | None = None,
                 clips: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> None:
    """One Dion2 step of every parameter in ``entries`` (each with a gradient; ``groups[i]`` its
    group, ``orthogonalize[i]`` its Newton–Schulz this step, :func:`orthogonalizers`),
    in place on the parameter, its momentum and its NorMuon ``v``; ``row_blocks[i]``: parameter
    ``i``'s row blocks (``checks.dion2_row_blocks``), ``clips[i]``: its QK-clip
    (scale table, local row slots) this step (``StepContext.dion2_clip_rows``), applied after every
    update (:func:`clip_updated_`)."""
    if not entries:
        return
    blocks = list(row_blocks) if row_blocks is not None else [None] * len(entries)
    params = [e.param for e in entries]
    views = [e.transposed for e in entries]
    bufs = momentum_buffers(params, groups, state)
    rows = row_states(params, groups, views, state)
    distributed = []
    for e, group, ns, buf, v, b in zip(entries, groups, orthogonalize, bufs, rows, blocks):
        options = _options(e, group, ns)
        if is_dtensor(e.param):  # every rank of its mesh steps it below, all together, in the agreed order
            entry = state[e.param]
            distributed.append(Dion2Item(e.param, entry[MOMENTUM_KEY],
                                         entry.get(ROW_STATE_KEY) if v is not None else None, e.transposed, options,
                                         _block_rates(e, b, group, options) if b is not None else None))
        elif b is not None:
            _step_blocks(e, local_matrix(buf, e.transposed), v, b, group, options)
        else:
            _step_one(e, local_matrix(buf, e.transposed), v, options)
    dion2_dtensor_update_(distributed)
    if clips is not None:
        clip_updated_(entries, clips)


def _options(e: NamedParam, group: Mapping, ns: NewtonSchulz) -> dict:
    """The rule's keywords for parameter ``e`` of ``group`` this step (the same for both paths)."""
    lr = group["lr"]
    return dict(
        fraction=group["dion2_fraction"], ef_decay=group.get("dion2_ef_decay", EF_DECAY_DEFAULT), lr=lr,
        adjusted=adjust_lr(lr, e.shape, group["adjust_lr"]), weight_decay=group["weight_decay"],
        orthogonalize=ns,
        normuon_beta2=group.get("normuon_beta2") if normuon_on(group) else None,
        cautious=bool(group.get("cautious_wd", False)), maximize=bool(group.get("maximize", False)),
        dtype=work_dtype(e.param, group))


def _step_one(e: NamedParam, buf: torch.Tensor, v: torch.Tensor | None, options: dict) -> None:
    _, v_new = dion2_rule.dion2_step_(local_matrix(e.param, e.transposed), local_matrix(e.param.grad, e.transposed),
                                      buf, row_state=v, **options)
    if v is not None and v_new is not v:
        v.copy_(v_new)


def _block_rates(e: NamedParam, blocks: RowBlocks, group: Mapping,
                 options: dict) -> list[tuple[tuple[int, ...], float]]:
    """Each row block's global rows (of the ``[out, in]`` view, in block order) and its lr adjusted
    for the block's own shape ``[..., rows_b, n]`` (one computation for both paths)."""
    rows = [tuple(r.tolist()) for r in blocks.rows_of_each()]
    return [(r, adjust_lr(options["lr"], (*e.shape[:-2], len(r), e.shape[-1]), group["adjust_lr"])) for r in rows]


def _step_blocks(e: NamedParam, buf: torch.Tensor, v: torch.Tensor | None, blocks: RowBlocks, group: Mapping,
                 options: dict) -> None:
    """Each row block of a plain tensor stepped as its own matrix (``dion2_rule.dion2_blocks_step_``),
    its lr adjusted for the block's own shape (:func:`_block_rates`)."""
    param = local_matrix(e.param, e.transposed)
    rates = _block_rates(e, blocks, group, options)
    rows = [torch.tensor(r, dtype=torch.long, device=param.device) for r, _ in rates]
    rule = {k: o for k, o in options.items() if k != "adjusted"}
    dion2_rule.dion2_blocks_step_(param, local_matrix(e.param.grad, e.transposed), buf, rows,
                                  adjusted=[a for _, a in rates], row_state=v, **rule)


def clip_updated_(entries: Sequence[NamedParam], clips: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
    """QK-clip after the Dion2 update, as Muon's ``MatrixStep.scale_rows`` does after its own: each
    clipped weight's local rows (of its ``[out, in]`` view) scaled by their head's factor.  A row
    scaling of every rank's own piece, given its rows' table slots: the same on plain tensors and
    DTensors (``qk_clip.step.apply_clip_``)."""
    for e, clip in zip(entries, clips):
        if clip is not None:
            apply_clip_(local_matrix(local_view(e.param), e.transposed), *clip)
