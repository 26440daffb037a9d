"""Drop-in torch-optimizer habits that live in muon.py (issue 13), each against an independent
reference:

- momentum schedules (OneCycleLR / CyclicLR with ``cycle_momentum``): torch.optim.Muon and
  torch.optim.AdamW under the same scheduler;
- ``skip_nonfinite`` with fp16 gradients: the same step with ``skip_nonfinite=False`` (finite
  gradients must not be skipped), and a real Inf (must be);
- fp32 parameters with bf16 gradients in Muon groups: torch.optim.Muon;
- ``maximize``: torch.optim.Muon fed the negated gradients, torch.optim.AdamW(maximize=True);
- a closure raising on one rank: every rank must raise, fast, instead of waiting in a collective;
- ``distributed_mode="gather"`` on a mesh whose ranks are not in ascending order:
  single-device Muon, each rank's rows picked by its mesh coordinate (Shard's index math).
"""

import pytest
import torch
from torch import nn

from harness import DistributedTestError, run_ranks
from optimizer import Muon

HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr="match_rms_adamw")
BETAS, EPS = (0.9, 0.95), 1e-8



# torch.optim.Muon compared like for like: its own iteration in fp32 (conftest.py)
pytestmark = pytest.mark.usefixtures("torch_muon_in_fp32")

def make_net(seed=3):
    g = torch.Generator().manual_seed(seed)
    return nn.ParameterDict({
        "w1": nn.Parameter(torch.randn(24, 16, generator=g) * 0.1),
        "w2": nn.Parameter(torch.randn(16, 24, generator=g) * 0.1),
        "norm": nn.Parameter(torch.randn(16, generator=g) * 0.1),
    })


def muon_params(net):
    return [net["w1"], net["w2"]]


def set_grads(net, step, sign=1.0):
    g = torch.Generator().manual_seed(700 + step)
    for p in net.values():
        p.grad = sign * torch.randn(p.shape, generator=g)


def ours(net, **group_kw):
    muon_kw = {k: v for k, v in group_kw.items() if not k.startswith("adamw_")}
    adamw_kw = {k[len("adamw_"):]: v for k, v in group_kw.items() if k.startswith("adamw_")}
    return Muon([{"params": muon_params(net), "use_muon": True, **muon_kw},
                 {"params": [net["norm"]], "use_muon": False, **adamw_kw}],
                lr=HP["lr"], weight_decay=HP["weight_decay"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                adjust_lr=HP["adjust_lr"], adamw_betas=BETAS, adamw_eps=EPS, compute_dtype=torch.float32, ns_method="classic")


def torch_muon(params):
    return torch.optim.Muon(params, lr=HP["lr"], weight_decay=HP["weight_decay"], momentum=HP["momentum"],
                            nesterov=HP["nesterov"], adjust_lr_fn=HP["adjust_lr"])


def torch_adamw(params, **kw):
    return torch.optim.AdamW(params, lr=HP["lr"], betas=BETAS, eps=EPS, weight_decay=HP["weight_decay"], **kw)


def assert_close_nets(net, ref, atol=1e-6):
    for name in net:
        torch.testing.assert_close(net[name], ref[name], atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------ momentum schedules

SCHEDULERS = {
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.05, total_steps=10, cycle_momentum=True, base_momentum=0.8, max_momentum=0.95),
    "CyclicLR": lambda opt: torch.optim.lr_scheduler.CyclicLR(
        opt, base_lr=0.005, max_lr=0.05, step_size_up=3, cycle_momentum=True, base_momentum=0.8, max_momentum=0.95),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_momentum_schedules_cycle_muon_momentum_like_torch_muon(sched):
    """Muon groups' ``momentum`` follows the schedule as in torch.optim.Muon; AdamW groups' betas[0]
    as in torch.optim.AdamW. Before the fix: the scheduler sees ``betas`` in Muon's defaults and writes
    ``betas`` into every group, so a Muon group's momentum never moves (~2e-2 off after 5 steps)."""
    net, ref = make_net(), make_net()
    opt = ours(net)
    refs = [torch_muon(muon_params(ref)), torch_adamw([ref["norm"]])]
    scheds = [SCHEDULERS[sched](o) for o in [opt, *refs]]
    for t in range(5):
        set_grads(net, t)
        set_grads(ref, t)
        for o in [opt, *refs]:
            o.step()
        for s in scheds:
            s.step()
    assert opt.param_groups[0]["momentum"] == refs[0].param_groups[0]["momentum"] != HP["momentum"]
    assert_close_nets(net, ref)


# ----------------------------------------------------------------- skip_nonfinite and fp16

def test_skip_nonfinite_does_not_skip_large_finite_fp16_gradients():
    """A finite fp16 gradient whose norm exceeds fp16's max (65504) is not a reason to skip.
    Before the fix: the finiteness check takes the norm in fp16, which overflows to Inf."""
    def run(skip, grad_value):
        p = nn.Parameter(torch.full((64, 64), 0.5, dtype=torch.float16))
        p.grad = torch.full((64, 64), grad_value, dtype=torch.float16)
        p.grad[0, 0] = -grad_value  # not rank-1, so the update is not degenerate
        opt = Muon([{"params": [p], "use_muon": True}], lr=0.02, skip_nonfinite=skip)
        opt.step()
        return p.detach().clone(), opt.last_step_skipped

    assert torch.isfinite(torch.full((64, 64), 2000.0, dtype=torch.float16)).all()
    stepped, skipped = run(True, 2000.0)
    plain, _ = run(False, 2000.0)
    assert not skipped
    assert torch.equal(stepped, plain)
    _, skipped_inf = run(True, float("inf"))
    assert skipped_inf  # a real Inf still skips


# -------------------------------------------------------------- fp32 params, bf16 gradients

def test_muon_group_takes_bf16_grads_of_fp32_params_like_torch_muon():
    """Failed before the fix with "expected dtype float for `end`" (lerp_ of an fp32 buffer with a bf16 gradient).

    Two behaviours are right: torch.optim.Muon's (the momentum buffer in the gradient's dtype,
    bf16) or upcasting the gradient into an fp32 buffer (= torch.optim.Muon fed fp32 copies of
    the gradients). They differ by ~5e-4 after 3 steps (the parameters move ~2.5e-2); the result
    must equal one of them to float32 rounding."""
    def bf16_grads(net, step, upcast=False):
        g = torch.Generator().manual_seed(900 + step)
        for p in muon_params(net):
            grad = torch.randn(p.shape, generator=g).bfloat16()
            if upcast:
                p.grad = grad.float()
            else:
                p.grad_dtype = torch.bfloat16
                p.grad = grad

    net, ref_bf16, ref_fp32 = make_net(), make_net(), make_net()
    opt = Muon([{"params": muon_params(net), "use_muon": True}], lr=HP["lr"], weight_decay=HP["weight_decay"],
               momentum=HP["momentum"], adjust_lr=HP["adjust_lr"], compute_dtype=torch.float32, ns_method="classic")
    refs = [torch_muon(muon_params(ref_bf16)), torch_muon(muon_params(ref_fp32))]
    for t in range(3):
        bf16_grads(net, t)
        bf16_grads(ref_bf16, t)
        bf16_grads(ref_fp32, t, upcast=True)
        opt.step()
        for o in refs:
            o.step()
    for p, a, b in zip(muon_params(net), muon_params(ref_bf16), muon_params(ref_fp32)):
        assert p.dtype == torch.float32
        deviation = min((p - a).abs().max().item(), (p - b).abs().max().item())
        assert deviation <= 1e-6, deviation


# --------------------------------------------------------------------------------- maximize

def test_maximize_in_muon_and_adamw_groups():
    """``maximize=True`` ascends: Muon groups as torch.optim.Muon fed -grad, AdamW groups as
    torch.optim.AdamW(maximize=True). Before the fix: the key is ignored in both kinds of group.
    (muon.py: read ``maximize`` per group, negate the Muon gradient before the momentum, and
    call ``adamw.adamw_group_step_`` for AdamW groups, which honours it.)"""
    net, ref = make_net(), make_net()
    opt = ours(net, maximize=True, adamw_maximize=True)
    refs = [torch_muon(muon_params(ref)), torch_adamw([ref["norm"]], maximize=True)]
    for t in range(3):
        set_grads(net, t)
        set_grads(ref, t)
        for p in muon_params(ref):
            p.grad = -p.grad
        opt.step()
        for o in refs:
            o.step()
    assert_close_nets(net, ref)


def test_maximize_must_be_a_bool():
    net = make_net()
    with pytest.raises(ValueError, match="maximize"):
        ours(net, maximize="yes")


# ------------------------------------------------------------------ closure failures

def _closure_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = nn.Parameter(distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)]))
    opt = Muon([{"params": [p], "use_muon": True}], lr=0.02)

    def closure():
        p.grad = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
        if rank == 1:
            raise ValueError("data loader failed on this rank")
        return torch.tensor(1.0)

    try:
        opt.step(closure)
    except (RuntimeError, ValueError) as err:
        return type(err).__name__, str(err)
    return None


def test_closure_failure_on_one_rank_fails_every_rank():
    """Before the fix: rank 1 raises inside its closure and leaves; rank 0 waits in the step's
    agreement all-reduce until the timeout. Expected: rank 1 raises its own error, rank 0 a
    RuntimeError saying another rank's closure failed, both at once (the closure's outcome is one
    more fact in the step's agreement)."""
    try:
        results = run_ranks(_closure_rank, 2, timeout=30)
    except DistributedTestError as err:
        pytest.fail(f"a rank hung or crashed instead of raising a clear error: {str(err)[:500]}")
    assert results[1] is not None and "data loader failed" in results[1][1]
    assert results[0] is not None and results[0][0] == "RuntimeError" and "closure" in results[0][1], results[0]


# ------------------------------------------------------------ gather mode, non-ascending meshes

def _non_ascending_rank(rank, world, mesh_ranks, mode):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh_ranks = torch.tensor(mesh_ranks)
    mesh = DeviceMesh("cpu", mesh_ranks)
    g = torch.Generator().manual_seed(11)
    full_w, full_g = torch.randn(8, 12, generator=g), torch.randn(8, 12, generator=g)
    placements = [Shard(0)] if mesh.ndim == 1 else [Shard(0), Shard(1)]
    # Shard's index math: the coordinate (not the rank) picks the block, block sizes 8/m0 and 12/m1
    coord = mesh.get_coordinate()
    rows = slice(coord[0] * 8 // mesh.size(0), (coord[0] + 1) * 8 // mesh.size(0))
    cols = slice(None) if mesh.ndim == 1 else slice(coord[1] * 12 // mesh.size(1), (coord[1] + 1) * 12 // mesh.size(1))
    p = nn.Parameter(DTensor.from_local(full_w[rows, cols].clone(), mesh, placements, run_check=False))
    p.grad = DTensor.from_local(full_g[rows, cols].clone(), mesh, placements, run_check=False)
    Muon([{"params": [p], "use_muon": True}], lr=0.02, distributed_mode=mode).step()
    ref = nn.Parameter(full_w.clone())
    ref.grad = full_g.clone()
    Muon([{"params": [ref], "use_muon": True}], lr=0.02).step()
    return (p.to_local() - ref.detach()[rows, cols]).abs().max().item()


@pytest.mark.parametrize("world,mesh_ranks", [(2, [1, 0]), (4, [3, 1, 2, 0]), (4, [[1, 0], [3, 2]])],
                         ids=["1d-[1,0]", "1d-[3,1,2,0]", "2d-[[1,0],[3,2]]"])
def test_gather_mode_on_non_ascending_mesh(world, mesh_ranks):
    """Failed before the fix (~1e-2 off): gather mode assembled matrices with DTensor.full_tensor(), which
    is wrong on such meshes. distributed_mode="parallel" is exact on all three (measured 0.0: it
    uses the placement index math); gather mode must be too, or refuse such meshes. (On
    [[0, 2], [1, 3]] gather mode is already right.)"""
    deviation = run_ranks(_non_ascending_rank, world, mesh_ranks, "gather", timeout=60)
    assert max(deviation) <= 1e-6, deviation
