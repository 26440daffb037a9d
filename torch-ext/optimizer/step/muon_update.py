"""The Muon half of a step: each Muon parameter's :class:`~optimizer.rule.MatrixStep`, built from
its group and its state, the momentum on every local piece (where the elementwise stages are
fused: in the pass that forms each piece's input), then the cached plan through the runtime
(``parallel/execution/pipeline.py``), which calls the rule's stages on every piece, then the
momentum of whatever piece the runtime did not form."""

from __future__ import annotations

import math
from collections.abc import MutableMapping

import torch

from ..matrix_view import local_matrix, row_state_layout
from ..momentum_progress import MomentumProgress
from ..parallel.execution.pipeline import gather_everything, run_parallel_muon
from ..parallel.execution.stats import PipelineStats
from ..qk_clip.step import ClipStep
from ..newton_schulz.group import NewtonSchulz
from ..newton_schulz.implementation import Implementation
from ..rule import (MatrixStep, OwnerStage, adjust_lr, momentum_, momentum_dtype, normuon_on, row_state_dtype,
                    work_dtype)
from ..settings import MuonSettings
from ..checkpoint import MOMENTUM_KEY, ROW_STATE_KEY
from ..tensors import is_dtensor, local_view
from .context import StepContext


def muon_update(context: StepContext, state: MutableMapping, settings: MuonSettings,
                clip: ClipStep | None) -> PipelineStats:
    """Update every Muon parameter with a gradient; returns what the pipeline did."""
    params = context.muon_params
    stats = PipelineStats(params[0].device if params else None)
    if not params:
        return stats
    steps = matrix_steps(context, state, settings, clip)
    if settings.distributed_mode == "gather":
        gather_everything(context.plan, steps, stats)
    else:
        run_parallel_muon(context.plan, steps, lookahead=settings.lookahead, stats=stats)
    for step in steps:  # fused: pieces (or parts) this rank never formed, e.g. owned in another replica
        step.finish_momentum()
    return stats


def momentum_buffers(params: list[torch.Tensor], groups, state: MutableMapping) -> list[torch.Tensor]:
    """Each parameter's momentum (created at zero on first use, in its group's ``momentum_dtype``;
    a buffer of another dtype, e.g. after the option changed, is converted), as its local piece."""
    bufs = []
    for p, group in zip(params, groups):
        entry, dtype = state[p], momentum_dtype(p, group)
        buf = entry.get(MOMENTUM_KEY)
        if buf is None:
            buf = entry[MOMENTUM_KEY] = torch.zeros_like(p, dtype=dtype)  # a DTensor keeps p's placements
        elif buf.dtype != dtype:
            buf = entry[MOMENTUM_KEY] = buf.to(dtype)
        bufs.append(local_view(buf))
    return bufs


def row_state_like(p: torch.Tensor, dtype: torch.dtype, transposed: bool = False) -> torch.Tensor:
    """Zeros of shape ``[..., rows, 1]`` for a parameter read as the matrix ``[..., rows, cols]``
    (``transposed``: stored ``[..., cols, rows]``, ``matrix_view.py``; v is kept in the matrix's
    orientation, one value per output row); for a DTensor, a DTensor whose local rows are exactly
    the matrix view's (``row_placements``), so that ``state_dict()`` and DCP save, and reshard,
    it like the momentum."""
    shape, placements = row_state_layout(p.shape, p.placements if is_dtensor(p) else (), transposed)
    if not is_dtensor(p):
        return torch.zeros(shape, dtype=dtype, device=p.device)
    from torch.distributed.tensor import DTensor

    local = local_matrix(local_view(p), transposed)
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return DTensor.from_local(torch.zeros((*local.shape[:-1], 1), dtype=dtype, device=local.device), p.device_mesh,
                              placements, run_check=False, shape=shape, stride=stride)


def row_states(params: list[torch.Tensor], groups, transposed: list[bool],
               state: MutableMapping) -> list[torch.Tensor | None]:
    """NorMuon's v of each parameter whose group has ``normuon_beta2`` set (created at zero on first
    use), as its local piece; None for the others, whose v, if any, is dropped (the state holds
    ``normuon_v`` exactly when the group has NorMuon on)."""
    out = []
    for p, group, t in zip(params, groups, transposed):
        entry = state[p]
        if not normuon_on(group):
            entry.pop(ROW_STATE_KEY, None)
            out.append(None)
            continue
        dtype = row_state_dtype(work_dtype(p, group))
        v = entry.get(ROW_STATE_KEY)
        if v is None:
            v = entry[ROW_STATE_KEY] = row_state_like(p, dtype, t)
        elif v.dtype != dtype:
            v = entry[ROW_STATE_KEY] = v.to(dtype)
        out.append(local_view(v))
    return out


def matrix_steps(context: StepContext, state: MutableMapping, settings: MuonSettings,
                 clip: ClipStep | None) -> list[MatrixStep]:
    """The momentum on every local piece (one foreach call per momentum and sign), then each
    parameter's stages with this step's hyper-parameters.  Where the elementwise stages are fused
    (``Implementation.fuses``) the momentum is not run here: the step carries it as pending
    (``momentum_progress.py``), ``MatrixStep.input_into`` updates it in the pass that forms the
    input, and ``MatrixStep.finish_momentum`` where the runtime forms none."""
    params, groups = context.muon_params, context.muon_groups
    views = [e.transposed for e in context.muon]  # [in, out] weights read as [out, in] (matrix_view.py)
    bufs = [local_matrix(b, t) for b, t in zip(momentum_buffers(params, groups, state), views)]
    rows = row_states(params, groups, views, state)  # stored as the matrix view's rows already
    grads = [local_matrix(local_view(p.grad), t) for p, t in zip(params, views)]
    work = [work_dtype(p, g) for p, g in zip(params, groups)]
    signed = list(grads)
    implementations = context.implementations
    fused = [implementation.fuses(local_view(p), b, grad)
             for p, implementation, b, grad in zip(params, implementations, bufs, grads)]
    by_momentum: dict[tuple[float, bool], list[int]] = {}
    for i, group in enumerate(groups):
        if fused[i]:  # with the input, in one pass (the gradient read as stored, its sign a flag)
            continue
        by_momentum.setdefault((group["momentum"], bool(group.get("maximize", False))), []).append(i)
    for (momentum, maximize), idx in by_momentum.items():
        moved = momentum_([bufs[i] for i in idx], [grads[i] for i in idx], momentum, maximize, [work[i] for i in idx])
        for i, g in zip(idx, moved):
            signed[i] = g

    stages: dict[tuple, OwnerStage] = {}  # one per group (and device): its matrices may share a batched call
    steps = []
    for i, (p, group) in enumerate(zip(params, groups)):
        beta2 = group.get("normuon_beta2")  # None: Muon
        if context.row_blocks[i] is not None:  # its own stage: never batched with other weights
            stage = OwnerStage(_newton_schulz(group, settings, implementations[i]), context.row_blocks[i],
                               group["adjust_lr"], beta2)
        else:
            stage = stages.get((id(group), implementations[i]))
            if stage is None:
                stage = stages[id(group), implementations[i]] = OwnerStage(
                    _newton_schulz(group, settings, implementations[i]), normuon_beta2=beta2)
        lr = group["lr"]
        steps.append(MatrixStep(
            param=local_matrix(local_view(p), views[i]), grad=signed[i], buf=bufs[i], momentum=group["momentum"],
            nesterov=group["nesterov"], lr=lr, adjusted_lr=adjust_lr(lr, context.muon[i].shape, group["adjust_lr"]),
            weight_decay=group["weight_decay"], orthogonalize=stage, clip=context.clip_rows(i, clip),
            row_state=rows[i], cautious=bool(group.get("cautious_wd", False)),
            fused=fused[i], maximize=bool(group.get("maximize", False)),
            pending=MomentumProgress(bufs[i].shape) if fused[i] else None,
        ))
    return steps


def _newton_schulz(group, settings: MuonSettings, implementation: Implementation) -> NewtonSchulz:
    return NewtonSchulz(group["ns_steps"], group["ns_coefficients"], group.get("ns_method", "auto"), group["eps"],
                        settings.compute_dtype, implementation)
