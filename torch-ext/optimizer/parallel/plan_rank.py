"""One rank's part of the step plan: its groups, buffer offsets and index tensors.

Given the world's jobs and chunks (``plan_world.py``), a rank works out, per chunk, its piece of
every job owned in its shard group (the gather's send buffer), how to assemble the jobs it owns
from the pieces that arrive, how to cut their updates for the scatter, and where the pieces of
jobs owned in other replicas arrive (the replica all-gather).  Pure apart from resolving process
groups (created at construction) and moving index tensors to the parameter's device.
"""

from __future__ import annotations

import math

import torch

from ..distributed.placements import Index, as_indexer
from .plan_types import Chunk, Owned, Pack, PlanParam, Region, SplitOwned, Update, row_slots
from .plan_world import _Job
from .split_plan import block_offsets, canonical_sets, cut_blocks

# A rank's pieces of a cut unit's blocks travel as one pack (and one update) when its piece of the
# unit has at most this many elements: there the calls per block, not their kernels, cost the time.
FUSE_MAX_ELEMENTS = 1 << 16


def _device_indexer(indices, device) -> tuple:
    moved = tuple(ix if isinstance(ix, slice) else ix.to(device) for ix in indices)
    return as_indexer(moved)


def _local_shape(p: PlanParam, rank: int) -> tuple[int, ...]:
    if p.layout is None:
        return p.shape
    return p.layout.local_shape(p.layout.grid.coordinate(rank))


def _region(leading: slice | None) -> Region:
    return () if leading is None else (leading,)


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
        placed = []
        for k, owned in enumerate(by_member):
            for job in owned:
                pad = self.padded(job)
                placed.append((job, offset, pad))
                offset += math.prod(pad)
        chunk.packs = self._fused(placed, Pack)
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
        chunk.updates = self._fused(placed, lambda *a, **kw: Update(*a[:2], "scatter", *a[2:], **kw))

        # 4. replica exchange: blocks of jobs owned in other replicas.
        if chunk.replica_group is not None:
            self._exchange(chunk, jobs)
        return chunk

    def _fused(self, placed, make) -> list:
        """Packs (or scatter updates) of ``placed`` jobs ``(job, offset, padded)``: one per job, except
        that this rank's pieces of the blocks of one cut unit (without row state) are one entry
        with an index (``Pack.index``): one momentum call and one index kernel for the unit, not
        one of each per block."""
        out, cut = [], {}
        for job, offset, pad in placed:
            slots = self.slots(job.param)
            if job.cut is not None and not slots:
                cut.setdefault((job.param, job.unit), []).append((job, offset, pad))
                continue
            out.append(make(job.param, self.region(job), offset, pad, self.mine(job), slots))
        for blocks in cut.values():
            job = blocks[0][0]
            extent = _local_shape(self.params[job.param], self.rank)[job.cut.dim]
            piece = math.prod(self.mine(job)) // max(1, self.mine(job)[job.cut.dim]) * extent
            if (len(blocks) == 1 or piece > FUSE_MAX_ELEMENTS
                    or sum(self.mine(j)[job.cut.dim] for j, _, _ in blocks) != extent):
                # one block, a large piece (its kernels outlast the calls; an index would cost 8 bytes
                # an element), or blocks owned in another replica too (split over replicas): one each
                out += [make(j.param, self.region(j), offset, pad, self.mine(j), 0) for j, offset, pad in blocks]
                continue
            out.append(self._fused_entry(blocks, make))
        return out

    def _fused_entry(self, blocks, make):
        """One entry for this rank's pieces of every block of a cut unit: its piece of the unit,
        and where each of its elements sits in the buffer."""
        job0 = blocks[0][0]
        dim = job0.cut.dim
        pieces = [(self._cut(job)[1], self.mine(job), offset, pad) for job, offset, pad in blocks]
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
        head = _region(job0.leading)
        return make(job0.param, head, -1, (), tuple(shape), 0,
                    index=index.reshape(-1).to(self.params[job0.param].device),
                    blocks=tuple((offset, pad, mine) for _, mine, offset, pad in pieces))

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
