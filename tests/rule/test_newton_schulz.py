"""Newton-Schulz orthogonalisation: singular values, batching, and torch.optim.Muon's NS.

Independent references: the SVD (torch.linalg) and a float64 scalar iteration of the same
polynomials on the input's singular values (NS acts on each singular value separately), and
torch.optim._muon._zeropower_via_newtonschulz. Properties of the iteration are checked for both
forms (``method="classic"`` and ``"gram"``, which compute the same polynomial); the Gram form's
own tests (restarts, accuracy against the classic form, FLOPs, the choice) are in
test_newton_schulz_gram.py.
"""

import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns
from torch.utils.flop_counter import FlopCounterMode

from optimizer.newton_schulz import zeropower_via_newtonschulz
from optimizer.newton_schulz.coefficients import NS_COEFFICIENTS, resolve_ns_coefficients
from optimizer.newton_schulz.forms import default_compute_dtype, newton_schulz_flops
from optimizer.newton_schulz.restarts import gram_restart_plan
from tolerances import newton_schulz_atol

METHODS = ["classic", "gram"]

FIXED = (3.4445, -4.7750, 2.0315)
FIXED_BAND = (0.6, 1.25)  # where the fixed iteration leaves singular values it has reached


def with_spectrum(m, n, singular_values, seed=0, batch=()):
    """A float64 [*batch, m, n] matrix with the given singular values and random singular vectors."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    s = torch.as_tensor(singular_values, dtype=torch.float64)
    U, _ = torch.linalg.qr(torch.randn(*batch, m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(*batch, n, k, generator=g, dtype=torch.float64))
    return (U * s) @ V.mT


def log_spectrum(k, cond):
    return torch.logspace(0, -math.log10(cond), k, dtype=torch.float64)


def scalar_ns(s, coefficients, norm_safety=1.0):
    """The NS polynomials applied to singular values directly, in float64."""
    x = s / (torch.linalg.vector_norm(s) * norm_safety)
    for a, b, c in coefficients:
        x = a * x + b * x**3 + c * x**5
    return x


SHAPES = [(64, 64), (96, 40), (40, 96)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cond", [10.0, 1e3])
@pytest.mark.parametrize("name", ["fixed", "polar_express"])
def test_singular_values_follow_scalar_polynomial(shape, cond, name, method):
    """Output singular values = the polynomial iteration applied to the input's (float64 ref)."""
    k = min(shape)
    s = log_spectrum(k, cond)
    G = with_spectrum(*shape, s).float()
    out = zeropower_via_newtonschulz(G, 5, coefficients=name, compute_dtype=torch.float32, method=method)
    assert out.shape == G.shape and out.dtype == torch.float32
    got = torch.linalg.svdvals(out.double())
    safety = 1.02 if name == "polar_express" else 1.0
    expected = scalar_ns(s, resolve_ns_coefficients(name, 5), safety).abs().sort(descending=True).values
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fixed_band_random_input(shape, method):
    # Gaussian square matrices have singular values near 0 that 5 steps cannot lift; give the
    # square case a moderate spectrum, the rectangular ones are plain randn.
    if shape[0] == shape[1]:
        G = with_spectrum(*shape, log_spectrum(shape[0], 10.0), seed=3).float()
    else:
        G = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    s = torch.linalg.svdvals(zeropower_via_newtonschulz(G, 5, method=method))
    assert FIXED_BAND[0] <= s.min() and s.max() <= FIXED_BAND[1], (s.min(), s.max())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fixed_band_ill_conditioned(shape, method):
    """Condition number 1e4: every singular value reaches the band with enough steps, none
    overshoots it with 5 steps (the slope at 0 is a=3.44, so sigma/||G|| ~ 4e-5 needs ~9 steps)."""
    G = with_spectrum(*shape, log_spectrum(min(shape), 1e4), seed=2).float()
    s5 = torch.linalg.svdvals(zeropower_via_newtonschulz(G, 5, method=method))
    assert s5.max() <= FIXED_BAND[1] and s5.min() > 0
    s10 = torch.linalg.svdvals(zeropower_via_newtonschulz(G, 10, method=method))
    assert FIXED_BAND[0] <= s10.min() and s10.max() <= FIXED_BAND[1], (s10.min(), s10.max())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cond, steps", [(1.0 + 1e-9, 5), (10.0, 5), (1e3, 5), (1e3, 8)])
def test_polar_express_closer_to_one_than_fixed(cond, steps, method):
    G = with_spectrum(96, 48, log_spectrum(48, cond), seed=4).float()
    dev = {}
    for name in ("fixed", "polar_express"):
        s = torch.linalg.svdvals(zeropower_via_newtonschulz(G, steps, coefficients=name, method=method))
        dev[name] = (s - 1).abs().max().item()
    assert dev["polar_express"] < dev["fixed"], dev
    if steps == 8:  # past the table, the classic quintic converges to 1
        assert dev["polar_express"] < 0.05, dev


# Batched against one by one, transposed, scaled: the same iteration in another order.  Compared in
# float64 against the bound on that difference (tests/tolerances.py: ~1e-9 classic, ~1e-4 for the
# Gram form, whose A-space recursion amplifies errors near 0 by a^2 per step), far below what a
# mixed-up matrix or a normalisation over the wrong dims changes; in float32 that bound says nothing.
@pytest.mark.parametrize("method", METHODS)
def test_batched_equals_loop_3d_and_4d(method):
    g = torch.Generator().manual_seed(5)
    f64 = dict(compute_dtype=torch.float64, method=method)
    G3 = torch.randn(4, 48, 80, generator=g, dtype=torch.float64)  # [E, out, in] experts, wide
    out3 = zeropower_via_newtonschulz(G3, 5, **f64)
    ref3 = torch.stack([zeropower_via_newtonschulz(G3[e], 5, **f64) for e in range(4)])
    torch.testing.assert_close(out3, ref3, atol=newton_schulz_atol(G3.shape, torch.float64, method=method), rtol=0)

    G4 = torch.randn(2, 3, 80, 48, generator=g, dtype=torch.float64)  # tall, two batch dims
    # Very different scales per matrix: the normalisation must be per matrix.
    G4 = G4 * torch.tensor([1e-3, 1.0, 1e3], dtype=torch.float64).view(1, 3, 1, 1)
    out4 = zeropower_via_newtonschulz(G4, 5, coefficients="polar_express", **f64)
    atol = newton_schulz_atol(G4.shape, torch.float64, coefficients="polar_express", method=method)
    for i in range(2):
        for j in range(3):
            ref = zeropower_via_newtonschulz(G4[i, j], 5, coefficients="polar_express", **f64)
            torch.testing.assert_close(out4[i, j], ref, atol=atol, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_transpose_and_scale_equivariance(method):
    G = torch.randn(72, 40, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    G_before = G.clone()
    f64 = dict(compute_dtype=torch.float64, method=method)
    out = zeropower_via_newtonschulz(G, **f64)
    assert torch.equal(G, G_before)  # the input is not modified
    atol = newton_schulz_atol(G.shape, torch.float64, method=method)
    torch.testing.assert_close(zeropower_via_newtonschulz(G.T, **f64), out.T, atol=atol, rtol=0)
    scale = 2.0**13  # a power of two: the scaled input is exact, any difference is the iteration's
    torch.testing.assert_close(zeropower_via_newtonschulz(G * scale, **f64), out, atol=atol, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_torch_muon_ns(shape):
    """torch.optim.Muon's NS computes in bf16, the classic form. Ours in bf16 runs the same
    iterations (addmm form) but divides by the fp32 norm where torch divides by its bf16 rounding;
    fed an already normalised matrix (whose norm rounds to 1 in bf16, so torch divides by 1),
    the two agree bit for bit. From the raw matrix the one-ulp differences in the normalised
    input grow through 5 bf16 iterations to ~1e-2 per entry (measured up to 1.2e-2, 2%
    relative). Ours in fp32 differs from torch's by bf16's error (8 mantissa bits over 5
    iterations: entries of size ~1/sqrt(n) differ ~1e-2)."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    ref = torch_ns(G, FIXED, 5, 1e-7).float()
    ours_bf16 = zeropower_via_newtonschulz(G, 5, compute_dtype=torch.bfloat16, method="classic")
    assert ours_bf16.dtype == torch.bfloat16
    normalised = zeropower_via_newtonschulz(G, 1, (1.0, 0.0, 0.0), compute_dtype=torch.bfloat16)
    assert normalised.float().norm().to(torch.bfloat16) == 1.0
    assert torch.equal(torch_ns(normalised, FIXED, 5, 1e-7), ours_bf16)
    assert (ours_bf16.float() - ref).abs().max() < 2e-2
    assert (ours_bf16.float() - ref).norm() / ref.norm() < 3e-2
    ours_fp32 = zeropower_via_newtonschulz(G, 5, compute_dtype=torch.float32, method="classic")
    assert (ours_fp32 - ref).abs().max() < 3e-2
    # Relative Frobenius difference: bf16 rounding amplified by the slope of the polynomial at
    # small singular values (a^5 ~ 480; a Gaussian square matrix has some) stays within 3%.
    assert (ours_fp32 - ref).norm() / ref.norm() < 3e-2


def test_zero_and_empty_inputs():
    z = zeropower_via_newtonschulz(torch.zeros(8, 16))
    assert torch.equal(z, torch.zeros(8, 16))
    e = zeropower_via_newtonschulz(torch.zeros(0, 8, 16))
    assert e.shape == (0, 8, 16)


def test_default_compute_dtype():
    assert default_compute_dtype("cpu") == torch.float32
    assert default_compute_dtype(torch.device("cuda", 0)) == torch.bfloat16
    G = torch.randn(8, 16)
    assert zeropower_via_newtonschulz(G).dtype == torch.float32


def test_resolve_ns_coefficients():
    assert resolve_ns_coefficients("fixed", 3) == [FIXED] * 3
    pe = NS_COEFFICIENTS["polar_express"]
    assert resolve_ns_coefficients("polar_express", 3) == pe[:3]
    assert resolve_ns_coefficients("polar_express", 7)[:5] == pe
    assert resolve_ns_coefficients("polar_express", 7)[5:] == [(15 / 8, -10 / 8, 3 / 8)] * 2
    assert resolve_ns_coefficients((1.5, -0.5, 0.0), 2) == [(1.5, -0.5, 0.0)] * 2
    custom = [(3.0, -3.0, 1.0), (2.0, -1.5, 0.5)]
    assert resolve_ns_coefficients(custom, 2) == custom
    with pytest.raises(ValueError, match="unknown name 'nope'"):
        resolve_ns_coefficients("nope", 5)
    with pytest.raises(ValueError, match="exactly ns_steps=5"):
        resolve_ns_coefficients(custom, 5)
    with pytest.raises(ValueError, match="three numbers"):
        resolve_ns_coefficients([(1.0, 2.0)], 1)
    with pytest.raises(ValueError, match="ns_steps"):
        resolve_ns_coefficients("fixed", 0)


def test_explicit_list_runs_those_polynomials():
    s = log_spectrum(24, 10.0)
    G = with_spectrum(40, 24, s, seed=8).float()
    custom = [(2.0, -1.5, 0.5), (1.875, -1.25, 0.375), FIXED]
    got = torch.linalg.svdvals(zeropower_via_newtonschulz(G, 3, coefficients=custom).double())
    torch.testing.assert_close(got, scalar_ns(s, custom).sort(descending=True).values, atol=1e-4, rtol=0)


def test_rejects_vectors():
    with pytest.raises(ValueError, match=r"\[\.\.\., m, n\]"):
        zeropower_via_newtonschulz(torch.randn(5))


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48), (3, 16, 40), (2, 2, 40, 16)])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype, name, ns_steps", [(torch.float32, "fixed", 4), (torch.float32, "fixed", 9),
                                                   (torch.bfloat16, "fixed", 5), (torch.bfloat16, "polar_express", 7)])
def test_flops_match_flop_counter(shape, method, dtype, name, ns_steps):
    """newton_schulz_flops counts the matmuls the implementation actually runs (FlopCounterMode),
    for both forms and restart plans of one segment (fp32, 4 steps), several (fp32, 9 steps) and
    with one-step segments (bf16). Shapes below the CPU's symmetric-block size, which does fewer."""
    G = torch.randn(shape)
    with FlopCounterMode(display=False) as counter:
        zeropower_via_newtonschulz(G, ns_steps, name, compute_dtype=dtype, method=method)
    assert newton_schulz_flops(shape, ns_steps, method, dtype, name) == counter.get_total_flops()
    s, l = min(shape[-2:]), max(shape[-2:])
    batch = math.prod(shape[:-2])
    if method == "classic":
        assert newton_schulz_flops(shape, ns_steps) == ns_steps * batch * 2 * (2 * s * s * l + s**3)
    else:
        # X X^T and Q X once per segment; per segment of L steps 4 L - 3 products of s x s matrices
        plan = gram_restart_plan(name, ns_steps, dtype)
        mm = sum(2 * s * s * l + (4 * L - 3) * s**3 for L in plan)
        assert newton_schulz_flops(shape, ns_steps, "gram", dtype, name) == batch * 2 * mm


# ------------------------------------------------- symmetric products (CPU fast path)


def test_symmetric_gram_equals_plain_product():
    from optimizer.newton_schulz.products import symmetric_product

    g = torch.Generator().manual_seed(7)
    for rows, cols in [(256, 40), (300, 17), (517, 33), (1030, 8)]:
        x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
        torch.testing.assert_close(symmetric_product(x, x.T), x @ x.T, rtol=0, atol=1e-12)


def _plain_quintic(G, steps):
    """The textbook iteration with plain matmuls (no symmetric shortcut)."""
    X = G.double()
    transpose = X.shape[0] > X.shape[1]
    if transpose:
        X = X.T
    X = X / X.norm().clamp(min=1e-7)
    for a, b, c in [(3.4445, -4.7750, 2.0315)] * steps:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if transpose else X


@pytest.mark.parametrize("method", METHODS)
def test_large_matrices_take_the_symmetric_path_and_match_the_plain_iteration(method):
    g = torch.Generator().manual_seed(3)
    for shape in [(300, 520), (600, 280)]:  # min dim >= 256: the symmetric path on CPU
        G = torch.randn(shape, generator=g)
        got = zeropower_via_newtonschulz(G, ns_steps=5, compute_dtype=torch.float32, method=method)
        torch.testing.assert_close(got.double(), _plain_quintic(G, 5), rtol=0, atol=2e-4)
    G = torch.randn(2, 280, 400, generator=g)  # a batch of experts takes it too
    got = zeropower_via_newtonschulz(G, ns_steps=5, compute_dtype=torch.float32, method=method)
    for e in range(2):
        torch.testing.assert_close(got[e].double(), _plain_quintic(G[e], 5), rtol=0, atol=2e-4)


@pytest.mark.parametrize("compute_dtype", [None, torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_output_dtype_is_what_it_returns(compute_dtype):
    """``NewtonSchulz.output_dtype`` (Dion2's owners return updates in it; every member computes it
    from the shape alone) is the dtype ``zeropower_via_newtonschulz`` returns, for every input dtype,
    form and shape (wide, tall, square, batched: the Gram form's choice depends on the shape)."""
    from optimizer.newton_schulz.group import NewtonSchulz

    for method in ("classic", "gram", "auto"):
        ns = NewtonSchulz(5, "polar_express", method, 1e-7, compute_dtype)
        for shape in [(4, 16), (16, 4), (6, 6), (2, 3, 12), (3, 12, 3)]:
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
                assert ns.output_dtype(shape, dtype, x.device) == ns(x).dtype, (method, shape, dtype, compute_dtype)
