"""The Gram-space Newton-Schulz form, its restart plan, the per-shape choice, and the fp32 norm.

References, all independent of the code under test: an fp64 SVD (the polar factor U V^T of the
input, and its singular values pushed through the NS polynomials in float64, ``scalar_ns``), the
classic form run in the same dtype (what the Gram form must match), torch's FlopCounterMode, and
Dao et al.'s published restart choice for fp16 Polar Express.

Stated accuracy (measured at these sizes, s = 16..64 and aspect ratios 1..8; the bounds asserted
below leave about 2x margin):

* fp32, 5 steps (one segment): the Gram form's singular values follow the fp64 polynomial to
  1.2e-3 (classic: 3e-5) and stay within 4e-4 of the classic form's band; its distance to U V^T
  is the classic form's within 1.3e-3; ||gram - classic|| / ||classic|| <= 3e-3 for full-rank
  inputs and 1.5e-2 for rank-deficient ones (where the noise directions differ). 10 steps (two
  segments of 5): singular values within 4e-3 of the fp64 iteration (classic: 2e-4), 1.3e-2 for
  condition number 1e6.
* bf16: every Gram segment is one step, i.e. the classic iteration, bit for bit (see
  newton_schulz._GRAM_STEP_ERROR_LIMIT). fp16, whose plan has 2-step segments (and bf16 Polar
  Express past 5 steps): singular values within 0.05 of the classic form's band.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import optimizer.newton_schulz as ns_module
from optimizer.rule import adjust_lr, apply_update_
from test_rule import muon_momentum_
from optimizer.newton_schulz import (
    GRAM_MIN_SAVED_FLOPS,
    NS_NORM_SAFETY,
    check_ns_method,
    choose_ns_method,
    gram_restart_plan,
    newton_schulz_flops,
    resolve_ns_coefficients,
    zeropower_via_newtonschulz,
)
from test_newton_schulz import log_spectrum, scalar_ns, with_spectrum
from tolerances import newton_schulz_atol

KINDS = ["randn", "lowrank", "rank1", "cond1e4", "cond1e6"]
RANK_DEFICIENT = {"lowrank", "rank1"}


def make_input(kind, m, n, seed=0):
    """A float64 m x n test matrix: Gaussian, rank min/8 (at least 2), rank 1, or a log-spaced
    spectrum with the given condition number."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    if kind == "randn":
        return torch.randn(m, n, generator=g, dtype=torch.float64)
    if kind in RANK_DEFICIENT:
        r = 1 if kind == "rank1" else max(2, k // 8)
        return torch.randn(m, r, generator=g, dtype=torch.float64) @ torch.randn(r, n, generator=g, dtype=torch.float64)
    return with_spectrum(m, n, log_spectrum(k, float(kind[4:])), seed=seed)


def shapes_for(short, aspect, tall):
    m, n = short, short * aspect
    return (n, m) if tall else (m, n)


def compare_forms(G, name, steps, dtype):
    """Both forms' outputs and, per form, facts about them against the fp64 SVD of G."""
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    r = int((S > S[0] * 1e-9).sum())  # numerical rank: the zero singular values stay zero
    polar = U[:, :r] @ Vh[:r]
    expected = scalar_ns(S, resolve_ns_coefficients(name, steps), NS_NORM_SAFETY[name])[:r].abs().sort().values
    out = {}
    for method in ("classic", "gram"):
        Y = zeropower_via_newtonschulz(G.float(), steps, name, compute_dtype=dtype, method=method)
        assert Y.dtype == dtype and Y.shape == G.shape
        Y = Y.double()
        assert torch.isfinite(Y).all()
        sv = torch.linalg.svdvals(Y)
        out[method] = dict(
            Y=Y,
            top=sv[:r],  # on the input's range
            tail=sv[r:].max().item() if r < len(sv) else 0.0,  # rounding noise lifted by NS
            to_polar=((Y - polar).norm() / polar.norm()).item(),
            to_polynomial=(sv[:r].sort().values - expected).abs().max().item(),
        )
    return out["classic"], out["gram"]


# ------------------------------------------------------------------ accuracy


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("aspect, tall", [(1, False), (2, False), (4, False), (8, False), (2, True), (4, True),
                                          (8, True)], ids=["square", "wide2", "wide4", "wide8", "tall2", "tall4", "tall8"])
@pytest.mark.parametrize("name", ["fixed", "polar_express"])
def test_fp32_gram_matches_classic_and_the_fp64_polynomial(kind, aspect, tall, name):
    G = make_input(kind, *shapes_for(32, aspect, tall))
    classic, gram = compare_forms(G, name, 5, torch.float32)
    assert classic["to_polynomial"] < 1e-4  # the reference itself is right
    assert gram["to_polynomial"] < 3e-3
    assert gram["top"].min() >= classic["top"].min() - 1e-3
    assert gram["top"].max() <= classic["top"].max() + 1e-3
    assert abs(gram["to_polar"] - classic["to_polar"]) < 3e-3
    assert gram["tail"] < 1e-3
    rel = ((gram["Y"] - classic["Y"]).norm() / classic["Y"].norm()).item()
    assert rel < (3e-2 if kind in RANK_DEFICIENT else 1e-2), rel


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(16, 16), (16, 64), (128, 16), (16, 32)])
@pytest.mark.parametrize("dtype, name, steps", [(torch.float16, "fixed", 5), (torch.float16, "polar_express", 5),
                                                (torch.bfloat16, "polar_express", 10)])
def test_low_precision_gram_stays_in_the_classic_band(kind, shape, dtype, name, steps):
    """Plans with 2-step segments in half precision (small matrices: slow on CPU)."""
    assert max(gram_restart_plan(name, steps, dtype)) >= 2
    G = make_input(kind, *shape, seed=1)
    classic, gram = compare_forms(G, name, steps, dtype)
    band = 0.1 if kind in RANK_DEFICIENT else 0.05
    assert gram["top"].min() >= classic["top"].min() - band
    assert gram["top"].max() <= classic["top"].max() + band
    assert gram["to_polar"] <= classic["to_polar"] + 0.05
    assert gram["tail"] <= classic["tail"] + 0.1


@pytest.mark.parametrize("name", ["fixed", "polar_express"])
def test_bf16_gram_is_the_classic_iteration(name):
    """In bf16 the rule allows no 2-step segment in the first 5 steps: the same computation."""
    G = torch.randn(3, 32, 96, generator=torch.Generator().manual_seed(9))
    assert set(gram_restart_plan(name, 5, torch.bfloat16)) == {1}
    gram = zeropower_via_newtonschulz(G, 5, name, compute_dtype=torch.bfloat16, method="gram")
    assert torch.equal(gram, zeropower_via_newtonschulz(G, 5, name, compute_dtype=torch.bfloat16, method="classic"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["rank1", "lowrank", "cond1e4", "cond1e6"])
@pytest.mark.parametrize("name", ["fixed", "polar_express"])
@pytest.mark.parametrize("shape", [(32, 128), (8, 32), (64, 16)])
def test_ten_steps_stay_accurate(dtype, kind, name, shape):
    """Without restarts a rounding-level negative eigenvalue of the Gram matrix grows by q(r)^2
    per step and blows up: measured singular values of 1e3-1e38 at 10 steps on these inputs.
    With one restart too few (6 + 4 steps in fp32), singular values below the rounding level
    were up to 0.16 off. With the plan, in fp32: within 1e-2 of the fp64 iteration (measured
    up to 3.6e-3), 3e-2 for condition number 1e6 (1.3e-2; the Gram matrix squares it past
    1/u); in fp16: in the classic form's band."""
    G = make_input(kind, *shape, seed=2)
    classic, gram = compare_forms(G, name, 10, dtype)
    if dtype == torch.float32:
        # cond 1e6: singular values down to 1e-6, far below the Gram matrix's resolution sqrt(u)
        assert gram["to_polynomial"] < (3e-2 if kind == "cond1e6" else 1e-2)
    top = max(classic["top"].max().item(), classic["tail"])
    assert max(gram["top"].max().item(), gram["tail"]) <= top + 0.1


def test_batched_experts_tall_and_wide_match_per_matrix():
    g = torch.Generator().manual_seed(3)
    for shape in [(6, 24, 96), (2, 3, 160, 40)]:
        G = torch.randn(shape, generator=g)
        out = zeropower_via_newtonschulz(G, 5, "polar_express", method="gram")
        # batched against one by one: another order, compared in float64 against its rounding bound
        # (tests/tolerances.py; in float32 the bound says nothing)
        G64 = G.double()
        out64 = zeropower_via_newtonschulz(G64, 5, "polar_express", compute_dtype=torch.float64, method="gram")
        atol = newton_schulz_atol(shape, torch.float64, coefficients="polar_express", method="gram")
        flat, ref_flat = out64.reshape(-1, *shape[-2:]), G64.reshape(-1, *shape[-2:])
        for i in range(flat.shape[0]):
            one = zeropower_via_newtonschulz(ref_flat[i], 5, "polar_express", compute_dtype=torch.float64,
                                             method="gram")
            torch.testing.assert_close(flat[i], one, atol=atol, rtol=0)
        classic = zeropower_via_newtonschulz(G, 5, "polar_express", method="classic")
        assert (out - classic).norm() / classic.norm() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(24, 96), (3, 96, 24)])
def test_one_step_segments_are_classic_steps_bit_for_bit(dtype, shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    # 1 step: one segment of one step. bf16: the fixed table restarts every step; fp32 needs a
    # table whose second step would be far off at a drift of u a^2: |b| a u > 0.01.
    multi = (5, "fixed") if dtype == torch.bfloat16 else (2, [(3000.0, -100.0, 0.0)] * 2)
    for steps, table in [(1, "fixed"), multi]:
        assert set(gram_restart_plan(table, steps, dtype)) == {1}
        gram = zeropower_via_newtonschulz(G, steps, table, compute_dtype=dtype, method="gram")
        classic = zeropower_via_newtonschulz(G, steps, table, compute_dtype=dtype, method="classic")
        assert torch.isfinite(gram).all() and torch.equal(gram, classic)


def test_symmetric_blocks_give_the_plain_products(monkeypatch):
    """The CPU block shortcut (forced on small matrices, batched too) computes the same products."""
    g = torch.Generator().manual_seed(5)
    for shape in [(37, 20), (3, 64, 9)]:
        L = torch.randn(shape, generator=g, dtype=torch.float64)
        S = L @ L.mT
        monkeypatch.setattr(ns_module, "_SYMMETRIC_MIN_BLOCK", 4)
        torch.testing.assert_close(ns_module._symmetric_product(L, L.mT), S)
        # beta C + alpha P R with P, R polynomials in S (commuting symmetric): symmetric result
        P, R = S @ S + 2 * S, 3 * S - S @ S
        got = ns_module._symmetric_product(P, R, S, beta=0.5, alpha=-2.0)
        torch.testing.assert_close(got, 0.5 * S - 2.0 * P @ R)
        monkeypatch.setattr(ns_module, "_SYMMETRIC_MIN_BLOCK", 128)
    # The forms on small matrices with the shortcut forced on equal the plain products: the same
    # iteration in another order, in float64 against its rounding bound (tests/tolerances.py).
    G = torch.randn(2, 40, 100, generator=g, dtype=torch.float64)
    f64 = dict(compute_dtype=torch.float64)
    plain = {m: zeropower_via_newtonschulz(G, 5, method=m, **f64) for m in ("classic", "gram")}
    monkeypatch.setattr(ns_module, "_SYMMETRIC_MIN_BLOCK", 4)
    monkeypatch.setattr(ns_module, "_uses_symmetric_blocks", lambda X: True)
    for method, ref in plain.items():
        torch.testing.assert_close(zeropower_via_newtonschulz(G, 5, method=method, **f64), ref,
                                   atol=newton_schulz_atol(G.shape, torch.float64, method=method), rtol=0)


# ------------------------------------------------------------------ Muon over several steps


def run_muon(shapes, method, dtype, steps=6, lr=0.02):
    """Muon's single-device step from its pure pieces, on a least-squares problem per matrix so
    each step's gradient depends on the weights the previous steps produced."""
    g = torch.Generator().manual_seed(6)
    weights = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    targets = [torch.randn(s, generator=g) for s in shapes]
    bufs = [torch.zeros(s) for s in shapes]
    for _ in range(steps):
        for W, T, buf in zip(weights, targets, bufs):
            grad = W - T  # d/dW of ||W - T||^2 / 2
            update = muon_momentum_(buf, grad, 0.95, True)
            update = zeropower_via_newtonschulz(update, 5, "fixed", compute_dtype=dtype, method=method)
            apply_update_(W, update, lr, adjust_lr(lr, W.shape, "match_rms_adamw"), 0.1)
    return weights


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 5e-2), (torch.bfloat16, 0.0)])
def test_muon_with_gram_equals_muon_with_classic_over_steps(dtype, tolerance):
    """||W_gram - W_classic|| / ||W_classic - W_0|| after 6 steps (the total change). Measured:
    fp32 8e-7; fp16 (2-step segments) 2e-3; bf16 0 (the same computation)."""
    shapes = [(48, 192), (192, 48), (3, 32, 128)] if dtype == torch.float32 else [(16, 64), (2, 64, 16)]
    g = torch.Generator().manual_seed(6)
    initial = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    classic = run_muon(shapes, "classic", dtype)
    gram = run_muon(shapes, "gram", dtype)
    for w0, c, r in zip(initial, classic, gram):
        assert ((r - c).norm() / (c - w0).norm()).item() <= tolerance


# ------------------------------------------------------------------ restart plan


def test_plan_reproduces_dao_et_al_restart_for_fp16_polar_express(monkeypatch):
    """Zhang, Amsel, Chen, Dao restart 5-step Polar Express in fp16 after step 2 (autotuned by
    simulating a negatively perturbed eigenvalue against blow-up). Our rule with a blow-up-only
    limit (a step factor up to 10% off) lands there too, on our table; with ours (1%) it
    restarts earlier and more often."""
    assert gram_restart_plan("polar_express", 5, torch.float16) == (1, 2, 2)
    monkeypatch.setattr(ns_module, "_GRAM_STEP_ERROR_LIMIT", 0.1)
    ns_module._restart_plan.cache_clear()
    try:
        assert gram_restart_plan("polar_express", 5, torch.float16) == (2, 3)
    finally:
        ns_module._restart_plan.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["fixed", "polar_express"])
@pytest.mark.parametrize("steps", [1, 2, 5, 8, 10, 20])
def test_plan_segments_keep_the_negative_eigenvalue_small_and_are_maximal(dtype, name, steps):
    """Every step of a segment after its first has its factor q(r) = a + b r + c r^2 within the
    limit of q(0) at the drifted eigenvalue; the step after the segment would not (else the
    segment would have been longer)."""
    plan = gram_restart_plan(name, steps, dtype)
    assert sum(plan) == steps and all(length >= 1 for length in plan)
    table = resolve_ns_coefficients(name, steps)
    u = torch.finfo(dtype).eps / 2
    limit = ns_module._GRAM_STEP_ERROR_LIMIT

    def off(r, a, b, c):  # |q(r) - q(0)| / |q(0)|, bounded termwise
        return (abs(b * r) + abs(c * r * r)) / abs(a)

    first = 0
    for length in plan:
        r = -u
        for j, (a, b, c) in enumerate(table[first : first + length]):
            assert j == 0 or off(r, a, b, c) <= limit  # a segment's first step is a classic step's
            r = r * (a + b * r + c * r * r) ** 2
        first += length
        if first < steps:
            assert off(r, *table[first]) > limit


def test_plans_per_dtype():
    """fp32 runs 5 steps in one segment, bf16 one step per segment (see _GRAM_STEP_ERROR_LIMIT)."""
    assert gram_restart_plan("fixed", 5, torch.float32) == (5,)
    assert gram_restart_plan("polar_express", 5, torch.float32) == (5,)
    assert gram_restart_plan("fixed", 5) == (5,)  # None: float32
    assert gram_restart_plan("fixed", 10, torch.float32) == (5, 5)
    assert gram_restart_plan("polar_express", 10, torch.float32) == (5, 5)
    assert gram_restart_plan("fixed", 5, torch.bfloat16) == (1,) * 5
    assert gram_restart_plan("polar_express", 5, torch.bfloat16) == (1,) * 5
    assert gram_restart_plan("fixed", 5, torch.float16) == (2, 2, 1)


# ------------------------------------------------------------------ FLOPs and the choice


def test_flop_ratios_of_the_issue_shapes():
    """classic / gram for 5 fp32 steps: (20 l + 10 s) / (4 l + 34 s) in units of s^2."""
    ratio = lambda shape: newton_schulz_flops(shape, 5) / newton_schulz_flops(shape, 5, "gram")
    assert ratio((1024, 4096)) == pytest.approx(90 / 50)
    assert ratio((4096, 1024)) == pytest.approx(90 / 50)
    assert ratio((8, 512, 2048)) == pytest.approx(90 / 50)
    assert ratio((512, 4096)) == pytest.approx(170 / 66)
    assert ratio((1024, 1024)) == pytest.approx(30 / 38)
    assert newton_schulz_flops((1024, 4096), 5, "auto") == newton_schulz_flops((1024, 4096), 5, "gram")
    assert newton_schulz_flops((1024, 1024), 5, "auto") == newton_schulz_flops((1024, 1024), 5, "classic")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["fixed", "polar_express"])
@pytest.mark.parametrize("steps", [1, 2, 5, 10])
def test_auto_is_gram_exactly_where_it_saves_enough_flops(dtype, name, steps):
    """Closed form: a segment of L >= 2 steps saves 2 (L - 1) s^2 (2 l - 3 s) FLOPs per matrix, so
    gram is cheaper iff l > 1.5 s and some segment has 2+ steps (never in bf16 for <= 5 steps);
    auto takes it when the saving reaches GRAM_MIN_SAVED_FLOPS (small matrices stay classic)."""
    plan = gram_restart_plan(name, steps, dtype)
    multi = any(length >= 2 for length in plan)
    if dtype == torch.bfloat16 and steps <= 5:
        assert not multi
    for s in (1, 8, 64, 96, 1000):
        for l in {s, s + 1, (3 * s) // 2, (3 * s) // 2 + 1, 2 * s, 8 * s}:
            for shape in [(s, l), (l, s), (4, s, l)]:
                batch = shape[0] if len(shape) == 3 else 1
                saved = batch * sum(2 * (length - 1) * s * s * (2 * l - 3 * s) for length in plan)
                want = "gram" if saved >= GRAM_MIN_SAVED_FLOPS else "classic"
                assert choose_ns_method(shape, steps, "auto", dtype, name) == want, (shape, steps)
                flops = {m: newton_schulz_flops(shape, steps, m, dtype, name) for m in ("classic", "gram")}
                assert flops["classic"] - flops["gram"] == saved, (shape, steps)


def test_auto_runs_the_chosen_form():
    for shape, dtype, form in [((64, 256), torch.float32, "gram"), ((256, 64), torch.float32, "gram"),
                               ((24, 96), torch.float32, "classic"),  # saves too little to pay for its kernels
                               ((48, 64), torch.float32, "classic"), ((64, 256), torch.bfloat16, "classic")]:
        G = torch.randn(shape)
        with FlopCounterMode(display=False) as counter:
            out = zeropower_via_newtonschulz(G, 5, compute_dtype=dtype)
        assert counter.get_total_flops() == newton_schulz_flops(shape, 5, form, dtype)
        assert torch.equal(out, zeropower_via_newtonschulz(G, 5, compute_dtype=dtype, method=form))


def test_bad_method_is_named():
    G = torch.randn(8, 16)
    for bad in ["fast", "Gram", None, 1]:
        with pytest.raises(ValueError, match=r"ns_method must be one of 'auto', 'classic', 'gram'"):
            check_ns_method(bad)
        with pytest.raises(ValueError, match="ns_method"):
            zeropower_via_newtonschulz(G, method=bad)
        with pytest.raises(ValueError, match="ns_method"):
            choose_ns_method((8, 16), 5, bad)
        with pytest.raises(ValueError, match="ns_method"):
            newton_schulz_flops((8, 16), 5, bad)
    for good in ("auto", "classic", "gram"):
        assert check_ns_method(good) == good
    assert choose_ns_method((8, 8), 5, "gram") == "gram"  # forcing is honoured, square or not
    assert choose_ns_method((8, 64), 5, "classic") == "classic"


# ------------------------------------------------------------------ normalisation in fp32


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["classic", "gram"])
def test_normalisation_divides_in_fp32_and_rounds_once(input_dtype, method):
    """The normalised matrix, seen through the identity polynomial p(s) = s (one step of
    (1, 0, 0)), is G in bf16 (what a bf16 all-gather delivers) divided by its norm in fp32 and
    rounded once. Dividing by a bf16-rounded norm instead scales it by up to 2^-8: here the norm
    is about 1 + 0.99 * 2^-8, which bf16 rounds to 1, so the old code's result is 0.4-0.5% large."""
    g = torch.Generator().manual_seed(7)
    G = torch.randn(64, 256, generator=g, dtype=torch.float64)
    G = (G * ((1 + 0.99 * 2.0**-8) / G.norm())).to(input_dtype)
    G_bf16 = G.to(torch.bfloat16).double()
    exact = G_bf16 / G_bf16.norm()
    rounded_once = exact.to(torch.bfloat16).double()
    out = zeropower_via_newtonschulz(G, 1, (1.0, 0.0, 0.0), compute_dtype=torch.bfloat16, method=method)
    assert out.dtype == torch.bfloat16
    out = out.double()
    # (G_bf16 lies on the grid the result is rounded to, so rounding once is not unbiased: the
    # norm of the correctly rounded quotient is itself ~0.13% below 1 here)
    assert abs(out.norm().item() - rounded_once.norm().item()) < 1e-4
    # elementwise: the exact quotient rounded once, up to the fp32 (not fp64) norm: <= 1 ulp
    assert ((out - rounded_once).abs() <= 2.0**-7 * exact.abs()).all()
    sv = torch.linalg.svdvals(out)
    torch.testing.assert_close(sv, torch.linalg.svdvals(rounded_once), atol=2e-4, rtol=0)
    # the same numbers whether G arrives in fp32 or already in bf16 (parallel Muon's bf16 wire)
    same = zeropower_via_newtonschulz(G.to(torch.bfloat16), 1, (1.0, 0.0, 0.0), compute_dtype=torch.bfloat16,
                                      method=method)
    assert torch.equal(same.double(), out)


def test_norm_safety_still_applies_in_fp32():
    G = torch.randn(32, 96, generator=torch.Generator().manual_seed(8))
    out = zeropower_via_newtonschulz(G, 1, (1.0, 0.0, 0.0), compute_dtype=torch.float32, norm_safety=1.02)
    assert out.norm().item() == pytest.approx(1 / 1.02, rel=1e-6)
    zero = zeropower_via_newtonschulz(torch.zeros(3, 8, 4), 5, method="gram")
    assert torch.equal(zero, torch.zeros(3, 8, 4))


# ---------------------------------------------------------- through optimizer.Muon

GRAM_SPECS = [  # rectangular (where auto picks the Gram form in fp32) and square
    ("layers.0.ffn.w1.weight", (32, 128), ["SS0/2", "S0"]),
    ("layers.0.ffn.w2.weight", (128, 32), ["S0", "S1"]),
    ("layers.0.attn.wo.weight", (48, 48), ["S0", "S1"]),
    ("layers.0.moe.w1", (4, 24, 96), ["S1", "S0"]),
]
MUON_STEPS = 6


def _relative_to_change(got, want, start):
    return max(((got[n] - want[n]).norm() / (want[n] - start[n]).norm()).item() for n in want)


def test_muon_with_the_gram_form_equals_the_classic_form_on_one_device():
    from dist_cases import make_case_tensors, run_reference

    start, _ = make_case_tensors(GRAM_SPECS, MUON_STEPS)
    classic = run_reference(GRAM_SPECS, MUON_STEPS, False, ns_method="classic")
    gram = run_reference(GRAM_SPECS, MUON_STEPS, False, ns_method="gram")
    auto = run_reference(GRAM_SPECS, MUON_STEPS, False)
    assert _relative_to_change(gram, classic, start) < 1e-4  # measured 1.2e-5 (the [4, 24, 96] experts)
    assert _relative_to_change(auto, classic, start) < 1e-4
    assert any(not torch.equal(gram[n], classic[n]) for n in classic)  # the forms did differ


def _parallel_gram(rank, world_size):
    from dist_cases import run_distributed

    return run_distributed(rank, world_size, (2, 2), GRAM_SPECS, MUON_STEPS, False, ns_method="gram")


def test_muon_with_the_gram_form_in_the_parallel_pipeline():
    from dist_cases import make_case_tensors, run_reference
    from harness import run_ranks

    start, _ = make_case_tensors(GRAM_SPECS, MUON_STEPS)
    classic = run_reference(GRAM_SPECS, MUON_STEPS, False, ns_method="classic")
    gram = run_reference(GRAM_SPECS, MUON_STEPS, False, ns_method="gram")
    for got in run_ranks(_parallel_gram, 4, timeout=90):
        for n in gram:  # the same form on the owner as on one device
            torch.testing.assert_close(got[n], gram[n], atol=2e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")
        assert _relative_to_change(got, classic, start) < 1e-4
