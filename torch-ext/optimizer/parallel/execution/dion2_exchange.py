"""Dion2's chosen slices on the wire: to each unit's owner, assembled, and their update back (collective).

After the selection (``dion2_selection.select_local``: every member's mask over its local slices,
the owner's chosen global indices), per shard group:

* every member takes its pieces of its chosen slices (``T`` slices of ``L`` entries: its share of
  the other dim) in local storage order, matrix after matrix, and NorDion2's ``v`` of those rows;
* one ``all_to_all_single`` carries them to each unit's owner (bytes: the momentum as stored and
  ``v`` travel in one buffer), which puts every piece at its global place: the slice's position
  among the chosen (ascending global index) and the member's global indices of the other dim
  (``SliceMap.indices``), so the owner holds the ``k x n`` (or ``m x k``) submatrix single-device
  Dion2 orthogonalises, bit for bit;
* the owner's stage (``dion2_step.py``) gives the update of that submatrix, and one more
  ``all_to_all_single`` returns each member exactly its pieces of it (and ``v``'s new rows).

No host read here: the split sizes come from the counts read once per step
(:func:`read_chosen_counts`, only where a unit's selection dim is split over its members), and the
positions are computed on the device without ``nonzero`` (:func:`chosen_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..planning.dion2_selection import SliceMap
from .dion2_selection import LocalSelection, SelectionPlan

__all__ = ["ChosenCounts", "Positions", "chosen_positions", "chosen_where", "exchange_bytes", "from_bytes",
           "owner_positions", "read_chosen_counts", "slice_major", "to_bytes"]


def slice_major(t: Tensor, dim: int, batch: int) -> Tensor:
    """``t`` ``[*leading, r, c]`` as ``[batch, slices, entries]`` along the selection ``dim``: a view
    (in-place writes reach ``t``)."""
    s = t if dim == -2 else t.transpose(-1, -2)
    return s.view(batch, s.shape[-2], s.shape[-1])


@dataclass
class Positions:
    """Where a member's chosen slices sit, in the order they travel (matrix after matrix, local
    storage order): ``matrix`` and ``local`` (the slice's local position) index
    :func:`slice_major`; on the owner ``chosen`` is the slice's position among the chosen."""

    matrix: Tensor
    local: Tensor
    chosen: Tensor | None = None

    @property
    def count(self) -> int:
        return self.matrix.numel()


def chosen_positions(mask: Tensor, total: int) -> Positions:
    """The chosen entries of ``mask`` ``[batch, count]`` (bool), matrix after matrix, each matrix's in
    ascending local order, without a host read: ``total`` (how many are chosen, read once per step
    or static) sizes the result; every entry is scattered to its rank among the chosen, the others
    to a discarded slot."""
    batch, count = mask.shape
    flat_mask = mask.reshape(-1).to(torch.int64)
    dest = torch.where(flat_mask.bool(), flat_mask.cumsum(0) - 1, total)
    out = torch.empty(total + 1, dtype=torch.int64, device=mask.device)
    out.scatter_(0, dest, torch.arange(batch * count, device=mask.device))
    flat = out[:total]
    if count == 0:
        return Positions(flat, flat)
    return Positions(torch.div(flat, count, rounding_mode="floor"), flat.remainder(count))


def owner_positions(where: Tensor, smap: SliceMap, index, total: int) -> Positions:
    """A member's :class:`Positions` as its owner computes them, from ``where`` ``[batch, s]``
    (each global slice's position among the chosen, -1 if unchosen) and the member's slice map
    (``index``: its ``slices`` on the device); ``chosen``: positions among the chosen."""
    pos = chosen_positions(where[:, index] >= 0, total)
    if pos.count == 0:
        return Positions(pos.matrix, pos.local, pos.local)
    globals_ = pos.local + index.start if isinstance(index, slice) else index[pos.local]
    return Positions(pos.matrix, pos.local, where[pos.matrix, globals_])


def chosen_where(chosen: Tensor, size: int) -> Tensor:
    """``[batch, size]``: each global slice's position among ``chosen`` ``[batch, k]`` (ascending), -1
    for the slices not chosen."""
    where = torch.full((chosen.shape[0], size), -1, dtype=torch.int64, device=chosen.device)
    ranks = torch.arange(chosen.shape[1], device=chosen.device).expand_as(chosen)
    return where.scatter_(1, chosen, ranks)


@dataclass
class ChosenCounts:
    """Host counts of a step: ``own[i]`` this rank's chosen slices of parameter ``i`` (all its
    local matrices); ``members[(i, j)]``: member ``j``'s of parameter ``i``, for the units this rank
    owns."""

    own: list[int]
    members: dict[tuple[int, int], int]


def read_chosen_counts(sel: SelectionPlan, sels: Sequence[LocalSelection],
                       wheres: dict[int, Tensor]) -> ChosenCounts:
    """Every count the chosen-slice exchange needs, in one host read where some unit's selection
    dim is split over its members (this rank's counts and, as an owner, its members'), none
    elsewhere (every member then holds ``k`` chosen slices per matrix).  ``wheres``: the owned
    parameters' :func:`chosen_where`."""
    own: list[int | None] = [None] * len(sels)
    members: dict[tuple[int, int], int | None] = {}
    pending: list[tuple[object, Tensor]] = []
    for pattern in sel.patterns:
        plan = pattern.plan
        for ui, u in enumerate(plan.units):
            i = pattern.params[ui]
            static = u.batch * u.maps[0].k
            if not u.split:
                own[i] = static
            else:
                pending.append((i, sels[i].counts.reshape(-1).sum().reshape(1)))
            if u.owner != plan.me:
                continue
            for j, smap in enumerate(u.maps):
                if not u.split:
                    members[(i, j)] = static
                else:
                    index = sel.on(smap.slices, wheres[i].device)
                    pending.append(((i, j), (wheres[i][:, index] >= 0).sum().reshape(1)))
    if pending:
        values = torch.cat([t for _, t in pending]).tolist()  # the one host read (docs/dion2.md, step 5)
        for (key, _), value in zip(pending, values):
            if isinstance(key, tuple):
                members[key] = int(value)
            else:
                own[key] = int(value)
    return ChosenCounts(own, members)


def to_bytes(t: Tensor) -> Tensor:
    """``t``'s bytes, flat (uint8): pieces of several dtypes travel in one buffer."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(b: Tensor, dtype: torch.dtype, shape: Sequence[int]) -> Tensor:
    """The tensor of ``dtype`` and ``shape`` whose bytes are ``b`` (copied where ``b`` is not
    aligned for ``dtype``)."""
    if b.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=b.device)
    if b.storage_offset() % dtype.itemsize:
        b = b.clone()
    return b.view(dtype).view(shape)


def exchange_bytes(parts: list[Tensor], send_sizes: list[int], recv_sizes: list[int], group,
                   device: torch.device) -> tuple[Tensor, object]:
    """Launch one ``all_to_all_single`` of ``parts`` (bytes, in destination order); returns the
    receive buffer and the work (None for a shard group of one: what it sends is what it gets)."""
    send = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    if group is None:
        return send, None
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    work = dist.all_to_all_single(recv, send, list(recv_sizes), list(send_sizes), group=group, async_op=True)
    return recv, work
