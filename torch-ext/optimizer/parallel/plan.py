"""The step plan: who orthogonalises what, and every buffer offset, computed once.

A step of parallel Muon moves the same bytes between the same ranks every time
as long as the parameters, their placements, which of them have gradients and
the optimizer's settings stay the same.  So everything that depends only on
those is worked out here once and cached by ``Muon``; a step then only launches
collectives with precomputed splits and runs a constant number of kernels per
matrix (``runtime.py``).

Planning is pure: shapes, placements and the mesh's rank grid in, plain data out;
every rank computes the same global part (units, owners, chunks) without talking
to the others, then its own part (what it sends, receives and updates, at which
offsets, with index tensors already on the parameter's device).

Terms
  unit      what one Newton-Schulz call orthogonalises: a parameter's matrix, or
            a contiguous range of its experts (one batch coordinate's local experts
            are cut into ranges when that balances the work or bounds memory).
  job       a unit with one owner.  Split over replicas (see ``replica_split``),
            a unit is one job whose owner may be any rank holding a copy, and its
            update reaches the other replicas through an all-gather on the replica
            group.  Otherwise each replica orthogonalises its own copy: one job per
            replica, owned inside it.
  pattern   parameters whose shard groups and replica groups are the same rank sets
            on every rank (same mesh, same matrix and replica mesh dims, same wire
            dtype): their jobs share chunks, hence collectives.
  chunk     a slice of a pattern's jobs, one all-to-all each way (plus an all-gather
            when split over replicas); chunks are cut by cumulative load.
  block     a member's piece of a unit, padded to the largest member's piece so that
            every member's piece sits at the same stride in the buffers: one index
            kernel assembles a whole matrix, whatever the layout.
  row state per-row state of a parameter that travels with its rows (NorMuon's v):
            ``k`` extra columns of every block, after its padded columns
            (``[..., padded rows, padded cols + k]``), holding each row's state as
            ``k`` elements of the wire dtype (its bytes).  The owner assembles it with
            the rows' index, the scatter returns it with the update: no collective of
            its own, and a zero-copy matrix stays a (strided) view of the buffer.
            A block of a cut unit carries its rows' state too: all rows for a cut
            along the columns, its own rows for a cut along the rows.
  cut       a unit split over the k ranks of a group (``ns_split``; ``split_plan.py``):
            k sub-jobs, each a block of its long side, owned by the group's members,
            orthogonalised together by the split Newton-Schulz iteration.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..distributed.layout import ParamLayout
from ..distributed.placements import Index, as_indexer
from .owners import assign_owners_among, cut_chunks, split_range_evenly
from .split_plan import (Cut, SplitModel, UnitOptions, aligned_groups, always_k, assign, auto_ks, block_offsets,
                         block_widths, canonical_sets, choose_ks, cut_blocks, cut_dim, set_lengths, sub_shape)

# A unit is cut into expert ranges no costlier than this fraction of the mean load per owner.
TARGET_UNIT_FRACTION = 0.1


# ----------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanParam:
    """One Muon parameter with a gradient this step, as planning sees it."""

    name: str
    shape: tuple[int, ...]  # global
    layout: ParamLayout | None  # None: a plain tensor, orthogonalised where it is
    wire_dtype: torch.dtype  # what its shards travel as
    device: torch.device
    ns_key: object  # same key and same shape: one batched Newton-Schulz call
    cost: Callable[[tuple[int, ...]], float]  # Newton-Schulz FLOPs of a (sub-)shape
    mesh: object = None  # the DeviceMesh (for its groups)
    compute_itemsize: int = 4  # bytes per element of Newton-Schulz's workspace
    state_itemsize: int = 4  # bytes per element of the momentum's arithmetic (the stacked input)
    row_bytes: int = 0  # bytes of per-row state travelling with each row (NorMuon's v); 0: none
    split: SplitModel | None = None  # how its units may be cut over several ranks (None: never)


@dataclass(frozen=True)
class PlanSettings:
    chunk_size: int | None = None  # jobs per chunk (None: the pattern's number of ranks)
    replica_split: str = "auto"  # "always" | "never" | "auto"
    replica_min_flops_per_byte: float = 0.0  # "auto": split units at least this compute-heavy
    mode: str = "parallel"  # "gather": the gather-everything baseline


# ----------------------------------------------------------------------------
# Outputs (this rank's view)
# ----------------------------------------------------------------------------

Region = tuple  # slices selecting a unit's part of a local tensor (leading dims only)


def row_slots(row_bytes: int, dtype: torch.dtype) -> int:
    """Elements of a ``dtype`` buffer that carry one row's state of ``row_bytes`` bytes (0: none)."""
    return max(1, row_bytes // dtype.itemsize) if row_bytes else 0


@dataclass
class LocalJob:
    """A unit this rank orthogonalises alone, with no communication."""

    param: int
    region: Region
    shape: tuple[int, ...]
    bytes: int = 0  # its momentum update and Newton-Schulz workspace (local_unit_bytes)


@dataclass
class Pack:
    """Gather stage: this rank's piece of a job, written into the send buffer."""

    param: int
    region: Region
    offset: int
    padded: tuple[int, ...]  # the block in the buffer (its last ``row_slots`` columns: row state)
    mine: tuple[int, ...]  # this rank's piece of the matrix (<= padded)
    row_slots: int = 0


@dataclass
class Owned:
    """A job this rank owns: how to assemble it from the gather buffer and cut it for the scatter."""

    param: int
    shape: tuple[int, ...]  # the unit's global shape
    offset: int  # within each member's segment
    padded: tuple[int, ...]  # every member's block (its last ``row_slots`` columns: row state)
    batch: int = -1  # index into Chunk.batches, or -1
    # Zero-copy: the members' padded pieces, in member order, are the matrix's rows
    # (then the gather buffer is the matrix, and the update is the scatter buffer).
    zero_copy: bool = False
    # index per unit dim: None (not sharded) or [S, padded_d] global indices; padded
    # entries point one past the end (``write``) or at 0 (``read``).
    write: tuple = ()
    read: tuple = ()
    trash: tuple[bool, ...] = ()  # per dim: the assembled tensor needs one spare slot
    experts: Index | None = None  # global indices of its leading dim (3-D units); None for a matrix
    row_slots: int = 0  # columns of row state after the matrix's padded columns
    split: SplitOwned | None = None  # a block of a cut unit: orthogonalised with its group


@dataclass
class SplitOwned:
    """An owned block of a unit cut over a group: the split Newton-Schulz call's arguments."""

    group: object  # ProcessGroup of ``ranks`` (group rank j = ranks[j] owns block j)
    ranks: tuple[int, ...]
    widths: tuple[int, ...]  # every block's width, in group-rank order
    transpose: bool  # cut along rows (a tall unit): the block's transpose is the column block
    unit: int  # the unit's index in its pattern: every rank runs a chunk's cut units in this order


@dataclass
class Update:
    """Update stage: where this rank's block of a job's update lands."""

    param: int
    region: Region
    source: str  # "scatter" (owned in this replica) or "exchange" (owned in another)
    offset: int
    padded: tuple[int, ...]
    mine: tuple[int, ...]
    row_slots: int = 0


@dataclass
class Chunk:
    pattern: int
    shard_group: object  # ProcessGroup or None (one member)
    shard_size: int
    member: int  # this rank's position in the shard group (sorted ranks: the group's order)
    replica_group: object
    replica_size: int
    wire_dtype: torch.dtype
    device: torch.device
    send_splits: list[int] = field(default_factory=list)  # gather
    packs: list[Pack] = field(default_factory=list)
    segment: int = 0  # gather: what each member sends to this rank (its owned jobs, padded)
    owned: list[Owned] = field(default_factory=list)
    batches: list[list[int]] = field(default_factory=list)  # owned jobs orthogonalised together
    scatter_recv_splits: list[int] = field(default_factory=list)
    exchange_length: int = 0  # padded contribution to the replica all-gather; 0: no exchange
    updates: list[Update] = field(default_factory=list)

    @property
    def send_numel(self) -> int:
        return sum(self.send_splits)

    @property
    def scatter_recv_numel(self) -> int:
        return sum(self.scatter_recv_splits)


@dataclass
class GatherAll:
    """The baseline for one parameter: all-gather its padded pieces over the shard group."""

    param: int
    group: object
    size: int
    owned: Owned  # how to assemble the whole matrix from every member's piece
    mine: tuple[int, ...]  # this rank's block shape
    my_index: tuple  # indexer of this rank's block in the whole matrix
    wire_dtype: torch.dtype
    my_rows: tuple = ()  # indexer of this rank's rows (of the row state) in the whole unit


@dataclass
class StepPlan:
    local: list[LocalJob] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    jobs: int = 0  # distributed jobs in the world
    owned: int = 0  # of which this rank owns
    load: float = 0.0  # Newton-Schulz FLOPs this rank runs (owned jobs and local units)
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_chunk_bytes: int = 0  # the largest buffer bytes of one chunk on this rank
    peak_workspace_bytes: int = 0  # the largest Newton-Schulz workspace of one chunk on this rank
    local_unit_bytes: int = 0  # the largest unit orthogonalised where it is (momentum + workspace)
    gather_all: list[GatherAll] = field(default_factory=list)
    split_jobs: int = 0  # of ``owned``: blocks of cut units
    split_bytes: int = 0  # what this rank sends (= receives) in the split iterations' collectives (modelled)

    def memory_bound(self, lookahead: int) -> int:
        """Extra bytes a step may hold at once on this rank: the buffers of ``lookahead + 2``
        chunks (gathers ahead, the chunk being computed, the previous chunk's scatter; one
        more while replica all-gathers are in flight; never more chunks than there are) and
        the Newton-Schulz workspace of the chunk being computed; or one batch of the units
        orthogonalised where they are, with the first gathers in flight."""
        exchanging = any(c.exchange_length for c in self.chunks)
        in_flight = min(len(self.chunks), lookahead + 2 + int(exchanging))
        pipeline = in_flight * self.peak_chunk_bytes + self.peak_workspace_bytes
        ahead = min(len(self.chunks), lookahead + 1) * self.peak_chunk_bytes
        return max(pipeline, ahead + self.local_batch_bytes)

    @property
    def local_batch_bytes(self) -> int:
        """What one batch of units orthogonalised where they are may hold: a chunk's
        buffers, or one unit when a single unit is larger."""
        return max(self.peak_chunk_bytes, self.local_unit_bytes)


def ns_workspace(shape: Sequence[int]) -> int:
    """Elements of Newton–Schulz's live tensors for ``shape``: X, the next X, A = X Xᵀ and B."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * (2 * m * n + 2 * m * m)


def split_workspace(block: Sequence[int], transpose: bool, k: int) -> int:
    """Elements of the split iteration's live tensors for one block ``[..., s, w]`` (or its
    transpose): X, the next X, the Gram matrix (its first one in the wide dtype, with the norm),
    B, and B's gathered rows."""
    s, w = (block[-1], block[-2]) if transpose else (block[-2], block[-1])
    return math.prod(block[:-2]) * (2 * s * w + 3 * s * s + k * -(-s // k) * s + 1)


def local_unit_bytes(p: PlanParam, shape: Sequence[int]) -> int:
    """One unit orthogonalised where it is: its stacked momentum update and the workspace."""
    return math.prod(shape) * p.state_itemsize + ns_workspace(shape) * p.compute_itemsize


# ----------------------------------------------------------------------------
# Global part: units, owners, chunks (identical on every rank)
# ----------------------------------------------------------------------------


@dataclass
class _Job:
    param: int
    batch: tuple[int, ...]  # batch coordinate of the unit's holders
    leading: slice | None  # range of the holders' local leading (expert) dim; None: whole
    shape: tuple[int, ...]
    cost: float
    candidates: tuple[int, ...]
    replica: tuple[int, ...] | None  # the replica it serves; None: every replica (split)
    owner: int = -1
    cut: Cut | None = None  # a block of a unit cut over ``group`` (split_plan.py)
    group: tuple[int, ...] = ()
    widths: tuple[int, ...] = ()
    unit: int = -1  # the cut unit's index in the pattern


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


def _units(p: PlanParam, batch: tuple[int, ...], count: int, max_cost: float, max_bytes: float):
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
                  held: Callable[[], dict[int, float]] = dict) -> list[_Job]:
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

    def build(max_cost: float, max_bytes: float) -> list[_Job]:
        jobs: list[_Job] = []
        for i, b, count in whole:
            p = params[i]
            holders = p.layout.holders(b)
            for leading, shape, cost in _units(p, b, count, max_cost, max_bytes):
                if math.prod(shape) == 0:
                    continue  # nobody holds anything of it (uneven experts)
                if split:
                    jobs.append(_Job(i, b, leading, shape, cost, holders, None))
                    continue
                for rc in _replica_coordinates(p.layout):
                    inside = _holders_in_replica(p.layout, b, rc)
                    jobs.append(_Job(i, b, leading, shape, cost, inside, rc))
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


def _cut_units(params: Sequence[PlanParam], jobs: list[_Job], world: int, split: bool,
               held: Callable[[], dict[int, float]] = dict) -> list[_Job]:
    """Cut units over k ranks where the cost model says it lowers the busiest rank
    (``split_plan.py``), counting what each rank orthogonalises where it is (``held()``, computed
    only if the choice is made); the whole units are then owned anew, around the cut ones."""
    if all(params[j.param].split is None for j in jobs):
        return jobs
    units = [_unit_options(params[j.param], j, split) for j in jobs]
    ks = choose_ks(units, world, held)
    if ks is None:
        return jobs
    owners, _ = assign(units, ks, held())
    out: list[_Job] = []
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
            out.append(_Job(job.param, job.batch, job.leading, sub_shape(job.shape, cut, widths[j]), cost, group,
                            job.replica, rank, cut, group, widths, n))
    return out


def _unit_options(p: PlanParam, job: _Job, split: bool) -> UnitOptions:
    """The k a unit may be cut into and on which groups (``split_plan.py``)."""
    u = UnitOptions(job.cost, job.candidates)
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
        return u
    ks = tuple(k for k in auto_ks(model, p.shape[-2:], len(job.candidates)) if k <= long)
    if ks:
        u.ks, u.member_cost = ks, cost
        u.groups = functools.partial(aligned_groups, tuple(job.candidates))
    return u


@functools.lru_cache(maxsize=4096)
def _shard_groups(layout: ParamLayout, batch: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Every replica's shard holders of one batch coordinate (sorted ranks)."""
    return tuple(tuple(sorted(_holders_in_replica(layout, batch, rc))) for rc in _replica_coordinates(layout))


def _busiest(jobs: Sequence[_Job]) -> float:
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
    cut: Cut | None = None  # a block of a unit cut over ``group`` (split_plan.py)
    group: tuple[int, ...] = ()
    widths: tuple[int, ...] = ()
    unit: int = -1


def world_jobs(params: Sequence[PlanParam], settings: PlanSettings) -> list[tuple[list[WorldJob], list[list[int]]]]:
    """Every pattern's jobs with their owners, and the pattern's chunks (lists of job indices).

    Pure and rank-independent: the part of :func:`build_plan` that is the same on every
    rank.  Returns ``[(jobs, chunks)]`` per pattern, in plan order; parameters that are
    orthogonalised where they are (no communication) are not included.
    """
    local, _, patterns = _classify(params, settings)
    held = _held_loads(params, local)
    out = []
    for key, members in patterns:
        jobs, order = _pattern_chunks(params, members, settings, key[-1], held)
        out.append(([WorldJob(j.param, j.shape, j.cost, j.owner, key[-1], j.cut, j.group, j.widths, j.unit)
                     for j in jobs], order))
    return out


def _classify(params: Sequence[PlanParam], settings: PlanSettings):
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


def _pattern_chunks(params: Sequence[PlanParam], members: Sequence[int], settings: PlanSettings, split: bool,
                    held: Callable[[], dict[int, float]] = dict):
    jobs = _pattern_jobs(params, members, settings, split, held)
    chunk_size = settings.chunk_size or len(params[members[0]].layout.grid.ranks)
    return jobs, _cut_units_together(jobs, cut_chunks([j.cost for j in jobs], [j.owner for j in jobs], chunk_size))


def _held_loads(params: Sequence[PlanParam], local: Sequence[int]) -> Callable[[], dict[int, float]]:
    """Every rank's Newton-Schulz cost of the DTensor units it orthogonalises where it is (experts
    held whole, replicated weights): computed once, when the choice of cuts first needs it (it
    touches every rank of the world)."""
    memo: list[dict[int, float]] = []

    def held() -> dict[int, float]:
        if not memo:
            loads: dict[int, float] = {}
            for i in local:
                lay = params[i].layout
                if lay is None:
                    continue  # plain tensors: the same on every rank
                for r in lay.grid.ranks:
                    shape = lay.local_shape(lay.grid.coordinate(r))
                    if math.prod(shape) > 0:
                        loads[r] = loads.get(r, 0.0) + params[i].cost(shape)
            memo.append(loads)
        return memo[0]

    return held


def _cut_units_together(jobs: Sequence[_Job], order: list[list[int]]) -> list[list[int]]:
    """Every block of a cut unit in one chunk (the earliest holding one of them): its owners
    orthogonalise it together."""
    home: dict[int, int] = {}
    for c, items in enumerate(order):
        for k in items:
            if jobs[k].unit >= 0:
                home.setdefault(jobs[k].unit, c)
    if not home:
        return order
    out: list[list[int]] = [[] for _ in order]
    for c, items in enumerate(order):
        for k in items:
            out[c if jobs[k].unit < 0 else home[jobs[k].unit]].append(k)
    return [items for items in out if items]


# ----------------------------------------------------------------------------
# The whole plan
# ----------------------------------------------------------------------------


def build_plan(
    params: Sequence[PlanParam],
    rank: int,
    settings: PlanSettings,
    resolve_group: Callable[[tuple[int, ...], object, tuple[int, ...]], object] = lambda ranks, mesh, dims: None,
) -> StepPlan:
    """The plan of one step for ``rank``.

    ``resolve_group(ranks, mesh, mesh_dims)`` returns the process group of a shard
    or replica group (``distributed.groups.group_for``); planning itself never
    communicates.
    """
    local_ix, gather_ix, patterns = _classify(params, settings)
    held = _held_loads(params, local_ix)
    plan = StepPlan()
    for i in local_ix:
        shape = _local_shape(params[i], rank)
        if math.prod(shape) > 0:
            job = LocalJob(i, (), shape, local_unit_bytes(params[i], shape))
            plan.local.append(job)
            plan.load += params[i].cost(shape)
            plan.local_unit_bytes = max(plan.local_unit_bytes, job.bytes)
    for i in gather_ix:
        plan.gather_all.append(_gather_all(params, i, rank, resolve_group))
        plan.load += params[i].cost(params[i].shape)
    for pattern_index, (key, members) in enumerate(patterns):
        split = key[-1]
        jobs, order = _pattern_chunks(params, members, settings, split, held)
        plan.jobs += len(jobs)
        view = _RankView(params, rank, split, resolve_group, params[members[0]])
        for chunk_jobs in order:
            chunk = view.chunk(pattern_index, [jobs[k] for k in chunk_jobs])
            plan.chunks.append(chunk)
            plan.owned += len(chunk.owned)
            plan.load += sum(params[o.param].cost(o.shape) for o in chunk.owned if o.split is None)
            for j in (jobs[k] for k in chunk_jobs):
                if j.cut is not None and j.owner == rank:  # a block of a cut unit: its modelled time
                    plan.load += j.cost
                    plan.split_jobs += 1
                    plan.split_bytes += params[j.param].split.cost(_unit_shape(j), j.cut.k).bytes_per_rank
            sent, received, buffers, workspace = _traffic(chunk, params)
            plan.bytes_sent += sent
            plan.bytes_received += received
            plan.peak_chunk_bytes = max(plan.peak_chunk_bytes, buffers)
            plan.peak_workspace_bytes = max(plan.peak_workspace_bytes, workspace)
    return plan


def _unit_shape(job) -> tuple[int, ...]:
    """The whole unit a block of a cut unit belongs to."""
    return sub_shape(job.shape, job.cut, sum(job.widths))


def _gather_all(params: Sequence[PlanParam], i: int, rank: int, resolve_group) -> GatherAll:
    p = params[i]
    view = _RankView(params, rank, False, resolve_group, p)
    shape = (*_local_shape(p, rank)[:-2], *p.shape[-2:])  # this rank's experts, whole matrices
    whole = _Job(i, (), None, shape, 0.0, (), None, rank)
    pad = view.padded(whole)
    owned = view._owned(whole, 0, pad, single=False)
    mine_ix = view.members(i)[view.member]
    lead = [slice(None)] * (len(shape) - 2)
    return GatherAll(i, view.shard_group, len(view.shard), owned, view.mine(whole),
                     _device_indexer((*lead, *mine_ix[-2:]), p.device), p.wire_dtype,
                     _device_indexer((*lead, mine_ix[-2]), p.device))


def _device_indexer(indices, device) -> tuple:
    moved = tuple(ix if isinstance(ix, slice) else ix.to(device) for ix in indices)
    return as_indexer(moved)


def _local_shape(p: PlanParam, rank: int) -> tuple[int, ...]:
    if p.layout is None:
        return p.shape
    return p.layout.local_shape(p.layout.grid.coordinate(rank))


def _region(leading: slice | None) -> Region:
    return () if leading is None else (leading,)


def _traffic(chunk: Chunk, params: Sequence[PlanParam]) -> tuple[int, int, int, int]:
    """Bytes this rank sends and receives for a chunk, the chunk's buffer bytes here, and its
    Newton-Schulz workspace (the largest batched call)."""
    item = chunk.wire_dtype.itemsize
    me_in_gather = chunk.send_splits[chunk.member] if chunk.send_splits else 0
    gather_recv = chunk.segment * chunk.shard_size
    scatter_send = gather_recv
    sent = (chunk.send_numel - me_in_gather) + (scatter_send - chunk.segment)
    received = (gather_recv - chunk.segment) + (chunk.scatter_recv_numel - chunk.segment)
    # send, receive, the assembled matrices, the scatter's send and receive buffers
    buffers = chunk.send_numel + 2 * gather_recv + scatter_send + max(chunk.scatter_recv_numel, chunk.exchange_length)
    if chunk.exchange_length:
        sent += chunk.exchange_length * (chunk.replica_size - 1)
        received += chunk.exchange_length * (chunk.replica_size - 1)
        buffers += chunk.exchange_length * chunk.replica_size
    calls: dict[object, int] = {}  # batched Newton-Schulz calls (a zero-copy unit is its own)
    for k, o in enumerate(chunk.owned):
        key = ("batch", o.batch) if o.batch >= 0 else k
        space = (ns_workspace(o.shape) if o.split is None
                 else split_workspace(o.shape, o.split.transpose, len(o.split.ranks)))
        calls[key] = calls.get(key, 0) + space * params[o.param].compute_itemsize
    return sent * item, received * item, buffers * item, max(calls.values(), default=0)


class _RankView:
    """This rank's part of a pattern: its groups, offsets and index tensors."""

    def __init__(self, params, rank: int, split: bool, resolve_group, first: PlanParam):
        self.params = params
        self.first = first
        layout = first.layout
        grid = layout.grid
        self.coord = grid.coordinate(rank)
        self.rank = rank
        shard_ranks = layout.shard_group(self.coord)
        self.shard = tuple(sorted(shard_ranks))
        self.member = self.shard.index(rank)
        self.shard_group = resolve_group(shard_ranks, first.mesh, layout.matrix_dims) if len(shard_ranks) > 1 else None
        replica_ranks = layout.replica_group(self.coord)
        self.replicas = tuple(sorted(replica_ranks))
        self.replica_group = (resolve_group(replica_ranks, first.mesh, layout.replica_dims)
                              if split and len(replica_ranks) > 1 else None)
        self.layout = layout
        self.resolve_group = resolve_group
        self._members_cache: dict[int, tuple] = {}  # id(layout) -> (layout, indices per member)
        self._padded_cache: dict[tuple, tuple[int, ...]] = {}
        self._cut_cache: dict[tuple, tuple] = {}  # (id(layout), cut) -> (positions per member, my local slice)

    # -- per-parameter facts -------------------------------------------------

    def members(self, i: int) -> list[tuple[Index, ...]]:
        """Global indices held by each member of this rank's shard group, for param ``i``
        (shared by every parameter of the same layout: models repeat a few shapes)."""
        lay = self.params[i].layout
        hit = self._members_cache.get(id(lay))
        if hit is None:
            hit = self._members_cache[id(lay)] = (lay, [lay.indices(lay.grid.coordinate(r)) for r in self.shard])
        return hit[1]

    def holds(self, job: _Job) -> bool:
        lay = self.params[job.param].layout
        return lay.batch_coordinate(self.coord) == job.batch and (
            job.replica is None or lay.replica_coordinate(self.coord) == job.replica)

    def unit_members(self, job: _Job) -> list[tuple[Index, Index]]:
        """Each member's indices along the unit's last two dims, as positions in the unit: its
        global indices for a whole matrix; for a block of a cut unit, along the cut dim, where
        its slice of the block sits (``split_plan.cut_blocks``)."""
        if job.cut is None:
            return [ix[-2:] for ix in self.members(job.param)]
        return self._cut(job)[0]

    def _cut(self, job: _Job) -> tuple:
        lay = self.params[job.param].layout
        key = (id(lay), job.cut)
        hit = self._cut_cache.get(key)
        if hit is None:
            members = self.members(job.param)
            d, k, j = job.cut.dim, job.cut.k, job.cut.j
            sets_key = (id(lay), d)
            if sets_key not in self._cut_cache:
                self._cut_cache[sets_key] = canonical_sets([ix[d] for ix in members])
            sets, lengths = self._cut_cache[sets_key]
            row = cut_blocks(lengths, k)[j]
            offsets = block_offsets(row)
            positions = []
            for ix, t in zip(members, sets):
                at = slice(offsets[t], offsets[t] + row[t].stop - row[t].start)
                positions.append((ix[-2], at) if d == -1 else (at, ix[-1]))
            hit = self._cut_cache[key] = (positions, row[sets[self.member]])
        return hit

    def region(self, job: _Job) -> Region:
        """This rank's part of a job in its local tensors: the expert range, and for a block of a
        cut unit its local slice along the cut dim (basic slices: views)."""
        if job.cut is None:
            return _region(job.leading)
        ndim = len(self.params[job.param].shape)
        head = (job.leading,) if job.leading is not None else (slice(None),) * (ndim - 2)
        local = self._cut(job)[1]
        return (*head, local) if job.cut.dim == -2 else (*head, slice(None), local)

    def slots(self, i: int) -> int:
        p = self.params[i]
        return row_slots(p.row_bytes, p.wire_dtype)

    def padded(self, job: _Job) -> tuple[int, ...]:
        """A member's block of ``job``: its matrix padded to the largest member's piece, then the
        row state's columns."""
        lay = self.params[job.param].layout
        k = self.slots(job.param)
        key = (id(lay), job.shape, job.cut, k)
        hit = self._padded_cache.get(key)
        if hit is None:
            members = self.unit_members(job)
            dims = [max(_length(ix[d]) for ix in members) for d in (0, 1)]
            hit = self._padded_cache[key] = (*job.shape[:-2], dims[0], dims[1] + k)
        return hit

    def mine(self, job: _Job) -> tuple[int, ...]:
        ix = self.unit_members(job)[self.member]
        return (*job.shape[:-2], _length(ix[0]), _length(ix[1]))

    # -- one chunk -----------------------------------------------------------

    def chunk(self, pattern: int, jobs: list[_Job]) -> Chunk:
        p0 = self.first
        chunk = Chunk(pattern, self.shard_group, len(self.shard), self.member, self.replica_group,
                      len(self.replicas) if self.replica_group is not None else 1, p0.wire_dtype, p0.device)
        in_group = {r: k for k, r in enumerate(self.shard)}
        # Jobs whose owner is in this rank's shard group, grouped by owner (member order).
        by_member: list[list[_Job]] = [[] for _ in self.shard]
        for job in jobs:
            k = in_group.get(job.owner)
            if k is not None and self.holds(job):
                by_member[k].append(job)
        segments = [sum(math.prod(self.padded(j)) for j in owned) for owned in by_member]

        # 1. gather: my piece of every job owned in my shard group, by owner.
        offset = 0
        for k, owned in enumerate(by_member):
            for job in owned:
                pad = self.padded(job)
                chunk.packs.append(Pack(job.param, self.region(job), offset, pad, self.mine(job),
                                        self.slots(job.param)))
                offset += math.prod(pad)
        chunk.send_splits = segments

        # 2. the jobs I own: assembly and scatter recipes.
        mine = by_member[self.member]
        chunk.segment = segments[self.member]
        offset = 0
        for job in mine:
            pad = self.padded(job)
            chunk.owned.append(self._owned(job, offset, pad, single=len(mine) == 1))
            if job.cut is not None:
                chunk.owned[-1].split = SplitOwned(self._split_group(job), job.group, job.widths,
                                                   job.cut.dim == -2, job.unit)
            offset += math.prod(pad)
        groups: dict[tuple, list[int]] = {}
        for k, o in enumerate(chunk.owned):
            if not o.zero_copy and o.split is None:
                groups.setdefault((self.params[o.param].ns_key, o.shape, o.padded), []).append(k)
        for ks in groups.values():
            if len(ks) > 1:
                for k in ks:
                    chunk.owned[k].batch = len(chunk.batches)
                chunk.batches.append(ks)

        # 3. scatter: my block of every job owned in my shard group comes back.
        chunk.scatter_recv_splits = [
            sum(math.prod(self.padded(j)) for j in owned) for owned in by_member
        ]
        base = 0
        for owned in by_member:
            for job in owned:
                pad = self.padded(job)
                chunk.updates.append(Update(job.param, self.region(job), "scatter", base, pad, self.mine(job),
                                            self.slots(job.param)))
                base += math.prod(pad)

        # 4. replica exchange: blocks of jobs owned in other replicas.
        if chunk.replica_group is not None:
            self._exchange(chunk, jobs)
        return chunk

    def _split_group(self, job: _Job):
        try:
            return self.resolve_group(job.group, None, ())
        except RuntimeError as err:
            raise RuntimeError(
                f"{err} Here: ns_split cuts '{self.params[job.param].name}' over that group, which is made when the "
                "optimizer is built (or in add_param_group) for the ns_split its param group has then; set "
                "ns_split there rather than on a live optimizer."
            ) from None

    def _owned(self, job: _Job, offset: int, pad: tuple[int, ...], single: bool) -> Owned:
        members = self.members(job.param)
        positions = self.unit_members(job)
        lead = len(job.shape) - 2
        slots = self.slots(job.param)
        matrix_pad = (*pad[:-1], pad[-1] - slots)  # the block without its row-state columns
        write, read, trash, cpu_rows = [], [], [], []
        for d, size in zip((0, 1), job.shape[-2:]):
            per = [ix[d] for ix in positions]
            if all(isinstance(ix, slice) and ix == slice(0, size) for ix in per):
                write.append(None), read.append(None), trash.append(False)
                continue
            width = matrix_pad[d - 2]
            rows = torch.full((len(per), width), size, dtype=torch.long)
            for k, ix in enumerate(per):
                idx = torch.arange(ix.start, ix.stop) if isinstance(ix, slice) else ix
                rows[k, : idx.numel()] = idx
            padded_any = bool((rows == size).any())
            device = self.params[job.param].device
            cpu_rows.append(rows)
            write.append(rows.to(device))
            read.append(rows.clamp(max=max(size - 1, 0)).to(device))
            trash.append(padded_any)
        if len(members) == 1:
            zero_copy = True  # the one piece is the unit
        else:
            # tested on the CPU copy: reading the device copy back would wait for the device
            zero_copy = (single and lead == 0 and write[0] is not None and write[1] is None
                         and torch.equal(cpu_rows[0].flatten()[: job.shape[0]], torch.arange(job.shape[0])))
        experts = None
        if lead:
            held = members[0][0]  # every member holds the same experts (matrix dims only differ)
            experts = held if job.leading is None else (
                slice(held.start + job.leading.start, held.start + job.leading.stop) if isinstance(held, slice)
                else held[job.leading])
        return Owned(job.param, job.shape, offset, pad, zero_copy=zero_copy,
                     write=tuple(write), read=tuple(read), trash=tuple(trash), experts=experts, row_slots=slots)

    def _exchange(self, chunk: Chunk, jobs: list[_Job]) -> None:
        """Offsets of every replica's contribution, and the padded length all of them use."""
        lay = self.layout
        my_batch = lay.batch_coordinate(self.coord)
        # contribution of replica r = its scatter receive buffer: jobs owned in its shard
        # group (members in order, each owner's jobs in chunk order), padded blocks.
        per_replica: dict[int, list[_Job]] = {}
        grid = lay.grid
        for job in jobs:
            owner_coord = grid.coordinate(job.owner)
            if self.params[job.param].layout.batch_coordinate(owner_coord) != my_batch:
                continue
            per_replica.setdefault(grid.rank_at(_with(self.coord, owner_coord, lay.replica_dims)), []).append(job)
        lengths, offsets = {}, {}
        for r in self.replicas:
            owned = per_replica.get(r, [])
            shard = tuple(sorted(lay.shard_group(grid.coordinate(r))))
            order = sorted(owned, key=lambda j: shard.index(j.owner))  # stable: chunk order per owner
            base = 0
            for job in order:
                offsets[(r, id(job))] = base
                base += math.prod(self.padded(job))
            lengths[r] = base
        chunk.exchange_length = max(lengths.values(), default=0)
        me = self.replicas.index(self.rank)
        for k, r in enumerate(self.replicas):
            if k == me:
                continue
            for job in per_replica.get(r, []):
                pad = self.padded(job)
                chunk.updates.append(Update(job.param, self.region(job), "exchange",
                                            k * chunk.exchange_length + offsets[(r, id(job))], pad, self.mine(job),
                                            self.slots(job.param)))


def _with(coord, other, dims) -> tuple[int, ...]:
    """``coord`` with ``other``'s values on ``dims``."""
    out = list(coord)
    for m in dims:
        out[m] = other[m]
    return tuple(out)


def _length(ix: Index) -> int:
    return max(0, ix.stop - ix.start) if isinstance(ix, slice) else int(ix.numel())
