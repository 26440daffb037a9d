"""Cuts chosen unit by unit as each is placed (two k's in one class).

One k per class misses assignments where units of one shape must run two ways (Llama-3-70B's q/o at
1,024 ranks: docs/scale.md); :func:`pack_ways` places units costliest first, each the way with
the least rank-time that stays under a target load, the target bisected.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple, Sequence

from .cut_model import CutOptions

# Bisection steps of :func:`pack_ways`' target between the average load and the busiest rank of one k per class.
PACK_STEPS = 12


class _LeastLoaded:
    """The least loaded of a list of rank groups (by its busiest member), under loads that only
    grow: a heap of (busiest member's load, position) whose stale entries are refreshed as they
    surface (a stale entry is too low, never too high)."""

    def __init__(self, groups: Sequence[Sequence[int]], loads: dict[int, float]):
        self.groups, self.loads = groups, loads
        self.heap = [(max(loads.get(r, 0.0) for r in g), pos) for pos, g in enumerate(groups)]
        heapq.heapify(self.heap)

    def least(self) -> tuple[float, int]:
        while True:
            load, pos = self.heap[0]
            now = max(self.loads.get(r, 0.0) for r in self.groups[pos])
            if now == load:
                return load, pos
            heapq.heapreplace(self.heap, (now, pos))

    def charge(self, pos: int, cost: float) -> None:
        for r in self.groups[pos]:
            self.loads[r] = self.loads.get(r, 0.0) + cost
        heapq.heapreplace(self.heap, (max(self.loads[r] for r in self.groups[pos]), pos))


class _Ways(NamedTuple):
    """A unit's ways, priced once for every pass of :func:`pack_ways`."""

    cost: float  # whole
    candidates: Sequence[int]
    cuts: dict  # k -> (its groups, member cost alone, member cost paired)


def _ways(u: CutOptions) -> _Ways:
    ks = u.ks if u.forced == 1 else ()
    return _Ways(u.cost, u.candidates, {k: (u.groups(k), u.at_alone(k), u.member_cost(k)) for k in ks})


def _pack(menus: Sequence[_Ways], order: Sequence[int], held: dict[int, float], keys: Sequence[object],
          target: float) -> tuple[float, list[int], list[int]]:
    """One pass of :func:`pack_ways` at ``target``: (busiest rank, k per unit, owner per unit)."""
    loads = dict(held)
    ks = [1] * len(menus)
    owners = [0] * len(menus)
    # heaps keyed by identity (hashing the candidates would cost ranks x units); heaps over the
    # same ranks share ``loads``, so each still sees the others' charges
    heaps: dict[int, _LeastLoaded] = {}

    def heap(options, whole: bool) -> _LeastLoaded:
        if id(options) not in heaps:
            heaps[id(options)] = _LeastLoaded(tuple((r,) for r in dict.fromkeys(options)) if whole else options, loads)
        return heaps[id(options)]

    n = 0
    while n < len(order):
        i = order[n]
        u = menus[i]
        partner = menus[order[n + 1]].cuts if n + 1 < len(order) and keys[order[n + 1]] == keys[i] else {}
        where = heap(u.candidates, True)
        least, pos = where.least()
        # (misses the target, rank-time per unit if it fits else load after, load after, units taken), k, where
        options = [((least + u.cost > target, u.cost if least + u.cost <= target else least + u.cost,
                     least + u.cost, 1), 1, where, pos, u.cost)]
        for k, (groups, alone, paired) in u.cuts.items():
            where = heap(groups, False)
            least, pos = where.least()
            ways = [(1, alone, k * alone)]
            if k in partner:  # paired with the next unit of its key: the two as one call
                pair = paired + partner[k][2]
                ways.append((2, pair, k * pair / 2))
            for taken, cost, area in ways:
                after = least + cost
                # fits under the target: least rank-time first; else: least load after
                options.append(((after > target, area if after <= target else after, after, taken), k, where, pos, cost))
        rank, k, where, pos, cost = min(options, key=lambda o: o[0])
        where.charge(pos, cost)
        taken = rank[3]
        for m in order[n: n + taken]:
            ks[m] = k
            owners[m] = where.groups[pos][0] if k == 1 else pos
        n += taken
    return max(loads.values(), default=0.0), ks, owners


def pack_ways(units: Sequence[CutOptions], world: int, held: dict[int, float], keys: Sequence[object],
              ceiling: float) -> tuple[float, list[int], list[int]]:
    """Cuts that choose each unit's way as it is placed: (busiest rank, k per unit, owner per
    unit as :func:`choose_cuts` gives them).

    Units are taken costliest first (those of one key together, so that two in a row may be
    paired).  Each goes the way that puts the least rank-time on the world (k x its member
    cost: whole, alone over k ranks, or paired with the next unit of its key over k ranks, the
    two as one call) among those whose least loaded rank or group stays under a target load;
    where none does, the way that leaves the least load.  The target is bisected between the
    world's average (every unit at its least rank-time) and ``ceiling`` (the busiest rank of
    another choice), and the best pass kept: cost linear in the units per pass, PACK_STEPS + 1
    passes.  Pure: every rank computes the same cuts."""
    first: dict[object, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    order = sorted(range(len(units)), key=lambda i: (-units[i].cost, first[keys[i]], i))
    menus = [_ways(u) for u in units]
    least_area = sum(min([m.cost] + [k * paired for k, (_, _, paired) in m.cuts.items()]) for m in menus)
    low = (sum(held.values()) + least_area) / max(1, world)
    high = ceiling
    best = _pack(menus, order, held, keys, high)
    for _ in range(PACK_STEPS):
        target = (low + high) / 2
        trial = _pack(menus, order, held, keys, target)
        if trial[0] < best[0]:
            best = trial
        if trial[0] <= target:
            high = target
        else:
            low = target
    return best
