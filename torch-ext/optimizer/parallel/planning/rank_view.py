"""One rank's view of a pattern: its shard and replica groups, and every job's piece, block and region.

Given the world's jobs and chunks (``world.py``), a rank works out its part of them
(``rank_chunk.py``) from these facts: which members hold which indices of each unit, the padded
block every member's piece of a job takes in the buffers, and where the job lies in its local
tensors.  Pure apart from resolving process groups (created at construction).
"""

from __future__ import annotations

from ...distributed.placements import Index, as_indexer
from .cut_geometry import block_offsets, canonical_sets, cut_blocks
from .plan_data import PlanParam, Region, row_slots
from .world import Job


def device_indexer(indices, device) -> tuple:
    moved = tuple(ix if isinstance(ix, slice) else ix.to(device) for ix in indices)
    return as_indexer(moved)


def local_shape(p: PlanParam, rank: int) -> tuple[int, ...]:
    if p.layout is None:
        return p.shape
    return p.layout.local_shape(p.layout.grid.coordinate(rank))


def region_of(leading: slice | None) -> Region:
    return () if leading is None else (leading,)


class RankView:
    """This rank's view of a pattern (see the module docstring)."""

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

    def members(self, i: int) -> list[tuple[Index, ...]]:
        """Global indices held by each member of this rank's shard group, for param ``i``
        (shared by every parameter of the same layout: models repeat a few shapes)."""
        lay = self.params[i].layout
        hit = self._members_cache.get(id(lay))
        if hit is None:
            hit = self._members_cache[id(lay)] = (lay, [lay.indices(lay.grid.coordinate(r)) for r in self.shard])
        return hit[1]

    def holds(self, job: Job) -> bool:
        lay = self.params[job.param].layout
        return lay.batch_coordinate(self.coord) == job.batch and (
            job.replica is None or lay.replica_coordinate(self.coord) == job.replica)

    def unit_members(self, job: Job) -> list[tuple[Index, Index]]:
        """Each member's indices along the unit's last two dims, as positions in the unit: its
        global indices for a whole matrix; for a block of a cut unit, along the cut dim, where
        its slice of the block sits (``cut_geometry.cut_blocks``)."""
        if job.cut is None:
            return [ix[-2:] for ix in self.members(job.param)]
        return self.cut_positions(job)[0]

    def cut_positions(self, job: Job) -> tuple:
        """For a block of a cut unit: each member's positions in the block, and this rank's local slice."""
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

    def region(self, job: Job) -> Region:
        """This rank's part of a job in its local tensors: the expert range, and for a block of a
        cut unit its local slice along the cut dim (basic slices: views)."""
        if job.cut is None:
            return region_of(job.leading)
        ndim = len(self.params[job.param].shape)
        head = (job.leading,) if job.leading is not None else (slice(None),) * (ndim - 2)
        local = self.cut_positions(job)[1]
        return (*head, local) if job.cut.dim == -2 else (*head, slice(None), local)

    def slots(self, i: int) -> int:
        p = self.params[i]
        return row_slots(p.row_bytes, p.wire_dtype)

    def padded(self, job: Job) -> tuple[int, ...]:
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

    def mine(self, job: Job) -> tuple[int, ...]:
        ix = self.unit_members(job)[self.member]
        return (*job.shape[:-2], _length(ix[0]), _length(ix[1]))


def _length(ix: Index) -> int:
    return max(0, ix.stop - ix.start) if isinstance(ix, slice) else int(ix.numel())
