"""The Muon half of a step: each Muon parameter's :class:`~optimizer.rule.MatrixStep`, built from
its group and its state, the momentum on every local piece, then the cached plan through the
runtime (``parallel/runtime.py``), which calls the rule's stages on every piece."""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from .matrix_view import local_matrix
from .parallel.runtime import gather_everything, run_parallel_muon
from .parallel.stats import PipelineStats
from .qk_clip.step import ClipStep
from .rule import InBlocks, MatrixStep, NewtonSchulz, adjust_lr, momentum_
from .settings import MuonSettings
from .step_context import StepContext
from .tensors import local_view


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
    return stats


def momentum_buffers(params: list[torch.Tensor], state: MutableMapping) -> list[torch.Tensor]:
    """Each parameter's momentum (created at zero on first use), as its local piece."""
    bufs = []
    for p in params:
        entry = state[p]
        if "momentum_buffer" not in entry:
            entry["momentum_buffer"] = torch.zeros_like(p)  # a DTensor keeps p's placements
        bufs.append(local_view(entry["momentum_buffer"]))
    return bufs


def matrix_steps(context: StepContext, state: MutableMapping, settings: MuonSettings,
                 clip: ClipStep | None) -> list[MatrixStep]:
    """The momentum on every local piece (one foreach call per momentum and sign), then each
    parameter's stages with this step's hyper-parameters."""
    params, groups = context.muon_params, context.muon_groups
    views = [e.transposed for e in context.muon]  # [in, out] weights read as [out, in] (matrix_view.py)
    bufs = [local_matrix(b, t) for b, t in zip(momentum_buffers(params, state), views)]
    grads = [local_matrix(local_view(p.grad), t) for p, t in zip(params, views)]
    signed = list(grads)
    by_momentum: dict[tuple[float, bool], list[int]] = {}
    for i, group in enumerate(groups):
        by_momentum.setdefault((group["momentum"], bool(group.get("maximize", False))), []).append(i)
    for (momentum, maximize), idx in by_momentum.items():
        for i, g in zip(idx, momentum_([bufs[i] for i in idx], [grads[i] for i in idx], momentum, maximize)):
            signed[i] = g

    newton_schulz: dict[int, NewtonSchulz] = {}  # one per group: its matrices may share a batched call
    steps = []
    for i, (p, group) in enumerate(zip(params, groups)):
        orthogonalize = newton_schulz.setdefault(id(group), NewtonSchulz(
            group["ns_steps"], group["ns_coefficients"], group.get("ns_method", "auto"), group["eps"],
            settings.compute_dtype))
        if context.row_blocks[i] is not None:
            orthogonalize = InBlocks(orthogonalize, context.row_blocks[i], group["adjust_lr"])
        lr = group["lr"]
        steps.append(MatrixStep(
            param=local_matrix(local_view(p), views[i]), grad=signed[i], buf=bufs[i], momentum=group["momentum"],
            nesterov=group["nesterov"], lr=lr, adjusted_lr=adjust_lr(lr, context.muon[i].shape, group["adjust_lr"]),
            weight_decay=group["weight_decay"],
            orthogonalize=orthogonalize, clip=context.clip_rows(i, clip),
        ))
    return steps
