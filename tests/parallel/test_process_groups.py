"""Process groups are created collectively, once, in the same order on every rank.

With NCCL and a device-bound default group, torch creates a subgroup by splitting the
world communicator, which needs every rank of the world: a group created lazily inside
``step()``, or with ``use_local_synchronization=True``, by only the ranks that need it,
hangs when ranks need different groups (HSDP replicas, pipeline stages, expert vs dense
meshes).  These tests record every ``new_group`` call on 8 gloo ranks whose shard and
replica groups differ between ranks, and check that every rank made the same calls, in
the same order, all while building the optimizer, none with local synchronisation; and
that the results equal single-device Muon.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_cases import build_groups, make_case_tensors, parse_placement, run_reference, to_dtensor
from harness import run_ranks

ATOL, RTOL = 2e-6, 1e-5
STEPS = 3

# Dense weights on a (replicate, shard, tp) mesh: the shard group (dims 1, 2) is {0..3} on
# ranks 0-3 and {4..7} on ranks 4-7; replica groups {r, r+4}.  Expert weights on an
# (efsdp, ep) mesh of another shape.  Some replicated weights over two dims.
DENSE = [
    ("layers.0.attention.wq.weight", (16, 12), ["R", "SS0/2", "S0"]),
    ("layers.0.attention.wk.weight", (8, 12), ["R", "SS0/2", "S0"]),
    ("layers.0.attention.wo.weight", (12, 16), ["R", "S0", "S1"]),
    ("layers.0.ffn.w1.weight", (9, 6), ["S0", "R", "R"]),  # replica group spans two dims
    ("layers.0.ffn.w2.weight", (6, 9), ["R", "R", "S1"]),
]
EXPERTS = [
    ("layers.0.moe.w1", (8, 12, 16), ["S1", "S0"]),  # experts over ep, rows over efsdp
    ("layers.0.moe.w2", (8, 16, 12), ["R", "S0"]),  # replicated over efsdp
]


def _record(rank, world_size, split, ns_split="never"):
    from optimizer import Muon
    from optimizer.distributed import groups
    from torch.distributed.device_mesh import init_device_mesh

    dense_mesh = init_device_mesh("cpu", (2, 2, 2))
    expert_mesh = init_device_mesh("cpu", (4, 2))
    calls = []
    real = dist.new_group

    def recording(ranks=None, *args, **kwargs):
        calls.append((tuple(ranks) if ranks is not None else None, bool(kwargs.get("use_local_synchronization"))))
        return real(ranks, *args, **kwargs)

    dist.new_group = recording
    try:
        specs = DENSE + EXPERTS
        params, grads = make_case_tensors(specs, STEPS)
        named = []
        for n, _, pl in specs:
            mesh = dense_mesh if len(pl) == 3 else expert_mesh
            named.append((n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl]))))
        opt = Muon(build_groups(named), lr=0.02, weight_decay=0.1, momentum=0.95, replica_split=split,
                   ns_split=ns_split)
        at_construction = list(calls)
        for s in range(STEPS):
            for n, p in named:
                p.grad = to_dtensor(grads[s][n], p.device_mesh, p.placements)
            opt.step()
    finally:
        dist.new_group = real
    return at_construction, calls[len(at_construction):], {n: p.full_tensor() for n, p in named}, \
        list(groups.CREATION_LOG), opt.last_step_stats.split_units


def test_groups_created_collectively_at_construction_and_never_in_step():
    want = run_reference(DENSE + EXPERTS, STEPS, qk=False)
    for split, ns_split in (("always", "never"), ("never", "never"), ("always", "always")):
        results = run_ranks(_record, 8, split, ns_split, timeout=120)
        first_construction = results[0][0]
        assert first_construction, "multi-dim shard and replica groups need new groups"
        # ns_split: matrices cut over their shard groups, whose groups were made at construction too
        assert (sum(r[4] for r in results) > 0) == (ns_split == "always")
        for at_construction, in_steps, fulls, log, _ in results:
            assert at_construction == first_construction  # same calls, same order, on every rank
            assert in_steps == []  # nothing created during any step
            assert not any(local for _, local in at_construction)
            assert [r for r, _ in at_construction] == log
            for n, ref in want.items():
                torch.testing.assert_close(fulls[n], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{split} {n}: {m}")
        # Members and non-members alike created both replicas' shard groups.
        assert ((0, 1, 2, 3), False) in first_construction and ((4, 5, 6, 7), False) in first_construction


def _lazy_style(rank, world_size):
    """What the old code did: only the members create a group, with local synchronisation."""
    from optimizer.distributed import groups

    needed = [(0, 1, 2, 3)] if rank < 4 else [(4, 5, 6, 7)]
    calls = []
    real = dist.new_group

    def recording(ranks=None, *args, **kwargs):
        calls.append(tuple(ranks))
        return real(ranks, *args, **kwargs)

    dist.new_group = recording
    try:
        groups.create_collectively(needed)  # exchanges the lists: every rank creates both
    finally:
        dist.new_group = real
    return calls


def test_ranks_needing_different_groups_still_create_the_same_ones():
    results = run_ranks(_lazy_style, 8, timeout=60)
    assert all(calls == [(0, 1, 2, 3), (4, 5, 6, 7)] for calls in results), results


# ------------------------------------------------ ns_split's groups at 1,024 ranks (fake process group)


def _fake_world(world: int, rank: int, monkeypatch):
    """One rank of a fake world of ``world`` ranks: world / 8 [64, 512] FSDP matrices (fewer than
    ranks) and a link so fast that "auto" cuts them as far as it may (k = 8, one node): every
    rank owns one block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from optimizer import Muon
    from optimizer.parallel.planning import plan_inputs
    from optimizer.distributed.placements import local_indices
    from optimizer.parallel.planning.cut_hardware import SplitHardware

    free = SplitHardware("test: free communication", 1e12, 1e12, 1e18, 1e-12, torch.float32)
    monkeypatch.setattr(plan_inputs, "split_hardware", lambda device: free)
    real_all_reduce, real_new_group = dist.all_reduce, dist.new_group

    def agreed(t, op=dist.ReduceOp.SUM, group=None, async_op=False):  # the fake group moves no data:
        work = real_all_reduce(t, op=op, group=group, async_op=async_op)  # the agreement's sum is world x ours
        if op == dist.ReduceOp.SUM and (group is None or group is dist.group.WORLD):
            t.mul_(dist.get_world_size())
        return work

    calls = []

    def recording(ranks=None, *args, **kwargs):
        calls.append(tuple(ranks))
        return real_new_group(ranks, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", agreed)
    monkeypatch.setattr(dist, "new_group", recording)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))

        def dtensor(shape):
            ix = local_indices(shape, (world,), (Shard(0),), mesh.get_coordinate())
            local = torch.zeros(tuple(len(range(i.start, i.stop)) for i in ix))
            return DTensor.from_local(local, mesh, (Shard(0),), run_check=False, shape=torch.Size(shape),
                                      stride=(shape[1], 1))

        params = [torch.nn.Parameter(dtensor((64, 512))) for _ in range(max(2, world // 8))]
        opt = Muon([{"params": params, "use_muon": True}], lr=0.02)
        at_construction = list(calls)
        for _ in range(2):
            for p in params:
                p.grad = dtensor((64, 512))
            opt.step()
        owned = [o.split.ranks for c in opt._cached_context.plan.chunks for o in c.owned if o.split is not None]
        return at_construction, calls[len(at_construction):], opt.last_step_stats.split_units, owned
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, rank", [(8, 3), (1024, 5), (1024, 1023)])
def test_split_groups_at_1024_ranks_are_made_once_at_construction(world, rank, monkeypatch):
    """ns_split="auto" at 1,024 ranks: every aligned block of 2, 4 and 8 consecutive ranks, made
    at construction (896 communicators in the world; 3 per rank), none in step(); the block this
    rank orthogonalises runs on one of them."""
    at_construction, in_steps, split_units, owned = _fake_world(world, rank, monkeypatch)
    want = sorted(tuple(range(s, s + k)) for k in (2, 4, 8) if k < world for s in range(0, world, k))
    assert at_construction == want
    assert len(want) == {8: 6, 1024: 896}[world]
    assert sum(rank in s for s in want) == (3 if world > 8 else 2)
    assert in_steps == []
    assert split_units == 1 and len(owned) == 1 and rank in owned[0]
    assert owned[0] in want or len(owned[0]) == world
