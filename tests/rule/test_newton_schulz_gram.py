"""The Gram-space Newton-Schulz form, its restart plan, the per-shape choice of form and dtype, the
16-bit band, fp16's range, and the fp32 norm (docs/newton_schulz.md).

References, all independent of the code under test: an fp64 SVD (the polar factor U V^T of the
input, and its singular values pushed through the NS polynomials in float64, ``scalar_ns``), the
classic form run in the same dtype (what the Gram form must match), the classic 16-bit
iterations written here (the band), torch's FlopCounterMode, and Dao et al.'s published restart
choice for fp16 Polar Express.

Stated accuracy (measured at these sizes, s = 16..64 and aspect ratios 1..8; the bounds asserted
below leave about 2x margin):

* fp32, 5 steps (one segment): the Gram form's singular values follow the fp64 polynomial to
  1.2e-3 (classic: 3e-5) and stay within 4e-4 of the classic form's band; its distance to U V^T
  is the classic form's within 1.3e-3; ||gram - classic|| / ||classic|| <= 3e-3 for full-rank
  inputs and 1.5e-2 for rank-deficient ones (where the noise directions differ). 10 steps (two
  segments of 5): singular values within 4e-3 of the fp64 iteration (classic: 2e-4), 1.3e-2 for
  condition number 1e6.
* bf16: every Gram segment is one step, i.e. the classic iteration, bit for bit (see
  newton_schulz.restarts._GRAM_STEP_ERROR_LIMIT). fp16, whose plan has 2-step segments: singular values
  within 0.05 of the classic form's band, and within the 16-bit band (the classic bf16 or fp16
  iteration's own error) on the restart study's inputs (see the band tests for their figures).
"""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from optimizer.newton_schulz import implementation as ns_implementation
from optimizer.newton_schulz import products as ns_products
from optimizer.newton_schulz import restarts as ns_restarts
from optimizer.rule import adjust_lr, apply_update_
from test_rule import muon_momentum_
from optimizer.newton_schulz import zeropower_via_newtonschulz
from optimizer.newton_schulz.coefficients import NS_NORM_SAFETY, resolve_ns_coefficients
from optimizer.newton_schulz.forms import (
    GRAM_MIN_SAVED_FLOPS, check_ns_method, choose_ns_form, choose_ns_method, newton_schulz_flops,
    ns_io_dtype,
)
from optimizer.newton_schulz.restarts import gram_restart_plan, ns_value_bound
from optimizer.newton_schulz.whole import zeropower_with_plan
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
        assert Y.dtype == ns_io_dtype(torch.float32, dtype) and Y.shape == G.shape  # fp16 returns bf16
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
                                                (torch.float16, "polar_express", 10)])
def test_low_precision_gram_stays_in_the_classic_band(kind, shape, dtype, name, steps):
    """Plans with 2-step segments in half precision (small matrices: slow on CPU). fp16 only: bf16's
    plans are one step per segment (test_bf16_gram_is_the_classic_iteration)."""
    assert max(gram_restart_plan(name, steps, dtype)) >= 2
    G = make_input(kind, *shape, seed=1)
    classic, gram = compare_forms(G, name, steps, dtype)
    band = 0.1 if kind in RANK_DEFICIENT else 0.05
    assert gram["top"].min() >= classic["top"].min() - band
    assert gram["top"].max() <= classic["top"].max() + band
    assert gram["to_polar"] <= classic["to_polar"] + 0.05
    assert gram["tail"] <= classic["tail"] + 0.1


@pytest.mark.parametrize("steps", [5, 10])
@pytest.mark.parametrize("name", ["fixed", "polar_express"])
def test_bf16_gram_is_the_classic_iteration(name, steps):
    """In bf16 the rule allows no 2-step segment (no headroom below the band): the same computation."""
    G = torch.randn(3, 32, 96, generator=torch.Generator().manual_seed(9))
    assert set(gram_restart_plan(name, steps, torch.bfloat16)) == {1}
    gram = zeropower_via_newtonschulz(G, steps, name, compute_dtype=torch.bfloat16, method="gram")
    assert torch.equal(gram, zeropower_via_newtonschulz(G, steps, name, compute_dtype=torch.bfloat16, method="classic"))


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
        monkeypatch.setattr(ns_products, "_SYMMETRIC_MIN_BLOCK", 4)
        torch.testing.assert_close(ns_products.symmetric_product(L, L.mT), S)
        # beta C + alpha P R with P, R polynomials in S (commuting symmetric): symmetric result
        P, R = S @ S + 2 * S, 3 * S - S @ S
        got = ns_products.symmetric_product(P, R, S, beta=0.5, alpha=-2.0)
        torch.testing.assert_close(got, 0.5 * S - 2.0 * P @ R)
        monkeypatch.setattr(ns_products, "_SYMMETRIC_MIN_BLOCK", 128)
    # The forms on small matrices with the shortcut forced on equal the plain products: the same
    # iteration in another order, in float64 against its rounding bound (tests/tolerances.py).
    G = torch.randn(2, 40, 100, generator=g, dtype=torch.float64)
    f64 = dict(compute_dtype=torch.float64)
    plain = {m: zeropower_via_newtonschulz(G, 5, method=m, **f64) for m in ("classic", "gram")}
    monkeypatch.setattr(ns_products, "_SYMMETRIC_MIN_BLOCK", 4)
    monkeypatch.setattr(ns_implementation, "uses_symmetric_blocks", lambda X: True)
    for method, ref in plain.items():
        torch.testing.assert_close(zeropower_via_newtonschulz(G, 5, method=method, **f64), ref,
                                   atol=newton_schulz_atol(G.shape, torch.float64, method=method), rtol=0)


# ------------------------------------------------------------------ the 16-bit band
#
# The band (docs/newton_schulz.md): on each input, the largest singular-value error against the
# fp64 iteration of the classic iteration in bf16 or in fp16, whichever is larger (max over
# seeds). A form is within it when its own error is at most 1.0x that, or when both are saturated
# (>= 0.5, a noise direction lifted into the polynomials' attracting interval) and the form's is
# no more than the polynomials can output. Everything below is written here: the inputs, the fp64
# iteration (the polynomials on the input's fp64 singular values), and the classic 16-bit
# iteration as Muon runs it (fp16 reads and returns bf16).

BAND_INPUTS = ["gaussian", "rank1", "rank_s8", "cond1e4", "cond1e6", "powerlaw"]
SATURATED = 0.5


def band_input(kind, m, n, seed):
    """The restart study's inputs, small: Gaussian, rank 1, rank min/8 (>= 2), log-spaced spectra
    over 1e4 and 1e6, and the power law sigma_i = 1 / i; random singular vectors (float64)."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    if kind == "gaussian":
        return torch.randn(m, n, generator=g, dtype=torch.float64)
    if kind.startswith("rank"):
        r = 1 if kind == "rank1" else max(2, k // 8)
        return torch.randn(m, r, generator=g, dtype=torch.float64) @ torch.randn(r, n, generator=g, dtype=torch.float64)
    spectrum = 1 / torch.arange(1, k + 1, dtype=torch.float64) if kind == "powerlaw" else log_spectrum(k, float(kind[4:]))
    return with_spectrum(m, n, spectrum, seed=seed)


def fp64_iteration_sv(G, name, steps):
    """Singular values of the fp64 iteration: its polynomials on G's singular values."""
    s = torch.linalg.svdvals(G.double())
    return scalar_ns(s, resolve_ns_coefficients(name, steps), NS_NORM_SAFETY[name]).abs().sort(descending=True).values


def classic_16bit(G, name, steps, dtype):
    """The classic iteration in bf16 or fp16, as Muon runs it: G rounded to bf16 (what travels),
    divided by its fp32 norm (times the table's safety factor) into ``dtype``, ``X <- a X + (b A +
    c A^2) X`` with fp32-accumulated matmuls, the result in bf16."""
    X = G.float().to(torch.bfloat16)
    X = X.mT if X.shape[-2] > X.shape[-1] else X
    X = (X.float() / (X.float().norm() * NS_NORM_SAFETY[name])).to(dtype)
    for a, b, c in resolve_ns_coefficients(name, steps):
        A = X @ X.mT
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X.to(torch.bfloat16)


def sv_error(Y, reference):
    Y = Y.double()
    return math.inf if not bool(torch.isfinite(Y).all()) else (torch.linalg.svdvals(Y) - reference).abs().max().item()


def attractor_ceiling(name, steps):
    """The largest output of any step's polynomial on the outputs its predecessors can produce from
    [0, 1], plus 2^-6 for 16-bit rounding: a lifted noise direction ends at most there."""
    top = 1.0
    for a, b, c in resolve_ns_coefficients(name, steps):
        x = torch.linspace(0.0, top, 4097, dtype=torch.float64)
        top = float((a * x + b * x**3 + c * x**5).abs().max())
    return top * (1 + 2.0**-6)


def within_band(error, band, ceiling):
    return error <= band or (band >= SATURATED and SATURATED <= error <= ceiling)


def band_errors(shape, name, steps, run, seeds=(0, 1, 2)):
    """Per input (max over seeds): the band and the error of ``run(G_fp32) -> Y``."""
    out = {}
    for kind in BAND_INPUTS:
        band = err = 0.0
        for seed in seeds:
            G = band_input(kind, *shape, seed)
            reference = fp64_iteration_sv(G, name, steps)
            band = max(band, *(sv_error(classic_16bit(G, name, steps, d), reference)
                               for d in (torch.bfloat16, torch.float16)))
            err = max(err, sv_error(run(G.float()), reference))
        out[kind] = (err, band)
    return out


TIE = 0.05  # ten steps: ties with the classic fp16 iteration (see test_fp16_gram_stays_within_the_16bit_band)


def fp16_gram(name, steps):
    return lambda G: zeropower_via_newtonschulz(G, steps, name, compute_dtype=torch.float16, method="gram")


def with_plan(name, steps, dtype, plan):
    """The package's Gram form (its normalisation and rounding) with another restart plan."""
    return lambda G: zeropower_with_plan(G, resolve_ns_coefficients(name, steps), dtype, plan, NS_NORM_SAFETY[name], 1e-7)


def outside(errors, ceiling, tolerance=1.0):
    return {kind: (e, b) for kind, (e, b) in errors.items() if not within_band(e, b * tolerance, ceiling)}


@pytest.mark.parametrize("name, steps, shape", [
    ("fixed", 5, (32, 128)), ("polar_express", 5, (32, 128)), ("fixed", 5, (128, 32)),
    ("polar_express", 5, (128, 32)), ("fixed", 10, (32, 128)), ("polar_express", 10, (32, 128))])
def test_fp16_gram_stays_within_the_16bit_band(name, steps, shape):
    """The Gram form in fp16 with the package's restart plan (what "auto" runs on rectangular
    matrices with compute_dtype None on CUDA, or fp16) on every kind of study input, 3 seeds.
    Measured here, error / band: 5 steps 0.16-0.85 (fixed) and 0.16-0.83 (Polar Express), the
    worst on rank-1 and power-law inputs; asserted 1.0x. 10 steps: 0.1-0.45 on Gaussian and
    power-law inputs, 1.00x on the others, where errors come from singular values below the bf16
    input rounding that both forms share (ties with the classic fp16 iteration, up to 1.002x here
    and 1.04x at 48 x 96); asserted within 1 + TIE. At 128 x 512 and 256 x 1024 (the restart study)
    every input is within 1.0x."""
    errors = band_errors(shape, name, steps, fp16_gram(name, steps))
    bad = outside(errors, attractor_ceiling(name, steps), 1.0 if steps == 5 else 1 + TIE)
    assert not bad, bad


@pytest.mark.parametrize("name", ["fixed", "polar_express"])
@pytest.mark.parametrize("steps", [5, 10])
def test_a_skipped_restart_leaves_the_band(name, steps):
    """What the band test above would see if the plan lost its restarts: one segment (and, at 10
    steps, Dao et al.'s single restart after step 2) is outside the band even with the tie
    tolerance (measured: 60x to inf). The package's plan is not (the test above)."""
    ceiling = attractor_ceiling(name, steps)
    plans = [(steps,)] + ([(2, steps - 2)] if steps == 10 else [])
    for plan in plans:
        assert outside(band_errors((32, 128), name, steps, with_plan(name, steps, torch.float16, plan)), ceiling,
                       1 + TIE), plan


@pytest.mark.parametrize("name", ["fixed", "polar_express"])
def test_bf16_has_no_headroom_for_gram_segments(name):
    """Why bf16's plan is one step per segment: its classic iteration is the band, and 2-step Gram
    segments in bf16 are outside it (measured 1.5-9x on Gaussian and power-law inputs)."""
    errors = band_errors((32, 128), name, 5, with_plan(name, 5, torch.bfloat16, (2, 2, 1)), seeds=(0, 1))
    assert outside(errors, attractor_ceiling(name, 5))


# ------------------------------------------------------------------ fp16's range

EDGE_INPUTS = ["top of the range", "flat spectrum", "singular value 1e4x", "entry 1e4x", "gaussian"]


def edge_input(kind, m, n, seed=0):
    """Inputs at fp16's edges once normalised: rank 1 (its singular value is 1 / norm_safety, the
    largest possible, so A's eigenvalue is too); every singular value equal (each 1 / sqrt(m)); one
    singular value 1e4x the others (the rest far below fp16's normal range); one entry 1e4x the
    largest other (the others subnormal in fp16: about 1e-4 / sqrt(m n)); Gaussian."""
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(m, n, generator=g, dtype=torch.float64)
    if kind == "top of the range":
        return torch.randn(m, 1, generator=g, dtype=torch.float64) @ torch.randn(1, n, generator=g, dtype=torch.float64)
    if kind == "flat spectrum":
        return with_spectrum(m, n, torch.ones(min(m, n), dtype=torch.float64), seed=seed)
    if kind == "singular value 1e4x":
        U, S, Vh = torch.linalg.svd(G, full_matrices=False)
        return (U * torch.cat([S[:1] * 1e4, S[1:]])) @ Vh
    if kind == "entry 1e4x":
        G[3, 5] = 1e4 * G.abs().max()
    return G


@pytest.mark.parametrize("kind", EDGE_INPUTS)
@pytest.mark.parametrize("name", ["fixed", "polar_express"])
def test_fp16_edge_inputs_stay_within_the_band(kind, name):
    """Both forms in fp16 on inputs at the edges of its range stay finite and within the band:
    the normalised matrix is at most 1 and its stored products are bounded (ns_value_bound),
    entries below 2^-14 lose only an absolute 2^-25. Measured error / band: 0.1-0.9."""
    m, n = 64, 256
    ceiling = attractor_ceiling(name, 5)
    for seed in (0, 1):
        G = edge_input(kind, m, n, seed)
        reference = fp64_iteration_sv(G, name, 5)
        band = max(sv_error(classic_16bit(G, name, 5, d), reference) for d in (torch.bfloat16, torch.float16))
        for method in ("classic", "gram"):
            Y = zeropower_via_newtonschulz(G.float(), 5, name, compute_dtype=torch.float16, method=method)
            assert Y.dtype == torch.bfloat16 and bool(torch.isfinite(Y).all())
            error = sv_error(Y, reference)
            assert within_band(error, band, ceiling), (method, seed, error, band)


@pytest.mark.parametrize("method", ["classic", "gram"])
def test_fp16_is_scale_invariant_across_fp32s_range(method):
    """A power-of-two scale changes nothing (normalisation divides it out exactly) as long as the
    norm stays above eps (and its square within fp32, where the norm is taken, as for every
    dtype): entries of 4e6 and 4e12 (past fp16's 65504) and 6e-5 (fp16 subnormals) give the bf16
    result of the unscaled matrix bit for bit. Rounding the input to fp16 before normalising (the
    code before fp16 read bf16) gave inf and NaN for the first two, lost digits for the last."""
    G = torch.randn(48, 160, generator=torch.Generator().manual_seed(11))
    want = zeropower_via_newtonschulz(G, 5, "polar_express", compute_dtype=torch.float16, method=method)
    for scale in (2.0**-16, 2.0**20, 2.0**40):
        got = zeropower_via_newtonschulz(G * scale, 5, "polar_express", compute_dtype=torch.float16, method=method)
        assert torch.equal(got, want), scale


@pytest.mark.parametrize("norm", [1e-7, 1e-9, 1e-12, 1e-30, 0.0])
def test_fp16_norms_at_and_below_eps(norm):
    """||G|| at eps (1e-7) is a normal input. Below it the normalised matrix is G / eps, smaller
    than 1, and the output is about prod(a) * G / eps: its entries fall below fp16's normal range
    and keep an absolute error of at most 2^-25 each, amplified like the signal by at most
    prod(a) = 487 over 5 fixed steps. Asserted: finite, and within the band or within that
    absolute floor (Frobenius: 487 * 2^-25 * sqrt(m n), 2e-3 here) of the fp64 iteration."""
    m, n = 48, 160
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    G = G * (norm / G.norm()) if norm else G * 0
    steps = resolve_ns_coefficients("fixed", 5)
    exact = G / max(G.norm().item(), 1e-7)  # the fp64 iteration on the same normalised matrix
    for a, b, c in steps:
        exact = a * exact + (b * exact @ exact.mT + c * (exact @ exact.mT) @ (exact @ exact.mT)) @ exact
    floor = math.prod(abs(a) for a, _, _ in steps) * 2.0**-25 * math.sqrt(m * n)
    band = (classic_16bit_eps(G, steps) - exact).norm().item()
    for method in ("classic", "gram"):
        Y = zeropower_via_newtonschulz(G.float(), 5, "fixed", compute_dtype=torch.float16, method=method)
        assert Y.dtype == torch.bfloat16 and bool(torch.isfinite(Y).all())
        if norm == 0.0:
            assert torch.equal(Y, torch.zeros_like(Y))
            continue
        error = (Y.double() - exact).norm().item()
        assert error <= max(band, floor), (method, error, band, floor)


def classic_16bit_eps(G, steps):
    """The classic bf16 iteration of :func:`classic_16bit` with the eps clamp (for tiny norms)."""
    X = G.float().to(torch.bfloat16)
    X = (X.float() / max(X.float().norm().item(), 1e-7)).to(torch.bfloat16)
    for a, b, c in steps:
        A = X @ X.mT
        X = torch.addmm(X, torch.addmm(A, A, A, beta=b, alpha=c), X, beta=a)
    return X.double()


@pytest.mark.parametrize("name", ["fixed", "polar_express"])
@pytest.mark.parametrize("steps", [5, 10])
def test_stored_values_stay_under_the_bound_far_inside_fp16(monkeypatch, name, steps):
    """ns_value_bound (the largest entry any matrix of the iteration can hold) bounds what the fp16
    iteration actually stores on the edge inputs (every symmetric product it forms, and X), and
    is 12.0 (fixed) / 16.1 (Polar Express) for the fp16 plans: 4,000x below 65504."""
    plan = gram_restart_plan(name, steps, torch.float16)
    bound = ns_value_bound(name, steps, plan, torch.float16)
    assert bound <= 17 and bound * 2**8 < torch.finfo(torch.float16).max
    assert ns_value_bound(name, steps, None, torch.float16) <= bound  # the classic iteration stores fewer
    seen = []
    original = ns_products.symmetric_product

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out.abs().max().item())
        return out

    monkeypatch.setattr(ns_products, "symmetric_product", recording)
    for kind in EDGE_INPUTS:
        for method in ("classic", "gram"):
            G = edge_input(kind, 32, 96).float()
            Y = zeropower_via_newtonschulz(G, steps, name, compute_dtype=torch.float16, method=method)
            seen.append(Y.abs().max().item())
    assert max(seen) <= bound, (max(seen), bound)
    assert max(seen) > bound / 8  # the inputs do reach into the bound (Q of a segment is ~prod(a))


def test_the_rule_ends_a_segment_before_q_leaves_the_range():
    """Q's eigenvalue at the drifted eigenvalue is the product of a segment's factors: with a
    table whose factors are 10 and which does not drift, fp16 restarts every 2 steps (100 fits in
    65504 / 256, 1000 does not) and fp32 never needs to."""
    table = [(10.0, 0.0, 0.0)] * 8
    assert gram_restart_plan(table, 8, torch.float16) == (2, 2, 2, 2)
    assert gram_restart_plan(table, 8, torch.float32) == (8,)


# ------------------------------------------------------------------ dtypes: which form runs in which


def test_io_dtype_and_the_wire():
    """fp16 reads and returns bf16 for wider inputs (fp32's range on the wire), its own 16-bit
    dtypes as they are; every other compute dtype is its own. The pieces parallel Muon sends are
    exactly that (plan_inputs.wire_dtype), so the owner and one device see the same numbers."""
    from types import SimpleNamespace

    from optimizer.parallel.planning.plan_inputs import wire_dtype

    f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    assert [ns_io_dtype(d, f16) for d in (f64, f32, bf16, f16)] == [bf16, bf16, bf16, f16]
    for compute in (bf16, f32, f64):
        assert {ns_io_dtype(d, compute) for d in (f64, f32, bf16, f16)} == {compute}
    for param in (f64, f32, bf16, f16):
        p = SimpleNamespace(dtype=param)
        for compute in (f16, bf16, f32):
            narrower = compute.itemsize < param.itemsize
            assert wire_dtype(compute, p) == (ns_io_dtype(param, compute) if narrower else param)
    assert wire_dtype(f16, SimpleNamespace(dtype=f32)) == bf16


def test_the_form_and_its_dtype_per_compute_dtype_and_device():
    """compute_dtype None: fp32 on CPU; on CUDA the classic form in bf16 and the Gram form in fp16.
    A dtype the user set is never changed: bf16 runs bf16 forms only (and "auto" never picks the
    Gram form there), fp16 fp16 forms. Pure: a device is a name, no tensor is made."""
    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    big, tall, square, small = (1024, 4096), (4096, 1024), (1024, 1024), (24, 96)
    for device in ("cuda", torch.device("cuda", 3)):
        assert choose_ns_form(big, 5, "auto", None, "fixed", device) == ("gram", f16)
        assert choose_ns_form(tall, 10, "auto", None, "polar_express", device) == ("gram", f16)
        assert choose_ns_form(square, 5, "auto", None, "fixed", device) == ("classic", bf16)
        assert choose_ns_form(small, 5, "auto", None, "fixed", device) == ("classic", bf16)
        assert choose_ns_form(square, 5, "gram", None, "fixed", device) == ("gram", f16)
        assert choose_ns_form(big, 5, "classic", None, "fixed", device) == ("classic", bf16)
    for device in (None, "cpu"):
        assert choose_ns_form(big, 5, "auto", None, "fixed", device) == ("gram", f32)
        assert choose_ns_form(square, 5, "auto", None, "fixed", device) == ("classic", f32)
    for device in (None, "cuda"):
        for steps in (5, 10):
            for name in ("fixed", "polar_express"):
                assert choose_ns_form(big, steps, "auto", bf16, name, device) == ("classic", bf16)
                assert choose_ns_form(big, steps, "gram", bf16, name, device) == ("gram", bf16)
                assert choose_ns_form(big, steps, "auto", f16, name, device) == ("gram", f16)
                assert choose_ns_form(square, steps, "auto", f16, name, device) == ("classic", f16)
                assert choose_ns_form(big, steps, "auto", f32, name, device) == ("gram", f32)
    assert choose_ns_method(big, 5, "auto", None, "fixed", "cuda") == "gram"
    # what "auto" runs is what it counts
    assert newton_schulz_flops(big, 5, "auto", None, "fixed", "cuda") == newton_schulz_flops(big, 5, "gram", f16)
    assert newton_schulz_flops(square, 5, "auto", None, "fixed", "cuda") == newton_schulz_flops(square, 5)
    assert newton_schulz_flops(big, 5, "auto", bf16, "fixed", "cuda") == newton_schulz_flops(big, 5)


def test_the_cuda_default_keeps_tables_that_leave_fp16s_range_out_of_fp16():
    """A coefficient table whose iterates grow past fp16's range (with 2^8 to spare) never runs in
    fp16 unless the user asks for fp16: with compute_dtype None, "auto" keeps the classic form in
    bf16 for it, and a forced Gram form runs in bf16 (one-step segments)."""
    grows, mild = [(4.0, 0.0, 0.0)] * 5, [(1.5, 0.0, 0.0)] * 5  # X grows by 4^5 = 1024 / 1.5^5 = 7.6
    limit = torch.finfo(torch.float16).max / 2**8
    assert ns_value_bound(grows, 5, gram_restart_plan(grows, 5, torch.float16)) > limit
    assert ns_value_bound(mild, 5, gram_restart_plan(mild, 5, torch.float16)) <= limit
    assert choose_ns_form((1024, 4096), 5, "auto", None, grows, "cuda") == ("classic", torch.bfloat16)
    assert choose_ns_form((1024, 4096), 5, "auto", None, mild, "cuda") == ("gram", torch.float16)
    assert choose_ns_form((1024, 4096), 5, "gram", None, grows, "cuda") == ("gram", torch.bfloat16)
    assert newton_schulz_flops((1024, 4096), 5, "gram", None, grows, "cuda") == newton_schulz_flops((1024, 4096), 5)
    assert choose_ns_form((1024, 4096), 5, "auto", torch.float16, grows, "cuda") == ("gram", torch.float16)


@pytest.mark.parametrize("steps, name", [(5, "fixed"), (5, "polar_express"), (10, "polar_express")])
def test_symmetric_flop_counts(steps, name):
    """symmetric=True counts X X^T, A A and every s x s product of the Gram form as one triangle,
    s (s + 1) k FLOPs; B X and Q X stay full. Then the Gram form is cheaper for every rectangular
    shape (a segment saves 3 (L - 1) s^2 (l - s) up to the diagonal terms) and auto takes it."""
    for dtype in (torch.float32, torch.float16):
        plan = gram_restart_plan(name, steps, dtype)
        for shape in [(64, 256), (3, 96, 40), (100, 100), (512, 640)]:
            s, l = min(shape[-2:]), max(shape[-2:])
            batch = math.prod(shape[:-2])
            sym = lambda k: s * (s + 1) * k
            classic = batch * steps * (sym(l) + sym(s) + 2 * s * s * l)
            gram = batch * sum(sym(l) + 2 * s * s * l + (4 * L - 3) * sym(s) for L in plan)
            assert newton_schulz_flops(shape, steps, "classic", dtype, name, symmetric=True) == classic
            assert newton_schulz_flops(shape, steps, "gram", dtype, name, symmetric=True) == gram
            want = "gram" if classic - gram >= GRAM_MIN_SAVED_FLOPS else "classic"
            assert choose_ns_form(shape, steps, "auto", dtype, name, symmetric=True)[0] == want
    # 512 x 640 (l = 1.25 s): the Gram form only with symmetric products counted
    assert choose_ns_method((512, 640), 5, "auto", torch.float32) == "classic"
    assert choose_ns_method((512, 640), 5, "auto", torch.float32, symmetric=True) == "gram"


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
    monkeypatch.setattr(ns_restarts, "_GRAM_STEP_ERROR_LIMIT", 0.1)
    ns_restarts._restart_plan.cache_clear()
    try:
        assert gram_restart_plan("polar_express", 5, torch.float16) == (2, 3)
    finally:
        ns_restarts._restart_plan.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["fixed", "polar_express"])
@pytest.mark.parametrize("steps", [1, 2, 5, 8, 10, 20])
def test_plan_segments_keep_the_negative_eigenvalue_small_and_are_maximal(dtype, name, steps):
    """Every step of a segment after its first has its factor q(r) = a + b r + c r^2 within the
    limit of q(0) at the drifted eigenvalue; the step after the segment would not (else the
    segment would have been longer). Q's largest eigenvalue there, the product of the factors,
    stays far inside the dtype's range (the rule's other limit never binds for these tables). A
    dtype no finer than bf16 has one-step segments: no headroom below the 16-bit band."""
    plan = gram_restart_plan(name, steps, dtype)
    assert sum(plan) == steps and all(length >= 1 for length in plan)
    table = resolve_ns_coefficients(name, steps)
    u = torch.finfo(dtype).eps / 2
    if u >= torch.finfo(torch.bfloat16).eps / 2:
        assert plan == (1,) * steps
        return
    limit = ns_restarts._GRAM_STEP_ERROR_LIMIT

    def off(r, a, b, c):  # |q(r) - q(0)| / |q(0)|, bounded termwise
        return (abs(b * r) + abs(c * r * r)) / abs(a)

    stalled = stalled_steps(table) if dtype == torch.float16 else [False] * steps
    first = 0
    for length in plan:
        r, gain = -u, 1.0
        for j, (a, b, c) in enumerate(table[first : first + length]):
            assert j == 0 or (off(r, a, b, c) <= limit and not stalled[first + j])  # the first: a classic step
            gain *= abs(a + b * r + c * r * r)
            r = r * (a + b * r + c * r * r) ** 2
        assert gain <= torch.finfo(dtype).max / 2**8
        first += length
        if first < steps:
            assert off(r, *table[first]) > limit or stalled[first]


def stalled_steps(table):
    """Where the iteration neither lifts nor converges: the iterates of [2^-8, 1] (a linear grid
    here) occupy [lo, hi]; a step whose lo does not rise and whose width is not halved stalls."""
    x = torch.linspace(2.0**-8, 1.0, 50001, dtype=torch.float64)
    lo, width, out = x.min().item(), (x.max() - x.min()).item(), []
    for a, b, c in table:
        x = a * x + b * x**3 + c * x**5
        new_lo, new_width = x.abs().min().item(), (x.abs().max() - x.abs().min()).item()
        out.append(new_lo <= lo * (1 + 2.0**-8) and new_width > width / 2)
        lo, width = new_lo, new_width
    return out


def test_the_fixed_table_stalls_from_its_sixth_step_and_polar_express_never():
    """The fixed table's iterates reach [0.68, 1.20] in 5 steps and then cycle there (its fixed
    point 0.868 repels: |p'| = 1.58), so rounding is amplified rather than corrected: in fp16 no
    Gram segment spans those steps (measured at 256 x 1024: (2, 2, 2, 2, 2) is 1.16x the band on
    power-law inputs, (2, 2, 1, 1, 1, 1, 1, 1) 0.84x). Polar Express lifts, then converges."""
    fixed = resolve_ns_coefficients("fixed", 10)
    assert stalled_steps(fixed) == [False] * 5 + [True] * 5
    assert ns_restarts._stalled_steps(tuple(fixed)) == tuple(stalled_steps(fixed))
    assert not any(stalled_steps(resolve_ns_coefficients("polar_express", 10)))
    a, b, c = fixed[0]
    x = math.sqrt((-b - math.sqrt(b * b - 4 * c * (a - 1))) / (2 * c))  # p(x) = x
    assert x == pytest.approx(0.868, abs=1e-3) and abs(a + 3 * b * x**2 + 5 * c * x**4) > 1.5
    assert gram_restart_plan("fixed", 10, torch.float32) == (5, 5)  # fp32 is not held to the 16-bit band


def test_plans_per_dtype():
    """fp32 runs 5 steps in one segment, fp16 segments of two (three past Polar Express's table),
    bf16 one step per segment (see _GRAM_STEP_ERROR_LIMIT and the restart study)."""
    assert gram_restart_plan("fixed", 5, torch.float32) == (5,)
    assert gram_restart_plan("polar_express", 5, torch.float32) == (5,)
    assert gram_restart_plan("fixed", 5) == (5,)  # None: float32
    assert gram_restart_plan("fixed", 10, torch.float32) == (5, 5)
    assert gram_restart_plan("polar_express", 10, torch.float32) == (5, 5)
    assert gram_restart_plan("fixed", 5, torch.float16) == (2, 2, 1)
    assert gram_restart_plan("polar_express", 5, torch.float16) == (1, 2, 2)
    assert gram_restart_plan("fixed", 10, torch.float16) == (2, 2, 1, 1, 1, 1, 1, 1)  # stalled from step 6
    assert gram_restart_plan("polar_express", 10, torch.float16) == (1, 2, 2, 3, 2)
    for name in ("fixed", "polar_express"):
        for steps in (1, 5, 10, 20):
            assert gram_restart_plan(name, steps, torch.bfloat16) == (1,) * steps


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("name", ["fixed", "polar_express"])
@pytest.mark.parametrize("steps", [1, 2, 5, 10])
def test_auto_is_gram_exactly_where_it_saves_enough_flops(dtype, name, steps):
    """Closed form: a segment of L >= 2 steps saves 2 (L - 1) s^2 (2 l - 3 s) FLOPs per matrix, so
    gram is cheaper iff l > 1.5 s and some segment has 2+ steps (never in bf16);
    auto takes it when the saving reaches GRAM_MIN_SAVED_FLOPS (small matrices stay classic)."""
    plan = gram_restart_plan(name, steps, dtype)
    multi = any(length >= 2 for length in plan)
    if dtype == torch.bfloat16:
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
                               ((48, 64), torch.float32, "classic"), ((64, 256), torch.bfloat16, "classic"),
                               ((64, 256), torch.float16, "gram"), ((48, 64), torch.float16, "classic")]:
        G = torch.randn(shape)
        with FlopCounterMode(display=False) as counter:
            out = zeropower_via_newtonschulz(G, 5, compute_dtype=dtype)
        assert counter.get_total_flops() == newton_schulz_flops(shape, 5, form, dtype)
        assert out.dtype == ns_io_dtype(G.dtype, dtype)
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
