"""Ordinary torch-optimizer habits that must work with Muon (issue 13), on one device.

Each test compares against torch's own optimizers fed the same gradients: torch.optim.Muon
for the matrices (our Newton–Schulz in bf16 runs torch's operations in torch's order, so the
two agree to float32 rounding) and torch.optim.AdamW for everything else.

- ``lr`` as a 1-element Tensor (the AdamW path used to raise a torch-internal
  "capturable/foreach" error),
- ``torch.compile(opt.step)`` (the AdamW path used to fail with "scalars on meta"),
- ``maximize`` in AdamW's functional path (``adamw_step_`` / ``adamw_group_step_``).

The items that need muon.py (maximize in Muon groups and through Muon.step, momentum
schedules, ...) are in test_dropin_pending.py.
"""

import pytest
import torch
from torch import nn

from optimizer import Muon
from optimizer.adamw import adamw_group_step_, adamw_step_, init_adamw_state_

HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr="match_rms_adamw")
BETAS, EPS = (0.9, 0.95), 1e-8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a = nn.Linear(16, 24)  # weight [24, 16] -> Muon, bias -> AdamW
        self.b = nn.Linear(24, 16, bias=False)  # [16, 24] -> Muon
        self.norm = nn.LayerNorm(16)  # -> AdamW
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)



# torch.optim.Muon compared like for like: its own iteration in fp32 (conftest.py)
pytestmark = pytest.mark.usefixtures("torch_muon_in_fp32")

def split(net):
    muon = [p for p in net.parameters() if p.ndim == 2]
    adamw = [p for p in net.parameters() if p.ndim != 2]
    return muon, adamw


def ours(net, lr, **kw):
    muon, adamw = split(net)
    groups = [{"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}]
    return Muon(groups, lr=lr, weight_decay=HP["weight_decay"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                adjust_lr=HP["adjust_lr"], adamw_betas=BETAS, adamw_eps=EPS, compute_dtype=torch.float32, ns_method="classic", **kw)


def torch_pair(net, lr):
    """torch.optim.Muon + torch.optim.AdamW; a Tensor lr is copied so that each has its own
    (a scheduler updates a Tensor lr in place: a shared one would be stepped twice)."""
    muon, adamw = split(net)
    return (
        torch.optim.Muon(muon, lr=lr.clone() if torch.is_tensor(lr) else lr, weight_decay=HP["weight_decay"],
                         momentum=HP["momentum"], nesterov=HP["nesterov"], adjust_lr_fn=HP["adjust_lr"]),
        torch.optim.AdamW(adamw, lr=lr.clone() if torch.is_tensor(lr) else lr, betas=BETAS, eps=EPS,
                          weight_decay=HP["weight_decay"]),
    )


def set_grads(net, step):
    g = torch.Generator().manual_seed(500 + step)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def assert_same_params(net, ref, atol=1e-6):
    for (name, p), r in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------- lr as a Tensor

def test_tensor_lr_matches_torch_optimizers_with_tensor_lr():
    """torch.optim.Muon and torch.optim.AdamW accept a Tensor lr on CPU; so must we, AdamW group included."""
    net, ref = Net(), Net()
    opt = ours(net, lr=torch.tensor(HP["lr"]))
    refs = torch_pair(ref, lr=torch.tensor(HP["lr"]))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # schedulers keep it a Tensor
    ref_scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in refs]
    for t in range(4):
        set_grads(net, t)
        set_grads(ref, t)
        opt.step()
        for o in refs:
            o.step()
        sched.step()
        for s in ref_scheds:
            s.step()
    assert all(torch.is_tensor(g["lr"]) for g in opt.param_groups)
    assert_same_params(net, ref)
    moved = max((p - q).abs().max().item() for p, q in zip(net.parameters(), Net().parameters()))
    assert moved > 1e-2  # the comparison is not between two untouched models


def test_tensor_lr_equals_float_lr_in_adamw_step():
    """The functional path: a Tensor lr gives the numbers a float lr gives (torch's single-tensor loop)."""
    def run(lr):
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(6, generator=g), torch.randn(3, 4, generator=g)]
        state = [dict() for _ in params]
        for t in range(3):
            grads = [torch.randn(p.shape, generator=g) for p in params]
            for st, p in zip(state, params):
                init_adamw_state_(st, p)
            adamw_step_(params, grads, [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state],
                        [s["step"] for s in state], lr=lr, betas=BETAS, eps=EPS, weight_decay=0.1)
        return params

    for a, b in zip(run(torch.tensor(0.01)), run(0.01)):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)


def test_tensor_lr_errors_are_clear():
    p, g = torch.zeros(3), torch.ones(3)
    st = {}
    init_adamw_state_(st, p)
    args = ([p], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [st["step"]])
    with pytest.raises(ValueError, match="one element"):
        adamw_step_(*args, lr=torch.tensor([0.1, 0.2]), betas=BETAS, eps=EPS, weight_decay=0.0)
    with pytest.raises(ValueError, match="foreach=True"):
        adamw_step_(*args, lr=torch.tensor(0.1), betas=BETAS, eps=EPS, weight_decay=0.0, foreach=True)
    assert st["step"].item() == 0 and torch.equal(p, torch.zeros(3))  # refused before any change


# ------------------------------------------------------------------------------ torch.compile

def test_compiled_step_matches_eager_step_and_torch_adamw():
    """torch.compile(opt.step) runs (no "scalars on meta" from the AdamW path) and gives the numbers
    of an eager step: the AdamW parameters torch.optim.AdamW's, the matrices those of the eager
    Muon step (checked against torch.optim.Muon in test_muon_vs_torch.py). fp32 Newton–Schulz:
    inductor's bf16 kernels round differently from eager bf16, so bf16 would not compare tightly."""
    torch._dynamo.reset()
    net, eager_net, ref = Net(), Net(), Net()
    opt = ours(net, lr=HP["lr"])
    opt.compute_dtype = eager_compute = torch.float32
    eager = ours(eager_net, lr=HP["lr"])
    eager.compute_dtype = eager_compute
    ref_adamw = torch_pair(ref, lr=HP["lr"])[1]
    step = torch.compile(opt.step)
    for t in range(3):
        for m in (net, eager_net, ref):
            set_grads(m, t)
        step()
        eager.step()
        ref_adamw.step()
    for (name, p), q, r in zip(net.named_parameters(), eager_net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=lambda m: f"{name} vs eager: {m}")
        if p.ndim != 2:
            torch.testing.assert_close(p, r, atol=1e-6, rtol=0, msg=lambda m: f"{name} vs torch AdamW: {m}")
    assert max((p - q).abs().max().item() for p, q in zip(net.parameters(), Net().parameters())) > 1e-2
    steps = [opt.state[p]["step"].item() for p in split(net)[1]]
    assert steps == [3.0] * len(steps)


def test_compiled_adamw_step_matches_eager_torch_adamw():
    """The functional AdamW path compiled on its own (the capturable trace), incl. a Tensor lr."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(8, generator=g), torch.randn(4, 5, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in init] for _ in range(3)]
    for lr in (0.01, torch.tensor(0.01)):
        params = [p.clone() for p in init]
        state = [dict() for _ in params]
        for st, p in zip(state, params):
            init_adamw_state_(st, p)

        @torch.compile(backend="aot_eager")
        def step(gs, lr):
            adamw_step_(params, gs, [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state],
                        [s["step"] for s in state], lr=lr, betas=BETAS, eps=EPS, weight_decay=0.1)

        ref = [nn.Parameter(p.clone()) for p in init]
        ref_opt = torch.optim.AdamW(ref, lr=0.01, betas=BETAS, eps=EPS, weight_decay=0.1)
        for gs in grads:
            step(gs, lr)
            for r, gr in zip(ref, gs):
                r.grad = gr
            ref_opt.step()
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r.detach(), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------- maximize

@pytest.mark.parametrize("maximize", [False, True])
def test_adamw_group_step_honours_maximize(maximize):
    """adamw_group_step_ reads ``maximize`` from the group, as torch.optim.AdamW does."""
    g = torch.Generator().manual_seed(2)
    init = [torch.randn(8, generator=g), torch.randn(4, 5, generator=g)]
    params = [p.clone() for p in init]
    group = {"params": params, "lr": 0.01, "betas": BETAS, "eps": EPS, "weight_decay": 0.1, "maximize": maximize}
    state = {}
    ref = [nn.Parameter(p.clone()) for p in init]
    ref_opt = torch.optim.AdamW(ref, lr=0.01, betas=BETAS, eps=EPS, weight_decay=0.1, maximize=maximize)
    for _ in range(3):
        for p, r in zip(params, ref):
            p.grad = torch.randn(p.shape, generator=g)
            r.grad = p.grad.clone()
        adamw_group_step_(group, state)
        ref_opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), atol=1e-6, rtol=0)
    assert all(state[p]["step"].item() == 3 for p in params)


def test_adamw_group_step_skips_params_without_grad_and_defaults_maximize():
    a, b = torch.ones(3), torch.ones(3)
    a.grad = torch.ones(3)
    group = {"params": [a, b], "lr": 0.1, "betas": BETAS, "eps": EPS, "weight_decay": 0.0}
    state = {}
    adamw_group_step_(group, state)
    assert b not in state and torch.equal(b, torch.ones(3))
    assert (a < 1).all()  # descended: maximize defaults to False


def test_adamw_maximize_must_be_a_bool():
    p = torch.zeros(2)
    p.grad = torch.ones(2)
    group = {"params": [p], "lr": 0.1, "betas": BETAS, "eps": EPS, "weight_decay": 0.0, "maximize": "yes"}
    with pytest.raises(ValueError, match="maximize must be True or False"):
        adamw_group_step_(group, {})


# --------------------------------------------------------------- gradients narrower than params

def test_adamw_path_takes_bf16_grads_of_fp32_params():
    """bf16 gradients of fp32 parameters (mixed-precision reductions): torch.optim.AdamW raises on the
    mix; ours upcasts them and gives what torch.optim.AdamW gives on the upcast gradients."""
    g = torch.Generator().manual_seed(4)
    init = [torch.randn(8, generator=g), torch.randn(4, 5, generator=g)]
    params = [p.clone() for p in init]
    for p in params:
        p.grad_dtype = torch.bfloat16
    group = {"params": params, "lr": 0.01, "betas": BETAS, "eps": EPS, "weight_decay": 0.1}
    state = {}
    ref = [nn.Parameter(p.clone()) for p in init]
    ref_opt = torch.optim.AdamW(ref, lr=0.01, betas=BETAS, eps=EPS, weight_decay=0.1)
    for _ in range(3):
        for p, r in zip(params, ref):
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
            r.grad = p.grad.float()
        adamw_group_step_(group, state)
        ref_opt.step()
    for p, r in zip(params, ref):
        assert p.dtype == torch.float32 and state[p]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(p, r.detach(), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------- Tensor lr on DTensors

def _tensor_lr_dtensor_rank(rank, world, mode):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(6)
    full = {"w": torch.randn(8, 6, generator=g), "b": torch.randn(8, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in full.items()} for _ in range(2)]
    ps = {k: nn.Parameter(distribute_tensor(v, mesh, [Shard(0)])) for k, v in full.items()}
    refs = {k: nn.Parameter(v.clone()) for k, v in full.items()}
    opt = Muon([{"params": [ps["w"]], "use_muon": True}, {"params": [ps["b"]], "use_muon": False}],
               lr=torch.tensor(0.02), distributed_mode=mode)
    ref = Muon([{"params": [refs["w"]], "use_muon": True}, {"params": [refs["b"]], "use_muon": False}], lr=0.02)
    for gs in grads:
        for k in ps:
            ps[k].grad = distribute_tensor(gs[k], mesh, [Shard(0)])
            refs[k].grad = gs[k].clone()
        opt.step()
        ref.step()
    return {k: (ps[k].full_tensor() - refs[k].detach()).abs().max().item() for k in ps}


@pytest.mark.parametrize("mode", ["parallel", "gather"])
def test_tensor_lr_on_sharded_params_matches_single_device(mode):
    from harness import run_ranks

    deviation = run_ranks(_tensor_lr_dtensor_rank, 2, mode, timeout=60)[0]
    assert max(deviation.values()) <= 1e-6, deviation
