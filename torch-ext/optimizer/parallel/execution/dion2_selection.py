"""Dion2's exact selection on a mesh: partial norms to each unit's owner, masks back (collective).

The building block of ``docs/dion2.md``'s steps 1-5, for DTensor momenta (not wired into ``Muon``
yet).  Per shard group (the ranks that together hold one copy of a matrix):

1. every member computes the fp64 L1 norm of its pieces of its local slices
   (``dion2.rule.partial_slice_norms``);
2. one ``all_to_all_single`` delivers them to each unit's owner, which adds them per global slice
   index in member order (fp64);
3. the owner chooses the top ``k`` per matrix (``dion2.rule.choose``: larger norm first, equal
   norms lower index first);
4. one more ``all_to_all_single`` returns each member a mask (uint8) over its own local slices;
5. :func:`read_counts` reads every member's chosen counts in one host read, only where some
   unit's selection dim is split over its members (elsewhere every member holds ``k`` per matrix).

Split sizes come from :func:`plan_selection` (shapes and placements only), so steps 1-4 read
nothing on the host.  Every rank's mask is written by the owner, so ranks never disagree about it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ...dion2.rule import NORM_DTYPE, check_fraction, check_matrix, choose, partial_slice_norms
from ...distributed.groups import create_collectively, group_for, rank_sets_needed
from ...distributed.layout import MeshGrid, ParamLayout
from ..planning.dion2_selection import ExchangePlan, SliceMap, UnitExchange, exchange_plan

MASK_DTYPE = torch.uint8

__all__ = ["LocalSelection", "SelectionPlan", "plan_selection", "plan_selection_for", "read_counts", "select_local",
           "select_slices"]


@dataclass
class SelectionPattern:
    """The parameters (positions in the caller's list) that share one shard group on this rank."""

    group: dist.ProcessGroup | None
    plan: ExchangePlan
    params: tuple[int, ...]


@dataclass
class SelectionPlan:
    """What :func:`select_slices` needs each step; built once by :func:`plan_selection`."""

    patterns: list[SelectionPattern]
    maps: list[SliceMap]  # this rank's slice map of every parameter
    specs: list[tuple]  # every parameter's (global shape, placements), as planned
    _devices: dict = field(default_factory=dict)  # (device, id of an index) -> the index there

    def on(self, index, device: torch.device):
        """An index (slice or LongTensor) on ``device``, copied there once."""
        if isinstance(index, slice):
            return index
        key = (device, id(index))
        hit = self._devices.get(key)
        if hit is None:
            hit = self._devices[key] = (index, index.to(device))
        return hit[1]

    def wire_bytes(self) -> int:
        """What this rank sends to other ranks per step (fp64 partials, uint8 masks)."""
        return sum(p.plan.wire_bytes(torch.finfo(NORM_DTYPE).bits // 8, 1) for p in self.patterns)


@dataclass
class LocalSelection:
    """One parameter's selection on this rank.  ``mask`` ``[*local leading, local slices]`` (bool):
    which local slices are chosen, in local storage order (``SliceMap.slices``); ``counts``
    ``[*local leading]`` (int64, on the device): how many per local matrix; ``chosen`` (only on the
    unit's owner, else None): the chosen global indices ``[batch, k]``, ascending per matrix."""

    mask: Tensor
    counts: Tensor
    chosen: Tensor | None = None


def plan_selection(momenta: Sequence[DTensor], fraction: float, rows_only: bool = False) -> SelectionPlan:
    """Plan the selection of ``momenta`` (DTensors, every rank passing the same list in the same
    order).  Collective over the default group: creates the shard groups that span several mesh
    dims (``distributed.groups.create_collectively``).  Bad input is refused before that, alike on
    every rank (it depends only on what every rank passes)."""
    _check_momenta(momenta, fraction)
    layouts = [ParamLayout(tuple(m.shape), MeshGrid.of(m.device_mesh), tuple(m.placements)) for m in momenta]
    union = sorted({r for lay in layouts for r in lay.grid.ranks})
    create_collectively(rank_sets_needed([(lay, m.device_mesh) for lay, m in zip(layouts, momenta)], union))
    meshes = [m.device_mesh for m in momenta]
    return _plan(layouts, meshes, [fraction] * len(momenta), [rows_only] * len(momenta))


def plan_selection_for(specs: Sequence[tuple], fractions: Sequence[float], rows_only: Sequence[bool],
                       blocks: Sequence[tuple | None] | None = None) -> SelectionPlan:
    """:func:`plan_selection` for matrices described by ``(global shape, placements, DeviceMesh)``
    (a ``muon_transposed`` weight's view: ``matrix_view.view_shape``/``view_placements``), each
    with its own fraction and ``rows_only``, on the process groups that already exist (``Muon``
    creates every shard group its DTensor matrices need when it is built): no collective, so a
    step can plan at its first call.  Raises RuntimeError if a group is missing.  ``blocks``: per
    spec None, or one row block's global rows (a tuple): that block is the unit (``slice_map``)."""
    layouts = [ParamLayout(tuple(shape), MeshGrid.of(mesh), tuple(pl)) for shape, pl, mesh in specs]
    return _plan(layouts, [mesh for *_, mesh in specs], list(fractions), list(rows_only),
                 list(blocks) if blocks is not None else [None] * len(specs))


def _plan(layouts: list[ParamLayout], meshes: list, fractions: list[float], rows_only: list[bool],
          blocks: list | None = None) -> SelectionPlan:
    blocks = blocks if blocks is not None else [None] * len(layouts)
    keyed: dict[tuple, list[int]] = {}
    for i, lay in enumerate(layouts):
        keyed.setdefault((lay.grid, lay.matrix_dims), []).append(i)
    rank = dist.get_rank()
    patterns, maps = [], [None] * len(layouts)
    for (grid, matrix_dims), members in keyed.items():
        first = layouts[members[0]]
        ranks = first.shard_group(grid.coordinate(rank))
        group = group_for(ranks, meshes[members[0]], matrix_dims)
        order = dist.get_process_group_ranks(group) if group is not None else [rank]
        plan = exchange_plan([(layouts[i].shape, layouts[i].placements, blocks[i]) for i in members], grid.shape,
                             [grid.coordinate(r) for r in order], order.index(rank),
                             [fractions[i] for i in members], [rows_only[i] for i in members])
        for u in plan.units:
            maps[members[u.param]] = u.maps[plan.me]
        patterns.append(SelectionPattern(group, plan, tuple(members)))
    return SelectionPlan(patterns, maps, [(lay.shape, lay.placements) for lay in layouts])


def _check_momenta(momenta: Sequence[DTensor], fraction: float) -> None:
    if fraction is None:
        raise ValueError("plan_selection: `fraction` is None (that is Muon: nothing to select); give a number in (0, 1]")
    check_fraction(fraction, "fraction")
    rank = dist.get_rank()
    for i, m in enumerate(momenta):
        if not isinstance(m, DTensor):
            raise TypeError(f"plan_selection: momenta[{i}] is a {type(m).__name__}, not a DTensor: a tensor held "
                            "whole selects on its own (dion2.rule.choose_slices)")
        check_matrix(f"momenta[{i}]", tuple(m.shape))
        if rank not in MeshGrid.of(m.device_mesh).ranks:
            raise ValueError(f"plan_selection: rank {rank} is not in momenta[{i}]'s mesh: pass each rank only the "
                             "momenta of the meshes it belongs to")


def _partials(plan: ExchangePlan, locals_: Sequence[Tensor]) -> list[Tensor]:
    """This member's partial norms of every unit, ``[batch, count]`` fp64 each (step 1)."""
    out = []
    for u, t in zip(plan.units, locals_):
        m = u.maps[plan.me]
        out.append(partial_slice_norms(t, m.dim).reshape(u.batch, m.count))
    return out


def _exchange(send: Tensor, recv_splits, send_splits, group, like: Tensor) -> tuple[Tensor, object]:
    if group is None:  # a shard group of one: what it sends is what it receives
        return send, None
    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=like.device)
    work = dist.all_to_all_single(recv, send, list(recv_splits), list(send_splits), group=group, async_op=True)
    return recv, work


def _cat(parts: list[Tensor], dtype, device) -> Tensor:
    flat = [p.reshape(-1) for p in parts]
    return torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)


def _send_norms(plan: ExchangePlan, partials: list[Tensor], group, like: Tensor):
    """Step 2's send: this member's partials, by destination (owner), units in plan order."""
    parts = [partials[i] for i in plan.by_owner]
    send = _cat(parts, NORM_DTYPE, like.device)
    return _exchange(send, plan.norm_recv, plan.norm_send, group, like)


def _owner_choose(plan: ExchangePlan, sel: SelectionPlan, recv: Tensor) -> tuple[dict, list[Tensor]]:
    """Steps 2-3 on the owner: sum the members' partials per global slice (member order), choose.
    Returns the chosen indices per owned unit and the masks to send back, by destination."""
    owned = plan.owned()
    norms = {u.param: torch.zeros(u.batch, u.maps[0].size, dtype=NORM_DTYPE, device=recv.device) for u in owned}
    at = 0
    for j in range(plan.members):  # receive order: by source member, owned units in plan order
        for u in owned:
            n = u.values(j)
            ix = sel.on(u.maps[j].slices, recv.device)
            norms[u.param][:, ix] += recv[at:at + n].view(u.batch, u.maps[j].count)
            at += n
    chosen, masks = {}, {}
    for u in owned:
        idx = choose(norms[u.param], u.maps[0].k)
        chosen[u.param] = idx
        masks[u.param] = torch.zeros(u.batch, u.maps[0].size, dtype=MASK_DTYPE, device=recv.device).scatter_(1, idx, 1)
    back = [masks[u.param][:, sel.on(u.maps[j].slices, recv.device)] for j in range(plan.members) for u in owned]
    return chosen, back


def _unpack_masks(plan: ExchangePlan, recv: Tensor, locals_: Sequence[Tensor]) -> list[Tensor]:
    """Step 4's receive: this member's mask of every unit, shaped ``[*local leading, count]``."""
    out: list[Tensor | None] = [None] * len(plan.units)
    at = 0
    for i in plan.by_owner:  # by source (owner), its units in plan order
        u = plan.units[i]
        n = u.values(plan.me)
        out[i] = recv[at:at + n].view(*locals_[i].shape[:-2], u.maps[plan.me].count).bool()
        at += n
    return out


def _select_pattern(pattern: SelectionPattern, sel: SelectionPlan, locals_: list[Tensor]):
    """Launch step 2 of one pattern; returns a closure finishing steps 3-4."""
    plan, like = pattern.plan, locals_[0]
    recv, work = _send_norms(plan, _partials(plan, locals_), pattern.group, like)

    def finish():
        if work is not None:
            work.wait()
        chosen, back = _owner_choose(plan, sel, recv)
        send = _cat(back, MASK_DTYPE, like.device)
        got, work2 = _exchange(send, plan.norm_send, plan.norm_recv, pattern.group, like)
        return chosen, got, work2

    return finish


def select_slices(sel: SelectionPlan, momenta: Sequence[DTensor]) -> list[LocalSelection]:
    """Every parameter's selection on this rank (collective over each shard group; no host read).
    ``momenta``: the DTensors :func:`plan_selection` planned, in the same order.  Every pattern's
    norm exchange is in flight before any owner chooses."""
    if len(momenta) != len(sel.maps):
        raise ValueError(f"select_slices: planned for {len(sel.maps)} momenta, got {len(momenta)}")
    for i, (m, (shape, placements)) in enumerate(zip(momenta, sel.specs)):
        if tuple(m.shape) != shape or tuple(m.placements) != placements:
            raise ValueError(f"select_slices: momenta[{i}] is {tuple(m.shape)} {tuple(m.placements)}, planned as "
                             f"{shape} {placements}: plan again (plan_selection) after a reshard")
    return select_local(sel, [m.to_local() for m in momenta])


def select_local(sel: SelectionPlan, locals_: Sequence[Tensor]) -> list[LocalSelection]:
    """:func:`select_slices` from the local pieces (``[*local leading, rows, columns]``, as planned:
    a transposed weight's piece as its view), in the planned order (collective; no host read)."""
    pending = []
    for pattern in sel.patterns:
        mine = [locals_[i] for i in pattern.params]
        pending.append((pattern, mine, _select_pattern(pattern, sel, mine)))
    started = [(pattern, mine, finish()) for pattern, mine, finish in pending]
    out: list[LocalSelection | None] = [None] * len(locals_)
    for pattern, mine, (chosen, got, work) in started:
        if work is not None:
            work.wait()
        for u, mask in zip(pattern.plan.units, _unpack_masks(pattern.plan, got, mine)):
            out[pattern.params[u.param]] = LocalSelection(mask, mask.sum(dim=-1), chosen.get(u.param))
    return out


def read_counts(sel: SelectionPlan, selections: Sequence[LocalSelection]) -> list[list[int]]:
    """Step 5: this rank's chosen count per local matrix of every parameter, as host ints.  One
    host read (all parameters at once) if some parameter's selection dim is split over its members
    (its counts change per step); none otherwise (each member holds ``k`` per matrix)."""
    split = {pattern.params[u.param] for pattern in sel.patterns for u in pattern.plan.units if u.split}
    read = iter(torch.cat([selections[i].counts.reshape(-1) for i in sorted(split)]).tolist() if split else [])
    out = []
    for i, m in enumerate(sel.maps):
        out.append([next(read) for _ in range(m.batch)] if i in split else [m.k] * m.batch)
    return out


def unit_of(sel: SelectionPlan, i: int) -> UnitExchange:
    """Parameter ``i``'s unit (its owner and every member's slice map)."""
    for pattern in sel.patterns:
        if i in pattern.params:
            return pattern.plan.units[pattern.params.index(i)]
    raise IndexError(i)
