"""Dion2 and NorDion2 inside ``Muon.step`` (groups with ``dion2_fraction``; single device, plain
tensors) against the fp64 reference written from the formulas (``tests/dion2_reference.py``).

What a step must do, read off the optimizer's own tensors only: the slices that moved (any entry
not exactly ``W (1 - lr wd)``) are the reference's chosen slices; every other slice is exactly
``W (1 - lr wd)``; the momentum is bit for bit the reference's (the chosen slices ``ef_decay``
times the accumulated sum, the rest the sum); the weights within the roundings of the two orders
of operations.  Every Newton–Schulz form and backend a group can ask for (classic, Gram, fixed and
Polar Express coefficients, ``ns_kernels``) orthogonalises the chosen submatrix: the reference
runs the project's classic fp64 iteration with the group's coefficients, so a group option that
did not reach the submatrix shows as a difference far above the bound.
"""

from __future__ import annotations

import pytest
import torch

import dion2_reference as ref
from optimizer import Muon
from optimizer.newton_schulz import zeropower_via_newtonschulz
from tolerances import newton_schulz_atol, normuon_rtol, unit_roundoff

LR, WD, EF, BETA2, FRACTION = 0.02, 0.1, 0.9, 0.9, 0.3
SHAPES = {"wide": (8, 24), "tall": (24, 8), "square": (12, 12), "experts": (3, 10, 16), "tall experts": (2, 18, 6)}
U64 = unit_roundoff(torch.float64)


def _ns(coefficients="polar_express", steps=5):
    """The reference's orthogonalisation: the project's classic iteration in fp64 (its own tests
    hold it to the formulas), with the group's coefficients."""
    def orth(x):
        return zeropower_via_newtonschulz(x.contiguous(), ns_steps=steps, coefficients=coefficients,
                                          compute_dtype=torch.float64, method="classic", ns_kernels="torch")
    return orth


def _grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(steps + 1)]


def moved_slices(before: torch.Tensor, after: torch.Tensor, dim: int) -> list[list[int]]:
    """Per matrix of the stack: the slices (rows for dim -2, columns for -1) with an entry that is
    not exactly the decayed weight ``before (1 - lr wd)``."""
    decayed = before * (1 - LR * WD)
    moved = (after != decayed).reshape(-1, *after.shape[-2:])
    along = moved.any(dim=-1) if dim == -2 else moved.any(dim=-2)
    return [torch.nonzero(row).flatten().tolist() for row in along]


def run_against_reference(shape, *, nor=False, steps=3, adjust_lr="spectral_norm", ns=None, ref_ns=None,
                          cautious=False, maximize=False, transposed=False, fraction=FRACTION, seed=0,
                          ref_adjust="spectral_norm", **group):
    """Step a Dion2 (NorDion2 with ``nor``) group and the reference side by side and assert the
    module docstring's claims at every step; ``ns``: the group's Newton–Schulz options."""
    ns = ns or {"ns_coefficients": "polar_express", "ns_method": "classic", "ns_kernels": "torch"}
    ref_ns = ref_ns or _ns(ns["ns_coefficients"], ns.get("ns_steps", 5))
    W, *grads = _grads(shape, steps, seed)
    stored = W.mT.contiguous() if transposed else W.clone()
    p = torch.nn.Parameter(stored)
    extra = {"normuon_beta2": BETA2} if nor else {}
    if transposed:
        extra["muon_transposed"] = True
    opt = Muon([{"params": [p], "use_muon": True, "param_names": ["w"], **extra, **group}], lr=LR, weight_decay=WD,
               dion2_fraction=fraction, dion2_ef_decay=EF, adjust_lr=adjust_lr, compute_dtype=torch.float64,
               cautious_wd=cautious, maximize=maximize, **ns)
    view = (lambda t: t.mT) if transposed else (lambda t: t)
    rw, rm = W.clone(), torch.zeros_like(W)
    rv = torch.zeros(*shape[:-1], 1, dtype=torch.float64) if nor else None
    adjusted = ref.adjust(LR, shape, ref_adjust)
    for t, G in enumerate(grads, start=1):
        before = view(p.detach()).clone()
        p.grad = G.mT.contiguous() if transposed else G.clone()
        opt.step()
        r = ref.step(rw, G, rm, fraction=fraction, ef_decay=EF, lr=LR, weight_decay=WD, adjust_lr=ref_adjust,
                     orthogonalize=ref_ns, row_state=rv, beta2=BETA2 if nor else None, cautious=cautious,
                     maximize=maximize)
        after = view(p.detach())
        if not cautious:  # cautious decay changes chosen entries by the mask: moved != chosen there
            assert moved_slices(before, after, r.dim) == r.chosen, f"step {t}: the slices that moved"
        assert torch.equal(view(opt.state[p]["momentum_buffer"]), r.momentum), f"step {t}: momentum"
        hat_rtol, v_rtol = normuon_rtol(max(map(len, r.chosen)), shape[-1], torch.float64, BETA2) if nor else (0, 0)
        k_shape = (max(map(len, r.chosen)), shape[-1]) if r.dim == -2 else (shape[-2], max(map(len, r.chosen)))
        ns_atol = newton_schulz_atol(k_shape, torch.float64, ns_steps=ns.get("ns_steps", 5),
                                     coefficients=ns["ns_coefficients"], method="classic")
        scale = float(r.update.abs().max())
        atol = t * (2 * U64 * float(rw.abs().max() + adjusted * scale) + adjusted * (2 * ns_atol + hat_rtol * scale))
        torch.testing.assert_close(after, r.weight, atol=atol, rtol=0, msg=lambda s: f"step {t}: weights: {s}")
        if nor:
            torch.testing.assert_close(opt.state[p]["normuon_v"], r.row_state, atol=0, rtol=t * v_rtol + 2 * t * ns_atol)
        rw, rm, rv = r.weight, r.momentum, r.row_state
    return opt, p


@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "match_rms_adamw", None])
@pytest.mark.parametrize("name", SHAPES)
def test_dion2_group_matches_the_reference(name, adjust_lr):
    # Muon's "match_rms_adamw" is dion's "rms_norm" (0.2 sqrt(max(A, B)))
    run_against_reference(SHAPES[name], adjust_lr=adjust_lr,
                          ref_adjust={"match_rms_adamw": "rms_norm"}.get(adjust_lr, adjust_lr))


@pytest.mark.parametrize("name", SHAPES)
def test_nordion2_group_matches_the_reference(name):
    run_against_reference(SHAPES[name], nor=True, fraction=0.5)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
@pytest.mark.parametrize("method", ["classic", "gram"])
@pytest.mark.parametrize("coefficients", ["fixed", "polar_express"])
def test_every_newton_schulz_form_orthogonalises_the_submatrix(coefficients, method, kernels):
    ns = {"ns_coefficients": coefficients, "ns_method": method, "ns_kernels": kernels, "ns_steps": 6}
    run_against_reference((8, 24), ns=ns)
    run_against_reference((2, 18, 6), ns=ns, nor=True, fraction=0.5)


@pytest.mark.parametrize("variant", [dict(cautious=True), dict(maximize=True), dict(transposed=True),
                                     dict(nor=True, cautious=True), dict(nor=True, transposed=True)])
def test_variants_match_the_reference(variant):
    run_against_reference((8, 24), **variant)
    run_against_reference((24, 8), **variant)


def test_a_wrong_coefficient_table_is_caught():
    """The comparison sees the Newton–Schulz options: the group's 'fixed' against the reference's
    Polar Express is far outside the bound."""
    with pytest.raises(AssertionError, match="weights"):
        run_against_reference((8, 24), ns={"ns_coefficients": "fixed", "ns_method": "classic", "ns_kernels": "torch"},
                              ref_ns=_ns("polar_express"))


def test_bf16_momentum_of_fp32_parameters():
    """``momentum_dtype=torch.bfloat16``: the sum and the decay each rounded once as stored."""
    W, *grads = _grads((8, 24), 3, seed=5)
    p = torch.nn.Parameter(W.float())
    opt = Muon([{"params": [p], "use_muon": True}], lr=LR, weight_decay=WD, dion2_fraction=0.25, dion2_ef_decay=EF,
               momentum_dtype=torch.bfloat16, ns_kernels="torch")
    rm = torch.zeros_like(W)
    for G in grads:
        p.grad = G.float()
        opt.step()
        # sums of bf16 + fp32 values are exact in fp64, so rounding each to bf16 once is the rule
        r = ref.step(p.detach().double(), G.float().double(), rm, fraction=0.25, ef_decay=EF, lr=LR, weight_decay=WD,
                     store=lambda t: t.bfloat16().double())
        rm = r.momentum
        assert opt.state[p]["momentum_buffer"].dtype == torch.bfloat16
        assert torch.equal(opt.state[p]["momentum_buffer"].double(), rm)


def test_muon_and_dion2_groups_side_by_side():
    """A Muon group next to a Dion2 group steps exactly as in an optimizer of its own."""
    Wm, Wd, Gm, Gd = _grads((12, 20), 3, seed=7)
    a, b, solo = (torch.nn.Parameter(t.clone()) for t in (Wm, Wd, Wm))
    both = Muon([{"params": [a], "use_muon": True}, {"params": [b], "use_muon": True, "dion2_fraction": 0.25}],
                lr=LR, weight_decay=WD, compute_dtype=torch.float64)
    alone = Muon([{"params": [solo], "use_muon": True}], lr=LR, weight_decay=WD, compute_dtype=torch.float64)
    a.grad, b.grad, solo.grad = Gm.clone(), Gd.clone(), Gm.clone()
    both.step()
    alone.step()
    assert torch.equal(a, solo)
    assert "momentum" in both.param_groups[0] and "momentum" not in both.param_groups[1]
    assert moved_slices(Wd, b.detach(), -2) == ref.step(Wd, Gd, torch.zeros_like(Wd), fraction=0.25, ef_decay=0.95,
                                                         lr=LR, weight_decay=WD).chosen


def test_tensor_lr_is_used_as_a_tensor():
    W, G = _grads((8, 24), 1, seed=9)
    p, q = torch.nn.Parameter(W.clone()), torch.nn.Parameter(W.clone())
    kw = dict(weight_decay=WD, dion2_fraction=0.5, compute_dtype=torch.float64)
    opt_t = Muon([{"params": [p], "use_muon": True}], lr=torch.tensor([LR], dtype=torch.float64), **kw)
    opt_f = Muon([{"params": [q], "use_muon": True}], lr=LR, **kw)
    p.grad, q.grad = G.clone(), G.clone()
    opt_t.step()
    opt_f.step()
    torch.testing.assert_close(p, q, atol=4 * U64, rtol=0)
