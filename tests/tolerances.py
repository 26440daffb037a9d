"""Tolerances for two computations that agree in exact arithmetic and differ only in rounding.

Two results that run the same operations in the same order on the same machine are compared bit
for bit (``torch.equal``).  Where the order differs (a batched call against single calls, fused
weights against separate ones, a reduction split over ranks, another CPU's BLAS kernel), no
recorded number and no margin measured on one machine is an oracle: the bound comes from the
dtype's unit roundoff ``u`` and the computation's size, as below, and holds for any summation
order, blocking, vector width or FMA use, so on every CPU (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., 2002, section 3.1 and Lemma 3.1):

* ``gamma(n) = n u / (1 - n u)``: a sum of ``n`` terms (a dot product of length ``n``) computed
  in any order is within ``gamma(n) * sum |x_i y_i|`` of the exact one.  So ``fl(A @ B)`` is
  within ``gamma(k) * (|A| @ |B|)`` of ``A @ B`` entrywise (``k`` the inner dimension), and in
  Frobenius norm within ``gamma(k) * ||A||_F ||B||_F``.
* Each of two implementations lies within the bound ``E`` of the exact value, so they lie within
  ``2 E`` of each other: ``atol = 2 * E`` and ``rtol = 0``.

Newton–Schulz (:func:`newton_schulz_error_bound`) composes these bounds through its iterations.
In float32 the composed bound is far above the differences seen in practice (it assumes every
rounding error points the same way, and a singular value near 0 amplifies them by up to ``a`` per
step), so loose that it cannot tell a right block order from a wrong one; in float64 the same
bound is ~1e-10-1e-8 (classic form) or ~1e-6-1e-4 (Gram form) for the matrices in the tests,
far below anything a misplaced row, block or matrix changes (~0.1).  Tests that compare
differently ordered Newton–Schulz runs therefore run them in float64 against this bound;
float32 behaviour is checked where both sides run the same order (bit for bit), or against
float64 formulas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from optimizer.newton_schulz.coefficients import NS_NORM_SAFETY, resolve_ns_coefficients


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: half the distance from 1 to the next float (2^-24 for float32, 2^-53 for float64)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """``gamma_n = n u / (1 - n u)``: the relative error bound of a sum of ``n`` products."""
    nu = n * unit_roundoff(dtype)
    if not nu < 1:
        raise ValueError(f"gamma({n}) is unbounded in {dtype}: n * u = {nu} >= 1")
    return nu / (1 - nu)


def max_logit_atol(q: torch.Tensor, k: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """Tolerance between two per-head max logits ``max scale * q . k`` of the same ``q``
    ``[B, Hq, Lq, d]`` and ``k`` ``[B, Hkv, Lk, d]`` (key heads shared by ``Hq / Hkv`` query heads)
    computed in any order: one in ``dtype``, the other exactly (or in float64) and rounded to
    ``dtype``.  Each logit is a dot product of length ``d`` with the scale applied to it, to ``q``
    or to ``k`` (at most two more roundings): within ``gamma(d + 2) scale |q| . |k|`` of the exact
    one; a max of values each within ``E`` is within ``E`` (masking only drops pairs).  Add
    ``rtol = unit_roundoff(dtype)`` for the final rounding of the reference."""
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    sizes = abs(scale) * (q.double().abs() @ kk.double().abs().transpose(-1, -2))
    d = q.shape[-1]
    return float(sizes.max()) * (gamma(d + 2, dtype) + gamma(d + 2, torch.float64))


def normuon_rtol(rows: int, columns: int, dtype: torch.dtype, beta2: float) -> tuple[float, float]:
    """Relative tolerances ``(rtol of O-hat, rtol of v)`` between two NorMuon normalisations
    (``rule.normuon_normalize``) of the same ``rows x columns`` matrix in ``dtype`` whose sums run
    in any order (the whole matrix's against a cut one's: partial row sums all-reduced, the norms
    from the row sums).  Each quantity is a product or quotient of sums of positive terms, so its
    relative error is bounded entry by entry (no absolute part).  First order, each side against
    exact arithmetic, with ``g = gamma(rows * columns + 2)`` covering every sum (a row's squares,
    the sum over rows, the all-reduce):
      row sum of squares s_i          g + 3u   (a norm, then squared: the square root's rounding
                                               doubled, and the square's)
      v = lerp(v, s_i / C, w), w <= 1/2  g + 10u  (the mean's rounding; both terms positive, the
                                               roundings of (mean - v) and of w (mean - v) count at
                                               most w/(1-w) <= 1 of v)
      d_i = sqrt(v) + eps             (g + 10u)/2 + 2u
      ||O||^2 = sum s_i               g + 3u
      ||Ô||^2 = sum s_i / d_i^2        2g + 19u
      scale = sqrt of their quotient  1.5g + 14u
      O-hat = O * (scale / d_i)       2g + 23u (or, the cut form, O / d_i * scale: 2g + 23u)
    which totals at most ``2g + 24u`` for O-hat and ``g + 10u`` for v per side; two sides differ
    by at most twice that."""
    if not 0 < 1 - beta2 <= 0.5:
        raise ValueError(f"normuon_rtol: the bound assumes the lerp weight 1 - beta2 in (0, 1/2]; got {1 - beta2}")
    u, g = unit_roundoff(dtype), gamma(rows * columns + 2, dtype)
    return 2 * (2 * g + 24 * u), 2 * (g + 10 * u)


def _extremes(coefficients: Sequence[float], lo: float, hi: float) -> tuple[float, float]:
    """``(min P, max P)`` on ``[lo, hi]`` for ``P(t) = sum coefficients[i] t^i``: at an end or at a
    real root of ``P'`` (the eigenvalues of its companion matrix, in float64; a root off by ``d``
    moves the value found by ``O(d^2)``, far below anything here)."""
    def value(t):
        return sum(c * t**i for i, c in enumerate(coefficients))

    candidates = [lo, hi]
    deriv = [i * c for i, c in enumerate(coefficients)][1:]
    while deriv and deriv[-1] == 0:
        deriv.pop()
    if len(deriv) >= 2:
        n = len(deriv) - 1
        companion = torch.zeros(n, n, dtype=torch.float64)
        companion[1:, :-1] = torch.eye(n - 1, dtype=torch.float64)
        companion[:, -1] = -torch.tensor(deriv[:-1], dtype=torch.float64) / deriv[-1]
        for root in torch.linalg.eigvals(companion).tolist():
            if abs(root.imag) <= 1e-9 * (1 + abs(root.real)) and lo < root.real < hi:
                candidates.append(root.real)
    values = [value(t) for t in candidates]
    return min(values), max(values)


def _max_abs(coefficients: Sequence[float], lo: float, hi: float) -> float:
    """``max |P(t)|`` on ``[lo, hi]``."""
    return max(abs(v) for v in _extremes(coefficients, lo, hi))


def _step_bounds(a: float, b: float, c: float, lo: float, hi: float) -> tuple[float, float, float]:
    """For one step ``p(x) = a x + b x^3 + c x^5`` on singular values in ``[lo, hi]``: the range
    ``[lo', hi']`` of ``|p|`` there (``lo' = 0`` where ``p`` reaches 0), and the growth ``L``, the
    larger of ``max |p'|`` and ``max |p(x) / x|`` on ``[lo, hi]`` (these bound the divided
    differences of ``p`` between singular values, and ``p(x)/x`` on the directions ``X`` does not
    reach)."""
    p_min, p_max = _extremes((0, a, 0, b, 0, c), lo, hi)
    top = max(abs(p_min), abs(p_max))
    bottom = 0.0 if p_min <= 0 <= p_max else min(abs(p_min), abs(p_max))
    growth = max(_max_abs((a, 0, 3 * b, 0, 5 * c), lo, hi), _max_abs((a, 0, b, 0, c), lo, hi))
    return bottom, top, growth


def newton_schulz_error_bound(
    shape: Sequence[int],
    dtype: torch.dtype,
    ns_steps: int = 5,
    coefficients="fixed",
    norm_safety: float | None = None,
    method: str = "classic",
    sigma_min: float = 0.0,
) -> float:
    """Bound, in Frobenius norm per matrix, on how far Newton–Schulz (``optimizer.newton_schulz``)
    computed in ``dtype`` in *any* order can be from the exact iteration on the same input matrix of
    ``shape`` (``[..., m, n]``); ``method`` is the form run (``"auto"``: the one
    ``choose_ns_method`` picks).  ``sigma_min``: a lower bound on the input's smallest singular value
    over its Frobenius norm (e.g. from ``torch.linalg.svdvals`` in float64); 0 (the default) holds
    for any input.  Two implementations differ by at most the sum of their bounds, in every entry.
    First order in ``u``: the terms left out are smaller than the bound by a factor of the bound
    itself.

    Derivation.  With ``s = min(m, n)``, ``l = max(m, n)`` and ``X`` the ``s x l`` iterate:

    * Start: ``X_0 = G / (norm_safety ||G||_F)``, so ``||X_0||_2 <= ||X_0||_F = 1 / norm_safety``;
      the norm (a sum of ``m n`` squares), its scaling and the division give a relative error of at
      most ``gamma(m n + 4)``.
    * Step ``j``: ``X <- p_j(X) = a X + (b A + c A^2) X``, ``A = X X^T``, applies
      ``p_j(x) = a x + b x^3 + c x^5`` to every singular value.  The exact iterate's singular
      values lie in ``[lo_j, S_j]`` (``lo_0 = sigma_min / norm_safety``), then in the range of
      ``|p_j|`` there; its Frobenius norm ``F_{j+1} <= max |p_j(x)/x| F_j``.
    * Propagation: the Fréchet derivative of ``X -> p_j(X)`` at a matrix with singular values in
      ``[lo_j, S_j]`` has Frobenius-to-Frobenius norm at most ``L_j``, the larger of ``max |p_j'|``
      and ``max |p_j(x)/x|`` there (in the singular bases its entries are ``p_j`` divided
      differences between two singular values, or ``p_j(x)/x``, for the odd ``p_j``; Noferini, "A
      formula for the Fréchet derivative of a generalized matrix function", SIMAX 2017), so an
      error ``e`` in ``X`` becomes at most ``L_j e``.  A Gram segment computes the same map as its
      steps, so an error in its input grows by the product of their ``L_j``.
    * Rounding: a product ``beta C + alpha (P Q)`` with inner dimension ``k`` is within
      ``gamma(k + 3) (|beta||C| + |alpha||P||Q|)`` entrywise, so within
      ``gamma(k + 3) (|beta| ||C||_F + |alpha| ||P||_F ||Q||_F)``; an error ``dP`` in a factor adds
      ``||dP||_F ||Q||_2``.  Classic step (``A`` inner ``l``, ``b A + c A A`` and ``a X + B X``
      inner ``s``): :func:`_classic_step_rounding`.  Gram segment (``A = X X^T`` once, then per step
      ``B = b A + c A^2``, ``Q <- a Q + Q B``, ``A <- q(A) A q(A)`` as two products, and finally
      ``Q X``; all inner ``s``, spectral norms from the polynomials on ``[lo_j, S_j]``):
      :func:`_gram_segment_rounding`.
    * ``e <- (growth of the step or segment) e + (its rounding)``; the bound is the final ``e``.

    Which products the CPU's symmetric-block shortcut skips, and how a batch is split, does not
    matter: every entry is still one sum of ``k`` products.
    """
    from optimizer.newton_schulz.forms import choose_ns_method
    from optimizer.newton_schulz.restarts import gram_restart_plan

    shape = tuple(int(d) for d in shape)
    m, n = shape[-2:]
    s, l = min(m, n), max(m, n)
    steps = resolve_ns_coefficients(coefficients, ns_steps)
    if norm_safety is None:
        norm_safety = NS_NORM_SAFETY.get(coefficients, 1.0) if isinstance(coefficients, str) else 1.0
    method = choose_ns_method(shape, ns_steps, method, dtype, steps)
    plan = [1] * ns_steps if method == "classic" else list(gram_restart_plan(steps, ns_steps, dtype))
    S = F = 1.0 / norm_safety
    lo = min(sigma_min, 1.0) / norm_safety
    err = gamma(m * n + 4, dtype) * F
    first = 0
    for length in plan:
        segment, first = steps[first:first + length], first + length
        if length == 1:
            rounding = _classic_step_rounding(segment[0], S, F, s, l, dtype)
        else:
            rounding = _gram_segment_rounding(segment, lo, S, F, s, l, dtype)
        for a, b, c in segment:
            lo, top, growth = _step_bounds(a, b, c, lo, S)
            err *= growth
            S, F = top, min(growth * F, math.sqrt(s) * top)
        err += rounding
    return err


def _classic_step_rounding(coefficients, S, F, s, l, dtype) -> float:
    """Rounding of one classic step on an ``s x l`` iterate of spectral norm <= S, Frobenius <= F."""
    a, b, c = coefficients
    g_l, g_s = gamma(l + 3, dtype), gamma(s + 3, dtype)
    A_F = S * F  # ||X X^T||_F <= ||X||_2 ||X||_F
    e_A = g_l * F * F
    e_B = (abs(b) + 2 * abs(c) * S * S) * e_A + g_s * (abs(b) * A_F + abs(c) * A_F * A_F)
    B_F = (abs(b) + abs(c) * S * S) * A_F
    return e_B * S + g_s * (abs(a) + B_F) * F


def _gram_segment_rounding(segment, lo, S, F, s, l, dtype) -> float:
    """Rounding of one Gram segment (``newton_schulz.iteration.gram_segment_factor``, then ``Q X``) on an
    ``s x l`` iterate of spectral norm <= S, Frobenius <= F.

    Each rounding error is carried to the segment's end through the exact maps that follow it.  All
    the matrices are polynomials in the symmetric ``A``, whose eigenvalues are the squared singular
    values ``t`` of the current iterate, in ``[lo_j^2, S_j^2]``; a polynomial ``f`` of ``A`` has spectral
    norm ``max |f(t)|`` and Fréchet derivative (any perturbation, Daleckii–Krein) of norm at most
    ``max |f'(t)|``.  Per step, with ``q(t) = a + b t + c t^2``: ``B`` carries an error of ``A``
    by ``max |q'|``; ``A <- q(A) A q(A)`` by ``max |(t q^2)'|``; ``Q <- Q q(A)`` multiplies ``Q``'s
    error by ``max |q|`` and adds ``||Q||_2`` times ``B``'s."""
    g_l, g_s, u = gamma(l + 3, dtype), gamma(s + 3, dtype), unit_roundoff(dtype)
    root = math.sqrt(s)
    S0, F0 = S, F
    e_A = g_l * F * F  # A = X X^T
    e_Q = 0.0
    Q_2 = 1.0  # the identity before the first step
    for j, (a, b, c) in enumerate(segment):
        bottom, top, growth = _step_bounds(a, b, c, lo, S)
        T = S * S
        q_max, dq_max, dh_max = _gram_poly_bounds(a, b, c, lo * lo, T)
        A_F = S * F
        B_F = (abs(b) + abs(c) * T) * A_F
        r_B = g_s * (abs(b) * A_F + abs(c) * A_F * A_F)  # B = b A + c A A
        e_B = dq_max * e_A + r_B
        if j == 0:  # Q = B, its diagonal plus a
            e_Q = e_B + u * (abs(a) * root + B_F)
        else:  # Q <- a Q + Q B
            e_Q = e_Q * q_max + Q_2 * e_B + g_s * (abs(a) + B_F) * Q_2 * root
        Q_2 *= q_max
        if j + 1 < len(segment):
            AQ_2 = T * q_max  # A q(A)
            r_AQ = g_s * (abs(a) + B_F) * A_F  # A q(A) = a A + A B
            r_A = g_s * (abs(a) + B_F) * AQ_2 * root  # q(A) (A q(A)) = a AQ + B AQ
            e_A = dh_max * e_A + q_max * (r_AQ + T * r_B) + AQ_2 * r_B + r_A
        lo, S, F = bottom, top, min(growth * F, root * top)
    return e_Q * S0 + g_s * Q_2 * root * F0  # Q X


def _gram_poly_bounds(a: float, b: float, c: float, lo: float, hi: float) -> tuple[float, float, float]:
    """On ``[lo, hi]``: ``max |q|``, ``max |q'|`` and ``max |h'|`` for ``q(t) = a + b t + c t^2`` and
    ``h(t) = t q(t)^2``, whose derivative is ``q(t) (a + 3 b t + 5 c t^2)``."""
    dh = (a * a, 4 * a * b, 3 * b * b + 6 * a * c, 8 * b * c, 5 * c * c)
    return _max_abs((a, b, c), lo, hi), _max_abs((b, 2 * c), lo, hi), _max_abs(dh, lo, hi)


def newton_schulz_atol(shape: Sequence[int], dtype: torch.dtype, **kw) -> float:
    """Entrywise tolerance between two differently ordered Newton–Schulz runs of the same form on
    the same input of ``shape`` (or on row blocks of it: the bound only grows with either
    dimension): twice :func:`newton_schulz_error_bound`, since a Frobenius norm bounds every entry."""
    return 2 * newton_schulz_error_bound(shape, dtype, **kw)
