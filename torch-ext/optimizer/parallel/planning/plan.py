"""The step plan: who orthogonalises what, and every buffer offset, computed once.

A step of parallel Muon moves the same bytes between the same ranks every time
as long as the parameters, their placements, which of them have gradients and
the optimizer's settings stay the same.  So everything that depends only on
those is worked out here once and cached by ``Muon``; a step then only launches
collectives with precomputed splits and runs a constant number of kernels per
matrix (``execution/pipeline.py``).

Planning is pure: shapes, placements and the mesh's rank grid in, plain data out;
every rank computes the same global part (units, owners, chunks) without talking
to the others, then its own part (what it sends, receives and updates, at which
offsets, with index tensors already on the parameter's device).

Files, by role: ``plan_data.py`` (the inputs and the plan's data), ``world.py`` (the global
part: units, owners, cuts, chunks), ``rank_view.py`` and ``rank_chunk.py`` (one rank's part:
groups, offsets, index tensors), ``expert_moves.py`` (experts held whole that move), the
``cut_*.py`` files (one unit cut over k ranks), and here ``build_plan``, which puts them together.

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
  cut       a unit split over the k ranks of a group (``ns_split``; ``cut_*.py``):
            k sub-jobs, each a block of its long side, owned by the group's members,
            orthogonalised together by the split Newton-Schulz iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .expert_moves import (ExpertMoves, choose_moves, kept_units, move_chunk, move_groups, move_traffic,
                           movable)
from .cut_geometry import sub_shape
from .plan_data import (Chunk, GatherAll, LocalJob, MoveChunk, Owned, Pack, PlanParam, PlanSettings, Region,
                        SplitOwned, StepPlan, Update, local_unit_bytes, ns_workspace, row_slots, split_workspace)
from .rank_chunk import owned_unit, rank_chunk
from .rank_view import RankView, device_indexer, local_shape
from .world import TARGET_UNIT_FRACTION, Job, WorldJob, classify, held_loads, is_local, pattern_chunks

__all__ = ["Chunk", "GatherAll", "LocalJob", "MoveChunk", "Owned", "Pack", "PlanParam", "PlanSettings", "Region",
           "SplitOwned", "StepPlan", "TARGET_UNIT_FRACTION", "Update", "WorldJob", "build_plan", "is_local",
           "local_unit_bytes", "ns_workspace", "row_slots", "split_workspace", "world_jobs", "world_view"]


# ----------------------------------------------------------------------------
# The whole plan
# ----------------------------------------------------------------------------


@dataclass
class _World:
    """The rank-independent part of a plan: every pattern's jobs and chunks, and the moves."""

    patterns: list  # [(key, members, jobs, chunks)]
    moves: list[ExpertMoves]
    local: list[int]  # orthogonalised where they are (movable ones included: their kept units)
    gather_all: list[int]

    def moves_of(self, i: int) -> ExpertMoves | None:
        return next((m for m in self.moves if i in m.params), None)


def _world(params: Sequence[PlanParam], settings: PlanSettings) -> _World:
    local, gather_all, patterns = classify(params, settings)
    movable_ix = [i for i in local if movable(params[i])] if settings.mode != "gather" else []
    # Moves are balanced on their own, as each pattern is: their chunks run after the patterns',
    # every chunk meeting at its all-to-alls, so a rank's load in other chunks cannot be traded
    # against theirs (the critical path adds the chunks' busiest ranks).  They are planned first,
    # so that the patterns' cuts and owners see the experts that stay home where they are (their
    # holders' load), and those that move spread evenly.
    moves = [m for members in move_groups(params, movable_ix)
             if (m := choose_moves(params, members, {}, settings.chunk_size)) is not None]
    moving = {i for m in moves for i in m.params}
    fixed = [i for i in local if i not in moving]
    held_for = held_loads(params, fixed, [i for i in movable_ix if i in moving])
    out = []
    for key, members in patterns:
        # a pattern sees the load held on meshes that hold all its ranks (alike on each of them)
        held = held_for(params[members[0]].layout.grid.ranks)
        jobs, order = pattern_chunks(params, members, settings, key[-1], held)
        out.append((key, members, jobs, order))
    return _World(out, moves, local, gather_all)


def world_jobs(params: Sequence[PlanParam], settings: PlanSettings) -> list[tuple[list[WorldJob], list[list[int]]]]:
    """Every pattern's jobs with their owners, and the pattern's chunks (lists of job indices);
    then the moved units' (``expert_moves.py``: ``holder`` set), one entry per group of moves.

    Pure and rank-independent: the part of :func:`build_plan` that is the same on every
    rank.  Returns ``[(jobs, chunks)]`` per pattern, in plan order; parameters that are
    orthogonalised where they are (no communication) are not included (the units of movable ones
    are, once they move: those their holder keeps with ``owner == holder``).
    """
    return _world_jobs(_world(params, settings))


def _world_jobs(world: _World) -> list[tuple[list[WorldJob], list[list[int]]]]:
    out = []
    for key, _, jobs, order in world.patterns:
        out.append(([WorldJob(j.param, j.shape, j.cost, j.owner, key[-1], j.cut, j.group, j.widths, j.unit)
                     for j in jobs], order))
    for m in world.moves:
        out.append(([WorldJob(j.param, j.shape, j.cost, j.owner, False, j.cut, j.group, j.widths, j.unit, j.holder)
                     for j in m.jobs], m.order))
    return out


def world_view(params: Sequence[PlanParam], settings: PlanSettings):
    """:func:`world_jobs`, and every unit a rank orthogonalises where it is, as ``[(param, rank,
    shape)]`` (DTensors only: plain tensors are the same on every rank): for analysis
    (``benchmarks/scale_model.py``), from the same plan :func:`build_plan` runs."""
    world = _world(params, settings)
    local = []
    for i in world.local:
        lay = params[i].layout
        if lay is None:
            continue
        for r in lay.grid.ranks:
            shape = lay.local_shape(lay.grid.coordinate(r))
            if math.prod(shape) == 0:
                continue
            for leading in kept_units(world.moves_of(i), i):
                local.append((i, r, shape if leading is None else (leading.stop - leading.start, *shape[1:])))
    return _world_jobs(world), local


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
    world = _world(params, settings)
    plan = StepPlan()
    for i in world.local:
        shape = local_shape(params[i], rank)
        if math.prod(shape) == 0:
            continue
        for leading in kept_units(world.moves_of(i), i):
            unit = shape if leading is None else (leading.stop - leading.start, *shape[1:])
            job = LocalJob(i, () if leading is None else (leading,), unit, local_unit_bytes(params[i], unit))
            plan.local.append(job)
            plan.load += params[i].cost(unit)
            plan.local_unit_bytes = max(plan.local_unit_bytes, job.bytes)
    for i in world.gather_all:
        plan.gather_all.append(_gather_all(params, i, rank, resolve_group))
        plan.load += params[i].cost(params[i].shape)
    for pattern_index, (key, members, jobs, order) in enumerate(world.patterns):
        view = RankView(params, rank, key[-1], resolve_group, params[members[0]])
        _add_chunks(plan, params, rank, jobs, order, lambda chunk_jobs: rank_chunk(view, pattern_index, chunk_jobs))
    for n, m in enumerate(world.moves, start=len(world.patterns)):
        if rank in m.ranks:
            _add_chunks(plan, params, rank, m.jobs, m.order,
                        lambda chunk_jobs: move_chunk(params, rank, n, chunk_jobs, m.ranks, resolve_group))
    return plan


def _add_chunks(plan: StepPlan, params: Sequence[PlanParam], rank: int, jobs, order, make) -> None:
    plan.jobs += len(jobs)
    for chunk_jobs in order:
        chunk = make([jobs[k] for k in chunk_jobs])
        plan.chunks.append(chunk)
        plan.owned += len(chunk.owned)
        plan.load += sum(params[o.param].cost(o.shape) for o in chunk.owned if o.split is None)
        for j in (jobs[k] for k in chunk_jobs):
            if j.cut is not None and j.owner == rank:  # a block of a cut unit: its modelled time
                plan.load += j.cost
                plan.split_jobs += 1
                plan.split_bytes += params[j.param].split.cost(_unit_shape(j), j.cut.k).bytes_per_rank
        sent, received, buffers, workspace = (move_traffic(chunk, params, _workspace)
                                              if isinstance(chunk, MoveChunk) else _traffic(chunk, params))
        plan.bytes_sent += sent
        plan.bytes_received += received
        plan.peak_chunk_bytes = max(plan.peak_chunk_bytes, buffers)
        plan.peak_workspace_bytes = max(plan.peak_workspace_bytes, workspace)


def _unit_shape(job) -> tuple[int, ...]:
    """The whole unit a block of a cut unit belongs to."""
    return sub_shape(job.shape, job.cut, sum(job.widths))


def _gather_all(params: Sequence[PlanParam], i: int, rank: int, resolve_group) -> GatherAll:
    p = params[i]
    view = RankView(params, rank, False, resolve_group, p)
    shape = (*local_shape(p, rank)[:-2], *p.shape[-2:])  # this rank's experts, whole matrices
    whole = Job(i, (), None, shape, 0.0, (), None, rank)
    pad = view.padded(whole)
    owned = owned_unit(view, whole, 0, pad, single=False)
    mine_ix = view.members(i)[view.member]
    lead = [slice(None)] * (len(shape) - 2)
    return GatherAll(i, view.shard_group, len(view.shard), owned, view.mine(whole),
                     device_indexer((*lead, *mine_ix[-2:]), p.device), p.wire_dtype,
                     device_indexer((*lead, mine_ix[-2]), p.device))


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
        calls[key] = calls.get(key, 0) + _workspace(o) * params[o.param].compute_itemsize
    return sent * item, received * item, buffers * item, max(calls.values(), default=0)


def _workspace(o: Owned) -> int:
    """Elements of Newton–Schulz's live tensors for an owned unit (or a block of a cut one)."""
    if o.split is None:
        return ns_workspace(o.shape)
    return split_workspace(o.shape, o.split.transpose, len(o.split.ranks))
