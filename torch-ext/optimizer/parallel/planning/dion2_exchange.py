"""Dion2's chosen-slice exchange, sized: who sends what to each unit's owner and back (pure).

After the selection (``dion2_selection.py``) every member of a shard group knows which of its local
slices are chosen, and each unit's owner knows every member's (it wrote their masks).  Each member
then sends the owner its pieces of its chosen slices (``T`` slices, ``L`` entries each: its share of
the other dim), NorDion2's ``v`` of those rows beside them, and receives the same pieces of the
update back (``docs/dion2.md``, steps 6-7).  This module is the arithmetic of those two
``all_to_all_single``: the bytes of each member's message per unit, from host counts.

A unit whose selection dim is split over its members (a wide ``Shard(0)`` matrix) has counts that
change every step (read once per step, ``dion2_exchange.read_chosen_counts``); elsewhere every
member holds a piece of every slice and ``k`` of them are chosen per matrix: static.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...distributed.placements import block_shape
from .dion2_selection import ExchangePlan, SliceMap, UnitExchange

__all__ = ["UnitWire", "message_bytes", "other_length", "owned_in_order", "split_sizes"]


def other_length(smap: SliceMap) -> int:
    """How many entries of each of its local slices a member holds (its share of the other dim)."""
    shape = block_shape(smap.indices)
    return shape[-1] if smap.dim == -2 else shape[-2]


@dataclass(frozen=True)
class UnitWire:
    """The itemsizes one unit's messages carry: the pieces (``piece``: the momentum as stored on
    the way to the owner, the update's dtype on the way back) and NorDion2's ``v`` per slice (0
    without it)."""

    piece: int
    row_state: int = 0


def message_bytes(slices: int, length: int, wire: UnitWire) -> int:
    """The bytes of ``slices`` chosen slices of ``length`` entries each, with their ``v``."""
    return slices * (length * wire.piece + wire.row_state)


def split_sizes(plan: ExchangePlan, own: Sequence[int], members: dict[tuple[int, int], int],
                wires: Sequence[UnitWire]) -> tuple[list[int], list[int]]:
    """The byte split sizes of one direction of the exchange, from ``plan.me``'s side:
    ``(sent to each member, received from each member)``.  ``own[u]``: how many chosen slices
    ``me`` holds of unit ``u`` (all its local matrices); ``members[(u, j)]``: member ``j``'s, for
    the units ``me`` owns; ``wires[u]``: what a slice of unit ``u`` carries (toward the owner; the
    way back swaps the two lists, with the update's itemsize)."""
    send, recv = [0] * plan.members, [0] * plan.members
    for ui, u in enumerate(plan.units):
        send[u.owner] += message_bytes(own[ui], other_length(u.maps[plan.me]), wires[ui])
        if u.owner == plan.me:
            for j in range(plan.members):
                recv[j] += message_bytes(members[(ui, j)], other_length(u.maps[j]), wires[ui])
    return send, recv


def owned_in_order(plan: ExchangePlan, owner: int) -> list[tuple[int, UnitExchange]]:
    """The units ``owner`` owns, in the order a message to or from it carries them."""
    return [(i, plan.units[i]) for i in plan.by_owner if plan.units[i].owner == owner]
