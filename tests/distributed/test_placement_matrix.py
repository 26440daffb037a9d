"""local_indices against DTensor itself, over a generated matrix of placements.

For every case we build a DTensor the way training does (``redistribute`` from a
replicated tensor whose values encode their global position) and check, on every
rank, that the local tensor equals ``global[local_indices(...)]``, that
``full_tensor()`` gives the global tensor back, and that gathering the local blocks
over the shard group and placing them with our indices rebuilds it too.  Separately
(pure, in the parent) scattering with the indices and gathering back is the
identity, with every element held by exactly one member of a shard group.

One launch per mesh shape runs all its cases (a launch costs about a second).
"""

from __future__ import annotations

import itertools
import logging
import math
import random

import pytest
import torch
import torch._dynamo  # noqa: F401  imported once here so forked ranks do not each pay ~4 s for it

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard

from harness import run_ranks
from strided_layouts import full_of, make_dtensor
from optimizer.distributed.placements import (
    _shard_order,
    _split_factor,
    as_indexer,
    check_placements,
    local_indices,
    numel_for_rank,
)
from optimizer.distributed.shard_groups import construct_shard_mesh, get_slices_of_dtensor

TENSOR_SHAPES = {
    1: [(8,), (9,), (3,)],
    2: [(8, 4), (9, 6), (5, 3), (2, 7)],
    3: [(4, 6, 8), (3, 5, 7)],
}

# mesh shape -> how many cases to draw (all of them where there are fewer)
MESHES = {
    (2,): 40,
    (4,): 40,
    (8,): 40,
    (2, 2): 45,
    (4, 2): 40,
    (2, 4): 30,
    (2, 2, 2): 45,
    (2, 1, 2, 2): 30,
}


class _MeshSizes:
    """All that DTensor's shard-order decoder reads from a mesh."""

    def __init__(self, shape):
        self.shape = shape

    def size(self, mesh_dim):
        return self.shape[mesh_dim]


def _non_negative(placements, ndim):
    return tuple(
        _StridedShard(p.dim % ndim, split_factor=p.split_factor) if isinstance(p, _StridedShard)
        else Shard(p.dim % ndim) if isinstance(p, Shard)
        else p
        for p in placements
    )


def _decodable(shape, mesh_shape, placements) -> bool:
    """Does DTensor (torch 2.13) read these placements as a shard order?  Asked of
    DTensor's own decoder, so the test's case categories do not rest on our code."""
    return DTensorSpec._maybe_convert_StridedShard_to_shard_order(
        _non_negative(placements, len(shape)), _MeshSizes(mesh_shape)
    ) is not None


def _dtensor_round_trips(shape, mesh_shape, placements) -> bool:
    """Cases torch 2.13 itself can redistribute and reconstruct.

    When a ``_StridedShard``'s split factor encodes no shard order and another mesh
    dim shards the same tensor dim, ``full_tensor()`` does not give the global tensor
    back (or the ranks' collectives mismatch and abort), so there is no ground truth
    to compare against.  Such placements come from no FSDP2/TP/solver setup.
    """
    if _decodable(shape, mesh_shape, placements):
        return True
    dims = [p.dim % len(shape) if isinstance(p, (Shard, _StridedShard)) else None for p in placements]
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard) and dims.count(dims[m]) > 1:
            return False
    return True


def _options(mesh_shape, ndim):
    # Split factors that encode a shard order (products of other mesh dims' sizes)
    # and one that does not (3: _StridedShard then acts on its own mesh dim).
    sfs = {3}
    for r in range(1, len(mesh_shape)):
        for dims in itertools.combinations(range(len(mesh_shape)), r):
            sfs.add(math.prod(mesh_shape[i] for i in dims))
    sfs.discard(1)
    opts = [Replicate()] + [Shard(d) for d in range(ndim)]
    opts += [_StridedShard(d, split_factor=sf) for d in range(ndim) for sf in sorted(sfs)]
    return opts


def generate_cases(mesh_shape, count, seed=0):
    """Deterministic random sample: a third strided placements that encode a shard
    order, a sixth strided ones acting on their own mesh dim, half without."""
    rng = random.Random(seed)
    shapes = [s for ss in TENSOR_SHAPES.values() for s in ss]
    quota = {"strided-order": count // 3, "strided-own-dim": count // 6}
    quota["plain"] = count - sum(quota.values())
    options = {len(s): _options(mesh_shape, len(s)) for s in shapes}
    cases, seen = [], set()
    for _ in range(50 * count):
        if len(cases) == count:
            break
        shape = rng.choice(shapes)
        pl = tuple(rng.choice(options[len(shape)]) for _ in mesh_shape)
        if (shape, pl) in seen or not _dtensor_round_trips(shape, mesh_shape, pl):
            continue
        if not any(isinstance(p, _StridedShard) for p in pl):
            kind = "plain"
        else:
            kind = "strided-order" if _decodable(shape, mesh_shape, pl) else "strided-own-dim"
        if quota[kind] == 0:
            continue
        quota[kind] -= 1
        seen.add((shape, pl))
        cases.append((shape, pl))
    # Always include plain multi-dim sharding of one tensor dim, and negative dims.
    if len(mesh_shape) >= 2:
        cases.append(((9, 6), tuple(Shard(0) for _ in mesh_shape)))
        cases.append(((9, 6), tuple(Shard(-1) for _ in mesh_shape)))
    return cases


def _check_cases(rank, world_size, mesh_shape, cases):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    failures = []
    for shape, placements in cases:
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        # DTensor's redistribute; for placements this release refuses (2.10, 2.11: a _StridedShard that
        # encodes no shard order) the blocks strided_layouts cuts, read back by its gather
        dt = make_dtensor(full, mesh, placements)
        local = dt.to_local()
        idx = local_indices(shape, mesh_shape, placements, coord)
        what = f"{shape} {placements} at {coord}"
        if any(not isinstance(i, slice) and i.dtype != torch.long for i in idx):
            failures.append(f"non-long index tensor: {what}")
        ours = full[as_indexer(idx)]
        if not torch.equal(local, ours):
            failures.append(f"local block differs: {what}: {local.tolist()} vs {ours.tolist()}")
        if numel_for_rank(shape, mesh_shape, placements, coord) != local.numel():
            failures.append(f"numel differs: {what}")
        if not torch.equal(full_of(dt), full):
            failures.append(f"full_tensor differs: {what}")

        # Gather the local blocks over the shard group and place them with our indices.
        sg = construct_shard_mesh(dt.placements, mesh)
        pad = max(numel_for_rank(shape, mesh_shape, placements, c) for c in sg.coordinates)
        send = torch.zeros(pad)
        send[: local.numel()] = local.reshape(-1)
        if sg.group is None:
            recv = [send]
        else:
            recv = [torch.empty(pad) for _ in sg.ranks]
            torch.distributed.all_gather(recv, send, group=sg.group)
        rebuilt = torch.full(shape, float("nan"))
        for member, buf in enumerate(recv):
            ix = get_slices_of_dtensor(dt, member, sg)
            block_shape = rebuilt[ix].shape
            rebuilt[ix] = buf[: math.prod(block_shape)].reshape(block_shape)
        if not torch.equal(rebuilt, full):
            failures.append(f"gather over shard group differs: {what}")
    return failures


ALL_CASES = {mesh: generate_cases(mesh, count) for mesh, count in MESHES.items()}


def test_matrix_is_large_and_covers_every_kind():
    cases = [(m, c) for m, cs in ALL_CASES.items() for c in cs]
    assert len(cases) >= 200
    kinds = set()
    for mesh_shape, (shape, pl) in cases:
        if any(isinstance(p, _StridedShard) for p in pl):
            kinds.add("strided-decodable" if _decodable(shape, mesh_shape, pl) else "strided-own-dim")
        dims = [p.dim % len(shape) for p in pl if isinstance(p, (Shard, _StridedShard))]
        if len(dims) != len(set(dims)):
            kinds.add("several-mesh-dims-one-tensor-dim")
        if any(isinstance(p, Replicate) for p in pl):
            kinds.add("replicate")
        if any(s % math.prod(mesh_shape) for s in shape):
            kinds.add("uneven")
        kinds.add(f"{len(mesh_shape)}-D mesh")
        kinds.add(f"{len(shape)}-D tensor")
    expected = {
        "strided-decodable", "strided-own-dim", "several-mesh-dims-one-tensor-dim", "replicate",
        "uneven", "1-D mesh", "2-D mesh", "3-D mesh", "4-D mesh", "1-D tensor", "2-D tensor",
        "3-D tensor",
    }
    assert expected <= kinds, expected - kinds


def test_shard_order_decoding_agrees_with_dtensor():
    for mesh_shape, cases in ALL_CASES.items():
        for shape, pl in cases:
            ours = _shard_order(
                check_placements(pl, len(shape)), [_split_factor(p) for p in pl], mesh_shape
            )
            assert (ours is not None) == _decodable(shape, mesh_shape, pl), (mesh_shape, shape, pl)


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=lambda m: "x".join(map(str, m)))
def test_local_indices_match_dtensor(mesh_shape):
    cases = ALL_CASES[mesh_shape]
    results = run_ranks(_check_cases, math.prod(mesh_shape), mesh_shape, cases, timeout=240)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=lambda m: "x".join(map(str, m)))
def test_scatter_then_gather_is_identity(mesh_shape):
    """Pure: every element lands in exactly one member of each shard group, and
    putting every rank's block back rebuilds the tensor."""
    coords = list(itertools.product(*(range(k) for k in mesh_shape)))
    for shape, placements in ALL_CASES[mesh_shape]:
        full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
        shard_dims = [m for m, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard))]
        for fixed in {tuple(c[m] for m in range(len(mesh_shape)) if m not in shard_dims) for c in coords}:
            members = [
                c for c in coords
                if tuple(c[m] for m in range(len(mesh_shape)) if m not in shard_dims) == fixed
            ]
            rebuilt = torch.zeros(shape, dtype=torch.float64)
            hits = torch.zeros(shape, dtype=torch.int64)
            for c in members:
                ix = as_indexer(local_indices(shape, mesh_shape, placements, c))
                block = full[ix]  # scatter
                rebuilt[ix] = block  # gather
                hits[ix] += 1
            assert torch.equal(hits, torch.ones_like(hits)), (shape, placements, fixed)
            assert torch.equal(rebuilt, full), (shape, placements, fixed)
