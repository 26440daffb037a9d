"""local_indices on the placements fully_shard and parallelize_module really produce.

Parameters are filled with values that encode their global position before any
sharding, so ``param.to_local()`` must equal ``global[local_indices(...)]``.
Sizes are chosen so FSDP's split is uneven (including empty shards).  After one
forward/backward with the same input on every rank, each gradient must carry the
parameter's placements and its local block must match the single-device gradient
at our indices.
"""

from __future__ import annotations

import logging

import torch
import torch._dynamo  # noqa: F401  imported once here so forked ranks do not each pay ~4 s for it
import torch.nn as nn

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from harness import run_ranks
from optimizer.distributed.placements import as_indexer, local_indices


class Block(nn.Module):
    """q: colwise [hidden, 7]; o: rowwise [9, hidden]; experts [3, 8, 7] (not used in
    forward; FSDP needs even splits off dim 0).  FSDP's dim-0 splits are uneven; TP's
    are even for hidden=12 (a TP forward needs that) and uneven for hidden=9."""

    def __init__(self, hidden=12):
        super().__init__()
        self.q = nn.Linear(7, hidden, bias=False)
        self.o = nn.Linear(hidden, 9, bias=False)
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(torch.zeros(3, 8, 7))

    def forward(self, x):
        return self.o(torch.relu(self.q(x)))


def _encoded_block(hidden=12):
    m = Block(hidden)
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            # distinct values that encode the position (and which parameter)
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / 100 + i)
    return m


def _reference_grads(x):
    m = _encoded_block()
    m(x).square().sum().backward()
    return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


def _tp_experts(name, module, tp_mesh):
    # Expert weights [E, out, in], column-parallel along `out` like the q projection.
    if name == "experts":
        module.w = nn.Parameter(distribute_tensor(module.w.data, tp_mesh, [Shard(1)]))


def _hidden(setup):
    return 9 if setup.endswith("_uneven") else 12


def _build(setup, world_size):
    m = _encoded_block(_hidden(setup))
    if setup == "fsdp":
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        fully_shard(m, mesh=mesh)
    elif setup == "fsdp_dim1":  # FSDP sharding the expert weights on `out`
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 3 else Shard(0))
    elif setup == "hsdp":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_rep", "dp_shard"))
        fully_shard(m, mesh=mesh)
    elif setup in ("tp", "tp_uneven"):
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        parallelize_module(m, mesh, {"q": ColwiseParallel(), "o": RowwiseParallel()})
        distribute_module(m, mesh, _tp_experts)
    elif setup in ("fsdp+tp", "hsdp+tp", "fsdp+tp_dim1", "fsdp+tp_uneven", "hsdp+tp_uneven"):
        if setup.startswith("hsdp"):
            mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_rep", "dp_shard", "tp"))
            dp_mesh = mesh["dp_rep", "dp_shard"]
        else:
            mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp_shard", "tp"))
            dp_mesh = mesh["dp_shard"]
        parallelize_module(m, mesh["tp"], {"q": ColwiseParallel(), "o": RowwiseParallel()})
        distribute_module(m, mesh["tp"], _tp_experts)
        fn = (lambda p: Shard(1) if p.ndim == 3 else Shard(0)) if setup.endswith("dim1") else None
        fully_shard(m, mesh=dp_mesh, shard_placement_fn=fn)
    else:
        raise ValueError(setup)
    return m


def _check_setups(rank, world_size, setups):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    ref_grads = _reference_grads(x)
    report, failures = {}, []
    for setup in setups:
        m = _build(setup, world_size)
        expected = {n: p.detach().clone() for n, p in _encoded_block(_hidden(setup)).named_parameters()}
        if not setup.endswith("_uneven"):  # TP's forward needs even splits
            m(x).square().sum().backward()
        for name, p in m.named_parameters():
            assert isinstance(p, DTensor), (setup, name)
            mesh = p.device_mesh
            idx = local_indices(p.shape, mesh.shape, p.placements, mesh.get_coordinate())
            what = f"{setup} {name} {p.placements} at {mesh.get_coordinate()}"
            report[(setup, name)] = tuple(p.placements)
            if not torch.equal(p.to_local(), expected[name][as_indexer(idx)]):
                failures.append(f"param block differs: {what}")
            if not torch.equal(p.full_tensor(), expected[name]):
                failures.append(f"full_tensor differs: {what}")
            if name in ref_grads and not setup.endswith("_uneven"):
                g = p.grad
                if tuple(g.placements) != tuple(p.placements):
                    failures.append(f"grad placements {g.placements}: {what}")
                elif not torch.allclose(g.to_local(), ref_grads[name][as_indexer(idx)], atol=1e-4, rtol=1e-4):
                    failures.append(f"grad block differs from single-device grad: {what}")
    return report, failures


def _run(setups, world_size):
    results = run_ranks(_check_setups, world_size, setups, timeout=240)
    failures = [f for _, fs in results for f in fs]
    assert not failures, "\n".join(failures[:20])
    return results[0][0]


def test_fsdp_hsdp_tp_placements_on_4_ranks():
    placements = _run(["fsdp", "fsdp_dim1", "hsdp", "tp", "tp_uneven"], 4)
    # Guard that the setups produce the placements we mean to cover.
    assert placements[("fsdp", "q.weight")] == (Shard(0),)
    assert placements[("fsdp", "experts.w")] == (Shard(0),)  # 3 experts on 4 ranks: one empty
    assert placements[("fsdp_dim1", "experts.w")] == (Shard(1),)
    assert placements[("hsdp", "o.weight")] == (Replicate(), Shard(0))
    assert placements[("tp", "q.weight")] == (Shard(0),)
    assert placements[("tp", "o.weight")] == (Shard(1),)
    assert placements[("tp", "experts.w")] == (Shard(1),)
    assert placements[("tp_uneven", "q.weight")] == (Shard(0),)


def test_fsdp_tp_and_hsdp_tp_placements_on_8_ranks():
    placements = _run(["fsdp+tp", "fsdp+tp_dim1", "hsdp+tp", "fsdp+tp_uneven", "hsdp+tp_uneven"], 8)
    sf2 = _StridedShard(0, split_factor=2)
    assert placements[("fsdp+tp", "q.weight")] == (sf2, Shard(0))
    assert placements[("fsdp+tp", "o.weight")] == (Shard(0), Shard(1))
    assert placements[("fsdp+tp", "experts.w")] == (Shard(0), Shard(1))
    assert placements[("fsdp+tp_dim1", "experts.w")] == (_StridedShard(1, split_factor=2), Shard(1))
    assert placements[("hsdp+tp", "q.weight")] == (Replicate(), sf2, Shard(0))
    assert placements[("hsdp+tp", "o.weight")] == (Replicate(), Shard(0), Shard(1))
    # 9 q rows: TP holds [0:5] and [5:9], FSDP then splits 5 and 4 rows over dp_shard;
    # the case where torch 2.13's compute_local_shape_and_global_offset disagrees.
    assert placements[("fsdp+tp_uneven", "q.weight")] == (sf2, Shard(0))
    assert placements[("hsdp+tp_uneven", "q.weight")] == (Replicate(), sf2, Shard(0))
