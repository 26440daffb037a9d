"""The rank sets a step plan may need process groups for, created collectively.

A group must be created by every rank, in one order (``distributed/groups.py``): when the
optimizer is built, and in ``add_param_group``, every rank works out the rank sets its DTensor
matrices may need (shard and replica groups, and every group a cut may run on:
``cut_model.rank_sets``), and the ranks create the union together.  A step only looks for the
ones still missing (parameters that became DTensors after construction: ``Muon.step``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.distributed as dist

from ...checks import param_problem
from ...distributed import groups
from ...matrix_view import LayoutCache
from ...named_params import NamedParam, named_params
from ...row_blocks import ROW_BLOCKS_KEY
from ...settings import MuonSettings
from ...tensors import is_dtensor, local_view
from .cut_model import rank_sets
from .plan_inputs import split_model


def create_process_groups(all_groups: Sequence[Mapping], new_groups: Sequence[Mapping], layouts: LayoutCache,
                          settings: MuonSettings, only_if_missing: bool = False) -> None:
    """Create, collectively, every process group the parallel step will use for ``new_groups``'
    DTensor matrices (``distributed/groups.py``; split Newton–Schulz's too); ``all_groups``'
    meshes give the optimizer's ranks."""
    dtensors = [p for g in all_groups for p in g["params"] if is_dtensor(p)]
    if not dtensors or not dist.is_initialized():
        return
    union = sorted({r for p in dtensors for r in layouts.grid(p.device_mesh).ranks})
    needed = groups.rank_sets_needed(  # parameters step() refuses need none
        [(layouts.of(p), p.device_mesh) for g in new_groups for p in g["params"]
         if g["use_muon"] and is_dtensor(p) and p.dim() >= 2 and param_problem("", p) is None], union)
    needed = sorted(set(needed) | set(split_rank_sets(new_groups, settings, layouts)))
    if only_if_missing and all(groups.has_group(s) for s in needed):
        return
    groups.create_collectively(needed)


def missing_rank_sets(params: Sequence[NamedParam], param_groups: Sequence[Mapping], settings: MuonSettings,
                      layouts: LayoutCache) -> list[tuple[int, ...]]:
    """Rank sets the plan needs a process group for that this process has not created: the
    parameters became DTensors after the optimizer was built (accelerate's FSDP2 swaps them in).
    Every rank then creates them at this step, together (``Muon.step``)."""
    dtensors = [e for e in params if e.use_muon and is_dtensor(e.param) and e.param.dim() >= 2]
    if not dtensors or not dist.is_initialized():
        return []
    union = sorted({r for e in dtensors for r in layouts.grid(e.param.device_mesh).ranks})
    pairs = [(layouts.of(e.param, e.transposed), e.param.device_mesh) for e in dtensors]
    needed = set(groups.rank_sets_needed(pairs, union)) | set(split_rank_sets(param_groups, settings, layouts))
    return [s for s in sorted(needed) if not groups.has_group(s)]


def split_rank_sets(param_groups: Sequence[Mapping], settings: MuonSettings,
                    layouts: LayoutCache) -> list[tuple[int, ...]]:
    """Every rank set a split Newton–Schulz of these groups' DTensor matrices may run on
    (``cut_model.rank_sets``): created with the other process groups, collectively, at
    construction and in ``add_param_group``."""
    out: set[tuple[int, ...]] = set()
    for e in named_params(param_groups):
        group, p = param_groups[e.group], e.param
        if not e.use_muon or group.get(ROW_BLOCKS_KEY) is not None:
            continue  # kept whole (``plan_inputs.plan_input``: row blocks are orthogonalised apart)
        if not is_dtensor(p) or p.dim() < 2 or param_problem("", p) is not None:
            continue
        device = local_view(p).device
        model = split_model(group, settings.compute_dtype, device)
        out |= rank_sets(e.shape, layouts.of(p, e.transposed), model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return sorted(s for s in out if 1 < len(s) < world)
