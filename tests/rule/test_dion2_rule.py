"""``optimizer.dion2.rule`` (Dion2/NorDion2's rule as pure functions of local tensors) against the
fp64 reference written from the formulas (``tests/dion2_reference.py``) and against formulas and
index math written here: k and the dim, the top-k with its tie rule, partial norms of pieces
(uneven, empty, interleaved) summed in member order, the chosen slices' gather and scatter, the
momentum and its error feedback (bit for bit, fp64 and bf16 storage), the sparse update with
dion's lr rules, NorDion2's normalisation, experts, bad input.  The last tests break the rule on
purpose and show the comparison catches it.
"""

from __future__ import annotations

import math

import pytest
import torch

import dion2_reference as ref
import optimizer.dion2.rule as dr
from optimizer.dion2.constructors import ADJUST_LR as DION_TO_MUON_ADJUST_LR
from optimizer.rule import adjust_lr
from optimizer.newton_schulz import zeropower_via_newtonschulz
from tolerances import gamma, normuon_rtol, unit_roundoff

LR, WD, EF, BETA2 = 0.02, 0.1, 0.9, 0.9
SHAPES = {"wide": (8, 24), "tall": (24, 8), "square": (12, 12), "experts": (3, 10, 16), "tall experts": (2, 18, 6)}
U64 = unit_roundoff(torch.float64)


def polar(x: torch.Tensor) -> torch.Tensor:
    """One orthogonalisation for both sides, on the same bits: the exact polar factor (fp64 SVD)
    of a contiguous copy (an SVD's rounding depends on the memory layout)."""
    return ref.polar_factor(x.contiguous())


def _inputs(shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]


# ---------------------------------------------------------------- k, the dim, the selection


@pytest.mark.parametrize("fraction,size,k", [
    (0.25, 16, 4), (0.25, 17, 5), (1.0, 13, 13), (0.001, 10, 1), (0.07, 100, 8), (0.5, 0, 0), (1, 3, 3),
])
def test_chosen_count_is_dions_rounding(fraction, size, k):
    assert dr.chosen_count(fraction, size) == k


def test_chosen_count_and_dim_match_the_reference_on_a_grid():
    for f100 in range(1, 101):
        for size in (1, 2, 3, 7, 10, 64, 100, 127, 300, 1000, 4096, 14336):
            assert dr.chosen_count(f100 / 100, size) == ref.chosen_count(f100 / 100, size), (f100, size)
    for shape in [(1, 5), (5, 1), (5, 5), (4, 7, 3), (2, 3, 3, 9)]:
        for rows_only in (False, True):
            assert dr.selection_dim(shape, rows_only) == ref.selection_dim(shape, rows_only)


def test_choose_is_the_top_k_with_ties_lower_index_first():
    g = torch.Generator().manual_seed(0)
    norms = torch.randint(0, 6, (5, 40), generator=g).double()  # many exact ties
    for k in (0, 1, 7, 13, 40):
        got = dr.choose(norms, k)
        assert got.dtype == torch.long and got.shape == (5, k)
        for b in range(5):
            assert got[b].tolist() == ref.choose(norms[b].tolist(), k), (k, b)
    zeros = torch.zeros(9, dtype=torch.float64)
    assert dr.choose(zeros, 3).tolist() == [0, 1, 2]
    with_nan = torch.tensor([1.0, float("nan"), 3.0, 2.0], dtype=torch.float64)
    assert dr.choose(with_nan, 2).tolist() == [1, 2]  # NaN sorts above every number
    with pytest.raises(ValueError, match="k=5"):
        dr.choose(zeros[:4], 5)


def _pieces(n: int) -> list[torch.Tensor]:
    """Column pieces of an n-column matrix as a solver might leave them: uneven chunks, an empty
    one, and an interleaved (strided) split."""
    cut = [0, 5, 5, n // 2, n]
    chunks = [torch.arange(a, b) for a, b in zip(cut, cut[1:])]
    strided = [torch.arange(r, n, 3) for r in range(3)]
    return chunks + strided


def test_partial_norms_of_pieces_summed_in_member_order():
    g = torch.Generator().manual_seed(1)
    m, n = 6, 37
    x = torch.randn(m, n, generator=g, dtype=torch.float64) * torch.logspace(-6, 6, n, dtype=torch.float64)
    whole = dr.partial_slice_norms(x, dr.ROWS)
    exact = torch.tensor(ref.slice_norms(x, -2), dtype=torch.float64)
    for split in (_pieces(n)[:4], _pieces(n)[4:]):
        parts = [dr.partial_slice_norms(x[:, cols], dr.ROWS) for cols in split]
        summed = dr.sum_partials(parts)
        assert summed.dtype == torch.float64
        # each within gamma(n) of the exact sum, whatever the order
        torch.testing.assert_close(summed, exact, atol=0, rtol=gamma(n, torch.float64))
        torch.testing.assert_close(whole, exact, atol=0, rtol=gamma(n, torch.float64))
        expected = parts[0].clone()
        for p in parts[1:]:
            expected = expected + p  # member order, written out
        assert torch.equal(summed, expected)
        assert torch.equal(dr.choose(summed, 2), dr.choose(whole, 2))
    # values whose sums are exact in float64 (integers): every order gives the same bits
    ints = torch.randint(-1000, 1000, (m, n), generator=g).double()
    for split in (_pieces(n)[:4], _pieces(n)[4:]):
        summed = dr.sum_partials([dr.partial_slice_norms(ints[:, c], dr.ROWS) for c in split])
        assert torch.equal(summed, dr.partial_slice_norms(ints, dr.ROWS))
    # columns: partial norms over row pieces; bf16 pieces are summed in float64
    xb = x[:, :8].bfloat16()
    cols = dr.sum_partials([dr.partial_slice_norms(xb[r], dr.COLUMNS) for r in ([0, 1], [2], [3, 4, 5])])
    torch.testing.assert_close(cols, xb.double().abs().sum(0), atol=0, rtol=gamma(m, torch.float64))


def test_take_and_put_slices_against_indexing():
    g = torch.Generator().manual_seed(2)
    t = torch.randn(3, 6, 9, generator=g, dtype=torch.float64)
    rows = torch.tensor([[0, 2, 5], [1, 3, 4], [0, 1, 2]])
    cols = torch.tensor([[1, 8], [0, 4], [3, 7]])
    sub_r, sub_c = dr.take_slices(t, rows, dr.ROWS), dr.take_slices(t, cols, dr.COLUMNS)
    for e in range(3):
        assert torch.equal(sub_r[e], t[e][rows[e]]) and torch.equal(sub_c[e], t[e][:, cols[e]])
    out = t.clone()
    dr.put_slices_(out, rows, dr.ROWS, -sub_r)
    for e in range(3):
        untouched = [i for i in range(6) if i not in rows[e].tolist()]
        assert torch.equal(out[e][rows[e]], -t[e][rows[e]]) and torch.equal(out[e][untouched], t[e][untouched])
    out = t.clone()
    dr.put_slices_(out, cols, dr.COLUMNS, 2 * sub_c)
    for e in range(3):
        assert torch.equal(out[e][:, cols[e]], 2 * t[e][:, cols[e]])


# ---------------------------------------------------------------- the step against the reference


def _adjusted(shape, mode):
    return ref.adjust(LR, shape, mode)


def _compare(shape, *, nor=False, adjust_lr="spectral_norm", cautious=False, maximize=False, steps=3,
             fraction=0.3, orthogonalize=polar, seed=0):
    """Run the rule and the reference side by side for ``steps`` steps (the same gradients) and
    assert: the same chosen slices, the momentum bit for bit, weights and v within the roundings
    the two orders of operations allow (per step; the differences add up over the steps)."""
    W, _, _ = _inputs(shape, seed)
    grads = [_inputs(shape, seed + 100 + i)[0] for i in range(steps)]
    v = torch.zeros(*shape[:-1], 1, dtype=torch.float64) if nor else None
    rw, rm, rv = W.clone(), torch.zeros_like(W), None if v is None else v.clone()
    ew, em, ev = W.clone(), torch.zeros_like(W), v
    beta2 = BETA2 if nor else None
    m, n = shape[-2:]
    adjusted = _adjusted(shape, adjust_lr)
    for t, G in enumerate(grads, start=1):
        sel, rv = dr.dion2_step_(rw, G, rm, fraction=fraction, ef_decay=EF, lr=LR, adjusted=adjusted, weight_decay=WD,
                                 orthogonalize=orthogonalize, row_state=rv, normuon_beta2=beta2, cautious=cautious,
                                 maximize=maximize)
        r = ref.step(ew, G, em, fraction=fraction, ef_decay=EF, lr=LR, weight_decay=WD, adjust_lr=adjust_lr,
                     orthogonalize=orthogonalize, row_state=ev, beta2=beta2, cautious=cautious, maximize=maximize)
        ew, em, ev = r.weight, r.momentum, r.row_state
        assert sel.dim == r.dim
        assert sel.indices.reshape(-1, sel.indices.shape[-1]).tolist() == r.chosen, f"step {t}: chosen slices"
        assert torch.equal(rm, em), f"step {t}: momentum"
        # the update: W c - adjusted D, with or without an FMA: 2u of the terms; NorDion2's
        # normalisation in another order: normuon_rtol of the k x n submatrix, relative to D
        k = dr.chosen_count(fraction, m)
        hat_rtol, v_rtol = normuon_rtol(k, n, torch.float64, BETA2) if nor else (0.0, 0.0)
        atol = t * (2 * U64 * float(W.abs().max() + adjusted * r.update.abs().max())
                    + adjusted * hat_rtol * float(r.update.abs().max()))
        torch.testing.assert_close(rw, ew, atol=atol, rtol=0, msg=lambda s: f"step {t}: weights: {s}")
        if nor:
            torch.testing.assert_close(rv, ev, atol=0, rtol=t * v_rtol, msg=lambda s: f"step {t}: v: {s}")


@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm", None])
@pytest.mark.parametrize("name", SHAPES)
def test_dion2_step_matches_the_reference(name, adjust_lr):
    _compare(SHAPES[name], adjust_lr=adjust_lr)


@pytest.mark.parametrize("name", SHAPES)
def test_nordion2_step_matches_the_reference(name):
    _compare(SHAPES[name], nor=True, fraction=0.5)


@pytest.mark.parametrize("variant", [dict(cautious=True), dict(maximize=True), dict(nor=True, cautious=True)])
def test_variants_match_the_reference(variant):
    _compare((8, 24), **variant)
    _compare((2, 18, 6), **variant)


def test_project_newton_schulz_on_expert_submatrices():
    """The chosen submatrices of an expert stack go through Newton–Schulz as one batch
    ``[E, k, n]``: the project's iteration (fp64, classic) on both sides."""
    def ns(x):
        return zeropower_via_newtonschulz(x.contiguous(), ns_steps=5, coefficients="polar_express",
                                          compute_dtype=torch.float64, method="classic", ns_kernels="torch")
    _compare((3, 10, 16), orthogonalize=ns)
    _compare((2, 18, 6), orthogonalize=ns, nor=True, fraction=0.5)


def test_unchosen_entries_are_exactly_decayed_and_the_ef_decay_is_after_the_read():
    W, G, M = _inputs((8, 24), seed=3)
    w, m = W.clone(), M.clone()
    sel, _ = dr.dion2_step_(w, G, m, fraction=0.25, ef_decay=0.0, lr=LR, adjusted=LR, weight_decay=WD,
                            orthogonalize=polar)
    K = sel.indices.tolist()
    others = [i for i in range(8) if i not in K]
    assert torch.equal(w[others], W[others] * (1 - LR * WD))
    assert torch.equal(m[others], (M + G)[others]) and torch.equal(m[K], torch.zeros(len(K), 24, dtype=torch.float64))
    torch.testing.assert_close(W[K] * (1 - LR * WD) - w[K], LR * polar((M + G)[K]), atol=1e-14, rtol=0)


@pytest.mark.parametrize("maximize", [False, True])
def test_bf16_momentum_of_fp32_parameters(maximize):
    """The sum in fp32 rounded once into the bf16 buffer; the norms from the buffer as stored;
    the chosen slices read as stored (fp32) before the decay, decayed in fp32 and rounded once."""
    W, G, M = _inputs((8, 24), seed=4, dtype=torch.float32)
    buf = M.bfloat16()
    seen = []
    sel, _ = dr.dion2_step_(W.clone(), G, buf, fraction=0.25, ef_decay=EF, lr=LR, adjusted=LR, weight_decay=WD,
                            orthogonalize=lambda u: seen.append(u) or polar(u).float(), maximize=maximize)
    acc = ((M.bfloat16().float() - G) if maximize else (M.bfloat16().float() + G)).bfloat16()
    K = ref.choose(ref.slice_norms(acc.double(), -2), 2)
    assert sel.indices.tolist() == K
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0], acc[K].float())
    others = [i for i in range(8) if i not in K]
    assert buf.dtype == torch.bfloat16 and torch.equal(buf[others], acc[others])
    assert torch.equal(buf[K], (acc[K].float() * EF).bfloat16())


def test_tensor_lr_and_degenerate_shapes():
    W, G, M = _inputs((8, 24), seed=5)
    a, b = W.clone(), W.clone()
    dr.dion2_step_(a, G, M.clone(), fraction=0.25, ef_decay=EF, lr=torch.tensor(LR, dtype=torch.float64),
                   adjusted=torch.tensor(LR, dtype=torch.float64), weight_decay=WD, orthogonalize=polar)
    dr.dion2_step_(b, G, M.clone(), fraction=0.25, ef_decay=EF, lr=LR, adjusted=LR, weight_decay=WD,
                   orthogonalize=polar)
    torch.testing.assert_close(a, b, atol=2 * U64 * float(W.abs().max() + LR), rtol=0)
    for shape in [(0, 5), (3, 0, 4), (1, 8)]:
        W, G, M = _inputs(shape, seed=6)
        w, m = W.clone(), M.clone()
        sel, _ = dr.dion2_step_(w, G, m, fraction=0.25, ef_decay=EF, lr=LR, adjusted=LR, weight_decay=WD,
                                orthogonalize=polar)
        k = dr.chosen_count(0.25, shape[sel.dim])
        assert sel.indices.shape == (*shape[:-2], k)
        r = ref.step(W, G, M, fraction=0.25, ef_decay=EF, lr=LR, weight_decay=WD, adjust_lr=None, orthogonalize=polar)
        assert torch.equal(m, r.momentum)
        torch.testing.assert_close(w, r.weight, atol=4 * U64, rtol=0)


def test_bad_input_is_refused_by_name():
    for bad in (0, 0.0, -0.1, 1.5, True, "0.25", float("nan")):
        with pytest.raises(ValueError, match="param_groups\\[0\\] dion2_fraction.*\\(0, 1\\]"):
            dr.check_fraction(bad, "param_groups[0] dion2_fraction")
    dr.check_fraction(None, "dion2_fraction")
    dr.check_fraction(1, "dion2_fraction")
    for bad in (-0.5, float("inf"), float("nan"), None, False):
        with pytest.raises(ValueError, match="`dion2_ef_decay` must be a finite number >= 0"):
            dr.check_ef_decay(bad, "dion2_ef_decay")
    with pytest.raises(ValueError, match="parameter `norm.weight` has shape \\(16,\\).*AdamW group"):
        dr.check_matrix("norm.weight", (16,))
    with pytest.raises(ValueError, match="adjust_lr"):
        adjust_lr(LR, (4, 4), "rms")
    with pytest.raises(ValueError, match="normuon_beta2"):
        W, G, M = _inputs((4, 4))
        dr.dion2_step_(W, G, M, fraction=0.5, ef_decay=EF, lr=LR, adjusted=LR, weight_decay=WD,
                       orthogonalize=polar, normuon_beta2=0.9)


def test_adjusted_lr_is_dions():
    """The step's lr rule (``rule.adjust_lr``) under dion's modes as the constructors map them."""
    def dion(mode, shape):
        return adjust_lr(0.1, shape, DION_TO_MUON_ADJUST_LR[mode])
    assert dion("spectral_norm", (8, 32)) == 0.1 * math.sqrt(8 / 32)  # below 1: no max(1, .)
    assert dion("rms_norm", (3, 8, 32)) == 0.1 * 0.2 * math.sqrt(32)
    assert dion(None, (8, 32)) == 0.1


# ---------------------------------------------------------------- the comparison catches breaks


def test_breaks_are_caught(monkeypatch):
    """Each break, on its own, makes the comparison with the reference fail."""
    real_choose, real_decay = dr.choose, dr.decay_chosen_

    def ties_higher_first(norms, k):  # the same top-k on distinct norms, the other tie rule
        flipped = real_choose(norms.flip(-1), k)
        return torch.sort(norms.shape[-1] - 1 - flipped, dim=-1).values

    def decays_everything(buf, idx, dim, ef_decay, dtype=None):
        buf.mul_(ef_decay)

    tie_shape = (6, 12)
    breaks = {
        "ties": ("choose", ties_higher_first, dict(seed=7)),
        "decay": ("decay_chosen_", decays_everything, {}),
        "largest": ("choose", lambda n, k: real_choose(-n, k), {}),
        "dim": ("selection_dim", lambda shape, rows_only=False: -1 if shape[-2] <= shape[-1] else -2, {}),
    }
    for name, (attr, fn, kw) in breaks.items():
        with monkeypatch.context() as mp:
            mp.setattr(dr, attr, fn)
            with pytest.raises(AssertionError):
                if name == "ties":
                    _compare_with_ties(tie_shape)
                else:
                    _compare((8, 24), **kw)
    _compare_with_ties(tie_shape)  # and unbroken it passes
    assert dr.decay_chosen_ is real_decay


def _compare_with_ties(shape):
    """Rows with exactly equal norms (permuted copies of one row): the tie rule decides."""
    base = torch.arange(1.0, shape[1] + 1, dtype=torch.float64)
    g = torch.stack([base.roll(i) for i in range(shape[0])])
    sel, _ = dr.dion2_step_(torch.zeros(shape, dtype=torch.float64), g, torch.zeros(shape, dtype=torch.float64),
                            fraction=0.5, ef_decay=EF, lr=LR, adjusted=LR, weight_decay=WD, orthogonalize=polar)
    r = ref.step(torch.zeros(shape), g, torch.zeros(shape), fraction=0.5, ef_decay=EF, lr=LR, weight_decay=WD)
    assert sel.indices.tolist() == r.chosen[0] == [0, 1, 2]
