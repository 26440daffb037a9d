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
longer than T / 2, which no rank can hold two of, fit in ``world`` slots.  (3) generalises to any
*dual feasible function* f (Fekete and Schepers, 2001): f maps an item's share of T to [0, 1] so
that items sharing a rank (shares summing to at most 1) have f summing to at most 1; then the
items' f sum to at most ``world``.  (3) is f = [x > 1/2]; the bound also uses Fekete and
Schepers' u^(q) (x -> floor((q + 1) x) / q, x where (q + 1) x is whole) for q = 1..4, their
U^(e) (x -> 1 above 1 - e, x between, 0 below e) at every item share e <= 1/2, and u^(q) of
U^(e).  These count what the rank-time total (2) misses: a rank holding a 0.86 T item has
0.14 T left that only smaller items can use (Llama-3-70B at 1,024 ranks: 1.39x with (2) and
(3) only, 1.48x with every f, which the hand-built plan in docs/scale.md reaches).

The bound is the least T for which a fractional choice of ways per class of identical units
meets (2) and each f's constraint, found by bisection; feasibility is checked through the
Lagrangian of (2) and one f at a time: g(w) = sum over classes of their cheapest way under the
weighting (1 - w) (2) + w f, on a grid of w (every f at once, as float64 tensors); a value above
1 proves T infeasible.  A grid that misses the maximum can only admit an infeasible T, so the
bound stays a bound.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

POWERS = (2, 4, 8, 16, 32)
GRID = 65  # weightings of (2) against each f
SCAN_STEPS = 15  # 2% steps above the bisection's answer, to 1.3x


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


def _u(q: int, x: torch.Tensor) -> torch.Tensor:
    """Fekete and Schepers' u^(q): x -> x where (q + 1) x is whole, else floor((q + 1) x) / q."""
    y = (q + 1) * x
    return torch.where((y - y.round()).abs() < 1e-12, x, y.floor() / q)


def _big(e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """U^(e), e <= 1/2 (one row per e): 1 above 1 - e, x between e and 1 - e, 0 below e."""
    e = e.view(-1, 1)
    return torch.where(x > 1 - e, torch.ones_like(x * e), torch.where(x >= e, x * torch.ones_like(e), 0 * x * e))


def dual_feasible_functions(shares: torch.Tensor) -> torch.Tensor:
    """[F, S]: the values at ``shares`` of f = [x > 1/2] (the slots of (3)), u^(q) for q = 1..4,
    U^(e) at every share e <= 1/2, and u^(q) of U^(e), without repeats: each f maps [0, 1] to
    [0, 1] with sum f(x_i) <= 1 wherever sum x_i <= 1."""
    rows = [(shares > 0.5).to(shares.dtype).view(1, -1)] + [_u(q, shares).view(1, -1) for q in range(1, 5)]
    cuts = shares[(shares > 0) & (shares <= 0.5)].unique()
    if cuts.numel():
        big = _big(cuts, shares)  # [E, S]
        rows += [big] + [_u(q, big) for q in range(1, 5)]
    return torch.cat(rows).unique(dim=0)


def _feasible(T: float, classes, world: int) -> bool:
    options = []
    for n, way_list in classes:
        ok = []
        for load, k, per_item in way_list:
            item = load * per_item  # what one item (a unit, or a pair) puts on each of its k ranks
            if item > T * (1 + 1e-12):
                continue
            # rank-time per unit, item share of T, items per unit
            ok.append((k * load, min(1.0, item / T), k / per_item))
        if not ok:
            return False
        options.append((n, ok))
    shares = torch.tensor([x for _, ok in options for _, x, _ in ok], dtype=torch.float64)
    functions = dual_feasible_functions(shares)  # [F, S]
    # g(w) = sum over classes of n x its cheapest way under (1 - w) (2) + w f, for every f at once
    # on a grid of w (float64): g is concave, and a grid point above 1 refutes T (missing the
    # maximum can only admit an infeasible T)
    widest = max(len(ok) for _, ok in options)
    rank_time = torch.full((len(options), widest), math.inf, dtype=torch.float64)
    per_unit = torch.zeros((len(options), widest), dtype=torch.float64)  # f's items per unit
    fvals = torch.zeros((functions.shape[0], len(options), widest), dtype=torch.float64)
    counts = torch.tensor([n for n, _ in options], dtype=torch.float64)
    at = 0
    for c, (_, ok) in enumerate(options):
        for w, (r, _, m) in enumerate(ok):
            rank_time[c, w] = r / (world * T)
            per_unit[c, w] = m / world
            fvals[:, c, w] = functions[:, at]
            at += 1
    b = fvals * per_unit  # [F, C, W]
    a = torch.where(torch.isinf(rank_time), torch.zeros_like(rank_time), rank_time)
    grid = torch.linspace(0, 1, GRID, dtype=torch.float64).view(-1, 1, 1, 1)
    mixed = (1 - grid) * a + grid * b  # [G, F, C, W]
    mixed = torch.where(torch.isinf(rank_time), torch.full_like(mixed, math.inf), mixed)
    g = (mixed.min(dim=-1).values * counts).sum(dim=-1)  # [G, F]
    return not bool((g > 1 + 1e-9).any())


def lower_bound(params, world: int) -> float:
    """A busiest load (FLOP-equivalents) below which no whole-or-cut plan of ``params`` on
    ``world`` ranks goes: the largest T the checks prove infeasible (module docstring).

    A proof at T holds for every smaller T too, but the dual feasible functions look at each T
    through its own shares, so a T the checks admit may lie below one they refute: bisection,
    then a scan upward in 2% steps to 1.3x, keeping the largest T refuted."""
    classes = [(n, ways(params[i], shape)) for (shape, i), n in unit_classes(params).items()]
    total = sum(n * w[0][0] for n, w in classes)
    lo = total / world  # no plan goes below the average (every unit's cheapest way is its whole cost or more)
    hi = max(lo, max(w[0][0] for _, w in classes))
    if _feasible(lo, classes, world):
        return lo
    while not _feasible(hi, classes, world):
        lo, hi = hi, hi * 2
    for _ in range(24):
        mid = (lo + hi) / 2
        if _feasible(mid, classes, world):
            hi = mid
        else:
            lo = mid
    found = lo
    for j in range(1, SCAN_STEPS + 1):
        t = hi * (1 + 0.02 * j)
        if not _feasible(t, classes, world):
            found = t
    return found


# ----------------------------------------------------------------------------
# Experts held whole (Shard(0)): what moving them costs
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertBound:
    """The transfer-priced bound on experts held whole (:func:`expert_bound`), in FLOP-equivalents."""

    holder: float  # max over holders of what the busiest holder can shed to at best
    node: float  # max over nodes of what its ranks must carry on average
    busiest_holder: int  # the rank (or a node's first rank) each figure comes from
    busiest_node: int

    @property
    def value(self) -> float:
        return max(self.holder, self.node)


def _expert_ways(p, shape, nbytes: float, hw, rate: float) -> tuple[float, float]:
    """(holder, node) contribution of one expert held whole on one rank, the least over the ways
    any plan may run it (module note above :func:`expert_bound`)."""
    cost = p.cost(shape)
    both = hw.bandwidth + (hw.inter_bandwidth if hw.node_size > 0 and hw.inter_bandwidth > 0 else 0.0)
    out_and_back = 2 * nbytes / both * rate  # all of it sent over both links at once, and back
    holder = min(cost, out_and_back)
    long = max(shape[-2:])
    gamma = 1.0  # the least share of the bytes any cut ships with a block's share of the work
    for k in (k for k in POWERS if p.split is not None and k <= min(long, p.split.max_ranks)):
        member = p.split.cost(shape, k, 1).compute_s * rate  # the member's products alone (no collectives)
        widest = -(-long // k)
        holder = min(holder, member + (1 - widest / long) * out_and_back)
        gamma = min(gamma, k * (long // k) / long)
    if hw.node_size > 0 and hw.inter_bandwidth > 0:
        node = min(cost, gamma * 2 * nbytes / hw.inter_bandwidth * rate)
    else:
        node = cost  # one node: nothing leaves it
    return holder, node


def expert_bound(params, world: int) -> ExpertBound | None:
    """A lower bound on the busiest rank's step (FLOP-equivalents: Newton-Schulz plus the moves'
    transfers, as ``expert_moves.move_seconds`` prices them) that counts what moving experts held
    whole costs; None when no parameter's experts may move (``expert_moves.movable``).

    An expert held on rank h (m x n, b bytes on the wire, c its whole cost) may stay home (c on h),
    move whole to any rank, or be cut over k ranks with or without h.  h's step is its products
    plus its transfers: ``2 max(sent inside its node / NVLink, sent between nodes / NIC)`` (blocks
    out and updates back; receiving only adds).  Per expert the least any way leaves on h is
    ``min(c, 2 b / (NVLink + NIC), member(k) + (1 - ceil(l/k)/l) 2 b / (NVLink + NIC))`` in
    FLOP-equivalents (both links at once, the cut's member its products alone); summed over
    h's experts, that bounds h's step.  A node's ranks together carry what its holders keep, and
    every byte that leaves the node crosses one of their NICs: per expert at least
    ``min(c, gamma 2 b / NIC)`` (gamma <= 1 the least bytes-per-work share a cut ships, cuts
    running inside one node counting their members' products, at least c); summed over the node
    and divided by its ranks, that bounds its busiest rank.  The bound is the larger of the two
    maxima; ``lower_bound`` (experts as free units) is the third term the caller takes."""
    from optimizer.parallel.planning.expert_moves import holder_loads, movable

    members = [i for i, p in enumerate(params) if movable(p)]
    if not members:
        return None
    hw = params[members[0]].split.hardware
    rate = hw.rate(params[members[0]].split.dtype)
    per_holder: dict[int, float] = {}
    per_node: dict[int, float] = {}
    ways_of: dict[tuple, tuple[float, float]] = {}
    for i, _, h, count in holder_loads(params, members):
        p = params[i]
        shape = (1, *p.shape[1:])
        key = (i, shape)
        if key not in ways_of:
            ways_of[key] = _expert_ways(p, shape, math.prod(shape) * p.wire_dtype.itemsize, hw, rate)
        holder, node = ways_of[key]
        per_holder[h] = per_holder.get(h, 0.0) + count * holder
        n = hw.node_of(h) if hw.node_size > 0 else 0
        per_node[n] = per_node.get(n, 0.0) + count * node
    size = hw.node_size if 0 < hw.node_size < world else world
    h = max(per_holder, key=lambda r: (per_holder[r], -r))
    n = max(per_node, key=lambda r: (per_node[r], -r))
    return ExpertBound(per_holder[h], per_node[n] / size, h, n * size)
