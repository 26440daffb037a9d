"""construct_shard_mesh: who is in a shard group, in what order, and that groups
are created once.  Membership is checked against a brute-force scan of the mesh's
rank tensor; order against an all_gather over the group itself; the whole thing
end to end by rebuilding DTensors from gathered blocks (DTensor is the reference).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch._dynamo  # noqa: F401  imported once here so forked ranks do not each pay ~4 s for it
import torch.distributed as dist

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from harness import run_ranks
from strided_layouts import make_dtensor
from optimizer.distributed.shard_groups import (
    construct_shard_mesh,
    get_slices_of_dtensor,
    member_coordinates,
    num_cached_groups,
    numel_for_member,
)


def SS(dim, sf):
    return _StridedShard(dim, split_factor=sf)


def _expected_members(mesh, placements):
    """Brute force: ranks whose coordinates equal mine outside the sharding dims."""
    ranks = mesh.mesh
    me = dist.get_rank()
    mine = [int(x) for x in (ranks == me).nonzero()[0]]
    shard_dims = [m for m, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard))]
    out = {}
    for r in ranks.reshape(-1).tolist():
        c = [int(x) for x in (ranks == r).nonzero()[0]]
        if all(c[m] == mine[m] for m in range(ranks.dim()) if m not in shard_dims):
            out[r] = tuple(c)
    return out


def _gather_rebuild(dt, sg, shape):
    """Gather every member's local block over sg.group; place them with our indices."""
    local = dt.to_local()
    pad = max(numel_for_member(dt, i, sg) for i in range(sg.size))
    send = torch.zeros(pad)
    send[: local.numel()] = local.reshape(-1)
    recv = [send] if sg.group is None else [torch.empty(pad) for _ in sg.ranks]
    if sg.group is not None:
        dist.all_gather(recv, send, group=sg.group)
    rebuilt = torch.full(shape, float("nan"))
    for member, buf in enumerate(recv):
        ix = get_slices_of_dtensor(dt, member, sg)
        n = rebuilt[ix].numel()
        rebuilt[ix] = buf[:n].reshape(rebuilt[ix].shape)
    return rebuilt


PLACEMENTS_3D = [
    (Replicate(), Replicate(), Replicate()),
    (Shard(0), Replicate(), Replicate()),
    (Replicate(), SS(0, 2), Shard(0)),
    (Replicate(), Shard(0), Shard(1)),
    (Shard(1), Replicate(), Shard(0)),
    (Shard(0), Shard(0), Shard(1)),
    (SS(0, 4), Shard(0), Shard(0)),
]


def _membership_and_caching(rank, world_size):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_rep", "dp_shard", "tp"))
    problems = []
    cached_after_first_step = None
    for step in range(3):  # the optimizer calls this every step
        for placements in PLACEMENTS_3D:
            sg = construct_shard_mesh(placements, mesh)
            expected = _expected_members(mesh, placements)
            shard_dims = tuple(m for m, p in enumerate(placements) if not isinstance(p, Replicate))
            if sg.shard_mesh_dims != shard_dims:
                problems.append(f"{placements}: shard dims {sg.shard_mesh_dims}")
            if dict(zip(sg.ranks, sg.coordinates)) != expected:
                problems.append(f"{placements}: members {sg.ranks} {sg.coordinates} vs {expected}")
            if sg.ranks[sg.my_index] != rank:
                problems.append(f"{placements}: my_index {sg.my_index}")
            if not shard_dims:
                if sg.group is not None:
                    problems.append(f"{placements}: expected no group")
                continue
            if len(shard_dims) == 1 and sg.group is not mesh.get_group(shard_dims[0]):
                problems.append(f"{placements}: single dim should reuse the mesh's group")
            # ranks are in group order: gather everyone's rank over the group
            got = [torch.zeros(1, dtype=torch.int64) for _ in sg.ranks]
            dist.all_gather(got, torch.tensor([rank]), group=sg.group)
            if tuple(int(g) for g in got) != sg.ranks:
                problems.append(f"{placements}: group order {got} vs {sg.ranks}")
        if step == 0:
            cached_after_first_step = num_cached_groups()
    # Same member set, different placements: one cached group, not two.
    a = construct_shard_mesh((Replicate(), SS(0, 2), Shard(0)), mesh)
    b = construct_shard_mesh((Replicate(), Shard(0), Shard(1)), mesh)
    if a.group is not b.group:
        problems.append("same ranks should share the cached group")
    return problems, cached_after_first_step, num_cached_groups()


def test_members_order_and_group_caching():
    results = run_ranks(_membership_and_caching, 8, timeout=120)
    for problems, first, last in results:
        assert not problems, "\n".join(problems)
        # Multi-dim shard dims here: {1,2} and {0,2}, each partitioning the 8 ranks into two
        # sets of 4; {0,1,2} is the whole world (WORLD, nothing created).  Every rank creates
        # every set, members or not (collective creation): 4 groups on every rank.
        assert first == 4
        assert last == first  # nothing new after the first step


def _permuted_mesh_round_trip(rank, world_size):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # Ranks laid out in reverse, so group order (sorted ranks) differs from mesh order.
    mesh = DeviceMesh("cpu", torch.tensor([[3, 2], [1, 0]]), mesh_dim_names=("dp", "tp"))
    problems = []
    cases = [
        ((9, 5), (Shard(0), Shard(1))),
        ((9, 5), (SS(0, 2), Shard(0))),
        ((7, 6), (Replicate(), Shard(1))),
        ((7, 6), (Shard(1), Replicate())),
        ((5, 3), (Replicate(), Replicate())),
        ((11,), (SS(0, 3), Replicate())),
    ]
    for shape, placements in cases:
        full = torch.arange(float(math.prod(shape))).reshape(shape)
        dt = make_dtensor(full, mesh, placements)  # redistribute, or (2.10, 2.11 refuse SS(0, 3)) cut
        sg = construct_shard_mesh(dt.placements, mesh)
        if not torch.equal(_gather_rebuild(dt, sg, shape), full):
            problems.append(f"gather rebuild failed for {shape} {placements}")
        # shard-dim-only placements address the same blocks
        short = tuple(p for p in placements if not isinstance(p, Replicate))
        for i in range(sg.size):
            if short and full[get_slices_of_dtensor(dt, i, sg, short)].tolist() != full[
                get_slices_of_dtensor(dt, i, sg, placements)
            ].tolist():
                problems.append(f"short placements disagree for {shape} {placements}")
    return problems


def test_gather_rebuilds_dtensor_on_a_permuted_mesh():
    for problems in run_ranks(_permuted_mesh_round_trip, 4, timeout=120):
        assert not problems, "\n".join(problems)


def _partial_rejected(rank, world_size):
    mesh = init_device_mesh("cpu", (2,))
    try:
        construct_shard_mesh((Partial(),), mesh)
    except ValueError as e:
        return str(e)
    return None


def test_partial_is_rejected_with_advice():
    for msg in run_ranks(_partial_rejected, 2, timeout=60):
        assert msg is not None and "Partial" in msg and "Reduce the gradient" in msg


def test_member_coordinates_from_rank_tensor():
    ranks = torch.arange(12).reshape(2, 3, 2)
    got = member_coordinates(ranks, (1, 2, 0), (1,))
    assert got == {6: (1, 0, 0), 8: (1, 1, 0), 10: (1, 2, 0)}
    assert member_coordinates(ranks, (0, 1, 1), ()) == {3: (0, 1, 1)}


@pytest.mark.parametrize("bad", [(Shard(0),), (Shard(0), Shard(1), Shard(0))])
def test_placement_count_must_match_mesh(bad):
    class FakeMesh:  # only .ndim is read before the check
        ndim = 2

    with pytest.raises(ValueError, match="2-D mesh"):
        construct_shard_mesh(bad, FakeMesh())
