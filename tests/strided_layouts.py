"""DTensors with the placements a test asks for, on every torch release of the supported range.

Tests build their DTensors as training does, with DTensor's own ``redistribute`` from a replicated
tensor: DTensor is then the reference for which rank holds what.  torch 2.10 and 2.11 refuse to
redistribute (or ``full_tensor()``) a ``_StridedShard`` whose split factor encodes no shard order:
2.11 with a ``ValueError`` (``DTensorSpec._normalize_placements_into_shard_order``: "unable to be
interpreted into a corresponding shard_order"), 2.10 by failing its own assertion in redistribute's
planner (``_gen_transform_infos_non_cached``: ``assert src_shard_order is not None and
dst_shard_order is not None``, a bare ``AssertionError``); 2.8, 2.13 and 2.15 build and reconstruct
them.  For exactly those placements on such a release, this module cuts each rank's local block
itself and wraps it with ``DTensor.from_local``, and reads a DTensor back with an all-gather placed
by the same cut.

The cut is written here from the placement semantics, on real tensors (``torch.chunk``), not with
the optimizer's index math (``optimizer/distributed/placements.py``): placements apply left to
right over mesh dims, each to the piece the previous ones left; ``Shard(d)`` takes
``torch.chunk``'s c-th of k chunks; a ``_StridedShard(d, sf)`` that encodes no shard order splits
the piece into ``sf`` chunks, each of those into k, and gives coordinate c the c-th of each,
concatenated.  ``tests/distributed/test_strided_layouts.py`` checks it against DTensor's own
``redistribute`` and ``full_tensor()`` on the releases that build these placements.
"""

from __future__ import annotations

import math
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard


def _chunk(t: torch.Tensor, k: int, c: int, dim: int) -> torch.Tensor:
    """torch.chunk's c-th of k chunks along ``dim``, empty where torch.chunk returns fewer."""
    pieces = torch.chunk(t, k, dim=dim)
    return pieces[c] if c < len(pieces) else t.narrow(dim, 0, 0)


def cut_local(full: torch.Tensor, mesh_shape, placements, coord) -> torch.Tensor:
    """The block of ``full`` that the rank at mesh coordinate ``coord`` holds (semantics above)."""
    piece = full
    for m, p in enumerate(placements):
        k, c = mesh_shape[m], coord[m]
        if isinstance(p, _StridedShard):
            d = p.dim % full.dim()
            piece = torch.cat([_chunk(part, k, c, d) for part in _split(piece, p.split_factor, d)], dim=d)
        elif isinstance(p, Shard):
            piece = _chunk(piece, k, c, p.dim % full.dim())
        elif not isinstance(p, Replicate):
            raise ValueError(f"cut_local: {p!r} is not Shard, _StridedShard or Replicate")
    return piece.contiguous()


def _split(t: torch.Tensor, sf: int, dim: int) -> list[torch.Tensor]:
    return [_chunk(t, sf, i, dim) for i in range(sf)]


def _strided(placements) -> bool:
    return any(isinstance(p, _StridedShard) for p in placements)


#: what a release raises when it refuses a _StridedShard that encodes no shard order (2.11+:
#: ValueError; 2.10: AssertionError); :func:`_refused` then checks that the error is that refusal
REFUSALS = (ValueError, AssertionError)


def _refused(err: Exception, placements) -> bool:
    """DTensor of this release refuses these placements: a _StridedShard it cannot read as a shard
    order (the only refusal these helpers step around; anything else is re-raised).  2.11's
    ValueError says so; 2.10's bare AssertionError has no message, so the failing source line (its
    assertion that both specs have a shard order) is what identifies it."""
    if not _strided(placements):
        return False
    if isinstance(err, ValueError):
        return "shard_order" in str(err).replace(" ", "_")
    if isinstance(err, AssertionError):
        frames = traceback.extract_tb(err.__traceback__)
        return bool(frames) and "shard_order is not None" in (frames[-1].line or "")
    return False


def make_dtensor(full: torch.Tensor, mesh, placements) -> DTensor:
    """``full`` sharded as ``placements``: DTensor's own redistribution from Replicate where this
    release offers it, else ``from_local`` with :func:`cut_local`'s block (same on every rank)."""
    placements = tuple(placements)
    replicated = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim)
    try:
        return replicated.redistribute(mesh, placements)
    except REFUSALS as err:
        if not _refused(err, placements):
            raise
    local = cut_local(full, tuple(mesh.shape), placements, mesh.get_coordinate())
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def full_of(dt: DTensor) -> torch.Tensor:
    """The global tensor of ``dt`` (collective): DTensor's ``full_tensor()`` where this release
    reconstructs its placements, else every rank's block, all-gathered and put in place by
    :func:`cut_local` (cut from a tensor of global positions)."""
    try:
        return dt.full_tensor()
    except REFUSALS as err:
        if not _refused(err, dt.placements):
            raise
    mesh, shape = dt.device_mesh, tuple(dt.shape)
    if mesh.mesh.numel() != dist.get_world_size():
        raise ValueError("full_of: the fallback gathers over the world; this mesh is a part of it")
    local = dt.to_local().detach().contiguous()
    send = torch.zeros(max(1, math.prod(shape)), dtype=local.dtype, device=local.device)
    send[: local.numel()] = local.reshape(-1)
    recv = [torch.empty_like(send) for _ in range(dist.get_world_size())]
    dist.all_gather(recv, send)
    positions = torch.arange(math.prod(shape)).reshape(shape)
    out = torch.full(shape, float("nan"), dtype=local.dtype, device=local.device)
    for rank, buf in enumerate(recv):
        coord = tuple(int(i) for i in (mesh.mesh == rank).nonzero()[0])
        where = cut_local(positions, tuple(mesh.shape), dt.placements, coord).reshape(-1)
        out.view(-1)[where] = buf[: where.numel()]
    return out
