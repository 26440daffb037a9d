"""Which units of a pattern are cut over k ranks, and who owns them (pure: every rank computes the same).

Every member of a cut unit is busy for the split iteration's modelled time, in FLOP-equivalents
so that it compares with whole units.  A pattern is considered when one unit costs more than
:data:`TRIGGER` times a rank's ideal share; then, from whole units, a class of similar units
(within :data:`CLASS_BAND`) has its k doubled when that lowers the busiest rank by at least
:data:`MIN_GAIN` (:func:`choose_ks`), and :func:`choose_cuts` also tries :func:`~.cut_packing.pack_ways`,
which lets units of one class take different k (docs/parallel.md, "One matrix over k ranks").
"""

from __future__ import annotations

from typing import Callable, Sequence

from .cut_model import CutOptions
from .cut_packing import pack_ways
from .owners import assign_owners_grouped

# A pattern is considered for cutting when one unit costs more than this share of a rank's ideal load.
TRIGGER = 0.5
# A doubling of k is kept only if it lowers the busiest rank by at least this fraction.
MIN_GAIN = 0.02
# Units within this factor of the costliest are cut together (same-shape classes).
CLASS_BAND = 0.9


def assign(units: Sequence[CutOptions], ks: Sequence[int],
           held: dict[int, float] | None = None) -> tuple[list[int], dict[int, float]]:
    """LPT over whole and cut units (:func:`~.owners.assign_owners_grouped`), on top of ``held``
    (each rank's load from units it orthogonalises where it is): per unit the owner (k = 1) or the
    index of its group among ``units[i].groups(k)``; and every rank's load."""
    costs = [u.at(k) for u, k in zip(units, ks)]
    candidates = [u.candidates if k == 1 else None for u, k in zip(units, ks)]
    groups = [None if k == 1 else u.groups(k) for u, k in zip(units, ks)]
    return assign_owners_grouped(costs, candidates, groups if any(k > 1 for k in ks) else None, held)


def assign_paired(units: Sequence[CutOptions], ks: Sequence[int], held: dict[int, float] | None,
                  keys: Sequence[object]) -> tuple[list[int], dict[int, float]]:
    """:func:`assign`, with cut units of one key (``keys[i]``: what lets two units run as one call)
    and one k taken two by two, as one item, onto one group: there the runtime runs them as one
    call whose halves interleave (``member_cost`` assumes that partner)."""
    items: list[CutOptions] = []
    item_ks: list[int] = []
    members: list[list[int]] = []
    waiting: dict[tuple, int] = {}
    count: dict[tuple, int] = {}
    for i, k in enumerate(ks):
        if k > 1:
            count[(keys[i], k)] = count.get((keys[i], k), 0) + 1
    for i, (u, k) in enumerate(zip(units, ks)):
        # pairs only where units outnumber their groups: else alone, each on a group of its own, is faster
        pairing = k > 1 and count[(keys[i], k)] > len(u.groups(k))
        slot = waiting.pop((keys[i], k), None) if pairing else None
        if slot is None:
            if pairing:
                waiting[(keys[i], k)] = len(items)
            elif k > 1 and u.alone is not None:
                u = CutOptions(u.cost, u.candidates, u.ks, u.alone, u.groups, u.forced, u.alone)
            items.append(u)
            item_ks.append(k)
            members.append([i])
            continue
        a = items[slot]
        items[slot] = CutOptions(a.cost + u.cost, a.candidates, a.ks,
                                 lambda c, f=a.member_cost, g=u.member_cost: f(c) + g(c), a.groups, a.forced)
        members[slot].append(i)
    owners, loads = assign(items, item_ks, held)
    out = [0] * len(units)
    for owner, indices in zip(owners, members):
        for i in indices:
            out[i] = owner
    return out, loads


def choose_ks(units: Sequence[CutOptions], world: int,
              held: Callable[[], dict[int, float]] = dict, keys: Sequence[object] | None = None) -> list[int] | None:
    """k per unit (see the module docstring), or None when every unit stays whole.  ``held()``:
    every rank's load from units it orthogonalises where it is, which no cut can move (the busiest
    rank counts them)."""
    ks = [u.forced for u in units]
    auto = [i for i, u in enumerate(units) if u.ks and u.forced == 1]
    total = sum(u.cost for u in units)
    if not auto or max(units[i].cost for i in auto) <= TRIGGER * total / max(1, world):
        return ks if any(k > 1 for k in ks) else None
    base = held()
    best = _busiest(units, ks, base, keys)
    while True:  # each pass keeps the first move that pays: one class, costliest first, else two together
        # per class, its next k, then the later ones (with pairs, two units at k = 2 can cost as
        # much as the two whole while at k = 4 they pay): one class, else two together
        classes = []
        for cls in _classes(units, auto, ks):
            steps = {i: k for i in cls if (k := units[i].next_k(ks[i])) is not None}
            if steps:
                later = {i: _later_ks(units[i], k) for i, k in steps.items()}
                depth = max(len(v) for v in later.values())
                classes.append([steps] + [{i: (v[min(d, len(v) - 1)] if v else steps[i]) for i, v in later.items()}
                                          for d in range(depth)])
        moves = [[steps] for options in classes for steps in options]
        moves += [[a, b] for n, first in enumerate(classes) for later in classes[n + 1:] for a in first for b in later]
        for move in moves:
            trial = list(ks)
            for steps in move:
                for i, k in steps.items():
                    trial[i] = k
            busiest = _busiest(units, trial, base, keys)
            if busiest <= best * (1 - MIN_GAIN):
                ks, best = trial, busiest
                break
        else:
            break
    return ks if any(k > 1 for k in ks) else None


def _later_ks(unit: CutOptions, k: int) -> list[int]:
    """The allowed k above ``k`` (the next one excepted), each modelled faster than the one before
    (paired or alone: :meth:`CutOptions.faster`)."""
    out, here = [], k
    for c in unit.ks:
        if c > k and unit.faster(c, here):
            out.append(c)
            here = c
    return out


def _busiest(units: Sequence[CutOptions], ks: Sequence[int], held: dict[int, float],
             keys: Sequence[object] | None = None) -> float:
    _, loads = assign(units, ks, held) if keys is None else assign_paired(units, ks, held, keys)
    return max(loads.values(), default=0.0)


def _classes(units: Sequence[CutOptions], auto: Sequence[int], ks: Sequence[int]) -> list[list[int]]:
    """The units that may be cut, costliest first, in classes of similar cost (within CLASS_BAND
    of the class's costliest): same-shape units move together."""
    cost = {i: units[i].at(ks[i]) for i in auto}
    out: list[list[int]] = []
    for i in sorted(auto, key=lambda i: (-cost[i], i)):
        if out and cost[i] >= CLASS_BAND * cost[out[-1][0]]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def choose_cuts(units: Sequence[CutOptions], world: int, held: Callable[[], dict[int, float]] = dict,
                keys: Sequence[object] | None = None) -> tuple[list[int], list[int]] | None:
    """k and owner per unit (the owner as :func:`assign` gives it: a rank for k = 1, else the
    index of its group among ``units[i].groups(k)``), or None when every unit stays whole.

    Two ways of choosing: :func:`choose_ks` with :func:`assign_paired` (one k per class of similar units),
    kept unless the other lowers the busiest rank by at least :data:`MIN_GAIN`, and, with ``keys``,
    :func:`pack_ways` (each unit's way chosen as it is placed, so units of one class may take
    different k: Llama-3-70B at 1,024 ranks needs its q/o over 8 ranks on the groups that hold a
    pair of MLP matrices and paired over 4 on the others)."""
    ks = choose_ks(units, world, held, keys)
    if ks is not None:
        owners, loads = assign_paired(units, ks, held(), keys) if keys is not None else assign(units, ks, held())
        best = (max(loads.values(), default=0.0), ks, owners)
    auto = [i for i, u in enumerate(units) if u.ks and u.forced == 1]
    total = sum(u.cost for u in units)
    packable = (keys is not None and auto and all(u.forced == 1 for u in units)
                and max(units[i].cost for i in auto) > TRIGGER * total / max(1, world))
    if packable:
        if ks is None:
            ks = [1] * len(units)
            owners, loads = assign(units, ks, held())
            best = (max(loads.values(), default=0.0), ks, owners)
        packed = pack_ways(units, world, held(), keys, best[0])
        if packed[0] <= best[0] * (1 - MIN_GAIN):  # as a doubling of k: more bytes only for a real gain
            best = packed
    if ks is None or not any(k > 1 for k in best[1]):
        return None
    return best[1], best[2]
