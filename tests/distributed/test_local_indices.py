"""The contract of the pure index math (no process group needed), and the torch 2.13
uneven _StridedShard discrepancy, pinned down against DTensor.

References here are independent of the code under test: nested ``torch.chunk`` on
real tensors, DTensor's own documented examples, and brute-force loops.
"""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch
import torch._dynamo  # noqa: F401  imported once here so forked ranks do not each pay ~4 s for it

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from harness import run_ranks
from strided_layouts import make_dtensor
from optimizer.distributed.placements import (
    as_indexer,
    is_shard,
    local_indices,
    numel_for_rank,
    numel_of_indices,
)


def SS(dim, sf):
    return _StridedShard(dim, split_factor=sf)


def chunk(t: torch.Tensor, k: int, c: int) -> torch.Tensor:
    """torch.chunk's c-th of k chunks, empty where torch.chunk returns fewer."""
    pieces = torch.chunk(t, k)
    return pieces[c] if c < len(pieces) else t[:0]


def as_list(idx, n):
    return list(range(n))[idx] if isinstance(idx, slice) else idx.tolist()


# ---------------------------------------------------------------------------
# Shape of the result
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [8, 9, 3, 0])
def test_shard_gives_slices_following_torch_chunk(n):
    for c in range(4):
        (rows, cols) = local_indices((n, 5), (4,), [Shard(0)], (c,))
        assert isinstance(rows, slice) and rows.step in (None, 1)
        assert as_list(rows, n) == chunk(torch.arange(n), 4, c).tolist()
        assert cols == slice(0, 5)


def test_strided_shard_on_its_own_mesh_dim_gives_long_indices():
    # DTensor's documented example (_StridedShard._to_replicate_tensor docstring):
    # 9 rows, _StridedShard(0, split_factor=2) over 4 ranks.
    expected = [[0, 1, 5], [2, 3, 6], [4, 7], [8]]
    for c, rows in enumerate(expected):
        idx = local_indices((9, 2), (4,), [SS(0, 2)], (c,))
        if len(rows) > 1:
            assert isinstance(idx[0], torch.Tensor) and idx[0].dtype == torch.long
        assert as_list(idx[0], 9) == rows
        assert idx[1] == slice(0, 2)
    assert local_indices((9,), (4,), [SS(0, 2)], (3,)) == (slice(8, 9),)  # normalised


def test_fsdp_over_tp_blocks_are_contiguous_slices():
    # (dp_shard=4, tp=2), (_StridedShard(0, sf=2), Shard(0)): TP chunks rows first,
    # FSDP chunks each TP piece, so every rank holds one contiguous block.
    for n in (16, 9, 5):
        for dp, tp in itertools.product(range(4), range(2)):
            (rows,) = local_indices((n,), (4, 2), [SS(0, 2), Shard(0)], (dp, tp))
            assert isinstance(rows, slice)
            expected = chunk(chunk(torch.arange(n), 2, tp), 4, dp)
            assert as_list(rows, n) == expected.tolist()


def test_shard_order_example_from_dtensor_docs_and_a_4d_mesh():
    # DTensorSpec._convert_shard_order_to_StridedShard's example: mesh (4, 3, 2),
    # tensor dim 0 sharded by mesh dims 2, then 0, then 1.
    mesh = (4, 3, 2)
    placements = [SS(0, 2), SS(0, 2), Shard(0)]
    for n in (24, 29, 7):
        for c in itertools.product(*map(range, mesh)):
            ref = chunk(chunk(chunk(torch.arange(n), 2, c[2]), 4, c[0]), 3, c[1])
            assert as_list(local_indices((n,), mesh, placements, c)[0], n) == ref.tolist()

    # 4-D mesh: dim 0 sharded by mesh dims (3, 1), dim 1 by (2, 0), uneven sizes.
    mesh = (2, 3, 2, 2)
    placements = [SS(1, 2), SS(0, 2), Shard(1), Shard(0)]
    for c in itertools.product(*map(range, mesh)):
        rows = chunk(chunk(torch.arange(11), 2, c[3]), 3, c[1])
        cols = chunk(chunk(torch.arange(7), 2, c[2]), 2, c[0])
        idx = local_indices((11, 7), mesh, placements, c)
        assert as_list(idx[0], 11) == rows.tolist()
        assert as_list(idx[1], 7) == cols.tolist()


def test_plain_shards_apply_left_to_right_on_a_4d_mesh_with_3d_tensor():
    mesh = (2, 2, 3, 2)
    placements = [Shard(1), Replicate(), Shard(1), Shard(-1)]
    full = torch.arange(3 * 10 * 5).reshape(3, 10, 5)
    for c in itertools.product(*map(range, mesh)):
        ref = full
        for m, p in enumerate(placements):
            if isinstance(p, Shard):
                d = p.dim % 3
                pieces = torch.chunk(ref, mesh[m], dim=d)
                ref = pieces[c[m]] if c[m] < len(pieces) else ref.narrow(d, 0, 0)
        idx = local_indices(full.shape, mesh, placements, c)
        assert torch.equal(full[as_indexer(idx)], ref)
        assert numel_for_rank(full.shape, mesh, placements, c) == ref.numel()


# ---------------------------------------------------------------------------
# as_indexer: outer-product indexing, also for reads and writes
# ---------------------------------------------------------------------------


def test_as_indexer_with_several_index_tensors_selects_the_block():
    full = torch.arange(6 * 5 * 4).reshape(6, 5, 4)
    idx = (torch.tensor([4, 0, 5]), slice(1, 4), torch.tensor([3, 1]))
    ix = as_indexer(idx)
    block = full[ix]
    assert block.shape == (3, 3, 2)
    for a, i in enumerate([4, 0, 5]):
        for b, j in enumerate(range(1, 4)):
            for c, k in enumerate([3, 1]):
                assert block[a, b, c] == full[i, j, k]
    target = torch.zeros_like(full)
    target[ix] = block
    assert torch.equal(target[ix], block)
    assert int((target != 0).sum()) == int((block != 0).sum())


def test_as_indexer_with_one_index_tensor_keeps_dim_order():
    full = torch.arange(4 * 6).reshape(4, 6)
    idx = (slice(1, 3), torch.tensor([5, 0, 2]))
    block = full[as_indexer(idx)]
    assert torch.equal(block, torch.stack([full[1, [5, 0, 2]], full[2, [5, 0, 2]]]))


def test_numel_of_indices_counts_both_kinds():
    assert numel_of_indices((slice(2, 5), torch.tensor([1, 7]))) == 6
    assert numel_of_indices((slice(3, 3), slice(0, 4))) == 0


# ---------------------------------------------------------------------------
# Errors and predicates
# ---------------------------------------------------------------------------


def test_partial_is_rejected_with_advice():
    with pytest.raises(ValueError, match=r"placements\[1\].*Partial.*[Rr]educe"):
        local_indices((4, 4), (2, 2), [Shard(0), Partial()], (0, 0))


@pytest.mark.parametrize(
    "args, match",
    [
        (((4,), (2, 2), [Shard(0)], (0, 0)), "one placement and one coordinate"),
        (((4,), (2,), [Shard(0)], (2,)), r"coordinate\[0\]"),
        (((4,), (2,), [Shard(1)], (0,)), r"placements\[0\].*dim 1.*1 dims"),
        (((-1,), (2,), [Shard(0)], (0,)), "negative"),
    ],
)
def test_bad_input_names_the_problem(args, match):
    with pytest.raises(ValueError, match=match):
        local_indices(*args)


def test_is_shard_accepts_both_shard_kinds():
    assert is_shard(Shard(0)) and is_shard(SS(1, 2))
    assert not is_shard(Replicate()) and not is_shard(Partial())


# ---------------------------------------------------------------------------
# Against DTensor: the uneven _StridedShard discrepancy in torch 2.13
# ---------------------------------------------------------------------------


def _nine_rows(rank, world_size):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
    placements = (SS(0, 2), Shard(0))
    full = torch.arange(9.0)
    # Build it as training does: redistribute from a replicated tensor.
    dt = distribute_tensor(full, mesh, [Replicate(), Replicate()]).redistribute(mesh, placements)
    coord = mesh.get_coordinate()
    idx = local_indices((9,), (4, 2), placements, coord)
    shape, offset = compute_local_shape_and_global_offset((9,), mesh, placements)
    return {
        "coord": tuple(coord),
        "local": dt.to_local().tolist(),
        "ours": full[as_indexer(idx)].tolist(),
        "round_trip": torch.equal(dt.full_tensor(), full),
        "clsgo_rows": list(range(offset[0], offset[0] + shape[0])),
    }


def test_uneven_strided_follows_full_tensor_not_compute_local_shape():
    results = run_ranks(_nine_rows, 8, timeout=120)
    by_coord = {r["coord"]: r for r in results}
    for r in results:
        assert r["local"] == r["ours"], r
        assert r["round_trip"], r
    # FSDP2 over TP: TP holds rows [0:5] and [5:9]; FSDP splits each over dp_shard.
    assert by_coord[(3, 0)]["local"] == []
    assert by_coord[(3, 1)]["local"] == [8.0]
    assert by_coord[(0, 1)]["local"] == [5.0]
    if torch.__version__.startswith("2.13"):
        # Documented discrepancy: compute_local_shape_and_global_offset reads the
        # placements left to right and puts row 8 on (3, 0), unlike full_tensor().
        assert by_coord[(3, 0)]["clsgo_rows"] == [8]
        assert by_coord[(3, 1)]["clsgo_rows"] == []


def _own_dim_stacks(rank, world_size, cases):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    out = []
    for shape, placements in cases:
        full = torch.arange(float(math.prod(shape))).reshape(shape)
        # redistribute's blocks; where this release refuses the placements (2.10, 2.11), the blocks
        # strided_layouts cuts (checked against redistribute's in test_strided_layouts.py)
        dt = make_dtensor(full, mesh, placements)
        idx = local_indices(shape, (2, 2), placements, mesh.get_coordinate())
        out.append(torch.equal(dt.to_local(), full[as_indexer(idx)]))
    return out


def test_strided_shards_that_encode_no_shard_order_match_redistribute():
    # Split factors that match no shard order: each _StridedShard acts on its own
    # mesh dim.  torch 2.13's full_tensor() cannot rebuild these stacks, but the
    # blocks redistribute hands out are the ones we compute (torch 2.10 and 2.11 refuse them).
    cases = [
        ((9, 3), (SS(0, 2), SS(0, 2))),
        ((8, 4), (SS(0, 3), SS(0, 2))),
        ((9, 3), (SS(0, 3), Shard(0))),
        ((8, 6), (Shard(1), SS(1, 3))),
    ]
    results = run_ranks(_own_dim_stacks, 4, cases, timeout=120)
    assert all(all(r) for r in results), results
