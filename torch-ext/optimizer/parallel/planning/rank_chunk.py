"""This rank's part of one chunk: what it sends, assembles, owns and receives, at which offsets.

Per chunk of a pattern's jobs (``world.py``), from its view (``rank_view.py``): its piece of every
job owned in its shard group (the gather's send buffer), how to assemble the jobs it owns from
the pieces that arrive (index tensors already on the parameter's device), how to cut their
updates for the scatter, and where the pieces of jobs owned in other replicas arrive (the
replica all-gather).
"""

from __future__ import annotations

import math

import torch

from .plan_data import Chunk, Owned, Pack, SplitOwned, Update
from .rank_view import RankView, local_shape, region_of
from .world import Job

# A rank's pieces of a cut unit's blocks travel as one pack (and one update) when its piece of the
# unit has at most this many elements: there the calls per block, not their kernels, cost the time.
FUSE_MAX_ELEMENTS = 1 << 16


def rank_chunk(view: RankView, pattern: int, jobs: list[Job]) -> Chunk:
    """This rank's part of one chunk of a pattern's jobs: its packs, owned units, updates and splits."""
    p0 = view.first
    chunk = Chunk(pattern, view.shard_group, len(view.shard), view.member, view.replica_group,
                  len(view.replicas) if view.replica_group is not None else 1, p0.wire_dtype, p0.device)
    in_group = {r: k for k, r in enumerate(view.shard)}
    # Jobs whose owner is in this rank's shard group, grouped by owner (member order).
    by_member: list[list[Job]] = [[] for _ in view.shard]
    for job in jobs:
        k = in_group.get(job.owner)
        if k is not None and view.holds(job):
            by_member[k].append(job)
    segments = [sum(math.prod(view.padded(j)) for j in owned) for owned in by_member]

    # 1. gather: my piece of every job owned in my shard group, by owner.
    offset = 0
    placed = []
    for k, owned in enumerate(by_member):
        for job in owned:
            pad = view.padded(job)
            placed.append((job, offset, pad))
            offset += math.prod(pad)
    chunk.packs = _fused(view, placed, Pack)
    chunk.send_splits = segments

    # 2. the jobs I own: assembly and scatter recipes.
    mine = by_member[view.member]
    chunk.segment = segments[view.member]
    offset = 0
    for job in mine:
        pad = view.padded(job)
        chunk.owned.append(owned_unit(view, job, offset, pad, single=len(mine) == 1))
        if job.cut is not None:
            chunk.owned[-1].split = SplitOwned(_split_group(view, job), job.group, job.widths,
                                               job.cut.dim == -2, job.unit)
        offset += math.prod(pad)
    groups: dict[tuple, list[int]] = {}
    for k, o in enumerate(chunk.owned):
        if not o.zero_copy and o.split is None:
            groups.setdefault((view.params[o.param].ns_key, o.shape, o.padded), []).append(k)
    for ks in groups.values():
        if len(ks) > 1:
            for k in ks:
                chunk.owned[k].batch = len(chunk.batches)
            chunk.batches.append(ks)

    # 3. scatter: my block of every job owned in my shard group comes back.
    chunk.scatter_recv_splits = [
        sum(math.prod(view.padded(j)) for j in owned) for owned in by_member
    ]
    chunk.updates = _fused(view, placed, lambda *a, **kw: Update(*a[:2], "scatter", *a[2:], **kw))

    # 4. replica exchange: blocks of jobs owned in other replicas.
    if chunk.replica_group is not None:
        _exchange(view, chunk, jobs)
    return chunk


def _fused(view: RankView, placed, make) -> list:
    """Packs (or scatter updates) of ``placed`` jobs ``(job, offset, padded)``: one per job, except
    that this rank's pieces of the blocks of one cut unit (without row state) are one entry
    with an index (``Pack.index``): one momentum call and one index kernel for the unit, not
    one of each per block."""
    out, cut = [], {}
    for job, offset, pad in placed:
        slots = view.slots(job.param)
        if job.cut is not None and not slots:
            cut.setdefault((job.param, job.unit), []).append((job, offset, pad))
            continue
        out.append(make(job.param, view.region(job), offset, pad, view.mine(job), slots))
    for blocks in cut.values():
        job = blocks[0][0]
        extent = local_shape(view.params[job.param], view.rank)[job.cut.dim]
        piece = math.prod(view.mine(job)) // max(1, view.mine(job)[job.cut.dim]) * extent
        if (len(blocks) == 1 or piece > FUSE_MAX_ELEMENTS
                or sum(view.mine(j)[job.cut.dim] for j, _, _ in blocks) != extent):
            # one block, a large piece (its kernels outlast the calls; an index would cost 8 bytes
            # an element), or blocks owned in another replica too (split over replicas): one each
            out += [make(j.param, view.region(j), offset, pad, view.mine(j), 0) for j, offset, pad in blocks]
            continue
        out.append(_fused_entry(view, blocks, make))
    return out


def _fused_entry(view: RankView, blocks, make):
    """One entry for this rank's pieces of every block of a cut unit: its piece of the unit,
    and where each of its elements sits in the buffer."""
    job0 = blocks[0][0]
    dim = job0.cut.dim
    pieces = [(view.cut_positions(job)[1], view.mine(job), offset, pad) for job, offset, pad in blocks]
    shape = list(pieces[0][1])
    shape[dim] = sum(m[dim] for _, m, _, _ in pieces)
    index = torch.empty(shape, dtype=torch.long)
    for local, mine, offset, pad in pieces:
        if not math.prod(mine):
            continue
        where = torch.arange(offset, offset + math.prod(pad)).view(pad)[tuple(slice(0, n) for n in mine)]
        if dim == -1:
            index[..., local] = where
        else:
            index[..., local, :] = where
    head = region_of(job0.leading)
    return make(job0.param, head, -1, (), tuple(shape), 0,
                index=index.reshape(-1).to(view.params[job0.param].device),
                blocks=tuple((offset, pad, mine) for _, mine, offset, pad in pieces))


def _split_group(view: RankView, job: Job):
    try:
        return view.resolve_group(job.group, None, ())
    except RuntimeError as err:
        raise RuntimeError(
            f"{err} Here: ns_split cuts '{view.params[job.param].name}' over that group, which is made when the "
            "optimizer is built (or in add_param_group) for the ns_split its param group has then; set "
            "ns_split there rather than on a live optimizer."
        ) from None


def owned_unit(view: RankView, job: Job, offset: int, pad: tuple[int, ...], single: bool) -> Owned:
    members = view.members(job.param)
    positions = view.unit_members(job)
    lead = len(job.shape) - 2
    slots = view.slots(job.param)
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
        device = view.params[job.param].device
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


def _exchange(view: RankView, chunk: Chunk, jobs: list[Job]) -> None:
    """Offsets of every replica's contribution, and the padded length all of them use."""
    lay = view.layout
    my_batch = lay.batch_coordinate(view.coord)
    # contribution of replica r = its scatter receive buffer: jobs owned in its shard
    # group (members in order, each owner's jobs in chunk order), padded blocks.
    per_replica: dict[int, list[Job]] = {}
    grid = lay.grid
    for job in jobs:
        owner_coord = grid.coordinate(job.owner)
        if view.params[job.param].layout.batch_coordinate(owner_coord) != my_batch:
            continue
        per_replica.setdefault(grid.rank_at(_with(view.coord, owner_coord, lay.replica_dims)), []).append(job)
    lengths, offsets = {}, {}
    for r in view.replicas:
        owned = per_replica.get(r, [])
        shard = tuple(sorted(lay.shard_group(grid.coordinate(r))))
        order = sorted(owned, key=lambda j: shard.index(j.owner))  # stable: chunk order per owner
        base = 0
        for job in order:
            offsets[(r, id(job))] = base
            base += math.prod(view.padded(job))
        lengths[r] = base
    chunk.exchange_length = max(lengths.values(), default=0)
    me = view.replicas.index(view.rank)
    for k, r in enumerate(view.replicas):
        if k == me:
            continue
        for job in per_replica.get(r, []):
            pad = view.padded(job)
            chunk.updates.append(Update(job.param, view.region(job), "exchange",
                                        k * chunk.exchange_length + offsets[(r, id(job))], pad, view.mine(job),
                                        view.slots(job.param)))


def _with(coord, other, dims) -> tuple[int, ...]:
    """``coord`` with ``other``'s values on ``dims``."""
    out = list(coord)
    for m in dims:
        out[m] = other[m]
    return tuple(out)
