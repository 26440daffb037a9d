"""The test helpers that build strided layouts on every release (``tests/strided_layouts.py``)
against DTensor itself: the blocks ``cut_local`` cuts are the ones DTensor's ``redistribute``
hands out, DTensor's ``full_tensor()`` reconstructs a DTensor built from them with
``from_local``, and the fallback gather of ``full_of`` equals ``full_tensor()`` — on the releases
whose DTensor builds these placements (2.8, 2.13, 2.15).  Where DTensor refuses them (2.10, 2.11), the
test says so, and checks what is left: the cut blocks tile the tensor (every element on exactly
one member of each shard group, as the gather puts it back) and ``make_dtensor`` and ``full_of``
round-trip.  Values encode their global position, so a misplaced element is seen.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch._dynamo  # noqa: F401  imported once here so forked ranks do not each pay ~4 s for it
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import strided_layouts
from harness import run_ranks
from strided_layouts import cut_local, full_of, make_dtensor


def SS(dim, sf):
    return _StridedShard(dim, split_factor=sf)


# _StridedShard placements that encode no shard order (the ones 2.10 and 2.11 refuse), as the parallel,
# checkpoint and QK-clip tests use them: even and uneven sizes, 2-D and 3-D, each mesh shape.
CASES = {
    (2,): [((16, 12), (SS(0, 2),)), ((7, 5), (SS(0, 2),)), ((6, 9), (SS(1, 3),)), ((3, 9, 5), (SS(1, 2),))],
    (4,): [((9, 4), (SS(0, 2),)), ((10, 3), (SS(0, 3),))],
    (2, 2): [((16, 12), (Shard(0), SS(0, 2))), ((8, 12), (Replicate(), SS(0, 2))), ((9, 16, 12), (SS(0, 2), Shard(1))),
             ((10, 6), (SS(1, 2), Shard(0))), ((11, 7), (Shard(1), SS(0, 3)))],
    (2, 2, 2): [((9, 6), (Replicate(), SS(0, 2), Shard(1))), ((12, 8), (SS(1, 2), Replicate(), SS(0, 2)))],
}


# Stacks of _StridedShards on one tensor dim that encode no shard order (test_local_indices.py):
# DTensor's full_tensor() does not rebuild these (2.13), so only its blocks are compared.
STACKS = [((9, 3), (SS(0, 2), SS(0, 2))), ((8, 4), (SS(0, 3), SS(0, 2))), ((9, 3), (SS(0, 3), Shard(0))),
          ((8, 6), (Shard(1), SS(1, 3)))]


def _refuses(mesh, placements) -> bool:
    """Does this release's DTensor refuse to redistribute ``placements``?  Asked of DTensor."""
    probe = distribute_tensor(torch.zeros(4 * mesh.size(), 4 * mesh.size()), mesh, [Replicate()] * mesh.ndim)
    try:
        probe.redistribute(mesh, placements)
        return False
    except strided_layouts.REFUSALS as err:
        assert strided_layouts._refused(err, placements), repr(err)  # refused for the reason the helpers expect
        return True


def _check(rank, world_size, mesh_shape, cases):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    out = []
    for shape, placements in cases:
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        what = f"{shape} {placements} at {coord}"
        mine = cut_local(full, mesh_shape, placements, coord)
        built = make_dtensor(full, mesh, placements)
        assert isinstance(built, DTensor) and tuple(built.placements) == placements, what
        assert torch.equal(built.to_local(), mine), f"make_dtensor's block is not cut_local's: {what}"
        assert torch.equal(full_of(built), full), f"full_of(make_dtensor(full)) is not full: {what}"
        # every element is on exactly one member of its shard group: gathering the blocks of the
        # ranks that differ from this one only on sharding mesh dims covers the tensor once
        seen = torch.zeros(shape, dtype=torch.int64)
        shard_dims = [m for m, p in enumerate(placements) if not isinstance(p, Replicate)]
        for other in _group_coords(mesh_shape, coord, shard_dims):
            where = cut_local(full, mesh_shape, placements, other).long().reshape(-1)
            seen.view(-1)[where] += 1
        assert torch.equal(seen, torch.ones_like(seen)), f"the shard group's blocks do not tile the tensor: {what}"
        refused = _refuses(mesh, placements)
        if not refused:  # DTensor is the reference: its blocks, its reconstruction
            by_dtensor = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, placements)
            assert torch.equal(by_dtensor.to_local(), mine), f"cut_local differs from redistribute: {what}"
            from_cut = DTensor.from_local(mine, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
            assert torch.equal(from_cut.full_tensor(), full), f"full_tensor() of the cut blocks is not full: {what}"
            assert torch.equal(_gathered(from_cut), full), f"the fallback gather differs from full_tensor(): {what}"
        out.append(refused)
    return out


def _group_coords(mesh_shape, coord, dims):
    coords = [tuple(coord)]
    for m in dims:
        coords = [c[:m] + (i,) + c[m + 1:] for c in coords for i in range(mesh_shape[m])]
    return coords


def _gathered(dt):
    """``full_of``'s gather, asked for even where ``full_tensor()`` works (to compare the two)."""
    original = DTensor.full_tensor

    def refuse(self, *args, **kwargs):
        raise ValueError("refused for the test: unable to be interpreted into a corresponding shard_order")

    DTensor.full_tensor = refuse
    try:
        return full_of(dt)
    finally:
        DTensor.full_tensor = original


def _check_stacks(rank, world_size, cases):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh("cpu", (2, 2))
    coord = mesh.get_coordinate()
    refused = []
    for shape, placements in cases:
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        mine = cut_local(full, (2, 2), placements, coord)
        assert torch.equal(make_dtensor(full, mesh, placements).to_local(), mine), (shape, placements)
        refused.append(_refuses(mesh, placements))
        if not refused[-1]:
            by_dtensor = distribute_tensor(full, mesh, [Replicate()] * 2).redistribute(mesh, placements)
            assert torch.equal(by_dtensor.to_local(), mine), f"cut_local differs from redistribute: {shape} {placements}"
    return refused


def test_cut_blocks_of_strided_stacks_are_dtensors_own():
    refused = run_ranks(_check_stacks, 4, STACKS, timeout=120)
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version in ((2, 10), (2, 11)):
        assert all(refused[0]), f"torch {version} refuses these placements: the fallback is what is tested here"
    elif version in ((2, 13), (2, 15)):
        assert not any(refused[0]), "this release builds these placements: DTensor is the reference"


@pytest.mark.parametrize("mesh_shape", list(CASES), ids=lambda m: "x".join(map(str, m)))
def test_cut_blocks_are_dtensors_own(mesh_shape):
    refused = run_ranks(_check, math.prod(mesh_shape), mesh_shape, CASES[mesh_shape], timeout=120)
    assert all(r == refused[0] for r in refused), refused  # every rank saw the same DTensor
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version in ((2, 10), (2, 11)):
        assert all(refused[0]), f"torch {version} refuses these placements: the fallback is what is tested here"
    elif version in ((2, 13), (2, 15)):
        assert not any(refused[0]), "this release builds these placements: DTensor is the reference"


def test_cut_local_on_documented_examples():
    """Worked by hand: DTensor's docstring example (9 rows, _StridedShard(0, sf=2) on 4 ranks) and
    a plain Shard then a strided split of the piece."""
    rows = torch.arange(9)
    assert [cut_local(rows, (4,), (SS(0, 2),), (c,)).tolist() for c in range(4)] == [[0, 1, 5], [2, 3, 6], [4, 7], [8]]
    rows = torch.arange(12)
    # Shard(0) over 2: [0..5], [6..11]; then sf=2 splits [0..5] into [0,1,2],[3,4,5] and 2 ranks take
    # [0,1] + [3,4] and [2] + [5]
    got = {c: cut_local(rows, (2, 2), (Shard(0), SS(0, 2)), c).tolist() for c in [(0, 0), (0, 1), (1, 0)]}
    assert got == {(0, 0): [0, 1, 3, 4], (0, 1): [2, 5], (1, 0): [6, 7, 9, 10]}


def _torch_210_planner(src_shard_order, dst_shard_order):
    # the assertion torch 2.10's redistribute planner fails for a _StridedShard that encodes no
    # shard order (torch/distributed/tensor/_redistribute.py, _gen_transform_infos_non_cached)
    assert src_shard_order is not None and dst_shard_order is not None


def _some_other_assertion(x):
    assert x is not None


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001  the error itself, with its traceback, is what is tested
        return err
    raise AssertionError(f"{fn.__name__} raised nothing")


def test_only_the_shard_order_refusal_is_stepped_around():
    """The helpers fall back to their own cut only for DTensor's refusal of a _StridedShard it
    cannot read as a shard order (2.11's ValueError, 2.10's failed assertion); any other error, or
    that error for placements without a _StridedShard, is re-raised.  On 2.10 and 2.11 the real
    errors are checked by ``_refuses`` above; this checks the discrimination on every release."""
    strided, plain = (SS(0, 2), Shard(0)), (Shard(0), Replicate())
    value_refusal = ValueError("placements: (...) is unable to be interpreted into a corresponding shard_order")
    assertion_refusal = _raised(_torch_210_planner, None, ())
    assert strided_layouts._refused(value_refusal, strided)
    assert strided_layouts._refused(assertion_refusal, strided)
    assert not strided_layouts._refused(value_refusal, plain)
    assert not strided_layouts._refused(assertion_refusal, plain)
    assert not strided_layouts._refused(ValueError("Shard dim 3 out of range"), strided)
    assert not strided_layouts._refused(_raised(_some_other_assertion, None), strided)
    assert not strided_layouts._refused(AssertionError("no traceback"), strided)
    assert not strided_layouts._refused(RuntimeError("shard_order"), strided)
