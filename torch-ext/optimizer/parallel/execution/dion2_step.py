"""Dion2 and NorDion2 for DTensor parameters: only the chosen slices travel, to one owner and back (collective).

Every Dion2 DTensor parameter of a step (``docs/dion2.md``, "Built: DTensor parameters") is stepped
as single-device Dion2 steps its whole tensor, bit for bit, while the wire carries only the chosen
slices (and the selection's ``O(s)`` norms and masks):

1. ``M <- M + G`` on every rank's local piece (elementwise: the bits one device computes);
2. the exact selection (``dion2_selection.select_local``: fp64 partial norms to each unit's owner,
   the top ``k`` per matrix there, masks back), planned once per set of parameters and layouts
   (:func:`selection_plan`, no collective: ``Muon`` created the shard groups when it was built);
3. one host read of the chosen counts, only where a unit's selection dim is split over its members
   (``dion2_exchange.read_chosen_counts``; the lead's decision 1);
4. per shard group one ``all_to_all_single`` carries each member's pieces of its chosen slices (and
   NorDion2's ``v`` of those rows) to the unit's owner, which assembles the ``k``-slice submatrix in
   ascending global order (``dion2_exchange``), orthogonalises it with the group's Newton–Schulz,
   normalises it (NorDion2), and one more returns each member exactly its pieces of the update;
5. every member updates its own piece: weight decay everywhere (cautious where ``W D >= 0``, ``D``
   zero off the chosen slices), the update on its chosen slices, ``ef_decay`` on its chosen
   momentum slices (rounded once as stored), its rows of ``v``.

A parameter with row blocks (``muon_row_blocks``) is one unit per block in steps 2-5, each its own
matrix ``[..., rows_b, n]`` exactly as ``dion2_rule.dion2_blocks_step_`` steps it on one device: its
selection dim, ``k`` and lr from its own shape, its rows of each member's piece
(``planning/dion2_selection.block_rows``) stepped as copies and written back.

Experts held whole by one rank (a shard group of one) select and orthogonalise locally, with no
collective.  Under HSDP each replica's shard group runs the same step on identical inputs (Muon's
``replica_split``, ``distributed_mode``, ``chunk_size`` and ``lookahead`` do not apply to Dion2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ...dion2 import rule as dion2_rule
from ...matrix_view import local_matrix, view_placements, view_shape
from ...rule import apply_update_, normuon_normalize
from ...tensors import local_view
from ..planning.dion2_exchange import UnitWire, other_length, owned_in_order, split_sizes
from .dion2_exchange import (ChosenCounts, Positions, chosen_positions, chosen_where, exchange_bytes, from_bytes,
                             owner_positions, read_chosen_counts, slice_major, to_bytes)
from .dion2_selection import LocalSelection, SelectionPattern, SelectionPlan, plan_selection_for, select_local

__all__ = ["Dion2Item", "dion2_dtensor_update_", "selection_plan"]


@dataclass
class Dion2Item:
    """One Dion2 DTensor parameter of a step: the parameter (gradient set), its momentum and
    NorDion2's ``v`` (DTensors; ``v`` None without NorDion2), whether it is read transposed, the
    rule's keywords (``dion2/step.py``'s ``_options``) and its row blocks (None: the whole matrix)."""

    param: object
    buf: object
    v: object | None
    transposed: bool
    options: dict
    blocks: list[tuple[tuple[int, ...], float]] | None = None  # row blocks: (global rows, adjusted lr) each

    def views(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The local pieces as Muon reads them: parameter, momentum ``[*leading, r, c]`` and ``v``
        ``[*leading, r]`` (stored as the view's rows already)."""
        p = local_matrix(local_view(self.param), self.transposed)
        m = local_matrix(local_view(self.buf), self.transposed)
        v = local_view(self.v).select(-1, 0) if self.v is not None else None
        return p, m, v

    @property
    def dtype(self) -> torch.dtype:
        return self.options["dtype"] or torch.promote_types(self.param.dtype, self.buf.dtype)


@dataclass
class Unit:
    """One matrix a step selects and orthogonalises: a whole item (``rows`` None), or one row block
    of it (``muon_row_blocks``: ``rows`` its global rows of the ``[out, in]`` view, in block order),
    a matrix of its own: ``shape`` its global shape ``[..., rows_b, n]``, ``options`` the item's with
    the block's own adjusted lr."""

    item: Dion2Item
    shape: tuple[int, ...]
    options: dict
    rows: tuple[int, ...] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.item.dtype


def units_of(items: Sequence[Dion2Item]) -> list[Unit]:
    """Every item's units: the item itself, or each of its row blocks (``Dion2Item.blocks``)."""
    out = []
    for it in items:
        shape = view_shape(it.param.shape, it.transposed)
        if it.blocks is None:
            out.append(Unit(it, shape, it.options))
            continue
        for rows, adjusted in it.blocks:
            out.append(Unit(it, (*shape[:-2], len(rows), shape[-1]), {**it.options, "adjusted": adjusted}, rows))
    return out


# ---------------------------------------------------------------------------- the plan, once

_PLANS: dict[tuple, tuple[SelectionPlan, list]] = {}
_PLANS_LIMIT = 64


def selection_plan(units: Sequence[Unit]) -> SelectionPlan:
    """The selection plan of ``units`` (their items' ``muon_transposed`` views, or row blocks of
    them), memoised per process on their shapes, placements, meshes, fractions, ``rows_only`` and
    blocks (the meshes are kept alive with the plan, so their ids stay theirs).  No collective:
    every shard group exists already."""
    key = (id(dist.group.WORLD), tuple(
        (tuple(u.item.param.shape), tuple(u.item.param.placements), id(u.item.param.device_mesh), u.item.transposed,
         u.options["fraction"], u.options["normuon_beta2"] is not None, u.rows) for u in units))
    hit = _PLANS.get(key)
    if hit is None:
        if len(_PLANS) >= _PLANS_LIMIT:
            _PLANS.clear()
        items = [u.item for u in units]
        specs = [(view_shape(it.param.shape, it.transposed),
                  view_placements(it.param.placements, it.param.dim(), it.transposed), it.param.device_mesh)
                 for it in items]
        plan = plan_selection_for(specs, [u.options["fraction"] for u in units],
                                  [u.options["normuon_beta2"] is not None for u in units], [u.rows for u in units])
        hit = _PLANS[key] = (plan, [it.param.device_mesh for it in items])
    return hit[0]


# ---------------------------------------------------------------------------- the step


def dion2_dtensor_update_(items: Sequence[Dion2Item]) -> list[LocalSelection]:
    """One Dion2 step of every item (collective over each item's shard group; every rank of the
    items' meshes calls this with the same items in the same order), in place on the local pieces
    of the parameters, momenta and ``v``.  Returns each unit's selection on this rank (an item's,
    or each of its row blocks', in order: :func:`units_of`)."""
    if not items:
        return []
    for it in items:
        dion2_rule.momentum_sum_(local_view(it.buf), local_view(it.param.grad), it.options["maximize"], it.dtype)
    units = units_of(items)
    plan = selection_plan(units)
    whole = {id(it): it.views() for it in items}
    views = [_block_pieces(whole[id(u.item)], plan.maps[i].local_rows) for i, u in enumerate(units)]
    sels = select_local(plan, [m for _, m, _ in views])
    wheres = {pattern.params[ui]: chosen_where(sels[pattern.params[ui]].chosen, u.maps[0].size)
              for pattern in plan.patterns for ui, u in enumerate(pattern.plan.units) if u.owner == pattern.plan.me}
    counts = read_chosen_counts(plan, sels, wheres)
    mine = [chosen_positions(sels[i].mask.reshape(plan.maps[i].batch, plan.maps[i].count), counts.own[i])
            for i in range(len(units))]
    steps = [_PatternStep(pattern, plan, units, views, mine, counts, wheres) for pattern in plan.patterns]
    for step in steps:
        step.send_chosen()  # every group's pieces in flight before any owner waits
    for i, (u, (_, m, _)) in enumerate(zip(units, views)):
        _decay_chosen(m, plan.maps[i], mine[i], u.options["ef_decay"], u.dtype)
    for step in steps:
        step.own_and_return()
    for step in steps:
        step.apply()
    for i, u in enumerate(units):
        _put_block_pieces(whole[id(u.item)], plan.maps[i].local_rows, views[i])
    return sels


def _block_pieces(views: tuple, local_rows) -> tuple:
    """A row block's local pieces (parameter, momentum, ``v``): copies of the rows ``local_rows`` of
    the whole local pieces ``views`` (None: the whole pieces themselves)."""
    if local_rows is None:
        return views
    p, m, v = views
    rows = (p[..., local_rows, :].clone(), m[..., local_rows, :].clone())
    return (*rows, None if v is None else v[..., local_rows].clone())


def _put_block_pieces(views: tuple, local_rows, pieces: tuple) -> None:
    """A row block's stepped pieces written back into its rows of the whole local pieces."""
    if local_rows is None:
        return
    (p, m, v), (pb, mb, vb) = views, pieces
    p[..., local_rows, :] = pb
    m[..., local_rows, :] = mb
    if v is not None:
        v[..., local_rows] = vb


def _decay_chosen(m: Tensor, smap, pos: Positions, ef_decay: float, dtype: torch.dtype) -> None:
    """Error feedback on this rank's chosen momentum slices: ``M[K] <- ef_decay M[K]`` in ``dtype``,
    rounded once as stored (``dion2_rule.decay_chosen_``'s arithmetic)."""
    if pos.count == 0:
        return
    ms = slice_major(m, smap.dim, smap.batch)
    ms[pos.matrix, pos.local] = ms[pos.matrix, pos.local].to(dtype).mul_(ef_decay).to(ms.dtype)


def update_dtype(unit: Unit, smap, lead: Sequence[int]) -> torch.dtype:
    """The dtype of the orthogonalised submatrix (what Newton–Schulz returns for it; the input's
    when it is empty): every member computes it, so the update travels in it without a word."""
    shape = unit.shape
    sub = (*lead, smap.k, shape[-1]) if smap.dim == -2 else (*lead, shape[-2], smap.k)
    orth = unit.options["orthogonalize"]
    if smap.k == 0 or shape[-1] * shape[-2] == 0 or 0 in lead or not hasattr(orth, "output_dtype"):
        return unit.dtype
    return orth.output_dtype(sub, unit.dtype, local_view(unit.item.param).device)


class _PatternStep:
    """Steps 4-5 for one shard group's units, from this rank's side (member, and owner of some)."""

    def __init__(self, pattern: SelectionPattern, sel: SelectionPlan, units, views, mine: list[Positions],
                 counts: ChosenCounts, wheres: dict[int, Tensor]):
        self.pattern, self.plan, self.sel = pattern, pattern.plan, sel
        self.units = [units[i] for i in pattern.params]
        self.views = [views[i] for i in pattern.params]
        self.mine = [mine[i] for i in pattern.params]
        self.own = [counts.own[i] for i in pattern.params]
        self.members = {(ui, j): counts.members[(i, j)] for ui, i in enumerate(pattern.params)
                        for j in range(self.plan.members) if (i, j) in counts.members}
        self.wheres = {ui: wheres[i] for ui, i in enumerate(pattern.params) if i in wheres}
        self.device = self.views[0][1].device
        self.lead = [tuple(m.shape[:-2]) for _, m, _ in self.views]
        self.row_size = [v.element_size() if v is not None else 0 for _, _, v in self.views]
        self.forward = [UnitWire(m.element_size(), r) for (_, m, _), r in zip(self.views, self.row_size)]
        self.out_dtype = [update_dtype(unit, u.maps[self.plan.me], lead)
                          for unit, u, lead in zip(self.units, self.plan.units, self.lead)]
        self.back = [UnitWire(d.itemsize, r) for d, r in zip(self.out_dtype, self.row_size)]

    # -- members: their chosen pieces to the owners

    def send_chosen(self) -> None:
        parts = []
        for dest in range(self.plan.members):
            for ui, u in owned_in_order(self.plan, dest):
                _, m, v = self.views[ui]
                pos, smap = self.mine[ui], u.maps[self.plan.me]
                parts.append(to_bytes(slice_major(m, smap.dim, u.batch)[pos.matrix, pos.local]))
                if v is not None:
                    parts.append(to_bytes(v.view(u.batch, smap.count)[pos.matrix, pos.local]))
        send, recv = split_sizes(self.plan, self.own, self.members, self.forward)
        self.flight = exchange_bytes(parts, send, recv, self.pattern.group, self.device)

    # -- owners: assemble, orthogonalise, return each member its pieces

    def own_and_return(self) -> None:
        recv, work = self.flight
        if work is not None:
            work.wait()
        owned = owned_in_order(self.plan, self.plan.me)
        received = self._unpack_at_owner(recv, owned)
        parts_for: list[list[Tensor]] = [[] for _ in range(self.plan.members)]
        for ui, u in owned:
            for j, part in enumerate(self._owner_stage(ui, u, received[ui])):
                parts_for[j].extend(part)
        back_recv, back_send = split_sizes(self.plan, self.own, self.members, self.back)
        parts = [p for j in range(self.plan.members) for p in parts_for[j]]
        self.return_flight = exchange_bytes(parts, back_send, back_recv, self.pattern.group, self.device)

    def _unpack_at_owner(self, recv: Tensor, owned) -> dict[int, list]:
        """Per owned unit, per member: (its positions, its pieces, its ``v`` values or None)."""
        out: dict[int, list] = {ui: [] for ui, _ in owned}
        at = 0
        for j in range(self.plan.members):  # by source member, owned units in plan order
            for ui, u in owned:
                smap, total = u.maps[j], self.members[(ui, j)]
                pos = owner_positions(self.wheres[ui], smap, self.sel.on(smap.slices, self.device), total)
                length, wire = other_length(smap), self.forward[ui]
                pieces = from_bytes(recv[at:at + total * length * wire.piece], self.views[ui][1].dtype,
                                    (total, length))
                at += total * length * wire.piece
                v = None
                if wire.row_state:
                    v = from_bytes(recv[at:at + total * wire.row_state], self.views[ui][2].dtype, (total,))
                    at += total * wire.row_state
                out[ui].append((pos, pieces, v))
        return out

    def _owner_stage(self, ui: int, u, received: list) -> list[list[Tensor]]:
        """The owner's work on one unit: the submatrix in ascending global order, Newton–Schulz,
        NorDion2's normalisation; returns each member's message (its update pieces, its ``v``)."""
        unit, (_, m, v) = self.units[ui], self.views[ui]
        smap, lead, opts = u.maps[0], self.lead[ui], unit.options
        full = unit.shape
        length = full[-1] if smap.dim == -2 else full[-2]
        sub = torch.zeros(u.batch, smap.k, length, dtype=m.dtype, device=self.device)
        vk = torch.zeros(u.batch, smap.k, dtype=v.dtype, device=self.device) if v is not None else None
        for j, (pos, pieces, vals) in enumerate(received):
            _at_place(sub, pos, self.sel.on(u.maps[j].indices[_other(smap.dim)], self.device), pieces)
            if vals is not None and pos.count:
                vk[pos.matrix, pos.chosen] = vals
        sub = sub if smap.dim == -2 else sub.transpose(-1, -2)
        x = sub.reshape(*lead, *sub.shape[-2:]).to(unit.dtype).contiguous()  # before the decay, as one device
        o = _orthogonalize(opts["orthogonalize"], x, math.prod(full[:-2]))
        if vk is not None and u.batch * smap.k:
            o, vk = normuon_normalize(o, vk.view(*lead, smap.k, 1), opts["normuon_beta2"], o.dtype)
            vk = vk.reshape(u.batch, smap.k)
        o3 = (o if smap.dim == -2 else o.transpose(-1, -2)).reshape(u.batch, smap.k, length)
        out = []
        for j, (pos, _, _) in enumerate(received):
            part = [to_bytes(_at_take(o3, pos, self.sel.on(u.maps[j].indices[_other(smap.dim)], self.device)))]
            if vk is not None:
                part.append(to_bytes(vk[pos.matrix, pos.chosen]))
            out.append(part)
        return out

    # -- members: their pieces of the update

    def apply(self) -> None:
        recv, work = self.return_flight
        if work is not None:
            work.wait()
        at = 0
        for owner in range(self.plan.members):  # by source (owner), its units in plan order
            for ui, u in owned_in_order(self.plan, owner):
                smap, pos, wire = u.maps[self.plan.me], self.mine[ui], self.back[ui]
                total, length = self.own[ui], other_length(smap)
                pieces = from_bytes(recv[at:at + total * length * wire.piece], self.out_dtype[ui], (total, length))
                at += total * length * wire.piece
                v_new = None
                if wire.row_state:
                    v_new = from_bytes(recv[at:at + total * wire.row_state], self.views[ui][2].dtype, (total,))
                    at += total * wire.row_state
                self._apply_unit(ui, smap, pos, pieces, v_new)

    def _apply_unit(self, ui: int, smap, pos: Positions, pieces: Tensor, v_new: Tensor | None) -> None:
        """Weight decay everywhere, the update on this rank's chosen slices, their rows of ``v``."""
        unit, (p, _, v) = self.units[ui], self.views[ui]
        opts = unit.options
        d3 = torch.zeros(smap.batch, smap.count, other_length(smap), dtype=self.out_dtype[ui], device=self.device)
        if pos.count:
            d3[pos.matrix, pos.local] = pieces
        d = d3.view(*self.lead[ui], *d3.shape[-2:])
        d = d if smap.dim == -2 else d.transpose(-1, -2)
        apply_update_(p, d, opts["lr"], opts["adjusted"], opts["weight_decay"], opts["cautious"])
        if v_new is not None and pos.count:
            v.view(smap.batch, smap.count)[pos.matrix, pos.local] = v_new


def _orthogonalize(orth, x: Tensor, whole_batch: int) -> Tensor:
    """``orth(x)`` as single-device Dion2 computes it within the whole stack: one matrix of a stack
    of several runs as a batch of two (itself twice), since torch's batched products round a batch
    of one (run as plain matrix products) differently from a matrix inside a larger batch, and
    alike for every batch of two or more."""
    if not x.numel():
        return x
    if x.dim() > 2 and math.prod(x.shape[:-2]) == 1 and whole_batch > 1:
        one = x.reshape(1, *x.shape[-2:])
        return orth(torch.cat([one, one]))[:1].reshape(x.shape)
    return orth(x)


def _other(dim: int) -> int:
    return -1 if dim == -2 else -2


def _at_place(sub: Tensor, pos: Positions, other, pieces: Tensor) -> None:
    """Put a member's pieces ``[T, L]`` into the owner's ``[batch, k, length]`` submatrix: slice
    ``pos.chosen`` of matrix ``pos.matrix``, entries at the member's global ``other`` indices."""
    if pos.count == 0:
        return
    if isinstance(other, slice):
        sub[pos.matrix, pos.chosen, other] = pieces
    else:
        sub[pos.matrix[:, None], pos.chosen[:, None], other[None, :]] = pieces


def _at_take(o3: Tensor, pos: Positions, other) -> Tensor:
    """A member's pieces of the owner's update ``[batch, k, length]`` (the inverse of :func:`_at_place`)."""
    if isinstance(other, slice):
        return o3[pos.matrix, pos.chosen, other]
    return o3[pos.matrix[:, None], pos.chosen[:, None], other[None, :]]

