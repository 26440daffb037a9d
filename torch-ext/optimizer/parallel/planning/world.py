"""The global part of the step plan: units, owners, cuts and chunks (identical on every rank).

Pure: shapes, placements and the mesh's rank grid in, plain data out.  Every rank computes the
same jobs (units with owners, blocks of cut units with their groups) and the same chunks without
talking to the others; ``rank_view.py`` and ``rank_chunk.py`` then work out one rank's part of
them.  The terms are explained in ``plan.py``.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ...distributed.layout import ParamLayout
from .cut_choice import assign_paired, choose_cuts
from .cut_geometry import Cut, block_widths, cut_dim, set_lengths, sub_shape
from .cut_model import CutOptions, aligned_groups, always_k, auto_ks
from .owners import assign_owners_among, cut_chunks, split_range_evenly
from .plan_data import PlanParam, PlanSettings

# A unit is cut into expert ranges no costlier than this fraction of the mean load per owner.
TARGET_UNIT_FRACTION = 0.1


@dataclass
class Job:
    param: int
    batch: tuple[int, ...]  # batch coordinate of the unit's holders
    leading: slice | None  # range of the holders' local leading (expert) dim; None: whole
    shape: tuple[int, ...]
    cost: float
    candidates: tuple[int, ...]
    replica: tuple[int, ...] | None  # the replica it serves; None: every replica (split)
    owner: int = -1
    cut: Cut | None = None  # a block of a unit cut over ``group`` (cut_geometry.py)
    group: tuple[int, ...] = ()
    widths: tuple[int, ...] = ()
    unit: int = -1  # the cut unit's index in the pattern
    holder: int = -1  # a unit held whole by one rank and moved (expert_moves.py): that rank


def _pattern_key(p: PlanParam, split: bool):
    lay = p.layout
    return (lay.grid, lay.matrix_dims, lay.replica_dims, p.wire_dtype, split)


def _wants_split(p: PlanParam, shape: tuple[int, ...], settings: PlanSettings) -> bool:
    lay = p.layout
    if lay.num_replicas == 1 or settings.replica_split == "never":
        return False
    if settings.replica_split == "always":
        return True
    # "auto": splitting saves (R-1)/R of the unit's Newton-Schulz and ships its update
    # to the other replicas; worth it when the unit does enough FLOPs per byte shipped.
    numel = math.prod(shape)
    item = p.wire_dtype.itemsize
    return numel > 0 and p.cost(shape) / (numel * item) >= settings.replica_min_flops_per_byte


def is_local(p: PlanParam, split: bool) -> bool:
    """Orthogonalised where it is: plain tensors, and DTensors whose ranks hold whole
    matrices (no matrix dim sharded) when the work is not split over replicas."""
    return p.layout is None or (p.layout.shard_group_size == 1 and not split)


def expert_units(p: PlanParam, batch: tuple[int, ...], count: int, max_cost: float, max_bytes: float):
    """Cut one batch coordinate's ``count`` local experts into (range, shape, cost) units."""
    shape = p.shape
    if len(shape) < 3 or count <= 1:
        sub = (count, *shape[1:]) if len(shape) >= 3 else shape
        return [(None, sub, p.cost(sub))]
    per_cost = p.cost((1, *shape[1:]))
    per_bytes = math.prod(shape[1:]) * p.wire_dtype.itemsize
    pieces = 1
    if max_cost > 0:
        pieces = max(pieces, math.ceil(count * per_cost / max_cost))
    if max_bytes > 0:
        pieces = max(pieces, math.ceil(count * per_bytes / max_bytes))
    out = []
    for r in split_range_evenly(count, min(count, pieces)):
        n = r.stop - r.start
        sub = (n, *shape[1:])
        out.append((r if n != count else None, sub, per_cost * n))
    return out


def _pattern_jobs(params: Sequence[PlanParam], members: Sequence[int], settings: PlanSettings, split: bool,
                  held: Callable[[], dict[int, float]] = dict) -> list[Job]:
    """Jobs of one pattern, with owners (LPT among each job's candidates)."""
    lay0 = params[members[0]].layout
    world = lay0.grid.ranks
    whole: list[tuple[int, tuple, int]] = []  # (param, batch coordinate, local expert count)
    total_cost = total_bytes = 0.0
    for i in members:
        p = params[i]
        for b in p.layout.batch_coordinates():
            coord = _coordinate_with_batch(p.layout, b)
            count = p.layout.local_shape(coord)[0] if len(p.shape) >= 3 else 1
            whole.append((i, b, count))
            sub = (count, *p.shape[1:]) if len(p.shape) >= 3 else p.shape
            total_cost += p.cost(sub)
            total_bytes += math.prod(sub) * p.wire_dtype.itemsize
    # owners serving one copy of the model: every rank when split, one replica's ranks otherwise
    owners = len(world) if split else len(world) // lay0.num_replicas

    def build(max_cost: float, max_bytes: float) -> list[Job]:
        jobs: list[Job] = []
        for i, b, count in whole:
            p = params[i]
            holders = p.layout.holders(b)
            for leading, shape, cost in expert_units(p, b, count, max_cost, max_bytes):
                if math.prod(shape) == 0:
                    continue  # nobody holds anything of it (uneven experts)
                if split:
                    jobs.append(Job(i, b, leading, shape, cost, holders, None))
                    continue
                for rc in _replica_coordinates(p.layout):
                    inside = _holders_in_replica(p.layout, b, rc)
                    jobs.append(Job(i, b, leading, shape, cost, inside, rc))
        for job, owner in zip(jobs, assign_owners_among([j.cost for j in jobs], [j.candidates for j in jobs])):
            job.owner = owner
        return jobs

    # A unit is at most one owner's fair share of memory; cut finer only if that
    # lowers the busiest owner's load (each unit costs a little bookkeeping).
    fair_bytes = total_bytes / owners
    coarse = build(0.0, fair_bytes)
    fine = build(TARGET_UNIT_FRACTION * total_cost / owners, fair_bytes)
    jobs = fine if len(fine) > len(coarse) and _busiest(fine) < _busiest(coarse) else coarse
    return _cut_units(params, jobs, len(world), split, held)


def _cut_units(params: Sequence[PlanParam], jobs: list[Job], world: int, split: bool,
               held: Callable[[], dict[int, float]] = dict) -> list[Job]:
    """Cut units over k ranks where the cost model says it lowers the busiest rank
    (``cut_choice.py``), counting what each rank orthogonalises where it is (``held()``); the
    whole units are then owned anew, around the cut ones and the held load (also where nothing is
    cut, if anything is held)."""
    if all(params[j.param].split is None for j in jobs):
        return jobs
    units = [cut_options(params[j.param], j, split) for j in jobs]
    keys = [pair_key(params, j) for j in jobs]
    cuts = choose_cuts(units, world, held, keys)
    if cuts is not None:
        ks, owners = cuts
    else:
        if not any(held().values()):
            return jobs
        # nothing cut, but some ranks orthogonalise units where they are (experts held whole that
        # stay home): own the whole units around that load, not on top of it
        ks = [1] * len(units)
        owners, _ = assign_paired(units, ks, held(), keys)
    out: list[Job] = []
    for n, (job, u, k, owner) in enumerate(zip(jobs, units, ks, owners)):
        if k == 1:
            job.owner = owner
            out.append(job)
            continue
        group = u.groups(k)[owner]
        dim = cut_dim(job.shape)
        widths = block_widths(set_lengths(params[job.param].layout, job.shape), k)
        cost = u.member_cost(k)
        for j, rank in enumerate(group):
            cut = Cut(dim, k, j)
            out.append(Job(job.param, job.batch, job.leading, sub_shape(job.shape, cut, widths[j]), cost, group,
                           job.replica, rank, cut, group, widths, n))
    return out


def cut_options(p: PlanParam, job: Job, split: bool) -> CutOptions:
    """The k a unit may be cut into and on which groups (``cut_model.py``)."""
    u = CutOptions(job.cost, job.candidates)
    model, lay = p.split, p.layout
    if model is None or lay is None or len(job.shape) < 2:
        return u
    long = sum(set_lengths(lay, job.shape))
    cost = functools.partial(model.member_cost, job.shape)
    if model.mode == "always":
        k = always_k(job.shape, lay.shard_group_size)
        if 1 < k <= long:
            groups = _shard_groups(lay, job.batch) if split else (tuple(sorted(job.candidates)),)
            u.ks, u.forced, u.member_cost, u.groups = (k,), k, cost, (lambda _k, g=groups: g)
            u.alone = functools.partial(_alone, model, job.shape)
        return u
    ks = tuple(k for k in auto_ks(model, p.shape[-2:], len(job.candidates)) if k <= long)
    if ks:
        u.ks, u.member_cost = ks, cost
        u.groups = functools.partial(aligned_groups, tuple(job.candidates))
        u.alone = functools.partial(_alone, model, job.shape)
    return u


def _alone(model, shape, k: int) -> float:
    return model.member_cost(shape, k, 1)


@functools.lru_cache(maxsize=4096)
def _shard_groups(layout: ParamLayout, batch: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Every replica's shard holders of one batch coordinate (sorted ranks)."""
    return tuple(tuple(sorted(_holders_in_replica(layout, batch, rc))) for rc in _replica_coordinates(layout))


def _busiest(jobs: Sequence[Job]) -> float:
    loads: dict[int, float] = {}
    for j in jobs:
        loads[j.owner] = loads.get(j.owner, 0.0) + j.cost
    return max(loads.values(), default=0.0)


def _coordinate_with_batch(layout: ParamLayout, batch: tuple[int, ...]) -> tuple[int, ...]:
    coord = [0] * len(layout.grid.shape)
    for m, c in zip(layout.batch_dims, batch):
        coord[m] = c
    return tuple(coord)


def _replica_coordinates(layout: ParamLayout):
    return list(itertools.product(*(range(layout.grid.shape[m]) for m in layout.replica_dims)))


def _holders_in_replica(layout: ParamLayout, batch, replica) -> tuple[int, ...]:
    fixed = dict(zip(layout.batch_dims, batch))
    fixed.update(zip(layout.replica_dims, replica))
    return layout.grid.varying(layout.matrix_dims, fixed)


@dataclass(frozen=True)
class WorldJob:
    """One job of the world-wide plan, as every rank computes it (for analysis: benchmarks/scale_model.py)."""

    param: int
    shape: tuple[int, ...]
    cost: float
    owner: int  # global rank
    split: bool  # one job for every replica (True) or one per replica
    cut: Cut | None = None  # a block of a unit cut over ``group`` (cut_geometry.py)
    group: tuple[int, ...] = ()
    widths: tuple[int, ...] = ()
    unit: int = -1
    holder: int = -1  # a unit held whole by this rank and moved to its owner (expert_moves.py); -1: none


def classify(params: Sequence[PlanParam], settings: PlanSettings):
    """Which parameters are orthogonalised where they are, which the baseline gathers
    whole, and the patterns (``[(key, member indices)]`` in parameter order) of the rest."""
    local, gather_all, patterns = [], [], {}
    for i, p in enumerate(params):
        if settings.mode == "gather":
            (gather_all if p.layout is not None and p.layout.shard_group_size > 1 else local).append(i)
            continue
        split = p.layout is not None and _wants_split(p, p.shape if len(p.shape) < 3 else (1, *p.shape[1:]), settings)
        if is_local(p, split):
            local.append(i)
        else:
            patterns.setdefault(_pattern_key(p, split), []).append(i)
    return local, gather_all, sorted(patterns.items(), key=lambda kv: kv[1][0])


def pattern_chunks(params: Sequence[PlanParam], members: Sequence[int], settings: PlanSettings, split: bool,
                   held: Callable[[], dict[int, float]] = dict):
    jobs = _pattern_jobs(params, members, settings, split, held)
    chunk_size = settings.chunk_size or len(params[members[0]].layout.grid.ranks)
    order = cut_units_together(jobs, cut_chunks([j.cost for j in jobs], [j.owner for j in jobs], chunk_size), params)
    batch_costs(params, jobs, order)
    return jobs, order


def held_loads(params: Sequence[PlanParam], local: Sequence[int],
               movable: Sequence[int] = ()) -> Callable[[tuple[int, ...]], Callable[[], dict[int, float]]]:
    """For the pattern on ``ranks``: every rank's Newton-Schulz cost of the DTensor units it
    orthogonalises where it is (experts held whole, replicated weights), and of ``movable`` ones
    as they will be once moved (spread evenly over their mesh: ``expert_moves.py``), computed once,
    when the pattern's choice of cuts or owners first needs it (it touches every rank of the world).

    Only parameters whose mesh holds every one of ``ranks`` count, because the pattern's plan must
    be the same on each of its ranks and a mesh is what this rank sees, not what the others see:
    a parameter's mesh may be one slice of a larger mesh, another slice on other ranks (FSDP over
    TP shards the experts over the ``dp_shard`` slice: ranks (0, 2) on ranks 0 and 2, (1, 3) on
    ranks 1 and 3).  Counting such a slice on the ranks that hold it, each rank of the pattern saw
    other held loads and owned the pattern's matrices elsewhere (the all-to-alls' sizes disagreed:
    a gloo size mismatch).  A mesh that holds every rank of the pattern is the same mesh on each
    of them (the parameter is one DTensor over it, and the parameter lists are agreed), so all of
    them count it, and a slice that does not is counted by none of them."""
    costs: dict[int, dict[int, float]] = {}  # per parameter: rank -> cost, shared by the patterns
    rank_sets: dict[object, frozenset[int]] = {}
    moved = set(movable)

    def param_costs(i: int) -> dict[int, float]:
        if i not in costs:
            lay = params[i].layout
            out = {}
            for r in lay.grid.ranks:
                shape = lay.local_shape(lay.grid.coordinate(r))
                if math.prod(shape) > 0:
                    out[r] = params[i].cost(shape)
            if i in moved:
                even = sum(out.values()) / len(lay.grid.ranks)
                out = {r: even for r in lay.grid.ranks}
            costs[i] = out
        return costs[i]

    def holds_all(grid, ranks: tuple[int, ...]) -> bool:
        if grid not in rank_sets:
            rank_sets[grid] = frozenset(grid.ranks)
        return rank_sets[grid].issuperset(ranks)

    by_ranks: dict[tuple[int, ...], dict[int, float]] = {}  # patterns on the same ranks see the same loads

    def for_pattern(ranks: tuple[int, ...]) -> Callable[[], dict[int, float]]:
        def held() -> dict[int, float]:
            if ranks not in by_ranks:
                loads: dict[int, float] = {}
                for i in (*local, *movable):
                    lay = params[i].layout
                    if lay is None or not holds_all(lay.grid, ranks):
                        continue  # plain tensors: the same on every rank; a slice: see above
                    for r, c in param_costs(i).items():
                        loads[r] = loads.get(r, 0.0) + c
                by_ranks[ranks] = loads
            return by_ranks[ranks]

        return held

    return for_pattern


def cut_units_together(jobs: Sequence[Job], order: list[list[int]],
                       params: Sequence[PlanParam] | None = None) -> list[list[int]]:
    """Every block of a cut unit in one chunk (the earliest holding one of them): its owners
    orthogonalise it together.  With ``params``, cut units that the runtime can run in one call
    (:func:`batch_key`) are paired in unit order, the second joining the first's chunk, so that
    their halves interleave (one's collectives overlapping the other's products)."""
    home: dict[int, int] = {}
    block: dict[int, int] = {}
    for c, items in enumerate(order):
        for k in items:
            if jobs[k].unit >= 0:
                home.setdefault(jobs[k].unit, c)
                block.setdefault(jobs[k].unit, k)
    if not home:
        return order
    if params is not None:
        by_key: dict[tuple, list[int]] = {}
        for unit in sorted(home):
            by_key.setdefault(batch_key(params, jobs[block[unit]]), []).append(unit)
        for units in by_key.values():
            for a, b in zip(units[::2], units[1::2]):
                home[b] = home[a]
    out: list[list[int]] = [[] for _ in order]
    for c, items in enumerate(order):
        for k in items:
            out[c if jobs[k].unit < 0 else home[jobs[k].unit]].append(k)
    return [items for items in out if items]


def pair_key(params: Sequence[PlanParam], job: Job) -> tuple:
    """Whole units with the same key, cut alike, may run as one call on one group (``batch_key``)."""
    p = params[job.param]
    shape = job.shape
    return (job.candidates, p.ns_key, (*shape[:-2], min(shape[-2:]), max(shape[-2:])), p.row_bytes,
            cut_dim(shape) if p.row_bytes else None)


def batch_key(params: Sequence[PlanParam], job: Job) -> tuple:
    """Blocks of cut units with the same key, in one chunk, run as one call of the split iteration
    (``runtime.orthogonalize_owned``): the same group and widths, stage, unit shape short side
    first (a tall unit cut by rows is a wide one transposed) and row state; with row state
    (NorMuon, whose statistics differ for a row cut) the same orientation too."""
    p = params[job.param]
    unit = sub_shape(job.shape, job.cut, sum(job.widths))
    short_first = (*unit[:-2], min(unit[-2:]), max(unit[-2:]))
    return (job.group, job.widths, p.ns_key, short_first, p.row_bytes, job.cut.dim if p.row_bytes else None)


def batch_costs(params: Sequence[PlanParam], jobs: Sequence[Job], order: list[list[int]]) -> None:
    """Charge every block of a cut unit what the call it runs in costs, per unit: the cut units of
    a chunk with one :func:`batch_key` run together, their halves interleaved."""
    for items in order:
        calls: dict[tuple, dict[int, list[int]]] = {}
        for k in items:
            if jobs[k].cut is not None:
                calls.setdefault(batch_key(params, jobs[k]), {}).setdefault(jobs[k].unit, []).append(k)
        for key, units in calls.items():
            j = jobs[next(iter(units.values()))[0]]
            cost = params[j.param].split.member_cost(key[3], j.cut.k, len(units))
            for blocks in units.values():
                for k in blocks:
                    jobs[k].cost = cost
