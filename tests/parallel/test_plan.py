"""The step plan, pure (no process groups): units, owners and every rank's view of a world.

References: FLOPs counted by torch's FlopCounterMode on the real Newton–Schulz, the placement
index math's own statement of which experts a rank holds, and arithmetic done here (coverage,
byte conservation over the world).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.utils.flop_counter import FlopCounterMode

from optimizer.distributed.layout import MeshGrid, ParamLayout
from optimizer.newton_schulz import zeropower_via_newtonschulz
from optimizer.newton_schulz.forms import newton_schulz_flops
from optimizer.parallel.planning.plan import PlanParam, PlanSettings, build_plan, world_jobs


def _cost(shape):
    return float(newton_schulz_flops(shape, 5, "classic"))


def _params(world, specs):
    grid = MeshGrid((world,), tuple(range(world)))
    out = []
    for name, shape, placement in specs:
        out.append(PlanParam(name=name, shape=shape, layout=ParamLayout(shape, grid, (placement,)),
                             wire_dtype=torch.float32, device=torch.device("cpu"), ns_key=0, cost=_cost))
    return out


def _counted(shape):
    with FlopCounterMode(display=False) as counter:
        zeropower_via_newtonschulz(torch.randn(shape), ns_steps=5, method="classic")
    return counter.get_total_flops()


DOMINANT = [  # two dominant expert weights, sharded on a matrix dim (gathers needed), and a few matrices
    ("moe.w1", (32, 24, 16), Shard(1)),
    ("moe.w2", (32, 16, 24), Shard(2)),
    ("attn.wq", (16, 16), Shard(0)),
    ("attn.wo", (16, 16), Shard(1)),
]


def test_expert_units_cover_every_expert_once_and_cost_what_torch_counts():
    params = _params(8, DOMINANT)
    (jobs, _), = world_jobs(params, PlanSettings())
    for i, p in enumerate(params):
        units = [j for j in jobs if j.param == i]
        if len(p.shape) == 3:
            assert len(units) > 1, "a dominant expert weight is cut into ranges"
            assert sum(j.shape[0] for j in units) == p.shape[0]  # every expert once
        else:
            assert len(units) == 1 and units[0].shape == p.shape
        for j in units:
            assert j.cost == _counted(j.shape), (p.name, j.shape)


def test_units_balance_the_owners_and_stay_within_one_owners_share_of_bytes():
    params = _params(16, DOMINANT)
    (jobs, _), = world_jobs(params, PlanSettings())
    loads = [0.0] * 16
    for j in jobs:
        loads[j.owner] += j.cost
    total = sum(j.cost for j in jobs)
    assert total == pytest.approx(sum(_cost(p.shape) for p in params))
    # List scheduling (Graham): busiest <= mean + the largest unit; and far below one whole
    # expert weight, which is what a rank would carry unsplit.
    assert max(loads) <= total / 16 + max(j.cost for j in jobs), loads
    assert max(loads) < 0.5 * _cost(DOMINANT[0][1])
    fair_bytes = sum(4 * math.prod(p.shape) for p in params) / 16
    for j in jobs:
        assert 4 * math.prod(j.shape) <= max(fair_bytes, 4 * math.prod(j.shape[1:])), j


def test_experts_held_whole_split_over_replicas_only_among_their_holders():
    # experts sharded over dim 0 of a (2, 2) mesh, replicated over dim 1: rank r holds the experts
    # of its dim-0 coordinate, so the owner of an expert range is one of its two holders.
    grid = MeshGrid((2, 2), (0, 1, 2, 3))
    shape = (8, 12, 16)
    layout = ParamLayout(shape, grid, (Shard(0), Replicate()))
    p = PlanParam("moe.w1", shape, layout, torch.float32, torch.device("cpu"), 0, _cost)
    (jobs, _), = world_jobs([p], PlanSettings(replica_split="always"))
    for j in jobs:
        coord = grid.coordinate(j.owner)
        held = layout.indices(coord)[0]  # the experts the owner holds, by the index math
        assert isinstance(held, slice) and held.stop - held.start >= j.shape[0]
    assert sum(j.shape[0] for j in jobs) == shape[0] and {j.owner for j in jobs} == {0, 1, 2, 3}


@pytest.mark.parametrize("split", ["always", "never"])
def test_every_rank_sees_the_same_world_and_bytes_balance(split):
    grid = MeshGrid((2, 3), tuple(range(6)))
    specs = [("a", (12, 10), (Replicate(), Shard(0))), ("b", (9, 7), (Replicate(), Shard(1))),
             ("c", (6, 8, 5), (Replicate(), Shard(1))), ("d", (5, 5), (Replicate(), Replicate()))]
    params = [PlanParam(n, s, ParamLayout(s, grid, pl), torch.float32, torch.device("cpu"), 0, _cost)
              for n, s, pl in specs]
    settings = PlanSettings(replica_split=split)
    world = world_jobs(params, settings)
    plans = [build_plan(params, rank, settings) for rank in range(6)]
    owned = sorted(o for plan in plans for o in [plan.owned])
    assert sum(owned) == sum(len(jobs) for jobs, _ in world)  # every job owned by exactly one rank
    assert sum(p.bytes_sent for p in plans) == sum(p.bytes_received for p in plans) > 0
    assert all(p.jobs == plans[0].jobs for p in plans)
    for rank, plan in enumerate(plans):
        mine = sorted((j.param, j.shape) for jobs, _ in world for j in jobs if j.owner == rank)
        got = sorted((o.param, o.shape) for c in plan.chunks for o in c.owned)
        assert got == mine, rank


def test_row_state_widens_every_block_and_nothing_else():
    """NorMuon's v travels as ``k`` more columns of every block (one fp32 value per row: k = 1 on
    an fp32 wire, 2 on a bf16 one): the owners, chunks and zero-copy jobs stay as they were, and
    every buffer grows by exactly the rows the blocks carry."""
    import dataclasses

    specs = [("a", (12, 8), Shard(0)), ("b", (10, 6), Shard(1)), ("e", (4, 8, 6), Shard(1)), ("c", (9, 5), Shard(0))]
    for wire, k in ((torch.float32, 1), (torch.bfloat16, 2)):
        plain = [dataclasses.replace(p, wire_dtype=wire) for p in _params(4, specs)]
        with_v = [dataclasses.replace(p, row_bytes=4) for p in plain]
        for rank in range(4):
            a, b = build_plan(plain, rank, PlanSettings()), build_plan(with_v, rank, PlanSettings())
            assert len(a.chunks) == len(b.chunks) and a.jobs == b.jobs and a.owned == b.owned
            for ca, cb in zip(a.chunks, b.chunks):
                assert [o.zero_copy for o in ca.owned] == [o.zero_copy for o in cb.owned]
                assert [(o.param, o.shape) for o in ca.owned] == [(o.param, o.shape) for o in cb.owned]
                for pa, pb in zip(ca.packs, cb.packs):
                    assert pb.padded == (*pa.padded[:-1], pa.padded[-1] + k) and pb.mine == pa.mine
                    assert pb.row_slots == k and pa.row_slots == 0
                # each member's segment grows by k slots per padded row of every block it carries
                extra = sum(math.prod(p.padded[:-1]) * k for p in ca.packs)
                assert sum(cb.send_splits) - sum(ca.send_splits) == extra
                for o in cb.owned:
                    assert o.row_slots == k and (o.write[-1] is None or o.write[-1].shape[-1] == o.padded[-1] - k)
