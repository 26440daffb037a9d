"""How a DTensor parameter's placements spread its matrices over a mesh (pure).

For Muon every mesh dim is one of three kinds:

* matrix dims   shard one of the last two tensor dims: each rank holds a piece of
                every matrix, so whole matrices must be gathered.  A rank's *shard
                group* is the ranks that differ from it only along these dims; together
                they hold one copy.
* batch dims    shard a leading dim (the experts of ``[E, out, in]``): each rank holds
                whole matrices, different ones than its peers along these dims.
* replica dims  ``Replicate``: ranks that differ only along these dims hold the same
                data.  A rank's *replica group* is those ranks.

Everything here is arithmetic on the mesh's rank grid (``mesh.mesh``, which every
rank of the mesh has in full) and the placement index math; no process groups.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

from torch.distributed.tensor.placement_types import Placement

from .placements import Index, check_placements, local_indices

Coordinate = tuple[int, ...]


@dataclass(frozen=True)
class MeshGrid:
    """A device mesh as data: its shape and its global ranks in row-major order."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    @staticmethod
    def of(mesh) -> "MeshGrid":
        grid = mesh.mesh.cpu()  # DeviceMesh rebuilds this tensor on every access: read it once
        return MeshGrid(tuple(int(s) for s in grid.shape), tuple(int(r) for r in grid.flatten().tolist()))

    @cached_property
    def _position(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.ranks)}

    def coordinate(self, rank: int) -> Coordinate | None:
        pos = self._position.get(rank)
        if pos is None:
            return None
        coord = []
        for size in reversed(self.shape):
            pos, c = divmod(pos, size)
            coord.append(c)
        return tuple(reversed(coord))

    def rank_at(self, coordinate: Sequence[int]) -> int:
        pos = 0
        for c, size in zip(coordinate, self.shape):
            pos = pos * size + c
        return self.ranks[pos]

    def partition(self, dims: Sequence[int]) -> list[tuple[int, ...]]:
        """The rank sets obtained by varying ``dims`` with every other dim fixed (mesh order)."""
        dims = tuple(dims)
        fixed = [d for d in range(len(self.shape)) if d not in dims]
        out = []
        for outer in itertools.product(*(range(self.shape[d]) for d in fixed)):
            out.append(self.varying(dims, dict(zip(fixed, outer))))
        return out

    @cached_property
    def _varying_cache(self) -> dict:
        return {}

    def varying(self, dims: Sequence[int], fixed: dict[int, int]) -> tuple[int, ...]:
        """Ranks with the given coordinates on ``fixed`` dims, all values of ``dims`` (mesh order)."""
        key = (tuple(dims), tuple(sorted(fixed.items())))
        hit = self._varying_cache.get(key)
        if hit is None:
            hit = self._varying_cache[key] = self._varying(dims, fixed)
        return hit

    def _varying(self, dims: Sequence[int], fixed: dict[int, int]) -> tuple[int, ...]:
        coord = [0] * len(self.shape)
        for d, c in fixed.items():
            coord[d] = c
        out = []
        for inner in itertools.product(*(range(self.shape[d]) for d in dims)):
            for d, c in zip(dims, inner):
                coord[d] = c
            out.append(self.rank_at(coord))
        return tuple(out)


@dataclass(frozen=True)
class ParamLayout:
    """One DTensor parameter's global shape and placements on its mesh, classified for Muon."""

    shape: tuple[int, ...]
    grid: MeshGrid
    placements: tuple[Placement, ...]
    matrix_dims: tuple[int, ...] = field(init=False)
    batch_dims: tuple[int, ...] = field(init=False)
    replica_dims: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.placements) != len(self.grid.shape):
            raise ValueError(
                f"{len(self.placements)} placements for a {len(self.grid.shape)}-D mesh: give one per mesh dim"
            )
        ndim = len(self.shape)
        dims = check_placements(self.placements, ndim)
        object.__setattr__(self, "matrix_dims", tuple(m for m, d in enumerate(dims) if d is not None and d >= ndim - 2))
        object.__setattr__(self, "batch_dims", tuple(m for m, d in enumerate(dims) if d is not None and d < ndim - 2))
        object.__setattr__(self, "replica_dims", tuple(m for m, d in enumerate(dims) if d is None))

    # ---------------------------------------------------------------- indices

    def indices(self, coordinate: Coordinate) -> tuple[Index, ...]:
        """Global indices held at ``coordinate``, per tensor dim (see ``local_indices``)."""
        return _indices(self.shape, self.grid.shape, self.placements, tuple(coordinate))

    def local_shape(self, coordinate: Coordinate) -> tuple[int, ...]:
        return tuple(len(range(i.start, i.stop)) if isinstance(i, slice) else int(i.numel())
                     for i in self.indices(coordinate))

    # ----------------------------------------------------------------- groups

    def shard_group(self, coordinate: Coordinate) -> tuple[int, ...]:
        """Ranks that hold, with ``coordinate``, one copy of its matrices (mesh order)."""
        return self.grid.varying(self.matrix_dims, self._fixed(coordinate, self.matrix_dims))

    def replica_group(self, coordinate: Coordinate) -> tuple[int, ...]:
        """Ranks that hold the same data as ``coordinate`` (mesh order)."""
        return self.grid.varying(self.replica_dims, self._fixed(coordinate, self.replica_dims))

    def batch_coordinate(self, coordinate: Coordinate) -> tuple[int, ...]:
        return tuple(coordinate[m] for m in self.batch_dims)

    def replica_coordinate(self, coordinate: Coordinate) -> tuple[int, ...]:
        return tuple(coordinate[m] for m in self.replica_dims)

    def holders(self, batch: tuple[int, ...]) -> tuple[int, ...]:
        """Every rank (all shard positions, all replicas) whose leading block is ``batch``'s,
        replicas varying fastest: the first ranks listed are one of each replica."""
        fixed = dict(zip(self.batch_dims, batch))
        return self.grid.varying((*self.matrix_dims, *self.replica_dims), fixed)

    def batch_coordinates(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(self.grid.shape[m]) for m in self.batch_dims)))

    def _fixed(self, coordinate: Coordinate, varying: tuple[int, ...]) -> dict[int, int]:
        return {m: c for m, c in enumerate(coordinate) if m not in varying}

    @property
    def num_replicas(self) -> int:
        return math.prod(self.grid.shape[m] for m in self.replica_dims)

    @property
    def shard_group_size(self) -> int:
        return math.prod(self.grid.shape[m] for m in self.matrix_dims)


_INDEX_CACHE: dict[tuple, tuple[Index, ...]] = {}


def _indices(shape, mesh_shape, placements, coordinate) -> tuple[Index, ...]:
    # Pure in its arguments and called for the same few layouts over and over while
    # planning: cache it (the cache is bounded by the model's distinct layouts).
    key = (shape, mesh_shape, placements, coordinate)
    hit = _INDEX_CACHE.get(key)
    if hit is None:
        if len(_INDEX_CACHE) > 200_000:
            _INDEX_CACHE.clear()
        hit = _INDEX_CACHE[key] = local_indices(shape, mesh_shape, placements, coordinate)
    return hit
