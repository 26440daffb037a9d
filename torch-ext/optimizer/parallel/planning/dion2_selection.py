"""Dion2's distributed selection, planned: which slices each member holds and who chooses them (pure).

Dion2 chooses, per matrix, the ``k`` rows (or columns) of largest L1 norm (``dion2/rule.py``); the
dim is a function of the matrix's *global* shape (rows if ``m <= n`` else columns; NorDion2: rows).
On a mesh every member of a shard group holds a piece of some slices; the exact selection
(``docs/dion2.md``, "The selection, distributed") sends each member's partial norms to the unit's
owner, which sums them per global slice, chooses, and returns each member a mask over its own
slices.  This module is the static half: from global shapes, placements and the members' mesh
coordinates (``distributed/placements.py``'s index math, never DTensor's private methods), it works
out

* per parameter and member, the global indices of its local slices along the selection dim, in
  local storage order (:class:`SliceMap`), and
* per shard group, every unit's owner and the split sizes of the two ``all_to_all_single`` (norms to
  the owners, masks back), so that the collectives need no host read (:class:`ExchangePlan`).

A unit is one parameter's local matrices (``batch`` of them: the local experts of a 3-D stack, 1 for
a matrix); the members of a shard group hold the same leading indices, so they agree on ``batch``.
With row blocks (``muon_row_blocks``) a unit is one block of one parameter, its own matrix
``[..., rows_b, n]``: its global rows are the positions within the block, and each member holds the
local rows whose global row is in the block (:func:`block_rows`; ``SliceMap.local_rows``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from torch.distributed.tensor.placement_types import Placement

from ...dion2.rule import chosen_count, selection_dim
from ...distributed.placements import Index, block_shape, local_indices
from .owners import assign_owners_among

__all__ = ["ExchangePlan", "SliceMap", "UnitExchange", "block_rows", "exchange_plan", "slice_map"]


@dataclass(frozen=True)
class SliceMap:
    """One member's share of one parameter, seen along its selection dim.

    ``indices``: the global indices it holds per tensor dim (``local_indices``); ``dim``: the
    selection dim (-2 rows, -1 columns); ``slices`` = ``indices[dim]``: the global index of each
    local slice, in local storage order; ``size``: the global size ``s`` of that dim; ``k``: the
    slices chosen per matrix; ``batch``: the local matrices (product of the local leading shape).
    A row block's map: ``indices[-2]`` are positions within the block, ``local_rows`` where those
    rows sit in the member's local piece (None: the whole matrix, every local row)."""

    indices: tuple[Index, ...]
    dim: int
    size: int
    k: int
    batch: int
    local_rows: Index | None = None

    @property
    def slices(self) -> Index:
        return self.indices[self.dim]

    @property
    def count(self) -> int:
        """How many local slices (the length of ``slices``)."""
        return block_shape(self.indices)[self.dim]


def _as_index(t: torch.Tensor) -> Index:
    """A slice where ``t`` (int64) is a run of consecutive ascending indices (empty: ``slice(0, 0)``)."""
    if t.numel() == 0:
        return slice(0, 0)
    start = int(t[0])
    if torch.equal(t, torch.arange(start, start + t.numel())):
        return slice(start, start + t.numel())
    return t


def block_rows(rows: Index, block: Sequence[int], num_rows: int) -> tuple[Index, Index]:
    """A member's rows of one row block: ``rows`` (its global rows, in local storage order) against
    ``block`` (the block's global rows, in block order).  Returns ``(local, positions)``: where the
    block's rows sit among the member's local rows (ascending local order), and their positions
    within the block (the block's own row index), both as slices where they are runs."""
    held = torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows.to(torch.long)
    where = torch.full((num_rows,), -1, dtype=torch.long)
    where[torch.as_tensor(block, dtype=torch.long)] = torch.arange(len(block))
    positions = where[held]
    local = (positions >= 0).nonzero().flatten()
    return _as_index(local), _as_index(positions[local])


def slice_map(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
              coordinate: Sequence[int], fraction: float, rows_only: bool = False,
              block: Sequence[int] | None = None) -> SliceMap:
    """The :class:`SliceMap` of the member at mesh ``coordinate`` for a parameter of
    ``global_shape`` ``[..., m, n]`` placed with ``placements`` on a mesh of ``mesh_shape``; with
    ``block`` (a row block's global rows, in block order), of that block as its own matrix
    ``[..., len(block), n]``: its selection dim, size and ``k`` from that shape."""
    shape = tuple(int(s) for s in global_shape)
    indices = local_indices(shape, mesh_shape, placements, coordinate)
    local = None
    if block is not None:
        local, positions = block_rows(indices[-2], block, shape[-2])
        indices = (*indices[:-2], positions, indices[-1])
        shape = (*shape[:-2], len(block), shape[-1])
    dim = selection_dim(shape, rows_only)
    size = shape[dim]
    return SliceMap(indices, dim, size, chosen_count(fraction, size) if size else 0,
                    math.prod(block_shape(indices)[:-2]), local)


@dataclass(frozen=True)
class UnitExchange:
    """One parameter's selection within a shard group: its owner (a member's position), the
    members' slice maps (in member order), and whether the selection dim is split over the
    members (then the chosen count of each member changes with every step)."""

    param: int
    owner: int
    maps: tuple[SliceMap, ...]

    @property
    def batch(self) -> int:
        return self.maps[0].batch

    @property
    def split(self) -> bool:
        """True unless every member holds a piece of every slice (then each holds ``k`` chosen
        slices per matrix, a static count)."""
        return any(m.count != m.size for m in self.maps)

    def values(self, member: int) -> int:
        """The numbers member ``member`` sends for this unit: one per local slice per matrix."""
        return self.batch * self.maps[member].count


@dataclass(frozen=True)
class ExchangePlan:
    """The selection's two ``all_to_all_single`` in one shard group, from member ``me``'s side.

    Send order: by destination member, and for one destination its units in ``units`` order
    (``by_owner``: the units' positions in that order, so a step walks each unit once, never
    members x units).  ``norm_send[j]``: the fp64 partial norms ``me`` sends member ``j`` (its
    pieces of the units ``j`` owns); ``norm_recv[j]``: what ``me`` receives from ``j`` (``j``'s
    pieces of the units ``me`` owns).  The masks travel back with the two lists swapped."""

    members: int
    me: int
    units: tuple[UnitExchange, ...]
    norm_send: tuple[int, ...]
    norm_recv: tuple[int, ...]
    by_owner: tuple[int, ...]

    def owned(self) -> list[UnitExchange]:
        return [u for u in self.units if u.owner == self.me]

    def wire_bytes(self, norm_itemsize: int = 8, mask_itemsize: int = 1) -> int:
        """What ``me`` sends to the other members per step: its partial norms, and as an owner the
        masks (its own share never travels)."""
        others = [j for j in range(self.members) if j != self.me]
        return sum(self.norm_send[j] * norm_itemsize + self.norm_recv[j] * mask_itemsize for j in others)


def assign_selection_owners(costs: Sequence[int], members: int) -> list[int]:
    """Each unit's owner among ``members`` positions: longest job first onto the least loaded
    member (``owners.assign_owners_among``), the same on every member.  A unit's cost is the
    norms its owner sums and sorts (``batch * s``)."""
    candidates = [tuple(range(members))] * len(costs)
    return list(assign_owners_among([float(c) for c in costs], candidates))


def exchange_plan(params: Sequence[tuple], mesh_shape: Sequence[int],
                  member_coordinates: Sequence[Sequence[int]], me: int, fraction: float | Sequence[float],
                  rows_only: bool | Sequence[bool] = False, owners: Sequence[int] | None = None) -> ExchangePlan:
    """The :class:`ExchangePlan` of parameters ``(global_shape, placements)`` (or
    ``(global_shape, placements, block)``: one row block, its global rows as a tuple, a unit of its
    own; :func:`slice_map`) whose shard group is the members at ``member_coordinates`` (in the
    process group's rank order; ``me`` a position in it).  ``fraction`` and ``rows_only``: one value for every parameter, or one per parameter (Dion2
    groups with different fractions, NorDion2 beside Dion2).  ``owners``: each parameter's owner
    position (default :func:`assign_selection_owners`)."""
    if not 0 <= me < len(member_coordinates):
        raise ValueError(f"exchange_plan: member {me} outside a shard group of {len(member_coordinates)}")
    fractions = list(fraction) if isinstance(fraction, Sequence) else [fraction] * len(params)
    rows = list(rows_only) if isinstance(rows_only, Sequence) else [rows_only] * len(params)
    cache: dict[tuple, tuple[SliceMap, ...]] = {}
    maps = []
    for (shape, pl, *block), f, r in zip(params, fractions, rows):
        block = block[0] if block else None
        key = (tuple(shape), tuple(pl), f, r, block)
        if key not in cache:
            cache[key] = tuple(slice_map(shape, mesh_shape, pl, c, f, r, block) for c in member_coordinates)
        maps.append(cache[key])
    for i, per_member in enumerate(maps):
        if len({m.batch for m in per_member}) != 1:
            raise ValueError(f"exchange_plan: parameter {i}'s members hold different numbers of matrices "
                             f"{[m.batch for m in per_member]}: a leading dim is sharded within the shard group")
    if owners is None:
        owners = assign_selection_owners([m[0].batch * m[0].size for m in maps], len(member_coordinates))
    units = tuple(UnitExchange(i, int(o), m) for i, (o, m) in enumerate(zip(owners, maps)))
    size = len(member_coordinates)
    send, recv = [0] * size, [0] * size
    for u in units:
        send[u.owner] += u.values(me)
        if u.owner == me:
            for j in range(size):
                recv[j] += u.values(j)
    by_owner = tuple(sorted(range(len(units)), key=lambda i: (units[i].owner, i)))
    return ExchangePlan(size, me, units, tuple(send), tuple(recv), by_owner)
