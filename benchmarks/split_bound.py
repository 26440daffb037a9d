"""A lower bound on the busiest rank of any plan that orthogonalises every unit whole or cut over k ranks.

Used by ``scale_model.py`` for the rows that miss the balance target: how low could the busiest
rank go with these units, on these ranks, at the cost model's figures, whatever the planner does?

Every unit (a matrix; an expert stack counts as its single experts, the finest split of it) is run
one of three ways: whole on one rank (its Newton-Schulz FLOPs), cut over k ranks alone (every
member busy for the split iteration's time), or cut over k ranks with a partner of its shape, the
two as one call with interleaved halves (each member busy for the pair's time, i.e. two units'
worth: :meth:`SplitModel.member_cost` with ``units=2``).  For a candidate busiest load T, a plan
exists only if (1) no unit's way takes longer than T (a pair: twice its per-unit time), (2) the
ranks' total, sum over units of k x its per-member time, fits in ``world x T``, and (3) the items
longer than T / 2, which no rank can hold two of, fit in ``world`` slots.  The bound is the least
T for which a fractional choice of ways per class of identical units meets (2) and (3), found by
bisection; feasibility of the two linear constraints is checked through their Lagrangian (the
largest over a grid of weightings of the two constraints, each class taking its cheapest way,
must not exceed 1; the grid can only admit a T that is infeasible, so the bound stays a bound).
"""

from __future__ import annotations

import math
from collections import Counter

POWERS = (2, 4, 8, 16, 32)
GRID = 400


def unit_classes(params) -> Counter:
    """(shape of one unit, parameter index of a representative) -> how many: matrices as they are,
    expert stacks as their experts."""
    out: Counter = Counter()
    seen: dict[tuple, int] = {}
    for i, p in enumerate(params):
        shape = tuple(p.shape) if len(p.shape) == 2 else (1, *p.shape[-2:])
        count = 1 if len(p.shape) == 2 else math.prod(p.shape[:-2])
        key = seen.setdefault(shape, i)
        out[(shape, key)] += count
    return out


def ways(p, shape) -> list[tuple[float, int, int]]:
    """(per-member load, ranks per unit, units per item) of every way to run a unit of ``shape``."""
    out = [(p.cost(shape), 1, 1)]
    if p.split is None:
        return out
    for k in POWERS:
        if k > max(shape[-2:]) or k > p.split.max_ranks:
            continue
        out.append((p.split.member_cost(shape, k, 1), k, 1))
        out.append((p.split.member_cost(shape, k, 2), k, 2))
    return out


def _feasible(T: float, classes, world: int) -> bool:
    options = []
    for n, way_list in classes:
        ok = []
        for load, k, per_item in way_list:
            item = load * per_item  # what one item (a unit, or a pair) puts on each of its k ranks
            if item > T * (1 + 1e-12):
                continue
            ok.append((k * load, k / per_item if item > T / 2 else 0.0))  # rank-time, big slots per unit
        if not ok:
            return False
        options.append((n, ok))
    for g in range(GRID + 1):
        w = g / GRID
        if sum(n * min((1 - w) * r / (world * T) + w * b / world for r, b in ok) for n, ok in options) > 1 + 1e-9:
            return False
    return True


def lower_bound(params, world: int) -> float:
    """The least busiest load (FLOP-equivalents) any whole-or-cut plan of ``params`` allows on
    ``world`` ranks (module docstring)."""
    classes = [(n, ways(params[i], shape)) for (shape, i), n in unit_classes(params).items()]
    total = sum(n * w[0][0] for n, w in classes)
    lo = total / world
    hi = max(lo, max(w[0][0] for _, w in classes))
    while not _feasible(hi, classes, world):
        hi *= 2
    for _ in range(30):
        mid = (lo + hi) / 2
        if _feasible(mid, classes, world):
            hi = mid
        else:
            lo = mid
    return hi
