"""Splitting one unit's Newton–Schulz over k ranks in the step plan (pure: numbers and index math).

One owner per unit is ideal while there are many more units than ranks.  At 1,024 ranks there
are not: Llama-3-8B has 224 matrices, and Llama-3-70B's ``[28672, 8192]`` alone is 3.4x a rank's
ideal share.  :mod:`.split_newton_schulz` runs Newton–Schulz on a matrix whose column blocks sit
on k ranks; this module decides which units are cut, into how many blocks, which ranks own them,
and where every member's piece of every block lies.

**Blocks.**  A unit ``[..., M, N]`` is cut along its long side (``N`` for a wide or square matrix;
``M`` for a tall one, whose transpose is then split by columns), into k sub-jobs, each a unit
``[..., M, w_j]`` (or ``[..., w_j, N]``) like any other: holders send each block's owner their
piece of that block in the chunk's all-to-all, owners assemble it with the plan's index kernels,
and the update blocks come back the same way.  Which indices form block j: every member of the
shard group holds a set of indices along the cut dim (all of them when that dim is not sharded;
its shard when it is), and block j takes one contiguous slice of every distinct set
(:func:`cut_blocks`).  So every member sends every block owner 1/k of its piece: the uniform
padded buffers of the plan apply unchanged and nothing is shipped twice, even for a tall
``Shard(0)`` matrix cut along its sharded rows (contiguous row ranges would leave most members
with nothing for most blocks, and the padding would ship k times the matrix).  Newton–Schulz
commutes with permuting columns, and the split iteration is column-block-wise, so which columns
form a block does not matter; the blocks' widths differ by at most one.

**Groups.**  The k owners of a cut unit are the members of one process group: for ``"auto"`` an
aligned block of k consecutive ranks of the sorted candidates (the shard group, or the replica x
shard holders when the unit is split over replicas), k a power of two up to
:data:`SPLIT_MAX_RANKS` (one NVLink node); for ``"always"`` a whole shard group.  Group rank j
(sorted global ranks, as ``new_group`` orders them) owns block j.  The groups are created at
construction (:func:`rank_sets`), only for the k that :func:`auto_ks` allows for the shape.

**Cost and choice.**  Every member of a cut unit is busy for the modelled time of the split
iteration (FLOPs, bytes and collective latencies, :func:`~.split_newton_schulz.split_ns_cost`),
counted in FLOP-equivalents (time x the hardware's rate) so that it compares with whole units'
FLOPs.  A pattern is considered when one of its units costs more than :data:`TRIGGER` times a
rank's ideal share (fewer units than ranks, or one dominant unit); then, starting from whole
units, a class of similar units (within :data:`CLASS_BAND` of the class's costliest) has its k
doubled (to the next allowed k that is modelled faster) when that lowers the busiest rank of the
resulting assignment by at least :data:`MIN_GAIN`: the costliest class that pays, else the first
pair of classes that pays together (cutting the largest units further may only pay once the
next ones are cut too), repeatedly, until none does.  The busiest rank counts what each rank
orthogonalises where it is (experts held whole): no cut can move that work.  The assignment (:func:`assign`) is LPT
over whole and cut units together: a cut unit goes to the group whose busiest member is least
loaded.  Small units stay whole: splitting them is modelled slower, or does not lower the
busiest rank.

**Two k's in one class.**  One k per class misses plans where units of one shape must run two
ways: Llama-3-70B at 1,024 ranks reaches its bound only with 128 of its 160 q/o over 8 ranks
alone (one beside each pair of MLP matrices) and the other 32 paired over 4 (1.61x -> 1.48x the
ideal share); at 512 ranks with 128 q/o over 4 (16 of them paired) and 32 whole (1.35x -> 1.20x).
:func:`choose_plan` therefore also builds :func:`pack_ways`' plan, which chooses each unit's way
as it places it (the way with the least rank-time that stays under a target load, the target
bisected), and keeps it where its busiest rank is at least :data:`MIN_GAIN` lower (as for a
doubling of k: a smaller gain is not worth the bytes of cutting further).
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from ..distributed.placements import Index
from .owners import assign_owners_grouped, split_range_evenly
from .split_cost import SplitCost, SplitHardware, split_ns_cost

# Largest k for "auto": the GPUs of one NVLink node (CUDA_NVLINK models a group inside one).
SPLIT_MAX_RANKS = 8
# A pattern is considered for cutting when one unit costs more than this share of a rank's ideal load.
TRIGGER = 0.5
# A doubling of k is kept only if it lowers the busiest rank by at least this fraction.
MIN_GAIN = 0.02
# Units within this factor of the costliest are cut together (same-shape classes).
CLASS_BAND = 0.9
NS_SPLIT_MODES = ("auto", "never", "always")


# ----------------------------------------------------------------------------
# The cost model of one parameter
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=8192)
def _cost(shape: tuple[int, ...], k: int, ns_steps: int, method: str, coefficients, dtype: torch.dtype | None,
          hardware: SplitHardware, units: int = 1) -> SplitCost:
    return split_ns_cost(shape, k, ns_steps, method, dtype, coefficients, "auto", hardware, units=units)


def _hashable(coefficients):
    """A table name as it is; one triple, or one triple per step, as nested tuples of floats."""
    if isinstance(coefficients, str):
        return coefficients
    items = list(coefficients)
    if items and not isinstance(items[0], (tuple, list)):  # one (a, b, c) for every step
        return tuple(float(c) for c in items)
    return tuple(tuple(float(c) for c in t) for t in items)


@dataclass(frozen=True)
class SplitModel:
    """How a parameter's units may be split: the mode and the split iteration's cost model."""

    mode: str  # "auto" | "always"
    hardware: SplitHardware
    ns_steps: int
    method: str
    coefficients: object  # a table name or a tuple of triples
    dtype: torch.dtype | None  # Newton–Schulz's compute dtype as the user set it (None: the device's, per form)
    max_ranks: int = SPLIT_MAX_RANKS

    @staticmethod
    def of(mode: str, hardware: SplitHardware, ns_steps: int, method: str, coefficients, dtype: torch.dtype | None,
           max_ranks: int = SPLIT_MAX_RANKS) -> "SplitModel":
        return SplitModel(mode, hardware, ns_steps, method, _hashable(coefficients), dtype, max_ranks)

    def cost(self, shape: Sequence[int], k: int, units: int = 1) -> SplitCost:
        return _cost(tuple(int(d) for d in shape), int(k), self.ns_steps, self.method, self.coefficients,
                     self.dtype, self.hardware, int(units))

    def member_cost(self, shape: Sequence[int], k: int, units: int | None = None) -> float:
        """FLOP-equivalents that each of the k members is busy with one unit: its modelled time x
        rate, in a call with ``units`` same-shape units (their halves interleaved).  By default a
        single matrix cut over k > 1 ranks is assumed to find a partner of its shape on its group
        (two units); the plan then charges every cut unit what the call it runs in costs
        (``plan_world.batch_costs``)."""
        if units is None:
            units = 2 if k > 1 and math.prod(tuple(shape)[:-2]) == 1 else 1
        return self.cost(shape, k, units).time_s * self.hardware.rate(self.dtype) / units


# ----------------------------------------------------------------------------
# Geometry: which indices form each block
# ----------------------------------------------------------------------------


class Cut(NamedTuple):
    """Sub-job ``j`` of a unit cut into ``k`` blocks along tensor dim ``dim`` (negative: -1 or -2)."""

    dim: int
    k: int
    j: int


def cut_dim(shape: Sequence[int]) -> int:
    """The long side: -1 (columns) for a wide or square matrix, -2 (rows) for a tall one."""
    return -1 if shape[-1] >= shape[-2] else -2


def _length(ix: Index) -> int:
    return max(0, ix.stop - ix.start) if isinstance(ix, slice) else int(ix.numel())


def _first(ix: Index) -> int:
    if isinstance(ix, slice):
        return ix.start
    return int(ix.min()) if ix.numel() else -1


def _key(ix: Index):
    if isinstance(ix, slice):
        return ("slice", ix.start, ix.stop) if ix.stop > ix.start else ("empty",)
    return ("index", tuple(ix.tolist())) if ix.numel() else ("empty",)


def canonical_sets(indices: Sequence[Index]) -> tuple[list[int], list[int]]:
    """The distinct index sets among members' indices along one dim, ordered by their smallest
    index (so every shard group of a layout lists them alike): each member's set number and each
    set's length.  Members holding nothing along the dim share one empty set, listed last."""
    keys = [_key(ix) for ix in indices]
    first: dict = {}
    for key, ix in zip(keys, indices):
        if key not in first:
            first[key] = (_first(ix) if key != ("empty",) else math.inf, _length(ix))
    order = sorted(first, key=lambda k: first[k][0])
    number = {k: n for n, k in enumerate(order)}
    return [number[k] for k in keys], [first[k][1] for k in order]


def cut_blocks(lengths: Sequence[int], k: int) -> tuple[tuple[slice, ...], ...]:
    """``[j][t]``: the slice of set t's local positions that goes to block j.

    Each set is cut into k contiguous near-equal slices (:func:`split_range_evenly`); set t's
    slice s goes to block ``(s + c_t) mod k``, with ``c_t`` the sets before it's total length mod
    k, so the longer slices of consecutive sets land on consecutive blocks: block widths differ by
    at most one, and every block is non-empty when the sets hold at least k indices in all."""
    return _cut_blocks(tuple(int(n) for n in lengths), int(k))


@functools.lru_cache(maxsize=4096)
def _cut_blocks(lengths: tuple[int, ...], k: int) -> tuple[tuple[slice, ...], ...]:
    out = [[slice(0, 0)] * len(lengths) for _ in range(k)]
    c = 0
    for t, n in enumerate(lengths):
        for s, sl in enumerate(split_range_evenly(n, k)):
            out[(s + c) % k][t] = sl
        c = (c + n) % k
    return tuple(tuple(row) for row in out)


def block_widths(lengths: Sequence[int], k: int) -> tuple[int, ...]:
    return tuple(sum(sl.stop - sl.start for sl in row) for row in cut_blocks(lengths, k))


def block_offsets(row: Sequence[slice]) -> list[int]:
    """Where each set's slice of one block (a row of :func:`cut_blocks`) starts in the block
    (sets in canonical order, end to end)."""
    out, off = [], 0
    for sl in row:
        out.append(off)
        off += sl.stop - sl.start
    return out


@functools.lru_cache(maxsize=4096)
def _layout_lengths(layout, dim: int) -> tuple[int, ...]:
    members = layout.shard_group(layout.grid.coordinate(layout.grid.ranks[0]))
    _, lengths = canonical_sets([layout.indices(layout.grid.coordinate(r))[dim] for r in members])
    return tuple(lengths)


def set_lengths(layout, shape: Sequence[int]) -> tuple[int, ...]:
    """Lengths of the distinct index sets a layout's shard group holds along the cut dim of ``shape``."""
    if layout is None:
        return (shape[cut_dim(shape)],)
    return _layout_lengths(layout, len(layout.shape) + cut_dim(shape))


def lengths_along(layout, ndim: int, dim: int) -> tuple[int, ...]:
    """Lengths of the distinct index sets a layout's shard group holds along (negative) ``dim``."""
    return _layout_lengths(layout, ndim + dim)


def piece_length(lengths: Sequence[int], k: int, j: int) -> int:
    """The longest member slice of block j: what every member's piece is padded to along the cut dim."""
    return max(sl.stop - sl.start for sl in cut_blocks(lengths, k)[j])


def sub_shape(shape: Sequence[int], cut: Cut, width: int) -> tuple[int, ...]:
    out = list(shape)
    out[cut.dim] = width
    return tuple(out)


# ----------------------------------------------------------------------------
# Which k a unit may use, and on which groups
# ----------------------------------------------------------------------------


def auto_ks(model: SplitModel, matrix: Sequence[int], group_size: int) -> tuple[int, ...]:
    """The k (> 1) that ``"auto"`` may pick for a parameter of matrix shape ``[M, N]`` when its
    candidates number ``group_size``: powers of two up to the cap, the group and the long side,
    whose split iteration on one matrix is modelled faster than the unsplit one.  The groups
    created at construction and the planner's choices both come from here."""
    matrix = (1, *tuple(matrix)[-2:])
    whole = model.member_cost(matrix, 1)
    out = []
    k = 2
    while k <= min(model.max_ranks, group_size, max(matrix[-2:])):
        if model.member_cost(matrix, k) < whole:
            out.append(k)
        k *= 2
    return tuple(out)


def always_k(shape: Sequence[int], shard_size: int) -> int:
    """``"always"``: the whole shard group, for units whose short side has at least as many rows."""
    return shard_size if shard_size > 1 and min(shape[-2:]) >= shard_size else 1


@functools.lru_cache(maxsize=4096)
def aligned_groups(candidates: tuple[int, ...], k: int) -> tuple[tuple[int, ...], ...]:
    """Aligned blocks of k consecutive ranks of the sorted candidates (full blocks only)."""
    ranks = tuple(sorted(candidates))
    return tuple(ranks[i: i + k] for i in range(0, len(ranks) - k + 1, k))


def rank_sets(shape: Sequence[int], layout, model: SplitModel | None) -> set[tuple[int, ...]]:
    """Every rank set a split of this parameter may run on (all of the world's, members or not):
    for ``"auto"``, the aligned k-blocks of each shard group and, with replicas, of each batch
    coordinate's replica x shard holders, for every k :func:`auto_ks` allows; for ``"always"``
    each shard group.  Pure; created once, collectively, at construction."""
    if model is None or layout is None or len(shape) < 2:
        return set()
    out: set[tuple[int, ...]] = set()
    shard = layout.shard_group_size
    if model.mode == "always":
        if always_k(shape, shard) > 1:
            out.update(tuple(sorted(s)) for s in layout.grid.partition(layout.matrix_dims))
        return out
    candidate_sets = [tuple(sorted(s)) for s in layout.grid.partition(layout.matrix_dims)] if shard > 1 else []
    if layout.num_replicas > 1:
        for b in layout.batch_coordinates():
            candidate_sets.append(tuple(sorted(layout.holders(b))))
    if movable_layout(layout, len(shape), model):  # experts held whole move over the mesh (plan_moves.py)
        everyone = tuple(sorted(layout.grid.ranks))
        candidate_sets.append(everyone)
        out.add(everyone)  # the moves' all-to-all
    for cands in dict.fromkeys(candidate_sets):
        for k in auto_ks(model, shape[-2:], len(cands)):
            out.update(aligned_groups(cands, k))
    return out


def movable_layout(layout, ndim: int, model: SplitModel | None) -> bool:
    """Experts held whole whose units may move to other ranks (``plan_moves.py``): a stack of
    matrices whose every mesh dim shards the stack's dim (no matrix dim sharded, no replicas),
    with ``ns_split="auto"``."""
    return (model is not None and model.mode == "auto" and layout is not None and ndim >= 3
            and layout.shard_group_size == 1 and layout.num_replicas == 1 and bool(layout.batch_dims))


# ----------------------------------------------------------------------------
# Choosing k per unit, and the assignment
# ----------------------------------------------------------------------------


@dataclass
class UnitOptions:
    """What the choice needs of one unit: its whole cost and candidates, and per k its member
    cost and groups (``forced``: the k it must use, "always")."""

    cost: float
    candidates: tuple[int, ...]
    ks: tuple[int, ...] = ()  # allowed k > 1, ascending
    member_cost: Callable[[int], float] | None = None
    groups: Callable[[int], tuple[tuple[int, ...], ...]] | None = None
    forced: int = 1
    alone: Callable[[int], float] | None = None  # member cost at k with no partner (member_cost assumes one)

    def next_k(self, k: int) -> int | None:
        """The next allowed k above k that is faster than k run the same way: paired (two units
        as one call, ``member_cost``) or alone (``alone``).

        Each way against itself: whether a unit runs paired or alone is decided by the assignment
        (:func:`assign_paired`: alone where its groups outnumber the units), and a k that is
        slower paired than k paired may still be faster alone than k alone (Llama-3-8B's
        14336 x 4096 at 1,024 ranks: 4 -> 8 alone, 3.81x -> 3.30x the ideal share)."""
        for c in self.ks:
            if c > k and self.faster(c, k):
                return c
        return None

    def faster(self, c: int, k: int) -> bool:
        """Whether k = c is modelled faster than k, paired against paired or alone against alone
        (k = 1: the whole cost)."""
        paired = self.member_cost(c) < self.at(k)
        alone = self.alone is not None and self.alone(c) < (self.cost if k == 1 else self.alone(k))
        return paired or alone

    def at(self, k: int) -> float:
        return self.cost if k == 1 else self.member_cost(k)

    def at_alone(self, k: int) -> float:
        """Member cost at k > 1 with no partner (``member_cost`` where ``alone`` is not given)."""
        return self.alone(k) if self.alone is not None else self.member_cost(k)


def assign(units: Sequence[UnitOptions], ks: Sequence[int],
           held: dict[int, float] | None = None) -> tuple[list[int], dict[int, float]]:
    """LPT over whole and cut units (:func:`~.owners.assign_owners_grouped`), on top of ``held``
    (each rank's load from units it orthogonalises where it is): per unit the owner (k = 1) or the
    index of its group among ``units[i].groups(k)``; and every rank's load."""
    costs = [u.at(k) for u, k in zip(units, ks)]
    candidates = [u.candidates if k == 1 else None for u, k in zip(units, ks)]
    groups = [None if k == 1 else u.groups(k) for u, k in zip(units, ks)]
    return assign_owners_grouped(costs, candidates, groups if any(k > 1 for k in ks) else None, held)


def assign_paired(units: Sequence[UnitOptions], ks: Sequence[int], held: dict[int, float] | None,
                  keys: Sequence[object]) -> tuple[list[int], dict[int, float]]:
    """:func:`assign`, with cut units of one key (``keys[i]``: what lets two units run as one call)
    and one k taken two by two, as one item, onto one group: there the runtime runs them as one
    call whose halves interleave (``member_cost`` assumes that partner)."""
    items: list[UnitOptions] = []
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
                u = UnitOptions(u.cost, u.candidates, u.ks, u.alone, u.groups, u.forced, u.alone)
            items.append(u)
            item_ks.append(k)
            members.append([i])
            continue
        a = items[slot]
        items[slot] = UnitOptions(a.cost + u.cost, a.candidates, a.ks,
                                  lambda c, f=a.member_cost, g=u.member_cost: f(c) + g(c), a.groups, a.forced)
        members[slot].append(i)
    owners, loads = assign(items, item_ks, held)
    out = [0] * len(units)
    for owner, indices in zip(owners, members):
        for i in indices:
            out[i] = owner
    return out, loads


def choose_ks(units: Sequence[UnitOptions], world: int,
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


def _later_ks(unit: UnitOptions, k: int) -> list[int]:
    """The allowed k above ``k`` (the next one excepted), each modelled faster than the one before
    (paired or alone: :meth:`UnitOptions.faster`)."""
    out, here = [], k
    for c in unit.ks:
        if c > k and unit.faster(c, here):
            out.append(c)
            here = c
    return out


def _busiest(units: Sequence[UnitOptions], ks: Sequence[int], held: dict[int, float],
             keys: Sequence[object] | None = None) -> float:
    _, loads = assign(units, ks, held) if keys is None else assign_paired(units, ks, held, keys)
    return max(loads.values(), default=0.0)


def _classes(units: Sequence[UnitOptions], auto: Sequence[int], ks: Sequence[int]) -> list[list[int]]:
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


# ----------------------------------------------------------------------------
# Choosing each unit's way as it is placed (two k's in one class)
# ----------------------------------------------------------------------------

# Bisection steps of :func:`pack_ways`' target between the average load and the class plan's busiest rank.
PACK_STEPS = 12


def choose_plan(units: Sequence[UnitOptions], world: int, held: Callable[[], dict[int, float]] = dict,
                keys: Sequence[object] | None = None) -> tuple[list[int], list[int]] | None:
    """k and owner per unit (the owner as :func:`assign` gives it: a rank for k = 1, else the
    index of its group among ``units[i].groups(k)``), or None when every unit stays whole.

    Two plans: :func:`choose_ks` with :func:`assign_paired` (one k per class of similar units),
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


class _Groups:
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


class _Menu(NamedTuple):
    """A unit's ways, priced once for every pass of :func:`pack_ways`."""

    cost: float  # whole
    candidates: Sequence[int]
    cuts: dict  # k -> (its groups, member cost alone, member cost paired)


def _menu(u: UnitOptions) -> _Menu:
    ks = u.ks if u.forced == 1 else ()
    return _Menu(u.cost, u.candidates, {k: (u.groups(k), u.at_alone(k), u.member_cost(k)) for k in ks})


def _pack(menus: Sequence[_Menu], order: Sequence[int], held: dict[int, float], keys: Sequence[object],
          target: float) -> tuple[float, list[int], list[int]]:
    """One pass of :func:`pack_ways` at ``target``: (busiest rank, k per unit, owner per unit)."""
    loads = dict(held)
    ks = [1] * len(menus)
    owners = [0] * len(menus)
    # heaps keyed by identity (hashing the candidates would cost ranks x units); heaps over the
    # same ranks share ``loads``, so each still sees the others' charges
    heaps: dict[int, _Groups] = {}

    def heap(options, whole: bool) -> _Groups:
        if id(options) not in heaps:
            heaps[id(options)] = _Groups(tuple((r,) for r in dict.fromkeys(options)) if whole else options, loads)
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


def pack_ways(units: Sequence[UnitOptions], world: int, held: dict[int, float], keys: Sequence[object],
              ceiling: float) -> tuple[float, list[int], list[int]]:
    """A plan that chooses each unit's way as it places it: (busiest rank, k per unit, owner per
    unit as :func:`choose_plan` gives them).

    Units are taken costliest first (those of one key together, so that two in a row may be
    paired).  Each goes the way that puts the least rank-time on the world (k x its member
    cost: whole, alone over k ranks, or paired with the next unit of its key over k ranks, the
    two as one call) among those whose least loaded rank or group stays under a target load;
    where none does, the way that leaves the least load.  The target is bisected between the
    world's average (every unit at its least rank-time) and ``ceiling`` (the busiest rank of
    another plan), and the best pass kept: cost linear in the units per pass, PACK_STEPS + 1
    passes.  Pure: every rank computes the same plan."""
    first: dict[object, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    order = sorted(range(len(units)), key=lambda i: (-units[i].cost, first[keys[i]], i))
    menus = [_menu(u) for u in units]
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
