"""NorMuon, cautious weight decay and low-precision momentum on one device, against a reference
written here from the formulas (float64), not from the code under test:

    B <- mu B + (1 - mu) G                       (stored in momentum_dtype: rounded once per step)
    X <- (1 - mu) G + mu B   (Nesterov)          (B read as stored)
    O <- NS(X)                                   per matrix / expert / row block: the quintic
                                                 iteration, written out below
    v <- beta2 v + (1 - beta2) mean_j O_ij^2     NorMuon, per row (of a block)
    O <- O / (sqrt(v) + 1e-8);  O <- O ||O_before||_F / max(||O||_F, 1e-8)   per matrix / block
    O_block <- O_block adjust(1, block) / adjust(1, W)                       row blocks
    W <- W - lr wd W [W O >= 0] - adjust(lr, W) O                           cautious WD
    W <- W (1 - lr wd) - adjust(lr, W) O                                     otherwise

and AdamW with cautious weight decay (decay only where W and the Adam step agree in sign).
The last tests break each rule on purpose and show the comparison catches it.
"""

from __future__ import annotations

import math

import pytest
import torch

import optimizer.rule as rule
from optimizer.rule import formulas, owner_stage
from optimizer import Muon

COEFFS = (3.4445, -4.7750, 2.0315)
SHAPES = {"wide": (8, 24), "tall": (24, 8), "square": (16, 16), "experts": (3, 12, 20)}
STEPS = 4
HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr="match_rms_adamw")
ATOL = 1e-10  # float64 on both sides: only the order of operations differs


# ---------------------------------------------------------------- the reference


def ref_ns(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Quintic Newton–Schulz of every matrix of ``G`` [..., m, n] (tall ones transposed)."""
    a, b, c = COEFFS
    X = G.double()
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / torch.linalg.matrix_norm(X, keepdim=True).clamp_min(eps)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def ref_adjust(lr: float, shape) -> float:
    return lr * 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def ref_normuon(O, v, beta2):
    v = beta2 * v + (1 - beta2) * (O * O).mean(dim=-1, keepdim=True)
    hat = O / (v.sqrt() + 1e-8)
    norm = torch.linalg.matrix_norm(O, keepdim=True)
    return hat * norm / torch.linalg.matrix_norm(hat, keepdim=True).clamp_min(1e-8), v


class Reference:
    """One weight under the formulas above; ``blocks``: consecutive row-block sizes, or None."""

    def __init__(self, w, beta2=None, cautious=False, blocks=None, momentum_dtype=None, **hp):
        self.hp = {**HP, **hp}
        self.w = w.double().clone()
        self.buf = torch.zeros_like(w, dtype=momentum_dtype or torch.float64)
        self.v = torch.zeros(*w.shape[:-1], 1, dtype=torch.float64)
        self.beta2, self.cautious, self.blocks = beta2, cautious, blocks

    def step(self, g):
        hp, g = self.hp, g.double()
        mu, lr, wd = hp["momentum"], hp["lr"], hp["weight_decay"]
        self.buf = (mu * self.buf.double() + (1 - mu) * g).to(self.buf.dtype)
        B = self.buf.double()
        X = (1 - mu) * g + mu * B if hp["nesterov"] else B
        rows = X.shape[-2]
        blocks = self.blocks or [rows]
        U, start = torch.empty_like(X), 0
        for size in blocks:
            r = slice(start, start + size)
            O = ref_ns(X[..., r, :])
            if self.beta2 is not None:
                O, self.v[..., r, :] = ref_normuon(O, self.v[..., r, :], self.beta2)
            U[..., r, :] = O * ref_adjust(1.0, (size, X.shape[-1])) / ref_adjust(1.0, X.shape)
            start += size
        if self.cautious:
            self.w = self.w - lr * wd * self.w * (self.w * U >= 0)
        else:
            self.w = self.w * (1 - lr * wd)
        self.w = self.w - ref_adjust(lr, X.shape) * U


def grads(shape, steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(steps)]


def initial(shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def ours(w0, gs, dtype=torch.float64, **options):
    """Single-device optimizer.Muon (classic Newton–Schulz, in ``dtype``) on one weight."""
    w = torch.nn.Parameter(w0.to(dtype).clone())
    blocks = options.pop("blocks", None)
    group = {"params": [w], "use_muon": True}
    if blocks:
        group["muon_row_blocks"] = "blocks:" + ",".join(map(str, blocks))
    opt = Muon([group], **{**HP, **options}, ns_method="classic", compute_dtype=dtype)
    for g in gs:
        w.grad = g.to(dtype).clone()
        opt.step()
    return w.detach(), opt.state[w]


def reference(w0, gs, **options):
    ref = Reference(w0, **options)
    for g in gs:
        ref.step(g)
    return ref


# ---------------------------------------------------------------- NorMuon


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("beta2", [0.95, 0.0])
def test_normuon_matches_the_formula(shape, beta2):
    w0, gs = initial(shape), grads(shape)
    w, state = ours(w0, gs, normuon_beta2=beta2)
    ref = reference(w0, gs, beta2=beta2)
    torch.testing.assert_close(w, ref.w, atol=ATOL, rtol=0)
    assert state["normuon_v"].shape == (*shape[:-1], 1) and state["normuon_v"].dtype == torch.float64
    torch.testing.assert_close(state["normuon_v"], ref.v, atol=ATOL, rtol=0)
    # and NorMuon is not Muon (the comparison can tell them apart)
    assert (w - reference(w0, gs).w).abs().max() > 1e-4


def test_normuon_state_is_fp32_for_fp32_and_bf16_parameters():
    for dtype in (torch.float32, torch.bfloat16):
        w0, gs = initial((8, 12)), grads((8, 12))
        w = torch.nn.Parameter(w0.to(dtype))
        opt = Muon([{"params": [w], "use_muon": True}], normuon_beta2=0.9)
        w.grad = gs[0].to(dtype)
        opt.step()
        assert opt.state[w]["normuon_v"].dtype == torch.float32, dtype


@pytest.mark.parametrize("shape, blocks", [((24, 16), [8, 16]), ((3, 20, 12), [4, 4, 12])], ids=["2d", "experts"])
@pytest.mark.parametrize("cautious", [False, True])
def test_normuon_per_row_block_before_its_lr_factor(shape, blocks, cautious):
    """With row blocks, v and the Frobenius rescale are per block, and the normalisation sees the
    orthogonalised block before the block's lr factor (v holds the block's own statistics, as a
    separate weight's would)."""
    w0, gs = initial(shape), grads(shape)
    w, state = ours(w0, gs, normuon_beta2=0.9, cautious_wd=cautious, blocks=blocks)
    ref = reference(w0, gs, beta2=0.9, cautious=cautious, blocks=blocks)
    torch.testing.assert_close(w, ref.w, atol=ATOL, rtol=0)
    torch.testing.assert_close(state["normuon_v"], ref.v, atol=ATOL, rtol=0)


def test_a_row_block_equals_a_separate_weight():
    """The q rows of a fused weight under NorMuon + row blocks move exactly like a separate weight
    of those rows (lr adjusted for its own shape, v of its own rows)."""
    shape, blocks = (24, 16), [8, 16]
    w0, gs = initial(shape), grads(shape)
    fused, state = ours(w0, gs, normuon_beta2=0.9, cautious_wd=True, blocks=blocks)
    alone, alone_state = ours(w0[:8], [g[:8] for g in gs], normuon_beta2=0.9, cautious_wd=True)
    torch.testing.assert_close(fused[:8], alone, atol=ATOL, rtol=0)
    torch.testing.assert_close(state["normuon_v"][:8], alone_state["normuon_v"], atol=ATOL, rtol=0)


# ---------------------------------------------------------------- cautious weight decay


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("beta2", [None, 0.95], ids=["muon", "normuon"])
def test_cautious_weight_decay_matches_the_formula(shape, beta2):
    w0, gs = initial(shape), grads(shape)
    w, _ = ours(w0, gs, normuon_beta2=beta2, cautious_wd=True, weight_decay=0.5)
    ref = reference(w0, gs, beta2=beta2, cautious=True, weight_decay=0.5)
    torch.testing.assert_close(w, ref.w, atol=ATOL, rtol=0)
    plain = reference(w0, gs, beta2=beta2, weight_decay=0.5).w
    assert (w - plain).abs().max() > 1e-4  # the mask matters here


def test_cautious_weight_decay_with_maximize_uses_the_applied_direction():
    """Maximising negates the gradient, so the update and hence the mask flip with it."""
    shape = (8, 24)
    w0, gs = initial(shape), grads(shape)
    w, _ = ours(w0, gs, cautious_wd=True, weight_decay=0.5, maximize=True)
    ref = reference(w0, [-g for g in gs], cautious=True, weight_decay=0.5)
    torch.testing.assert_close(w, ref.w, atol=ATOL, rtol=0)


def ref_adamw(w0, gs, lr, betas, eps, wd, cautious):
    w, m, v = w0.double().clone(), torch.zeros_like(w0, dtype=torch.float64), torch.zeros_like(w0, dtype=torch.float64)
    b1, b2 = betas
    for t, g in enumerate(gs, 1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        step = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        decay = (w * step >= 0) if cautious else torch.ones_like(w)
        w = w - lr * wd * w * decay - lr * step
    return w


@pytest.mark.parametrize("cautious", [False, True])
def test_adamw_groups_with_cautious_weight_decay_match_the_formula(cautious):
    shape = (40,)
    w0, gs = initial(shape), grads(shape, steps=6)
    w = torch.nn.Parameter(w0.clone())
    opt = Muon([{"params": [w], "use_muon": False}], lr=0.05, weight_decay=0.5, adamw_betas=(0.9, 0.95),
               adamw_eps=1e-8, cautious_wd=cautious)
    for g in gs:
        w.grad = g.clone()
        opt.step()
    want = ref_adamw(w0, gs, 0.05, (0.9, 0.95), 1e-8, 0.5, cautious)
    torch.testing.assert_close(w.detach(), want, atol=1e-12, rtol=0)
    assert (want - ref_adamw(w0, gs, 0.05, (0.9, 0.95), 1e-8, 0.5, not cautious)).abs().max() > 1e-4


def test_non_cautious_adamw_groups_stay_torch_adamw_bit_for_bit():
    shape = (6, 5)
    w0, gs = initial(shape, dtype=torch.float32), grads(shape)
    mine, theirs = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt = Muon([{"params": [mine], "use_muon": False}], lr=0.01, weight_decay=0.1, cautious_wd=False)
    ref = torch.optim.AdamW([theirs], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for g in gs:
        mine.grad, theirs.grad = g.float(), g.float()
        opt.step()
        ref.step()
    assert torch.equal(mine, theirs)


def test_cautious_adamw_with_a_tensor_lr_and_bf16_gradients():
    w0, gs = initial((16,), dtype=torch.float32), grads((16,), steps=3)
    w = torch.nn.Parameter(w0.clone())
    w.grad_dtype = None  # bf16 gradients of an fp32 parameter (mixed-precision reductions)
    opt = Muon([{"params": [w], "use_muon": False}], lr=torch.tensor(0.05), weight_decay=0.5, cautious_wd=True)
    for g in gs:
        w.grad = g.to(torch.bfloat16)
        opt.step()
    want = ref_adamw(w0, [g.to(torch.bfloat16) for g in gs], 0.05, (0.9, 0.95), 1e-8, 0.5, True)
    torch.testing.assert_close(w.detach().double(), want, atol=2e-6, rtol=0)


# ---------------------------------------------------------------- low-precision momentum


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_bf16_momentum_is_stored_in_bf16_and_computed_wide(shape):
    w0, gs = initial(shape), grads(shape)
    w, state = ours(w0, gs, momentum_dtype=torch.bfloat16, normuon_beta2=0.9)
    ref = reference(w0, gs, momentum_dtype=torch.bfloat16, beta2=0.9)
    assert state["momentum_buffer"].dtype == torch.bfloat16
    assert torch.equal(state["momentum_buffer"], ref.buf)  # rounded once per step, from the wide value
    torch.testing.assert_close(w, ref.w, atol=ATOL, rtol=0)


@pytest.mark.parametrize("nesterov", [True, False])
def test_newton_schulz_sees_the_compute_dtype_not_the_buffer_dtype(monkeypatch, nesterov):
    seen = []
    from optimizer.newton_schulz.group import NewtonSchulz

    original = NewtonSchulz.__call__
    monkeypatch.setattr(NewtonSchulz, "__call__", lambda self, x: seen.append(x.dtype) or original(self, x))
    w = torch.nn.Parameter(initial((8, 12), dtype=torch.float32))
    opt = Muon([{"params": [w], "use_muon": True}], momentum_dtype="bfloat16", nesterov=nesterov)
    w.grad = torch.ones_like(w)
    opt.step()
    assert seen == [torch.float32] and opt.state[w]["momentum_buffer"].dtype == torch.bfloat16
    assert opt.param_groups[0]["momentum_dtype"] == torch.bfloat16  # a name is normalised to the dtype


# ---------------------------------------------------------------- broken on purpose


def _wrong_mean_dim(o, v, beta2, out_dtype=None):
    o = o.to(v.dtype)
    norm = torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True)
    v = torch.lerp(v, (o * o).mean(dim=-2, keepdim=True).mean(dim=-1, keepdim=True).expand_as(v), 1 - beta2)
    hat = o / (v.sqrt() + 1e-8)
    hat = hat * (norm / torch.linalg.vector_norm(hat, dim=(-2, -1), keepdim=True).clamp_min(1e-8))
    return hat.to(out_dtype or hat.dtype), v


def _factor_first(matrix, blocks, orthogonalize, adjust_lr_mode, v, beta2):
    """The lr factor applied before NorMuon's normalisation."""
    def scaled(x):
        f = rule.block_lr_factor(x.shape[-2], matrix.shape[-2:], adjust_lr_mode)
        return orthogonalize(x) * f
    out, v = original_in_blocks(matrix, blocks, scaled, None, v, beta2)
    return out, v


original_in_blocks = owner_stage._in_blocks


def _wrong_mask_sign(param, update):
    return torch.mul(param, update).le_(0)


@pytest.mark.parametrize("breakage", ["mean over the wrong dim", "lr factor before NorMuon", "mask sign"])
def test_the_comparisons_catch_a_broken_rule(monkeypatch, breakage):
    shape, blocks = (24, 16), [8, 16]
    w0, gs = initial(shape), grads(shape)
    options = dict(beta2=0.9, cautious=True, blocks=blocks, weight_decay=0.5)
    ref = reference(w0, gs, **options)
    if breakage == "mean over the wrong dim":
        monkeypatch.setattr(owner_stage, "normuon_normalize", _wrong_mean_dim)
    elif breakage == "lr factor before NorMuon":
        monkeypatch.setattr(owner_stage, "_in_blocks", _factor_first)
    else:
        monkeypatch.setattr(formulas, "cautious_mask", _wrong_mask_sign)
    w, state = ours(w0, gs, normuon_beta2=0.9, cautious_wd=True, blocks=blocks, weight_decay=0.5)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(w, ref.w, atol=ATOL, rtol=0)
        torch.testing.assert_close(state["normuon_v"], ref.v, atol=ATOL, rtol=0)
