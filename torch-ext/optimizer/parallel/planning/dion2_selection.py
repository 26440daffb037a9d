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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from torch.distributed.tensor.placement_types import Placement

from ...dion2.rule import chosen_count, selection_dim
from ...distributed.placements import Index, block_shape, local_indices
from .owners import assign_owners_among

__all__ = ["ExchangePlan", "SliceMap", "UnitExchange", "exchange_plan", "slice_map"]


@dataclass(frozen=True)
class SliceMap:
    """One member's share of one parameter, seen along its selection dim.

    ``indices``: the global indices it holds per tensor dim (``local_indices``); ``dim``: the
    selection dim (-2 rows, -1 columns); ``slices`` = ``indices[dim]``: the global index of each
    local slice, in local storage order; ``size``: the global size ``s`` of that dim; ``k``: the
    slices chosen per matrix; ``batch``: the local matrices (product of the local leading shape)."""

    indices: tuple[Index, ...]
    dim: int
    size: int
    k: int
    batch: int

    @property
    def slices(self) -> Index:
        return self.indices[self.dim]

    @property
    def count(self) -> int:
        """How many local slices (the length of ``slices``)."""
        return block_shape(self.indices)[self.dim]


def slice_map(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
              coordinate: Sequence[int], fraction: float, rows_only: bool = False) -> SliceMap:
    """The :class:`SliceMap` of the member at mesh ``coordinate`` for a parameter of
    ``global_shape`` ``[..., m, n]`` placed with ``placements`` on a mesh of ``mesh_shape``."""
    shape = tuple(int(s) for s in global_shape)
    dim = selection_dim(shape, rows_only)
    indices = local_indices(shape, mesh_shape, placements, coordinate)
    size = shape[dim]
    return SliceMap(indices, dim, size, chosen_count(fraction, size) if size else 0,
                    math.prod(block_shape(indices)[:-2]))


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


def exchange_plan(params: Sequence[tuple[Sequence[int], Sequence[Placement]]], mesh_shape: Sequence[int],
                  member_coordinates: Sequence[Sequence[int]], me: int, fraction: float | Sequence[float],
                  rows_only: bool | Sequence[bool] = False, owners: Sequence[int] | None = None) -> ExchangePlan:
    """The :class:`ExchangePlan` of parameters ``(global_shape, placements)`` whose shard group is
    the members at ``member_coordinates`` (in the process group's rank order; ``me`` a position in
    it).  ``fraction`` and ``rows_only``: one value for every parameter, or one per parameter (Dion2
    groups with different fractions, NorDion2 beside Dion2).  ``owners``: each parameter's owner
    position (default :func:`assign_selection_owners`)."""
    if not 0 <= me < len(member_coordinates):
        raise ValueError(f"exchange_plan: member {me} outside a shard group of {len(member_coordinates)}")
    fractions = list(fraction) if isinstance(fraction, Sequence) else [fraction] * len(params)
    rows = list(rows_only) if isinstance(rows_only, Sequence) else [rows_only] * len(params)
    cache: dict[tuple, tuple[SliceMap, ...]] = {}
    maps = []
    for (shape, pl), f, r in zip(params, fractions, rows):
        key = (tuple(shape), tuple(pl), f, r)
        if key not in cache:
            cache[key] = tuple(slice_map(shape, mesh_shape, pl, c, f, r) for c in member_coordinates)
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
