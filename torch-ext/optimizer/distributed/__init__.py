"""Distributed building blocks, each pure where it can be.

- ``placements``   which global indices each rank holds, from placement semantics alone;
- ``layout``       a DTensor parameter's mesh dims classified for Muon (matrix, batch, replica);
- ``groups``       the process groups parallel Muon needs, created collectively, once;
- ``shard_groups`` a rank's shard group for some placements, and block indexers (helpers);
- ``agreement``    one all-reduce so that every rank takes the same branch of a step.
"""

from .placements import (
    Index,
    as_indexer,
    is_shard,
    is_strided_shard,
    local_indices,
    numel_for_rank,
    numel_of_indices,
)
from .shard_groups import (
    ShardGroup,
    construct_shard_mesh,
    dtensor_local_indices,
    get_slices_of_dtensor,
    member_coordinates,
    num_cached_groups,
    numel_for_member,
)

__all__ = [
    "Index",
    "ShardGroup",
    "as_indexer",
    "construct_shard_mesh",
    "dtensor_local_indices",
    "get_slices_of_dtensor",
    "is_shard",
    "is_strided_shard",
    "local_indices",
    "member_coordinates",
    "num_cached_groups",
    "numel_for_member",
    "numel_for_rank",
    "numel_of_indices",
]
