"""Shard groups of DTensors: the ranks that together hold one full copy of a tensor.

The DTensor-facing helpers around the pure index math of ``placements.py``: a rank's shard
group for some placements on a mesh (with its process group), and which block of a full
tensor each member holds.  Parallel Muon itself plans from ``layout.py``; these are the
building blocks a user (or a test) reaches for to reason about one DTensor.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate

from .groups import create_collectively, group_for, num_created_groups
from .layout import MeshGrid
from .placements import Index, as_indexer, check_placements, local_indices, numel_for_rank

__all__ = [
    "ShardGroup",
    "construct_shard_mesh",
    "dtensor_local_indices",
    "get_slices_of_dtensor",
    "member_coordinates",
    "num_cached_groups",
    "numel_for_member",
]


@dataclass(frozen=True)
class ShardGroup:
    """This rank and the ranks that differ from it only in the sharding mesh dims.

    ``ranks``/``coordinates`` are ordered by rank in ``group``; ``my_index`` is this
    rank's position.  ``group`` is None when no mesh dim shards (one member).
    """

    group: dist.ProcessGroup | None
    shard_mesh_dims: tuple[int, ...]
    ranks: tuple[int, ...]
    coordinates: tuple[tuple[int, ...], ...]
    my_index: int
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def indices_of(self, global_shape: Sequence[int], member: int) -> tuple[Index, ...]:
        """Global indices held by member ``member`` (an index into ``ranks``)."""
        return local_indices(global_shape, self.mesh_shape, self.placements, self.coordinates[member])


def num_cached_groups() -> int:
    """How many process groups this package has created (see ``groups.py``; tests use it)."""
    return num_created_groups()


def member_coordinates(
    mesh_ranks: torch.Tensor, coordinate: Sequence[int], shard_mesh_dims: Sequence[int]
) -> dict[int, tuple[int, ...]]:
    """Global rank -> full-mesh coordinate for every rank that matches ``coordinate``
    on all mesh dims outside ``shard_mesh_dims`` (``mesh_ranks`` is ``mesh.mesh``)."""
    index = tuple(
        slice(None) if m in shard_mesh_dims else c for m, c in enumerate(coordinate)
    )
    sub = mesh_ranks[index]  # dims: the shard dims, in mesh order
    out: dict[int, tuple[int, ...]] = {}
    for pos in itertools.product(*(range(s) for s in sub.shape)):
        full = list(coordinate)
        for m, p in zip(shard_mesh_dims, pos):
            full[m] = p
        out[int(sub[pos])] = tuple(full)
    return out


def construct_shard_mesh(placements: Sequence[Placement], mesh) -> ShardGroup:
    """The shard group of this rank for a tensor with ``placements`` on ``mesh``.

    Replicate mesh dims are dropped: members differ only in the sharding dims, and
    together hold one full copy.  One sharding dim reuses ``mesh.get_group(dim)``;
    several get a group created once per distinct rank set and cached.  That
    creation is collective over the default group (every rank calls this with the
    same placements and mesh, as with ``init_device_mesh``).
    """
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"construct_shard_mesh: {len(placements)} placements for a {mesh.ndim}-D mesh"
        )
    dims = check_placements(placements, None)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(
            f"construct_shard_mesh: rank {dist.get_rank()} is not part of the mesh {mesh}"
        )
    coordinate = tuple(int(c) for c in coordinate)
    shard_mesh_dims = tuple(m for m, d in enumerate(dims) if d is not None)
    members = member_coordinates(mesh.mesh.cpu(), coordinate, shard_mesh_dims)

    if not shard_mesh_dims:
        group, ranks = None, (dist.get_rank(),)
    else:
        if len(shard_mesh_dims) == 1:
            group = mesh.get_group(shard_mesh_dims[0])
        else:
            grid = MeshGrid.of(mesh)
            create_collectively([tuple(sorted(s)) for s in grid.partition(shard_mesh_dims)
                                 if 1 < len(s) < dist.get_world_size()])
            group = group_for(list(members))
        ranks = tuple(dist.get_process_group_ranks(group))
        if sorted(ranks) != sorted(members):
            raise RuntimeError(
                f"construct_shard_mesh: group ranks {ranks} differ from the mesh's {sorted(members)}"
            )
    return ShardGroup(
        group=group,
        shard_mesh_dims=shard_mesh_dims,
        ranks=ranks,
        coordinates=tuple(members[r] for r in ranks),
        my_index=ranks.index(dist.get_rank()),
        mesh_shape=tuple(int(s) for s in mesh.shape),
        placements=placements,
    )


def _full_placements(shard_mesh: ShardGroup, shard_placements: Sequence[Placement]) -> tuple:
    """Accept placements for the full mesh or for the shard dims only."""
    shard_placements = tuple(shard_placements)
    if len(shard_placements) == len(shard_mesh.mesh_shape):
        return shard_placements
    if len(shard_placements) == len(shard_mesh.shard_mesh_dims):
        full: list[Placement] = [Replicate()] * len(shard_mesh.mesh_shape)
        for m, p in zip(shard_mesh.shard_mesh_dims, shard_placements):
            full[m] = p
        return tuple(full)
    raise ValueError(
        f"shard_placements {shard_placements} must have one entry per mesh dim "
        f"({len(shard_mesh.mesh_shape)}) or per sharding mesh dim ({len(shard_mesh.shard_mesh_dims)})"
    )


def get_slices_of_dtensor(
    target: torch.Tensor,
    local_rank: int,
    shard_mesh: ShardGroup,
    shard_placements: Sequence[Placement] | None = None,
) -> tuple:
    """Indexer selecting, from a full tensor shaped like ``target``, the block that
    member ``local_rank`` of ``shard_mesh`` holds (its position in ``ranks``).

    Works as ``full[result]`` and ``full[result] = local_block`` for slices and index
    tensors alike.  ``shard_placements`` defaults to ``shard_mesh.placements``.
    """
    if not 0 <= local_rank < shard_mesh.size:
        raise ValueError(f"local_rank {local_rank} outside a shard group of {shard_mesh.size}")
    placements = shard_mesh.placements if shard_placements is None else _full_placements(
        shard_mesh, shard_placements
    )
    shape = target.shape  # a DTensor's shape is its global shape
    return as_indexer(
        local_indices(shape, shard_mesh.mesh_shape, placements, shard_mesh.coordinates[local_rank])
    )


def numel_for_member(
    target: torch.Tensor,
    local_rank: int,
    shard_mesh: ShardGroup,
    shard_placements: Sequence[Placement] | None = None,
) -> int:
    """Elements held by member ``local_rank`` of ``shard_mesh`` (same arguments as
    :func:`get_slices_of_dtensor`)."""
    placements = shard_mesh.placements if shard_placements is None else _full_placements(
        shard_mesh, shard_placements
    )
    return numel_for_rank(
        target.shape, shard_mesh.mesh_shape, placements, shard_mesh.coordinates[local_rank]
    )


def dtensor_local_indices(param: DTensor) -> tuple[Index, ...]:
    """Global indices of ``param``'s local tensor on this rank."""
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the DTensor's mesh")
    return local_indices(param.shape, param.device_mesh.shape, param.placements, coordinate)
