"""Muon against torch.optim.Muon / torch.optim.AdamW, step by step, on one device.

Part 1 composes our pure pieces (muon_momentum_, zeropower_via_newtonschulz, adjust_lr,
apply_update_) the way an optimizer step does. Part 2 runs ``optimizer.Muon`` itself.

Tolerances. torch.optim.Muon orthogonalises in bf16, dividing by the Frobenius norm rounded to
bf16 (up to 0.4% off); ours divides by the fp32 norm (issue 10), so even with
``compute_dtype=torch.bfloat16`` the two differ by bf16 noise, not float32 rounding (the same
iteration from an already normalised input is bit-identical: tests/rule/test_newton_schulz.py). In
fp32 (our CPU default) the difference is torch's bf16 error. Either way 8 mantissa bits through 5
iterations leave entries of the orthogonalised update (size ~1/sqrt(n) ~ 0.1) off by up to
~1e-2, so after k steps the parameters may differ by k * adjusted_lr * NS_ERR, and by ~1% of
the total change.  The AdamW path is torch's functional AdamW: float32 rounding (atol 1e-6).
"""

import pytest
import torch
from torch import nn

import optimizer
from optimizer.rule import adjust_lr, apply_update_
from test_rule import muon_momentum_
from optimizer.newton_schulz import zeropower_via_newtonschulz
from optimizer.param_groups import get_default_muon_param_groups

SHAPES = [(96, 32), (32, 96), (48, 48)]
STEPS = 4
NS_ERR = 1.5e-2  # per-entry bound on |bf16 NS - fp32 NS| for these shapes (seen: ~7e-3)
REL_ERR = 0.02  # bound on ||ours - torch|| / ||torch's total change|| (seen: ~1%)


def initial_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 0.1 for s in SHAPES]


def grads_at(step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def run_torch_muon(hp, steps=STEPS):
    params = [nn.Parameter(p) for p in initial_params()]
    opt = torch.optim.Muon(params, lr=hp["lr"], weight_decay=hp["weight_decay"], momentum=hp["momentum"],
                           nesterov=hp["nesterov"], adjust_lr_fn=hp["adjust_lr"])
    for t in range(steps):
        for p, g in zip(params, grads_at(t)):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def run_composed(hp, compute_dtype, steps=STEPS):
    params = initial_params()
    bufs = [torch.zeros_like(p) for p in params]
    for t in range(steps):
        for p, buf, g in zip(params, bufs, grads_at(t)):
            update = muon_momentum_(buf, g, hp["momentum"], hp["nesterov"])
            update = zeropower_via_newtonschulz(update, 5, "fixed", 1e-7, compute_dtype=compute_dtype)
            apply_update_(p, update, hp["lr"], adjust_lr(hp["lr"], p.shape, hp["adjust_lr"]), hp["weight_decay"])
    return params


CASES = [
    dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr="match_rms_adamw"),
    dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr="original"),
    dict(lr=0.05, weight_decay=0.0, momentum=0.9, nesterov=False, adjust_lr="original"),
    dict(lr=0.01, weight_decay=0.2, momentum=0.8, nesterov=False, adjust_lr="match_rms_adamw"),
]


def fp32_tolerance(hp, shape, steps=STEPS):
    return steps * adjust_lr(hp["lr"], shape, hp["adjust_lr"]) * NS_ERR


@pytest.mark.parametrize("hp", CASES, ids=lambda hp: f"{hp['adjust_lr']}-nesterov{hp['nesterov']}-wd{hp['weight_decay']}")
def test_composed_pieces_match_torch_muon(hp):
    ref = run_torch_muon(hp)
    init = initial_params()
    for dtype in (torch.bfloat16, torch.float32):
        ours = run_composed(hp, dtype)
        for p, r, p0 in zip(ours, ref, init):
            assert (p - r).abs().max() <= fp32_tolerance(hp, p.shape), dtype
            assert (p - r).norm() <= REL_ERR * (r - p0).norm(), dtype  # same trajectory up to bf16 noise


def test_composed_pieces_would_notice_a_wrong_setting():
    """The comparison above is sharp enough to tell the settings apart."""
    hp = CASES[0]
    ref = run_torch_muon(hp)
    init = initial_params()
    for wrong in (dict(hp, nesterov=False), dict(hp, adjust_lr="original"), dict(hp, weight_decay=0.0)):
        ours = run_composed(wrong, torch.bfloat16)
        assert any((p - r).norm() > REL_ERR * (r - p0).norm() for p, r, p0 in zip(ours, ref, init)), wrong


# ------------------------------------------------------------------------- optimizer.Muon

Muon = getattr(optimizer, "Muon", None)
needs_muon = pytest.mark.skipif(Muon is None, reason="optimizer.Muon is not available")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = nn.Embedding(10, 32)
        self.a = nn.Linear(32, 96)  # weight [96, 32] tall, bias 1-D
        self.b = nn.Linear(96, 32, bias=False)  # [32, 96] wide
        self.norm = nn.LayerNorm(32)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def set_grads(named_params, step):
    g = torch.Generator().manual_seed(2000 + step)
    for _, p in named_params:
        p.grad = torch.randn(p.shape, generator=g)


def torch_reference(hp, steps, adamw_betas, adamw_eps):
    """torch.optim.Muon on the matrices, torch.optim.AdamW on the rest, same grads."""
    net = Net()
    muon_g, adamw_g = get_default_muon_param_groups(net)
    tm = torch.optim.Muon(muon_g["params"], lr=hp["lr"], weight_decay=hp["weight_decay"], momentum=hp["momentum"],
                          nesterov=hp["nesterov"], adjust_lr_fn=hp["adjust_lr"])
    ta = torch.optim.AdamW(adamw_g["params"], lr=hp["lr"], betas=adamw_betas, eps=adamw_eps,
                           weight_decay=hp["weight_decay"], foreach=True)
    for t in range(steps):
        set_grads(net.named_parameters(), t)
        tm.step()
        ta.step()
    return dict(net.named_parameters()), set(muon_g["param_names"])


@needs_muon
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, None])
@pytest.mark.parametrize("hp", CASES[:3], ids=lambda hp: f"{hp['adjust_lr']}-nesterov{hp['nesterov']}")
def test_optimizer_muon_matches_torch(hp, compute_dtype):
    betas, eps = (0.9, 0.95), 1e-8
    ref, muon_names = torch_reference(hp, STEPS, betas, eps)
    net = Net()
    opt = Muon(get_default_muon_param_groups(net), lr=hp["lr"], weight_decay=hp["weight_decay"],
               momentum=hp["momentum"], nesterov=hp["nesterov"], adjust_lr=hp["adjust_lr"],
               adamw_betas=betas, adamw_eps=eps, compute_dtype=compute_dtype)
    init = dict(Net().named_parameters())
    for t in range(STEPS):
        set_grads(net.named_parameters(), t)
        opt.step()
    assert muon_names == {"a.weight", "b.weight"}
    for name, p in net.named_parameters():
        r = ref[name].detach()
        if name not in muon_names:  # the AdamW path: torch's own functional AdamW
            torch.testing.assert_close(p.detach(), r, atol=1e-6, rtol=0, msg=name)
        else:
            assert (p - r).abs().max() <= fp32_tolerance(hp, p.shape), name
            assert (p - r).norm() <= REL_ERR * (r - init[name]).norm(), name


class Attn(nn.Module):
    def __init__(self, d=16, head_dim=4, n_q=4, n_kv=2):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.layers = nn.ModuleList([nn.Module()])
        blk = self.layers[0]
        blk.q_proj = nn.Linear(d, n_q * head_dim, bias=False)
        blk.k_proj = nn.Linear(d, n_kv * head_dim, bias=False)
        blk.v_proj = nn.Linear(d, n_kv * head_dim, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@needs_muon
def test_optimizer_muon_qk_clip_scales_updated_weights():
    """With QK-clip the q/k rows of heads over the threshold end up as the unclipped step's
    weights times sqrt(threshold / logit) (q) and the group minimum of that (k, GQA)."""
    head_dim, threshold = 4, 10.0
    logits = torch.tensor([5.0, 40.0, 10.0, 12.5])  # heads 1 and 3 over; kv groups {0,1}, {2,3}

    def run(clip):
        net = Attn()
        cfg = optimizer.QKClipConfig(head_dim=head_dim, threshold=threshold)
        opt = Muon(get_default_muon_param_groups(net), lr=0.02, qk_clip=cfg if clip else None)
        set_grads(net.named_parameters(), 0)
        opt.step(qk_logits={0: logits} if clip else None)
        return {n: p.detach().clone() for n, p in net.named_parameters()}

    plain, clipped = run(False), run(True)
    q_scale = [(threshold / v) ** 0.5 if v > threshold else 1.0 for v in logits.tolist()]
    k_scale = [min(q_scale[0:2]), min(q_scale[2:4])]
    for name, scales in (("layers.0.q_proj.weight", q_scale), ("layers.0.k_proj.weight", k_scale)):
        want = plain[name].clone()
        for r in range(want.shape[0]):
            want[r] *= scales[r // head_dim]
        torch.testing.assert_close(clipped[name], want, atol=1e-7, rtol=1e-6, msg=name)
    assert torch.equal(clipped["layers.0.v_proj.weight"], plain["layers.0.v_proj.weight"])
