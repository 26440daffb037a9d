"""An optimizer built on plain parameters whose groups are then switched to DTensors (accelerate's
FSDP2 idiom: ``fsdp2_switch_optimizer_parameters``) works on every mesh (issue 23).

The process groups such a step needs are created at its first step, collectively, in one order
on every rank (never again), and every parameter equals single-device Muon fed the same
gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from dist_cases import HEAD_DIM, build_groups, make_case_tensors, parse_placement, qk_logits_for, run_reference, \
    to_dtensor
from harness import run_ranks

SPECS_2D = [
    ("layers.0.attention.wq.weight", (16, 12), None),
    ("layers.0.attention.wk.weight", (8, 12), None),
    ("layers.0.ffn.w1.weight", (20, 12), None),
    ("layers.0.ffn.experts", (4, 10, 12), None),
    ("layers.0.norm.weight", (12,), None),
]
MESHES = {  # mesh shape, placements of (matrices, experts, norms)
    "1-D fsdp": ((4,), ["S0"], ["S0"], ["S0"]),
    "2-D fsdp+tp": ((2, 2), ["S0", "S1"], ["S1", "S2"], ["S0", "R"]),
    "3-D hsdp+tp": ((2, 2, 2), ["R", "S0", "S0"], ["R", "S0", "S1"], ["R", "S0", "R"]),
    "3-D strided": ((2, 2, 2), ["R", "SS0/2", "S0"], ["S0", "R", "S1"], ["R", "R", "S0"]),
    # HSDP x context x TP-like: 16 ranks, matrices sharded over three mesh dims
    "4-D hsdp+cp+tp": ((2, 2, 2, 2), ["R", "S0", "S0", "S1"], ["R", "S0", "S1", "S2"], ["R", "S0", "R", "R"]),
}
# Whether a step needs a process group of its own: a shard group over two of three mesh dims
# (4 of 8 ranks; 8 of 16 on the 4-D mesh). One mesh dim reuses the mesh's group; the whole world is WORLD.
NEEDS_A_GROUP = {"1-D fsdp": False, "2-D fsdp+tp": False, "3-D hsdp+tp": True, "3-D strided": True,
                 "4-D hsdp+cp+tp": True}
STEPS = 3


def _placements(name, shape, mesh_case):
    _, matrices, experts, norms = mesh_case
    return [parse_placement(x) for x in (norms if len(shape) == 1 else experts if len(shape) == 3 else matrices)]


def _swapped(rank, world_size, mesh_name, qk):
    from optimizer import Muon, QKClipConfig
    from optimizer.distributed import groups

    groups.CREATION_LOG.clear()  # a forked rank inherits the log of the tests its parent ran before
    case = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", case[0])
    params, grads = make_case_tensors(SPECS_2D, STEPS)
    plain = [(n, torch.nn.Parameter(params[n].clone())) for n, _, _ in SPECS_2D]
    opt = Muon(build_groups(plain), lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr="match_rms_adamw",
               qk_clip=QKClipConfig(head_dim=HEAD_DIM, threshold=1.0) if qk else None)
    created_at_build = list(groups.CREATION_LOG)
    # accelerate: shard the model, then put the sharded parameters into the optimizer's groups
    sharded = {n: torch.nn.Parameter(to_dtensor(params[n], mesh, _placements(n, p.shape, case))) for n, p in plain}
    for group in opt.param_groups:
        group["params"] = [sharded[n] for n in group["param_names"]]
    created_per_step = []
    for step in range(STEPS):
        for n, p in sharded.items():
            p.grad = to_dtensor(grads[step][n], mesh, p.placements)
        opt.step(qk_logits=qk_logits_for(SPECS_2D, step, 1.0) if qk else None)
        created_per_step.append(list(groups.CREATION_LOG))
    fulls = {n: p.full_tensor().detach() for n, p in sharded.items()}
    return fulls, created_at_build, created_per_step


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_parameters_switched_to_dtensors_after_construction_match_single_device(mesh_name):
    qk = mesh_name != "3-D strided"
    world = 1
    for s in MESHES[mesh_name][0]:
        world *= s
    want = run_reference(SPECS_2D, STEPS, qk)
    results = run_ranks(_swapped, world, mesh_name, qk, timeout=120)
    logs = set()
    for fulls, at_build, per_step in results:
        for n, ref in want.items():
            torch.testing.assert_close(fulls[n], ref, atol=2e-6, rtol=1e-5, msg=n)
        assert at_build == []  # plain parameters: nothing to create then
        assert per_step[0] == per_step[-1]  # created at the first step, never again
        logs.add(tuple(per_step[-1]))
    assert len(logs) == 1  # the same groups, in the same order, on every rank
    assert bool(logs.pop()) == NEEDS_A_GROUP[mesh_name]
