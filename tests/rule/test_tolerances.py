"""The rounding bounds of tests/tolerances.py hold where they can be checked directly.

The polynomial maxima against a dense grid; the float32 Newton–Schulz and max-logit bounds against
the float32 computation's actual distance from float64 (whose own rounding is smaller by 2^29).
What this can catch is limited: worst-case bounds sit ~1e4 above the errors rounding really makes
(they hold for every order, with every error aligned), so a bound computed for the wrong precision
fails here, but one missing a step's rounding or growth term would still pass; the derivation in
tolerances.py is what makes them bounds.  (That the float64 bounds are small enough to catch a
misplaced row is shown by the tests that use them.)
"""

import pytest
import torch

from optimizer import zeropower_via_newtonschulz
from optimizer.newton_schulz.coefficients import NS_COEFFICIENTS, NS_TAIL
from tolerances import _gram_poly_bounds, _step_bounds, gamma, max_logit_atol, newton_schulz_error_bound


def test_gamma():
    u = 2.0**-24
    assert gamma(1, torch.float32) == pytest.approx(u / (1 - u), rel=1e-15)
    assert gamma(100, torch.float64) == pytest.approx(100 * 2.0**-53, rel=1e-12)
    with pytest.raises(ValueError, match="unbounded"):
        gamma(2**24, torch.float32)


TABLES = NS_COEFFICIENTS["fixed"] + NS_COEFFICIENTS["polar_express"] + [NS_TAIL["polar_express"]]


@pytest.mark.parametrize("a, b, c", TABLES)
@pytest.mark.parametrize("lo, s", [(0.0, 1 / 1.02), (0.0, 1.0), (0.0, 1.21), (0.05, 1.0), (0.7, 1.2)])
def test_polynomial_extremes_equal_a_dense_grid(a, b, c, lo, s):
    x = torch.linspace(lo, s, 200_001, dtype=torch.float64)
    t = x * x
    q = a + b * t + c * t * t
    p = a * x + b * x**3 + c * x**5
    # p' and p(x)/x = q(x^2) give the growth
    grid_max = [f.abs().max().item() for f in (p, torch.maximum((a + 3 * b * t + 5 * c * t * t).abs(), q.abs()),
                                                q, b + 2 * c * t, q * (a + 3 * b * t + 5 * c * t * t))]
    bottom, top, growth = _step_bounds(a, b, c, lo, s)
    exact_max = [top, growth, *_gram_poly_bounds(a, b, c, lo * lo, s * s)]
    for e, g in zip(exact_max, grid_max):  # at least the grid's maximum, above it by no more than its spacing
        assert g * (1 - 1e-12) <= e <= g * (1 + 1e-6), (exact_max, grid_max)
    low = p.abs().min().item()  # the exact minimum: at most the grid's, below it by no more than its spacing
    assert low * (1 - 1e-6) - 1e-12 <= bottom <= low * (1 + 1e-12), (bottom, low)


@pytest.mark.parametrize("method", ["classic", "gram"])
@pytest.mark.parametrize("coefficients", ["fixed", "polar_express"])
@pytest.mark.parametrize("shape, cond", [((32, 12), 1.0), ((48, 80), 1.0), ((3, 40, 100), 1.0), ((64, 64), 1e3)])
def test_float32_newton_schulz_stays_within_its_bound(shape, cond, coefficients, method):
    g = torch.Generator().manual_seed(0)
    G = torch.randn(shape, generator=g, dtype=torch.float64)
    if cond > 1:  # singular values down to 1/cond: the iteration's growth at small ones matters
        U, _, V = torch.linalg.svd(G, full_matrices=False)
        G = U @ torch.diag_embed(torch.logspace(0, -3, min(shape[-2:]), dtype=torch.float64)) @ V
    G = G.float().double()  # the same input for both
    f32 = zeropower_via_newtonschulz(G.float(), 5, coefficients, compute_dtype=torch.float32, method=method)
    f64 = zeropower_via_newtonschulz(G, 5, coefficients, compute_dtype=torch.float64, method=method)
    worst = (f32.double() - f64).flatten(-2).norm(dim=-1).max().item()  # Frobenius, per matrix
    sigma_min = (torch.linalg.svdvals(G)[..., -1] / G.flatten(-2).norm(dim=-1)).min().item()
    for lower in (0.0, sigma_min * (1 - 1e-6)):  # any input, and this one's smallest singular value
        bound = sum(newton_schulz_error_bound(shape, dtype, coefficients=coefficients, method=method, sigma_min=lower)
                    for dtype in (torch.float32, torch.float64))
        assert 0 < worst <= bound, (worst, bound, lower)


@pytest.mark.parametrize("d", [4, 64])
def test_float32_max_logits_stay_within_their_bound(d):
    g = torch.Generator().manual_seed(d)
    q = torch.randn(2, 4, 16, d, generator=g) * 3
    k = torch.randn(2, 2, 16, d, generator=g)
    kk = k.repeat_interleave(2, dim=1)
    scale = d**-0.5
    f32 = ((q @ kk.transpose(-1, -2)) * scale).amax(dim=(0, 2, 3))
    f64 = ((q.double() @ kk.double().transpose(-1, -2)) * scale).amax(dim=(0, 2, 3))
    worst = (f32.double() - f64).abs().max().item()
    assert 0 < worst <= max_logit_atol(q, k, scale), (worst, max_logit_atol(q, k, scale))
