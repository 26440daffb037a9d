"""The AdamW path against torch.optim.AdamW, on plain tensors and on DTensors."""

import pytest
import torch
import torch._dynamo  # noqa: F401 - DTensor imports it lazily; once here, not in every forked rank
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from harness import run_ranks
from optimizer.adamw import adamw_step_, init_adamw_state_

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = [(8, 6), (6,), (3, 4, 5), ()]


def make_params(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def make_grads(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def run_ours(params, steps, dtype=torch.float32, **kw):
    states = [dict() for _ in params]
    for t in range(steps):
        grads = make_grads(t, dtype)
        for st, p in zip(states, params):
            init_adamw_state_(st, p)
        adamw_step_(
            params,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            **HP,
            **kw,
        )
    return states


def run_torch(params, steps, dtype=torch.float32, foreach=None):
    params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(params, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                            weight_decay=HP["weight_decay"], foreach=foreach)
    for t in range(steps):
        for p, g in zip(params, make_grads(t, dtype)):
            p.grad = g
        opt.step()
    return [p.detach() for p in params], opt


def test_matches_torch_adamw_foreach_exactly():
    ours = make_params(0)
    states = run_ours(ours, 5)
    ref, opt = run_torch(make_params(0), 5, foreach=True)
    for p, r in zip(ours, ref):
        assert torch.equal(p, r)
    for st, ref_param in zip(states, opt.param_groups[0]["params"]):
        ref_state = opt.state[ref_param]
        assert st["step"].item() == ref_state["step"].item() == 5
        assert torch.equal(st["exp_avg"], ref_state["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], ref_state["exp_avg_sq"])


def test_matches_torch_adamw_default_and_single_tensor():
    """torch's default on CPU is the single-tensor loop: same math, rounding may differ ~1e-7."""
    ours = make_params(1)
    run_ours(ours, 6)
    ref, _ = run_torch(make_params(1), 6)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-6)
    ours_single = make_params(1)
    run_ours(ours_single, 6, foreach=False)
    ref_single, _ = run_torch(make_params(1), 6, foreach=False)
    for p, r in zip(ours_single, ref_single):
        assert torch.equal(p, r)


def test_bf16_params():
    ours = make_params(2, torch.bfloat16)
    run_ours(ours, 3, dtype=torch.bfloat16)
    ref, _ = run_torch(make_params(2, torch.bfloat16), 3, dtype=torch.bfloat16, foreach=True)
    for p, r in zip(ours, ref):
        assert p.dtype == torch.bfloat16 and torch.equal(p, r)


def test_state_init_like_torch():
    p = torch.randn(3, 2)
    st = {}
    init_adamw_state_(st, p)
    assert st["step"].dtype == torch.float32 and st["step"].device.type == "cpu"
    assert st["step"].ndim == 0 and st["step"].item() == 0
    assert torch.equal(st["exp_avg"], torch.zeros(3, 2))
    assert torch.equal(st["exp_avg_sq"], torch.zeros(3, 2))
    ea = st["exp_avg"]
    init_adamw_state_(st, p)  # idempotent: existing state is kept
    assert st["exp_avg"] is ea


def test_length_mismatch_errors():
    p = torch.zeros(2)
    with pytest.raises(ValueError, match="same length"):
        adamw_step_([p], [], [p], [p], [torch.tensor(0.0)], **HP)


def _dtensor_adamw_rank(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    full = make_params(3)
    placements = [[Shard(0)], [Shard(0)], [Shard(2)], [Replicate()]]
    dparams = [distribute_tensor(p.clone(), mesh, pl) for p, pl in zip(full, placements)]
    # plain tensors in the same call (must be batched separately from DTensors)
    plain = [torch.randn(5, generator=torch.Generator().manual_seed(9))]
    params = dparams + plain
    states = [dict() for _ in params]
    for t in range(4):
        grads = make_grads(t)
        dgrads = [distribute_tensor(g, mesh, pl) for g, pl in zip(grads, placements)]
        pgrads = [torch.randn(5, generator=torch.Generator().manual_seed(50 + t))]
        for st, p in zip(states, params):
            init_adamw_state_(st, p)
        adamw_step_(params, dgrads + pgrads, [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states], [s["step"] for s in states], **HP)
    for st, p, pl in zip(states, dparams, placements):
        assert isinstance(st["exp_avg"], DTensor) and tuple(st["exp_avg"].placements) == tuple(pl)
        assert isinstance(p, DTensor) and tuple(p.placements) == tuple(pl)
    return [p.full_tensor() for p in dparams] + plain


def test_dtensor_params_match_plain():
    results = run_ranks(_dtensor_adamw_rank, 2, timeout=60)
    ref, _ = run_torch(make_params(3), 4, foreach=True)
    plain_p = torch.nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(9)))
    opt = torch.optim.AdamW([plain_p], lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                            weight_decay=HP["weight_decay"], foreach=True)
    for t in range(4):
        plain_p.grad = torch.randn(5, generator=torch.Generator().manual_seed(50 + t))
        opt.step()
    for rank_out in results:
        for got, want in zip(rank_out, ref + [plain_p.detach()]):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
