"""Experts held whole, orthogonalised by ranks that hold none of them (``ns_split="auto"``).

With experts on ``Shard(0)`` (the batch dim) every rank holds whole expert matrices and
orthogonalises them where they are, with no communication.  With fewer experts than ranks most
ranks hold none: Qwen3-235B's 128 experts on 1,024 ranks leave 896 ranks idle while 128 run all of
them (7.8x the ideal share).  Here such units move: a holder keeps units while its load stays
within the ideal share (:data:`SPILL_SLACK`), and the rest spill to whichever ranks are least
loaded, whole or cut over an aligned group of ranks exactly as ``ns_split`` cuts a dense matrix
(``cut_choice.choose_ks`` and ``assign`` decide, with what the other patterns already put on each
rank as the starting loads).

Moves cost time: a holder ships its units out and takes their updates back, through NVLink inside
a node and through its own NIC between nodes (Qwen3-235B's experts on ``Shard(0)`` at 1,024 ranks:
up to 3.4 GB out per rank per step, longer over 45 GB/s InfiniBand than the Newton–Schulz it
would balance).  So each rank's step is modelled as its Newton–Schulz load plus its transfer time
(:func:`move_seconds`, the cost model's link figures, in FLOP-equivalents at the device's rate),
for a few ways of deciding how much each holder keeps (:data:`KEEP_LEVELS`); the best is kept
only if that step beats not moving by :data:`~.cut_choice.MIN_GAIN`, else the experts stay home.

Transport (``MoveChunk``, ``execution/move_stages.py``): one all-to-all over the mesh's ranks takes each block from
its holder to its owner, one brings the update back; a block is a whole expert range (or its slice
along the long side, for a cut), sent as it is.  The holder applies the update to its own piece,
as it would have.  Only layouts whose every mesh dim shards the expert dim qualify (no matrix dim
sharded, no replicas): there the mesh's ranks are exactly the ranks that could hold any expert.

Pure: every rank computes the same moves (:func:`choose_moves`) and then its own part of them
(:func:`move_chunk`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .cut_choice import MIN_GAIN, assign_paired, choose_ks
from .cut_geometry import Cut, block_widths, cut_blocks, cut_dim, sub_shape
from .cut_model import CutOptions, movable_layout
from .owners import cut_chunks
from .plan_data import MoveChunk, Owned, Pack, PlanParam, SplitOwned, Update, row_slots
from .world import TARGET_UNIT_FRACTION, Job, batch_costs, cut_options, cut_units_together, expert_units, pair_key

# A holder keeps units while its load stays within this fraction above the ideal share.
SPILL_SLACK = 0.02
# How many shares a holder may keep before it spills, spaced geometrically from the ideal share to
# the busiest holder's load: the way with the shortest modelled step (Newton-Schulz plus the
# moves' transfers) among them wins.  Keeping more ships fewer bytes; where the links are slow
# against the products, the best keeps everything (no moves).
KEEP_LEVELS = 8


def movable(p: PlanParam) -> bool:
    """Units of ``p`` may move (``cut_model.movable_layout``)."""
    return movable_layout(p.layout, len(p.shape), p.split)


@dataclass
class ExpertMoves:
    """The units of one mesh's movable parameters (one wire dtype) once they move: jobs (one per
    unit or block, ``holder`` set; a kept unit's owner is its holder) and their chunks."""

    params: list[int]
    ranks: tuple[int, ...]
    jobs: list[Job]
    order: list[list[int]]


def move_groups(params: Sequence[PlanParam], movable_ix: Sequence[int]) -> list[list[int]]:
    """Movable parameters sharing a mesh and wire dtype (one all-to-all each way per chunk)."""
    groups: dict[tuple, list[int]] = {}
    for i in movable_ix:
        groups.setdefault((params[i].layout.grid, params[i].wire_dtype), []).append(i)
    return list(groups.values())


def holder_loads(params: Sequence[PlanParam], members: Sequence[int]) -> list[tuple[int, tuple, int, int]]:
    """(param, batch coordinate, holder, local expert count) of every rank holding experts."""
    out = []
    for i in members:
        lay = params[i].layout
        for b in lay.batch_coordinates():
            (h,) = lay.holders(b)
            count = lay.local_shape(lay.grid.coordinate(h))[0]
            if count:
                out.append((i, b, h, count))
    return out


def choose_moves(params: Sequence[PlanParam], members: Sequence[int], loads: dict[int, float],
                 chunk_size: int | None) -> ExpertMoves | None:
    """The moves of one group of movable parameters, on top of every rank's ``loads`` from the
    rest of the plan; None when nothing is worth moving."""
    ranks = tuple(sorted(params[members[0]].layout.grid.ranks))
    world = len(ranks)
    held = holder_loads(params, members)
    base = {r: loads.get(r, 0.0) for r in ranks}
    before, total_bytes = _loads_at_home(params, held, base)
    ideal = sum(before.values()) / world
    busiest = max(before.values(), default=0.0)
    if busiest <= ideal * (1 + MIN_GAIN):
        return None
    units = [Job(i, b, leading, shape, cost, ranks, None, h, holder=h)
             for i, b, h, count in held
             for leading, shape, cost in expert_units(params[i], b, count, TARGET_UNIT_FRACTION * ideal,
                                                      total_bytes / world)]
    jobs = _best_moves(params, units, params[members[0]].split, base, ideal, busiest, ranks)
    if jobs is None:  # no way of moving beats the experts staying home
        return None
    order = cut_units_together(jobs, cut_chunks([j.cost for j in jobs], [j.owner for j in jobs], chunk_size or world),
                               params)
    batch_costs(params, jobs, order)
    return ExpertMoves(list(members), ranks, jobs, order)


def _loads_at_home(params: Sequence[PlanParam], held, base: dict[int, float]) -> tuple[dict[int, float], float]:
    """Every rank's load with the experts orthogonalised where they are, and the experts' bytes."""
    before = dict(base)
    total_bytes = 0.0
    for i, b, h, count in held:
        p = params[i]
        sub = (count, *p.shape[1:])
        before[h] += p.cost(sub)
        total_bytes += math.prod(sub) * p.wire_dtype.itemsize
    return before, total_bytes


def _best_moves(params: Sequence[PlanParam], units: list[Job], model, base: dict[int, float], ideal: float,
                busiest: float, ranks: tuple[int, ...]) -> list[Job] | None:
    """The jobs of the way of spilling units whose modelled step (Newton–Schulz plus the moves'
    transfers, :func:`move_seconds`) is shortest, if it beats keeping them home by MIN_GAIN."""
    options = [cut_options(params[u.param], u, split=False) for u in units]
    # Which units are cut, as if every unit could go anywhere; those spill.  The others: holders
    # keep them (largest first) while they fit under a share of the ideal (or the largest whole
    # unit, which no placement avoids); the rest spill, to the least-loaded ranks.
    keys = [pair_key(params, u) for u in units]
    cuts = choose_ks(options, len(ranks), lambda: base, keys) or [1] * len(units)
    rate = model.hardware.rate(model.dtype)
    best, best_step, tried = None, busiest * (1 - MIN_GAIN), set()
    for factor, cut, allowed in _spill_ways(units, cuts, options, busiest / ideal, model.hardware, ranks):
        largest = max([0.0, *(u.cost for u, k in zip(units, cut) if k == 1)])
        load, spilled = _keep_at_home(units, cut, base, max(ideal * factor, largest) * (1 + SPILL_SLACK))
        ks = [cut[n] for n in spilled]
        if not spilled or (tuple(spilled), tuple(ks), id(allowed)) in tried:
            continue
        tried.add((tuple(spilled), tuple(ks), id(allowed)))
        owners, after = assign_paired([allowed[n] for n in spilled], ks, load, [keys[n] for n in spilled])
        jobs = _move_jobs(units, options, dict(zip(spilled, zip(ks, owners))), ranks)
        moving = move_seconds(params, jobs, model.hardware)
        step = max(after.get(r, 0.0) + moving.get(r, 0.0) * rate for r in ranks)
        if step < best_step:
            best, best_step = jobs, step
    return best


def _spill_ways(units: Sequence[Job], cuts: list[int], options: list[CutOptions], spread: float, hardware,
                ranks: tuple[int, ...]) -> list[tuple[float, list[int], list[CutOptions]]]:
    """(keep factor, k per unit, where each may go) of every way tried: every keep factor with the
    chosen cuts, then with every unit whole (a cut unit always spills: where the links are slow,
    keeping it whole at home may be the better way), then whole units spilled only inside their
    holder's node (where the links between nodes are the slow ones)."""
    whole = [1] * len(units)
    factors = [spread ** (i / KEEP_LEVELS) for i in range(KEEP_LEVELS)]
    ways = [(f, cuts, options) for f in factors]
    if cuts != whole:
        ways += [(f, whole, options) for f in factors]
    if 0 < hardware.node_size < len(ranks):
        nodes: dict[int, tuple[int, ...]] = {}
        for r in ranks:
            nodes.setdefault(hardware.node_of(r), ())
            nodes[hardware.node_of(r)] += (r,)
        local = [CutOptions(u.cost, nodes[hardware.node_of(u.holder)]) for u in units]
        ways += [(f, whole, local) for f in factors]
    return ways


def _keep_at_home(units: Sequence[Job], cut: Sequence[int], base: dict[int, float],
                  target: float) -> tuple[dict[int, float], list[int]]:
    """Holders keep their whole units, largest first, while their load stays within ``target``:
    every rank's load then, and the units that spill."""
    load = dict(base)
    spilled: list[int] = []
    for n in sorted(range(len(units)), key=lambda n: (units[n].holder, -units[n].cost, n)):
        u = units[n]
        if cut[n] == 1 and load[u.holder] + u.cost <= target:
            load[u.holder] += u.cost
        else:
            spilled.append(n)
    return load, spilled


def _move_jobs(units: Sequence[Job], options, chosen: dict[int, tuple[int, int]], ranks) -> list[Job]:
    """Every unit as a job of the moves, kept ones too (owner = holder: they go to their holder's
    own slot of the all-to-all; the chunks then hold similar work for every rank, kept or moved,
    and a holder's kept units do not run ahead of the chunks the others wait on); ``chosen``: the
    spilled units' (k, owner or group index)."""
    jobs: list[Job] = []
    for n, u in enumerate(units):
        k, owner = chosen.get(n, (1, u.holder))
        if k == 1:
            job = copy.copy(u)
            job.owner = owner
            jobs.append(job)
            continue
        opt = options[n]
        group = opt.groups(k)[owner]
        dim = cut_dim(u.shape)
        widths = block_widths((u.shape[dim],), k)
        for j, rank in enumerate(group):
            cut = Cut(dim, k, j)
            jobs.append(Job(u.param, u.batch, u.leading, sub_shape(u.shape, cut, widths[j]), opt.member_cost(k),
                            ranks, None, rank, cut, group, widths, n, holder=u.holder))
    return jobs


def move_seconds(params: Sequence[PlanParam], jobs: Sequence[Job], hardware) -> dict[int, float]:
    """Modelled seconds each rank spends moving blocks (holder -> owner) and their updates back:
    per direction the slowest of what it sends and receives inside its node (the node's link) and
    between nodes (its own NIC: ``SplitHardware.transfer_s``), the two kinds of link running at
    once; the way back moves the same bytes the other way, so twice that.  Not overlapped with the
    products (a bound on what the runtime pays).  Only ranks that move something appear."""
    sends: dict[tuple[int, bool], float] = {}
    receives: dict[tuple[int, bool], float] = {}
    for j in jobs:
        if j.holder == j.owner or j.holder < 0:
            continue
        nbytes = math.prod(j.shape) * params[j.param].wire_dtype.itemsize
        same = hardware.node_size <= 0 or hardware.node_of(j.holder) == hardware.node_of(j.owner)
        sends[(j.holder, same)] = sends.get((j.holder, same), 0.0) + nbytes
        receives[(j.owner, same)] = receives.get((j.owner, same), 0.0) + nbytes
    out: dict[int, float] = {}
    for table in (sends, receives):
        for (r, same), nbytes in table.items():
            out[r] = max(out.get(r, 0.0), hardware.transfer_s(nbytes, same))
    return {r: 2 * t for r, t in out.items()}


def move_bytes(params: Sequence[PlanParam], jobs: Sequence[Job]) -> dict[int, int]:
    """Bytes each rank sends in the moves (blocks out as a holder, updates back as an owner)."""
    out: dict[int, int] = {}
    for j in jobs:
        if j.holder == j.owner or j.holder < 0:
            continue
        nbytes = math.prod(j.shape) * params[j.param].wire_dtype.itemsize
        out[j.holder] = out.get(j.holder, 0) + nbytes
        out[j.owner] = out.get(j.owner, 0) + nbytes
    return out


def kept_units(moves: ExpertMoves | None, i: int) -> list:
    """The leading ranges of param ``i``'s experts that their holder orthogonalises where they are,
    outside the moves' chunks: all of them (None: the whole local tensor) unless its units move."""
    return [None] if moves is None or i not in moves.params else []


# ----------------------------------------------------------------------------
# One rank's part
# ----------------------------------------------------------------------------


def move_chunk(params: Sequence[PlanParam], rank: int, pattern: int, jobs: Sequence[Job], ranks: tuple[int, ...],
               resolve_group: Callable) -> MoveChunk:
    """This rank's part of one chunk of moves: what it sends (blocks it holds), what it receives
    and orthogonalises (blocks it owns), and where the updates land."""
    p0 = params[jobs[0].param]
    lay0 = p0.layout
    group = resolve_group(ranks, p0.mesh, tuple(range(len(lay0.grid.shape))))
    chunk = MoveChunk(pattern, group, ranks, ranks.index(rank), p0.wire_dtype, p0.device)
    position = {r: n for n, r in enumerate(ranks)}
    out = [[] for _ in ranks]
    into = [[] for _ in ranks]
    for job in jobs:
        if job.holder == rank:
            out[position[job.owner]].append(job)
        if job.owner == rank:
            into[position[job.holder]].append(job)
    offset = 0
    for n, blocks in enumerate(out):
        start = offset
        for job in blocks:
            pad, slots = _block(params, job)
            region = _region(params[job.param], job)
            chunk.packs.append(Pack(job.param, region, offset, pad, job.shape, slots))
            chunk.updates.append(Update(job.param, region, "scatter", offset, pad, job.shape, slots))
            offset += math.prod(pad)
        chunk.send_splits.append(offset - start)
    offset = 0
    for n, blocks in enumerate(into):
        start = offset
        for job in blocks:
            pad, slots = _block(params, job)
            o = Owned(job.param, job.shape, offset, pad, zero_copy=True, experts=_experts(params[job.param], job),
                      row_slots=slots)
            if job.cut is not None:
                o.split = SplitOwned(_split_group(params, job, resolve_group), job.group, job.widths,
                                     job.cut.dim == -2, job.unit)
            chunk.owned.append(o)
            offset += math.prod(pad)
        chunk.recv_splits.append(offset - start)
    same: dict[tuple, list[int]] = {}
    for k, o in enumerate(chunk.owned):
        if o.split is None:
            same.setdefault((params[o.param].ns_key, o.shape, o.padded), []).append(k)
    for ks in same.values():
        if len(ks) > 1:
            for k in ks:
                chunk.owned[k].batch = len(chunk.batches)
            chunk.batches.append(ks)
    return chunk


def _block(params: Sequence[PlanParam], job: Job) -> tuple[tuple[int, ...], int]:
    p = params[job.param]
    slots = row_slots(p.row_bytes, p.wire_dtype)
    return (*job.shape[:-1], job.shape[-1] + slots), slots


def _region(p: PlanParam, job: Job) -> tuple:
    """The block's place in its holder's local tensor: the expert range, and for a block of a cut
    unit its slice along the cut dim (basic slices: views)."""
    if job.cut is None:
        return () if job.leading is None else (job.leading,)
    head = (job.leading,) if job.leading is not None else (slice(None),) * (len(p.shape) - 2)
    length = sum(job.widths)
    local = cut_blocks((length,), job.cut.k)[job.cut.j][0]
    return (*head, local) if job.cut.dim == -2 else (*head, slice(None), local)


def _experts(p: PlanParam, job: Job):
    held = p.layout.indices(p.layout.grid.coordinate(job.holder))[0]
    if job.leading is None:
        return held
    if isinstance(held, slice):
        return slice(held.start + job.leading.start, held.start + job.leading.stop)
    return held[job.leading]


def _split_group(params: Sequence[PlanParam], job: Job, resolve_group):
    try:
        return resolve_group(job.group, None, ())
    except RuntimeError as err:
        raise RuntimeError(
            f"{err} Here: ns_split cuts experts of '{params[job.param].name}' over that group, which is made when "
            "the optimizer is built (or in add_param_group) for the ns_split its param group has then; set "
            "ns_split there rather than on a live optimizer."
        ) from None


def move_traffic(chunk: MoveChunk, params: Sequence[PlanParam], workspace: Callable) -> tuple[int, int, int, int]:
    """Bytes this rank sends and receives for a chunk of moves (blocks out and updates back, itself
    excepted), the chunk's buffer bytes here (send, receive, batched copies, the way back), and
    its Newton–Schulz workspace (the largest batched call)."""
    item = chunk.wire_dtype.itemsize
    me = chunk.member
    out, into = chunk.send_numel, chunk.recv_numel
    sent = (out - chunk.send_splits[me]) + (into - chunk.recv_splits[me])
    received = (into - chunk.recv_splits[me]) + (out - chunk.send_splits[me])
    buffers = 2 * out + 3 * into
    calls: dict[object, int] = {}
    for k, o in enumerate(chunk.owned):
        key = ("batch", o.batch) if o.batch >= 0 else k
        calls[key] = calls.get(key, 0) + workspace(o) * params[o.param].compute_itemsize
    return sent * item, received * item, buffers * item, max(calls.values(), default=0)
