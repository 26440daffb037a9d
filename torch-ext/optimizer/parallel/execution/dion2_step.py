"""Dion2 and NorDion2 for DTensor parameters: the first version, exact on every placement (collective).

Each Dion2 DTensor parameter (``docs/dion2.md``, "Built: DTensor parameters, gathered") is
stepped as single-device Dion2 steps its whole tensor, bit for bit:

1. ``M <- M + G`` on every rank's local piece (elementwise, so the same bits as on one device);
2. every member of the shard group gathers the whole momentum (:func:`gather_whole`: one
   all-gather per sharding mesh dim; a replica dim moves nothing) and NorDion2's ``v``;
3. every rank chooses the top ``k`` on the gathered matrix (``dion2_rule.choose_slices``, the
   global shape's dim, per expert of a stack), orthogonalises the ``k``-slice submatrix with the
   group's Newton–Schulz and normalises it (NorDion2): identical inputs, identical arithmetic, so
   every rank holds the same selection and update, and no rank can disagree about a collective;
4. every rank keeps its own piece (``distributed.placements.local_indices``): the weight decays
   everywhere and moves by the update on its chosen slices, its momentum's chosen slices decay by
   ``ef_decay``, its rows of ``v`` take the new values.

What it moves: the whole momentum to every member, ``P w (S - 1) / S`` received per rank
(``S`` members, ``P`` entries, ``w`` bytes each), where Muon moves ``2 P w (S - 1) / S`` in
total over the group: ``S / 2`` times Muon's bytes (equal at ``S = 2``), and every rank
orthogonalises every Dion2 submatrix.  Only the chosen slices travelling (the design's steps 6-7,
with ``parallel/execution/dion2_selection.py``'s exact selection) is the next step.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.distributed as dist
from torch import Tensor

from ...dion2 import rule as dion2_rule
from ...distributed.placements import as_indexer, block_shape, is_shard, local_indices, numel_for_rank
from ...matrix_view import local_matrix
from ...rule import apply_update_
from ...tensors import local_view

__all__ = ["dion2_dtensor_step_", "gather_whole", "local_piece"]

# all_gather_into_tensor is deprecated in favour of all_gather_single (torch >= 2.10)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_whole(dt) -> Tensor:
    """The global tensor of DTensor ``dt`` on every rank of its mesh (collective): one all-gather
    per sharding mesh dim (over ``mesh.get_group(dim)``, in mesh order; a replica dim moves
    nothing), every piece put where ``local_indices`` says it lives, bits unchanged.  Works for
    every placement ``local_indices`` decodes, also the ``_StridedShard`` layouts whose
    ``full_tensor()`` this torch release refuses."""
    mesh, shape, placements = dt.device_mesh, tuple(dt.shape), tuple(dt.placements)
    local = local_view(dt).contiguous()
    sharded = [m for m, p in enumerate(placements) if is_shard(p)]
    coords = [tuple(mesh.get_coordinate())]
    width = _widest_piece(shape, tuple(mesh.shape), placements)
    pieces = torch.zeros(1, max(1, width), dtype=local.dtype, device=local.device)
    pieces[0, :local.numel()] = local.reshape(-1)
    for m in sharded:  # after dim m, this rank holds the pieces of every coordinate along it
        out = torch.empty(mesh.shape[m] * pieces.shape[0], pieces.shape[1], dtype=pieces.dtype, device=pieces.device)
        group = mesh.get_group(m)
        _all_gather(out, pieces, group=group)
        along = [_coordinate_of(mesh, r)[m] for r in dist.get_process_group_ranks(group)]  # group rank order
        coords = [c[:m] + (j,) + c[m + 1:] for j in along for c in coords]
        pieces = out
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    for c, flat in zip(coords, pieces):
        indices = _on(_indices(shape, tuple(mesh.shape), placements, c), full.device)
        block = block_shape(indices)
        full[as_indexer(indices)] = flat[:math.prod(block)].view(block)
    return full


@functools.lru_cache(maxsize=4096)
def _widest_piece(shape, mesh_shape, placements) -> int:
    """The most entries any coordinate holds (pure; memoised: a step walks no mesh)."""
    coords = itertools.product(*(range(int(k)) for k in mesh_shape))
    return max(numel_for_rank(shape, mesh_shape, placements, c) for c in coords)


@functools.lru_cache(maxsize=4096)
def _indices(shape, mesh_shape, placements, coordinate) -> tuple:
    return local_indices(shape, mesh_shape, placements, coordinate)


def _coordinate_of(mesh, rank: int) -> tuple[int, ...]:
    return tuple(int(i) for i in (mesh.mesh == rank).nonzero()[0])


def _on(indices, device) -> tuple:
    return tuple(i if isinstance(i, slice) else i.to(device) for i in indices)


def local_piece(full: Tensor, like) -> Tensor:
    """This rank's piece of ``full`` (a whole tensor of ``like``'s global shape), laid out as
    ``like.to_local()`` is (``like`` a DTensor; ``local_indices`` decodes ``Shard``,
    ``_StridedShard``, uneven and empty pieces)."""
    mesh = like.device_mesh
    coordinate = mesh.get_coordinate()
    indices = _indices(tuple(like.shape), tuple(mesh.shape), tuple(like.placements), tuple(coordinate))
    return full[as_indexer(_on(indices, full.device))]


def dion2_dtensor_step_(param, buf, v, *, transposed: bool, fraction: float, ef_decay: float, lr, adjusted: float,
                        weight_decay: float, orthogonalize, normuon_beta2: float | None = None,
                        cautious: bool = False, maximize: bool = False,
                        dtype: torch.dtype | None = None) -> dion2_rule.Selection:
    """One Dion2 step of a DTensor ``param`` (gradient set, same placements) with its momentum
    ``buf`` and NorDion2's ``v`` (DTensors, ``v`` None without NorDion2), in place on their local
    pieces.  Collective over ``param``'s mesh (every rank of it calls this, in one order).
    ``transposed``: the parameter is read as its ``muon_transposed`` view.  Returns the selection
    (global indices along the view's dim), the same on every rank."""
    dtype = dtype or torch.promote_types(param.dtype, buf.dtype)
    dion2_rule.momentum_sum_(local_view(buf), local_view(param.grad), maximize, dtype)
    full = gather_whole(buf)  # the whole momentum, as stored, on every member
    view = local_matrix(full, transposed)
    sel = dion2_rule.choose_slices(view, fraction, rows_only=normuon_beta2 is not None)
    u = dion2_rule.take_slices(view, sel.indices, sel.dim).to(dtype)  # before the decay
    dion2_rule.decay_chosen_(view, sel.indices, sel.dim, ef_decay, dtype)
    o = orthogonalize(u) if u.numel() else u
    if normuon_beta2 is not None and sel.indices.numel():
        o, v_full = dion2_rule.normalize_chosen_rows(o, gather_whole(v), sel.indices, normuon_beta2)
        local_view(v).copy_(local_piece(v_full, v))
    update = torch.zeros(view.shape, dtype=o.dtype, device=full.device)
    if sel.indices.numel():
        dion2_rule.put_slices_(update, sel.indices, sel.dim, o)
    local_view(buf).copy_(local_piece(full, buf))
    mine = local_piece(local_matrix(update, transposed), param)
    apply_update_(local_view(param), mine, lr, adjusted, weight_decay, cautious)
    return sel

