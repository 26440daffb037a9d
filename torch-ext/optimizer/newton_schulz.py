"""Quintic Newton-Schulz orthogonalisation (the "zeroth power" of a matrix).

Muon replaces each matrix update ``G = U S V^T`` by (approximately) ``U V^T``. Newton-Schulz
gets there with matmuls only: normalise ``X = G / ||G||_F`` (so every singular value is in
(0, 1]), then repeat ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, which applies the odd
polynomial ``p(s) = a s + b s^3 + c s^5`` to every singular value.

Two ways to run the same iteration (``method``):

* ``"classic"``: the loop above, on the m x n matrix (m <= n after transposing tall ones).
* ``"gram"``: every step multiplies X on the left by ``q(A) = a I + b A + c A^2``, a polynomial
  in the m x m Gram matrix, so the steps can run on m x m matrices alone and touch X only at
  the start and end of a segment: ``A_{k+1} = q_k(A_k) A_k q_k(A_k)``, ``Q_{k+1} = Q_k q_k(A_k)``,
  ``X_K = Q_K X_0``. Fewer FLOPs once n > 1.5 m (see :func:`newton_schulz_flops`). In finite
  precision the m x m recursion drifts, so it restarts (re-forms A from X) on a schedule that
  depends on the coefficients and the compute dtype (:func:`gram_restart_plan`).
* ``"auto"`` (default) picks the form with fewer FLOPs among those accurate enough, per shape,
  coefficient table and compute dtype (:func:`choose_ns_form`): the Gram form for rectangular
  matrices in fp32; in 16 bits the Gram form in fp16 (its restart plan keeps it within the
  classic 16-bit iteration's error) and never in bf16, where no Gram segment stays within it.

Which dtype runs: the compute dtype when one is set; with ``compute_dtype=None`` fp32 on CPU and,
on CUDA, 16 bits: bf16 for the classic form (as every Muon), fp16 for the Gram form (the same
16-bit cost, eight times finer rounding, which the Gram recursion needs). An fp16 iteration reads
and returns bf16 when its input is wider (:func:`ns_io_dtype`: what parallel Muon's wire carries,
fp32's range); docs/newton_schulz.md has the policy, the restart rule, the band and fp16's range.

Everything here is a pure function of its inputs: no process groups, no optimizer state. The
distributed code gathers a full matrix (or a batch of them) and calls this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Union

import torch
from torch import Tensor

from .ns_kernels import resolve as resolve_kernels

Coefficients = tuple[float, float, float]
CoefficientSpec = Union[str, Coefficients, Sequence[Coefficients]]

NS_COEFFICIENTS: dict[str, list[Coefficients]] = {
    # Keller Jordan's Muon (also torch.optim.Muon, Moonlight and Kimi K2): one (a, b, c) for every
    # iteration, chosen to maximise the slope at zero. Singular values end in roughly [0.7, 1.2]
    # rather than at 1, which does not hurt training.
    # https://github.com/KellerJordan/Muon/blob/master/muon.py
    "fixed": [(3.4445, -4.7750, 2.0315)],
    # Polar Express (Amsel, Persson, Musco, Gower 2025, https://arxiv.org/abs/2505.16932): a
    # different minimax-optimal polynomial for each iteration, so small singular values are pulled
    # up fast early on and all of them converge to 1 at the end. Numbers as published in
    # modded-nanogpt's train_gpt.py ("Computed for num_iters=5, safety_factor=2e-2, cushion=2"),
    # https://github.com/KellerJordan/modded-nanogpt. They assume the input is divided by
    # (1 + 2e-2) * ||X||_F, see NS_NORM_SAFETY. Steps past the table use NS_TAIL.
    "polar_express": [
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ],
}

# What a named table does past its end. Polar Express's optimal quintic on [l, u] tends to the
# classic Newton-Schulz quintic (15/8, -10/8, 3/8) as l/u -> 1 (the paper's `optimal_quintic`), whose
# fixed point at 1 is superattracting; repeating the table's last, still aggressive entry would
# instead settle near 1.035. Tables not listed here repeat their last entry.
NS_TAIL: dict[str, Coefficients] = {"polar_express": (15 / 8, -10 / 8, 3 / 8)}

# Extra factor on the Frobenius norm that a named table was designed for. The Polar Express
# polynomials grow fast above 1, so bf16 rounding that nudges a singular value past 1 must not be
# amplified; the table above was fitted to inputs scaled by 1 / 1.02.
NS_NORM_SAFETY: dict[str, float] = {"fixed": 1.0, "polar_express": 1.0 + 2e-2}


def _check_triple(triple, where: str) -> Coefficients:
    try:
        a, b, c = (float(v) for v in triple)
    except (TypeError, ValueError):
        raise ValueError(
            f"ns_coefficients: {where} must be three numbers (a, b, c), got {triple!r}"
        ) from None
    if not all(math.isfinite(v) for v in (a, b, c)):
        raise ValueError(f"ns_coefficients: {where} must be finite, got {(a, b, c)!r}")
    return (a, b, c)


def resolve_ns_coefficients(spec: CoefficientSpec, ns_steps: int) -> list[Coefficients]:
    """Return the ``(a, b, c)`` to use at each of ``ns_steps`` iterations.

    ``spec`` is a name from :data:`NS_COEFFICIENTS` (past the table's end: :data:`NS_TAIL`, or
    the table's last entry), a single ``(a, b, c)`` used at every step, or an explicit list with exactly
    ``ns_steps`` entries.
    """
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be a positive int, got {ns_steps!r}")
    if isinstance(spec, str):
        if spec not in NS_COEFFICIENTS:
            raise ValueError(
                f"ns_coefficients: unknown name {spec!r}; use one of {sorted(NS_COEFFICIENTS)}, "
                "a single (a, b, c) tuple, or a list of ns_steps such tuples"
            )
        table = NS_COEFFICIENTS[spec]
        tail = NS_TAIL.get(spec, table[-1])
        return [table[i] if i < len(table) else tail for i in range(ns_steps)]
    if not isinstance(spec, Sequence) or len(spec) == 0:
        raise ValueError(
            f"ns_coefficients must be a name, an (a, b, c) tuple or a list of them, got {spec!r}"
        )
    if all(isinstance(v, (int, float)) for v in spec):
        return [_check_triple(spec, "the tuple")] * ns_steps
    if len(spec) != ns_steps:
        raise ValueError(
            f"ns_coefficients: a per-iteration list needs exactly ns_steps={ns_steps} entries, "
            f"got {len(spec)}; pass ns_steps={len(spec)} or a list of that length"
        )
    return [_check_triple(t, f"entry {i}") for i, t in enumerate(spec)]


NS_METHODS = ("auto", "classic", "gram")


def check_ns_method(method) -> str:
    """Return ``method`` if it is one of :data:`NS_METHODS`, else raise a ValueError saying which are."""
    if not isinstance(method, str) or method not in NS_METHODS:
        raise ValueError(
            f"ns_method must be one of {', '.join(map(repr, NS_METHODS))}, got {method!r} "
            '("auto" picks the form with fewer FLOPs for each shape and compute dtype; '
            '"classic" and "gram" force one form)'
        )
    return method


def default_compute_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 where tensor cores make it fast (CUDA); fp32 elsewhere.

    On CPU a bf16 matmul is roughly 100x slower than fp32, and fp32 is more accurate anyway. It is
    the classic form's dtype when ``compute_dtype`` is None; the Gram form runs in fp16 there
    (:func:`ns_form_dtypes`). Parallel Muon's pieces travel in it (when narrower than the parameter).
    """
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


# ------------------------------------------------------------------ which dtype runs


def ns_form_dtypes(compute_dtype: torch.dtype | None, device: torch.device | str | None = None) -> dict[str, torch.dtype]:
    """The dtype each form runs in: ``compute_dtype`` for both when it is set (a dtype the user
    chose is never changed); with None, :func:`default_compute_dtype` of ``device`` (None: CPU)
    for the classic form and, where that is 16-bit (CUDA), fp16 for the Gram form.

    Why fp16 for the Gram form: the same 16-bit matmul rate, and 8x finer rounding (unit roundoff
    2^-11 against bf16's 2^-8), which the Gram recursion needs to stay within the classic 16-bit
    iteration's error (``_GRAM_STEP_ERROR_LIMIT``); in bf16 it never does. fp16's narrow range is
    safe here: see the comment on ``_RANGE_HEADROOM``. Pure: the same answer on every rank.
    """
    if compute_dtype is not None:
        return {"classic": compute_dtype, "gram": compute_dtype}
    classic = default_compute_dtype(device if device is not None else "cpu")
    return {"classic": classic, "gram": torch.float16 if classic.itemsize == 2 else classic}


def ns_io_dtype(input_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """What Newton–Schulz rounds its input to before normalising it, and the dtype it returns: the
    compute dtype, except that an fp16 iteration reads and returns bf16 when its input is wider
    than 16 bits (a 16-bit input stays as it is).

    That is also what parallel Muon's pieces travel as (``step_context.wire_dtype``), so the owner
    of a matrix and a single device see the same numbers: a momentum entry above fp16's 65504 or
    below its 6e-8 survives the wire in bf16 (fp32's range), and normalisation then brings every
    entry into [-1, 1] before anything is rounded to fp16. The result, whose singular values are
    about 1, goes back in bf16 like the classic bf16 iteration's.
    """
    if compute_dtype != torch.float16:
        return compute_dtype
    return input_dtype if input_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


# ------------------------------------------------------------------ Gram-space restarts

# How much a Gram-space step's polynomial may be off, within one segment, because of drift.
#
# Rounding makes the computed A = X X^T slightly indefinite: an eigenvalue that should be 0, or
# any below the rounding level (singular values under sqrt(u) of the largest), comes out near
# -u * ||A|| (u: the compute dtype's unit roundoff). The m x m recursion multiplies every
# eigenvalue r of A by q(r)^2 per step, q(r) = a + b r + c r^2, so such an r drifts from -u
# geometrically. Two things go wrong (Zhang, Amsel, Chen and Dao, "Gram Newton-Schulz", Dao AI Lab
# blog, 2026; github.com/Dao-AILab/gram-newton-schulz): while |r| is small, the directions below
# the rounding level get the step factor q(r) instead of q(r_true), an error of about
# |b r| / |a|; and since, unlike a positive r, a negative one is never damped (q grows with -r),
# it eventually blows up, taking the result with it. The classic form has neither problem: it
# re-forms A from X every step, and an odd polynomial cannot flip a singular value's sign. The
# cure is to restart part-way: X <- Q X, A <- X X^T, which resets the drift to -u.
#
# Dao et al. place restarts by simulating a negatively perturbed eigenvalue (-4e-4, about fp16's
# u) through the table for singular values from 1 down to 1e-10 and taking the placement with the
# smallest largest |Q| (autotuned: after step 2 of 5-step Polar Express in fp16, which Microsoft's
# dion and others hard-code). That guards against blow-up, not against error. Our rule, evaluated
# per (coefficients, dtype) in ``_restart_plan``, aims at accuracy; a segment ends before a step
#
# 1. whose factor the drift would put more than this fraction off: follow r_0 = -u through
#    r <- r q(r)^2 and compare (|b| |r| + |c| r^2) / |a| with the limit;
# 2. in a dtype no finer than bf16 (every step: one-step segments, the classic iteration);
# 3. in fp16, where the iteration has stalled (``_stalled_steps``: the fixed table from its 6th
#    step, where its iterates cycle and rounding is amplified instead of corrected);
# 4. that would take Q's largest eigenvalue past the dtype's max / _RANGE_HEADROOM.
#
# What it must achieve is measured by benchmarks/ns_efficiency.py --restart-study against the
# fp64 iteration, on Gaussian, rank-1, rank-s/8, condition number 1e4 and 1e6, and power-law
# inputs, at 128 x 512 (6 seeds) and 256 x 1024 (4 seeds); docs/newton_schulz.md has the tables:
#
# * fp32 (and fp64): 5 steps in one segment (the 5th is 0.2% off with the fixed table, 0.8% with
#   Polar Express), 10 in two of 5 (a 6th would be 2% off; 6+4 steps left singular values of
#   ill-conditioned inputs up to 0.16 off the fp64 iteration, 5+5 at most 4e-3, 1.3e-2 at
#   condition number 1e6: tests/rule/test_newton_schulz_gram.py). Not held to the 16-bit band
#   (at most 0.21x it), so rules 2 and 3 do not apply.
# * fp16: (2, 2, 1) for the fixed table and (1, 2, 2) for Polar Express at 5 steps (at most 0.82x
#   and 0.71x the band), (2, 2, 1, 1, 1, 1, 1, 1) and (1, 2, 2, 3, 2) at 10 (0.88x, and 1.00x /
#   0.96x: ties with the classic fp16 iteration, itself 1.00x / 0.96x). Longer plans are not:
#   with a 10% limit, which lands on Dao et al.'s (2, 3) for Polar Express, that plan is 1.4x
#   (128 x 512) to 4.3x (256 x 1024) the band on power-law spectra; the fixed table's (3, 2) is
#   0.86-0.98x, too close to call; without rule 3 the fixed table's 10 steps would be
#   (2, 2, 2, 2, 2), 1.16x on power-law spectra at 256 x 1024 (3 and 8 seeds).
# * bf16: one step per segment, for every table and step count. The band is the classic 16-bit
#   iteration's own error, bf16's included, and a Gram segment does everything a classic step
#   does plus its drift: in bf16 it has no headroom. Measured: every placement with a 2-step
#   segment in 5 steps (128 x 512, 4 seeds) is 3.8x (the best, fixed (1, 2, 2)) to 1e15x the band;
#   at 10 steps even a single 2-step segment at the end is 1.01x (Polar Express) to 1.19x (fixed).
#
# The band: on each study input, the largest singular-value error (against the fp64 iteration) of
# the classic iteration in bf16 or in fp16, whichever is larger, max over seeds; a form is within
# it when its own error is at most 1.0x that, or when both are "saturated" (>= 0.5: noise directions
# of a rank-deficient input lifted into the polynomials' attracting interval, which no 16-bit form
# resolves; there the error is the position within that interval, not an accuracy) and its error
# is no more than what the polynomials can output.
_GRAM_STEP_ERROR_LIMIT = 0.01

# Rounding no finer than this leaves a Gram segment no headroom below the band: one-step segments.
_BAND_UNIT_ROUNDOFF = torch.finfo(torch.bfloat16).eps / 2
# Dtypes at least this coarse (fp16) are held to the 16-bit band, where rounding that a stalled
# iteration keeps amplifying reaches it: no Gram segment across a stalled step (``_stalled_steps``).
_SIXTEEN_BIT_UNIT_ROUNDOFF = torch.finfo(torch.float16).eps / 2

# fp16's range (max 65504; normal down to 2^-14 = 6.1e-5, subnormal steps of 2^-24 below that).
# Why nothing overflows. X is G / (||G||_F * norm_safety), divided in fp32 (or wider) and rounded
# once (``_normalised``; the input first rounded to bf16, fp32's range: ``ns_io_dtype``), so
# every singular value, hence every entry, is <= 1. Every other matrix the iteration stores is a
# polynomial in one symmetric matrix applied to singular values in [0, 1]: an entry of a symmetric
# matrix is at most its largest |eigenvalue|, and those are scalar functions of each singular value
# (A: s^2; B: b s^2 + c s^4; Q: the product of a segment's q(r_j); A q(A); the next X: p(s)).
# :func:`ns_value_bound` evaluates them all on [0, 1] and at the drifted eigenvalue -u: for the
# tables here and their fp16 plans the largest is 12.0 (fixed: Q of a 2-step segment, 3.44^2;
# X <= 1.21, A <= 1.45, B <= 2.81) and 16.1 (Polar Express: Q; X <= 1.99, A <= 3.97, B <= 7.96), 4,000x
# below 65504. Products are accumulated in fp32 and rounded once (cuBLAS, and the CPU's kernels),
# so no partial sum is stored in fp16. The rule also ends a segment before its Q, which grows
# like the product of the a's, could pass 65504 / _RANGE_HEADROOM, and ``"auto"`` runs the fp16
# Gram form of its own accord (compute_dtype None) only for tables whose bound is below that.
# Why underflow is harmless. A stored entry below 2^-14 keeps an absolute error of at most 2^-25
# (instead of a relative 2^-11). For X (Frobenius norm 1/norm_safety) that adds at most
# 2^-25 sqrt(m n) to the Frobenius norm of its rounding error, against bf16's 2^-8: less for
# any matrix under 1.3e10 entries, so an fp16 X is never rounded worse than a bf16 one. For A
# (entries of a flat spectrum are about 1 / (m sqrt(n))) the floor only perturbs q(A) by
# about (|b| + 2|c|) 2^-25 * 2 sqrt(m) (random signs): 3e-4 at m = 8192 for Polar Express's
# first step, under bf16's X rounding (2^-8); measured on flat and outlier spectra in
# tests/rule/test_newton_schulz_gram.py. Inputs whose normalised entries all lie below 2^-14
# (||G|| far below ``eps``, where the output is about prod(a) * G / eps, tiny) lose relative
# accuracy but keep that absolute error bound; a zero matrix gives zeros.
_RANGE_HEADROOM = 2.0**8


def gram_restart_plan(
    coefficients: CoefficientSpec, ns_steps: int, dtype: torch.dtype | None = None
) -> tuple[int, ...]:
    """Lengths of the Gram-space segments for ``ns_steps`` iterations (they sum to ``ns_steps``).

    Each segment forms ``A = X X^T`` from the current X, runs its steps on m x m matrices and
    ends with ``X <- Q X``; a segment of one step is exactly a classic step. ``dtype`` is the
    dtype the Gram form runs in (None: float32). See ``_GRAM_STEP_ERROR_LIMIT`` for the rule; with
    the tables here: fp32 5 steps -> (5,), 10 -> (5, 5); fp16 5 steps -> (2, 2, 1) (fixed) and
    (1, 2, 2) (Polar Express); bf16 -> all ones (the classic iteration).
    """
    steps = tuple(resolve_ns_coefficients(coefficients, ns_steps))
    return _restart_plan(steps, dtype or torch.float32)


def _drift_error(r: float, a: float, b: float, c: float) -> float:
    """Relative error of the step factor q(r) = a + b r + c r^2 at a drifted eigenvalue r."""
    return (abs(b * r) + abs(c * r * r)) / abs(a) if a != 0 else math.inf


@lru_cache(maxsize=512)
def _restart_plan(steps: tuple[Coefficients, ...], dtype: torch.dtype) -> tuple[int, ...]:
    info = torch.finfo(dtype)
    unit_roundoff = info.eps / 2
    if unit_roundoff >= _BAND_UNIT_ROUNDOFF:
        return (1,) * len(steps)
    stalled = _stalled_steps(steps) if unit_roundoff >= _SIXTEEN_BIT_UNIT_ROUNDOFF else (False,) * len(steps)
    gain_limit = info.max / _RANGE_HEADROOM
    lengths: list[int] = []
    r = gain = math.nan
    for (a, b, c), stall in zip(steps, stalled):
        # not <=: restarts on the first step (r is nan) and on an overflowed r
        if (not lengths or stall or not _drift_error(r, a, b, c) <= _GRAM_STEP_ERROR_LIMIT
                or not gain * abs(a + b * r + c * r * r) <= gain_limit):
            lengths.append(0)
            r, gain = -unit_roundoff, 1.0
        lengths[-1] += 1
        q = a + b * r + c * r * r
        r, gain = r * q * q, gain * abs(q)  # the drifted eigenvalue, and Q's largest eigenvalue there
    return tuple(lengths)


@lru_cache(maxsize=512)
def _stalled_steps(steps: tuple[Coefficients, ...]) -> tuple[bool, ...]:
    """Per step: whether the iteration has stalled there, neither lifting nor converging. The
    iterates of singular values in [2^-8, 1] (those the 16-bit band resolves; fp64, 20001 points,
    log-spaced) occupy an interval [lo, hi] after each step; a step stalls when lo does not rise
    and the width is not at least halved. The fixed table stalls from its 6th step, cycling in
    [0.68, 1.13] (its fixed point 0.87 repels, |p'| = 1.58); Polar Express never does."""
    x = torch.logspace(-8 * math.log10(2), 0, 20001, dtype=torch.float64)
    lo, width = float(x.min()), float(x.max() - x.min())
    out = []
    for a, b, c in steps:
        x = a * x + b * x**3 + c * x**5
        new_lo, new_width = float(x.abs().min()), float(x.abs().max() - x.abs().min())
        out.append(bool(not new_lo > lo * (1 + 2.0**-8) and not new_width <= width / 2))
        lo, width = new_lo, new_width
    return tuple(out)


def ns_value_bound(coefficients: CoefficientSpec, ns_steps: int, plan: Sequence[int] | None = None,
                   dtype: torch.dtype = torch.float16) -> float:
    """The largest |entry| any matrix of the iteration can hold, for inputs normalised to singular
    values in [0, 1]: X, A = X X^T, B = b A + c A^2 and, within Gram segments of ``plan`` (None:
    the classic iteration), Q and A q(A), with the segment's eigenvalues also drifted by -u ||A||
    (u of ``dtype``). Each is a symmetric matrix (or X, whose entries are at most its largest
    singular value) whose eigenvalues are a scalar function of each singular value s, evaluated here
    on 4097 points of [0, 1] in fp64. See the comment on ``_RANGE_HEADROOM``."""
    steps = tuple(resolve_ns_coefficients(coefficients, ns_steps))
    plan = tuple(plan) if plan is not None else (1,) * ns_steps
    if sum(plan) != ns_steps or min(plan) < 1:
        raise ValueError(f"ns_value_bound: plan {plan} must be positive lengths summing to ns_steps={ns_steps}")
    return _value_bound(steps, plan, torch.finfo(dtype).eps / 2)


@lru_cache(maxsize=512)
def _value_bound(steps: tuple[Coefficients, ...], plan: tuple[int, ...], unit_roundoff: float) -> float:
    s = torch.linspace(0.0, 1.0, 4097, dtype=torch.float64)
    worst = 1.0
    first = 0
    for length in plan:
        segment, first = steps[first: first + length], first + length
        top = float((s * s).max())
        new_s = None
        for shift in (0.0, -unit_roundoff * max(top, 1.0)):  # the true eigenvalues, and drifted ones
            r, Q = s * s + shift, None
            for j, (a, b, c) in enumerate(segment):
                B = b * r + c * r * r
                Q = a + B if Q is None else Q * (a + B)
                worst = max(worst, float(r.abs().max()), float(B.abs().max()), float(Q.abs().max()))
                if j + 1 < length:
                    AQ = r * (a + B)
                    r = (a + B) * AQ
                    worst = max(worst, float(AQ.abs().max()))
            if shift == 0.0:
                new_s = Q * s
        s = new_s
        worst = max(worst, float(s.abs().max()))
    return worst if math.isfinite(worst) else math.inf


def _fits_fp16(steps: Sequence[Coefficients], plan: Sequence[int]) -> bool:
    return _value_bound(tuple(steps), tuple(plan), torch.finfo(torch.float16).eps / 2) \
        <= torch.finfo(torch.float16).max / _RANGE_HEADROOM


# ------------------------------------------------------------------ FLOPs and the choice


def newton_schulz_flops(
    shape: Sequence[int],
    ns_steps: int,
    method: str = "classic",
    dtype: torch.dtype | None = None,
    coefficients: CoefficientSpec = "fixed",
    device: torch.device | str | None = None,
    *,
    symmetric: bool = False,
) -> int:
    """Floating-point operations (2 per multiply-add) of the NS matmuls for ``shape``.

    With ``s = min(m, n)`` and ``l = max(m, n)``, every matrix of a batched shape counting:

    * classic: per step ``X X^T`` (s*s*l), ``A @ A`` (s^3) and ``B @ X`` (s*s*l) multiply-adds.
    * gram: per segment of L steps (:func:`gram_restart_plan`, which depends on the
      coefficients and the dtype the Gram form runs in: :func:`choose_ns_form` of ``dtype``, the
      compute dtype, and ``device``; None, None: float32) ``X X^T`` and ``Q @ X`` (s*s*l each)
      plus ``4 L - 3`` products of s x s matrices (``A @ A`` every step, ``Q q(A)`` every step but
      the first, ``A q(A)`` and ``q(A) (A q(A))`` every step but the last).

    Per segment of L >= 2 steps the gram form saves ``2 (L - 1) s^2 (2 l - 3 s)`` FLOPs: fewer
    exactly when ``l > 1.5 s``, whatever the plan. ``symmetric=True`` counts the products known to
    be symmetric (``X X^T``; ``A @ A``; every s x s product of the Gram form, all polynomials in
    one symmetric matrix) as one triangle, ``s (s + 1) k`` FLOPs for an s x k by k x s product: what
    symmetric kernels do. Then a segment saves ``3 (L - 1) s^2 (l - s)`` (up to the diagonals'
    terms): fewer FLOPs for every rectangular shape. ``method="auto"`` counts the form
    :func:`choose_ns_form` picks (with the same ``symmetric``). Elementwise work and the
    normalisation are ignored (lower order). Nominal counts by default: the CPU's symmetric-block
    shortcut does fewer. Used to balance owners across ranks.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"newton_schulz_flops needs a shape [..., m, n], got {shape}")
    if ns_steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {ns_steps}")
    check_ns_method(method)
    if ns_steps == 0:
        return 0
    if method == "auto":
        method = choose_ns_form(shape, ns_steps, "auto", dtype, coefficients, device, symmetric=symmetric)[0]
    batch = math.prod(shape[:-2])
    s, l = min(shape[-2:]), max(shape[-2:])
    gram_xxt = s * (s + 1) * l if symmetric else 2 * s * s * l  # X X^T
    square = s * (s + 1) * s if symmetric else 2 * s**3  # a product of two s x s matrices
    left = 2 * s * s * l  # B X or Q X: not symmetric

    def segment(length: int) -> int:  # a segment of one step is a classic step
        return gram_xxt + left + (4 * length - 3) * square

    if method == "classic":
        return batch * ns_steps * segment(1)
    gram_dtype = choose_ns_form(shape, ns_steps, "gram", dtype, coefficients, device)[1]
    plan = gram_restart_plan(coefficients, ns_steps, gram_dtype)
    return batch * sum(segment(length) for length in plan)


def choose_ns_form(
    shape: Sequence[int],
    ns_steps: int,
    method: str = "auto",
    compute_dtype: torch.dtype | None = None,
    coefficients: CoefficientSpec = "fixed",
    device: torch.device | str | None = None,
    *,
    symmetric: bool = False,
) -> tuple[str, torch.dtype]:
    """The form (``"classic"`` or ``"gram"``) and the dtype it runs in, for ``shape`` (batch
    included), the user's ``compute_dtype`` (None: the device's defaults, :func:`ns_form_dtypes`;
    ``device`` None: CPU) and the coefficient table.

    ``method`` itself unless it is ``"auto"``, which picks the Gram form when it saves at least
    :data:`GRAM_MIN_SAVED_FLOPS` FLOPs (:func:`newton_schulz_flops`, ``symmetric`` as there):
    that holds exactly when ``max(m, n) > 1.5 min(m, n)`` (any rectangular shape with
    ``symmetric``) and its restart plan (:func:`gram_restart_plan`) has a segment of two or more
    steps, i.e. in fp32, fp64 and fp16, never in bf16, where no Gram segment stays within the
    classic 16-bit iteration's error (``_GRAM_STEP_ERROR_LIMIT``). With compute_dtype None on CUDA
    the candidates are the classic form in bf16 and the Gram form in fp16 (same 16-bit rate); fp16
    only for tables whose values fit it with room to spare (:func:`ns_value_bound`; else the Gram
    form, forced or chosen, runs in bf16). A small matrix saves too few FLOPs to pay for the Gram
    form's extra, smaller products (measured on CPU: 1.1-1.5x slower at 4 x 64 to 64 x 128).
    Pure (a table's scalar checks are evaluated once on the CPU and cached): the same answer on
    every rank.
    """
    check_ns_method(method)
    dtypes = ns_form_dtypes(compute_dtype, device)
    if compute_dtype is None and dtypes["gram"] == torch.float16:
        steps = resolve_ns_coefficients(coefficients, ns_steps)
        if not _fits_fp16(steps, gram_restart_plan(steps, ns_steps, torch.float16)):
            dtypes["gram"] = dtypes["classic"]  # not our choice to make when it may overflow
    if method != "auto":
        return method, dtypes[method]
    classic = newton_schulz_flops(shape, ns_steps, "classic", symmetric=symmetric)
    gram = newton_schulz_flops(shape, ns_steps, "gram", dtypes["gram"], coefficients, symmetric=symmetric)
    form = "gram" if classic - gram >= GRAM_MIN_SAVED_FLOPS else "classic"
    return form, dtypes[form]


def choose_ns_method(
    shape: Sequence[int],
    ns_steps: int,
    method: str = "auto",
    dtype: torch.dtype | None = None,
    coefficients: CoefficientSpec = "fixed",
    device: torch.device | str | None = None,
    *,
    symmetric: bool = False,
) -> str:
    """``"classic"`` or ``"gram"``: the form of :func:`choose_ns_form` (``dtype`` is its
    ``compute_dtype``; None with ``device`` None: float32)."""
    return choose_ns_form(shape, ns_steps, method, dtype, coefficients, device, symmetric=symmetric)[0]


# FLOPs the Gram form must save before "auto" takes it: its extra kernels cost ~100 µs on a CPU
# core. Measured (fp32, 1 thread, classic vs gram): 64 x 128 saves 2.1 MFLOP and runs 1.07x
# slower, 48 x 192 saves 4.4 MFLOP and runs 0.92x, 64 x 256 saves 10 MFLOP and runs 0.75x.
GRAM_MIN_SAVED_FLOPS = 4_000_000


# ------------------------------------------------------------------ the iteration


def zeropower_via_newtonschulz(
    G: Tensor,
    ns_steps: int = 5,
    coefficients: CoefficientSpec = "fixed",
    eps: float = 1e-7,
    compute_dtype: torch.dtype | None = None,
    norm_safety: float | None = None,
    method: str = "auto",
    kernels: str = "auto",
) -> Tensor:
    """Approximately orthogonalise every matrix in ``G`` (shape ``[..., m, n]``).

    Leading dims are a batch of independent matrices (a 3-D MoE weight ``[E, out, in]`` is E
    matrices done in one batched call). ``method`` is ``"classic"``, ``"gram"`` or ``"auto"``;
    with ``compute_dtype`` it fixes the form and the dtype it runs in (:func:`choose_ns_form`;
    the two forms compute the same polynomial and differ in rounding only). G is rounded to
    :func:`ns_io_dtype` (the run dtype, or bf16 for an fp16 run on a wider input) and each
    matrix divided by its own Frobenius norm in fp32 (times ``norm_safety``; default: what the
    named table needs, else 1), rounding once to the run dtype; tall matrices are transposed so
    the Gram matrix ``X X^T`` is the small one. Returns a tensor of ``G``'s shape in
    :func:`ns_io_dtype` (the compute dtype, default :func:`default_compute_dtype` of ``G``'s
    device, except bf16 for an fp16 iteration on a wider input).
    ``kernels`` (``optimizer.ns_kernels``) says what runs the products: the Triton kernels of
    :mod:`optimizer.kernels` or torch's matmuls.
    """
    if G.ndim < 2:
        raise ValueError(
            f"zeropower_via_newtonschulz expects a matrix or a batch of matrices [..., m, n], "
            f"got shape {tuple(G.shape)}"
        )
    check_ns_method(method)
    steps = resolve_ns_coefficients(coefficients, ns_steps)
    if norm_safety is None:
        norm_safety = NS_NORM_SAFETY.get(coefficients, 1.0) if isinstance(coefficients, str) else 1.0
    if not norm_safety > 0:
        raise ValueError(f"norm_safety must be positive, got {norm_safety!r}")
    shape = G.shape
    form, dtype = choose_ns_form(shape, ns_steps, method, compute_dtype, steps, G.device)
    if G.numel() == 0:
        return torch.zeros(shape, dtype=ns_io_dtype(G.dtype, dtype), device=G.device)
    plan = gram_restart_plan(steps, ns_steps, dtype) if form == "gram" else None
    return _zeropower(G, steps, dtype, plan, norm_safety, eps, kernel_backend(kernels, G.device, dtype))


def kernel_backend(kernels: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend Newton–Schulz's products get for ``ns_kernels=kernels`` on ``device`` in
    ``dtype``: ``"torch"`` where the option resolves to torch (``"triton"`` where it cannot run
    raises); else the option itself. ``"auto"`` on the kernels is the products' own ``"auto"``:
    symmetric products on the kernels from two tile rows up (below, nothing to skip: cuBLAS) and
    ``a X + B X``, ``Q X`` on cuBLAS (nothing symmetric; its epilogue fuses ``a X``); ``"triton"``
    runs every product on the kernels (what the tests force under the interpreter)."""
    return "torch" if resolve_kernels(kernels, device, dtype) == "torch" else kernels


def _zeropower(G: Tensor, steps: Sequence[Coefficients], dtype: torch.dtype, plan: Sequence[int] | None,
               norm_safety: float, eps: float, kernels: str = "torch") -> Tensor:
    """The iteration on G in ``dtype``: the Gram form with restart ``plan``, or the classic form
    (``plan`` None), its products on torch's matmuls (``kernels="torch"``) or on the kernels'
    products with that backend (``"auto"``, ``"triton"``: :func:`kernel_backend`).
    Also what benchmarks/ns_efficiency.py --restart-study runs other plans with."""
    shape = G.shape
    X = _normalised(G, dtype, norm_safety, eps)  # [batch, s, l], s <= l
    single = X.shape[0] == 1
    if single:  # 2-D kernels (mm/addmm) for the common unbatched case
        X = X[0]
    if kernels != "torch":
        from .kernels import newton_schulz as on_kernels

        X = (on_kernels.classic_iterations(X, steps, backend=kernels) if plan is None
             else on_kernels.gram_iterations(X, steps, plan, backend=kernels))
    else:
        X = _classic_iterations(X, steps) if plan is None else _gram_iterations(X, steps, plan)
    if single:
        X = X.unsqueeze(0)
    if shape[-2] > shape[-1]:
        X = X.mT
    return X.reshape(shape).to(ns_io_dtype(G.dtype, dtype))


def _normalised(G: Tensor, dtype: torch.dtype, norm_safety: float, eps: float) -> Tensor:
    """G as [batch, s, l] (tall matrices transposed), each matrix divided by its Frobenius norm
    times ``norm_safety``, in ``dtype``, contiguous; the same numbers whatever G's memory layout.

    G is first rounded to :func:`ns_io_dtype` (``dtype`` itself but for fp16, which reads bf16):
    exactly the numbers a 16-bit all-gather delivers to the owner, so parallel and single-device
    Muon see the same matrix. The norm of that matrix and the division are then in fp32 (or wider,
    if G or dtype is), rounding once more, to ``dtype``: dividing by a bf16-rounded norm would
    scale the matrix by up to 2^-8 (0.4%) off, a fifth of Polar Express's 2% safety margin; and an
    fp16 matrix is only ever formed from values already in [-1, 1]. Frobenius norm >= spectral
    norm, so singular values land in (0, 1 / norm_safety].
    """
    m, n = G.shape[-2:]
    # Contiguous first: a reduction's rounding depends on the memory layout, and the same matrix
    # arrives as a strided view on some paths (an owner's zero-copy piece with NorMuon's row-state
    # columns beside it, an assembled matrix cut from its padding) and contiguous on others.
    X = G.to(ns_io_dtype(G.dtype, dtype)).reshape(-1, m, n).contiguous()
    if m > n:
        X = X.mT
    wide = torch.promote_types(torch.promote_types(G.dtype, dtype), torch.float32)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=wide)
    out = torch.empty(X.shape, dtype=dtype, device=G.device)
    return torch.div(X, (norm * norm_safety).clamp_min(eps), out=out)


def _uses_symmetric_blocks(X: Tensor) -> bool:
    # On CPU, computing only the diagonal and upper blocks of a product known to be symmetric
    # saves 1/4 of its FLOPs per level. Single matrices: 5-20% faster from 768 wide
    # (benchmarks/ns_efficiency.py). Batches of experts, [4..16, 256..1024, ...]: 3-22% faster
    # for the classic form and 7-25% for the Gram form (minima of 7 interleaved repeats, one
    # thread). Not used on CUDA (not measured; cuBLAS has no symmetric-output GEMM to call).
    return X.device.type == "cpu" and X.shape[-2] >= 2 * _SYMMETRIC_MIN_BLOCK


def _classic_iterations(X: Tensor, steps: Sequence[Coefficients]) -> Tensor:
    """``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, per step; X is [s, l] or [batch, s, l]."""
    symmetric = _uses_symmetric_blocks(X)
    addmm = torch.addmm if X.ndim == 2 else torch.baddbmm
    for a, b, c in steps:
        A = _symmetric_product(X, X.mT, blocks=symmetric)  # [s, s]
        # B = b*A + c*A@A in one fused call; A@A is A^T A as well, no extra transpose.
        B = _symmetric_product(A, A, A, beta=b, alpha=c, blocks=symmetric)
        X = addmm(X, B, X, beta=a)  # a*X + B@X
    return X


def _gram_iterations(X: Tensor, steps: Sequence[Coefficients], plan: Sequence[int]) -> Tensor:
    """The same polynomial as :func:`_classic_iterations`, run on s x s matrices.

    Within a segment, with ``q(A) = a I + B`` and ``B = b A + c A^2``: ``Q <- Q q(A)`` and
    ``A <- q(A) A q(A)``, all products of polynomials in the segment's first A, hence symmetric;
    at its end ``X <- Q X``. ``a I`` is kept out of the stored B so that in low precision B keeps
    its own relative accuracy (as the classic form's ``a X + B X`` does).
    """
    symmetric = _uses_symmetric_blocks(X)
    mm = torch.mm if X.ndim == 2 else torch.bmm
    first = 0
    for length in plan:
        segment, first = steps[first : first + length], first + length
        if length == 1:  # a classic step
            X = _classic_iterations(X, segment)
            continue
        A = _symmetric_product(X, X.mT, blocks=symmetric)
        X = mm(_gram_segment_factor(A, segment, symmetric), X)
    return X


def _gram_segment_factor(A: Tensor, segment: Sequence[Coefficients], symmetric: bool) -> Tensor:
    """Q of one Gram segment: the product of its steps' ``q(A_j) = a I + b A_j + c A_j^2``, run on
    the s x s Gram matrix ``A`` ([s, s] or [batch, s, s]) of the segment's first X alone (then
    ``X <- Q X``). Also used by parallel/split_newton_schulz.py, which all-reduces A over ranks first."""
    Q = None
    length = len(segment)
    for j, (a, b, c) in enumerate(segment):
        B = _symmetric_product(A, A, A, beta=b, alpha=c, blocks=symmetric)
        if Q is None:
            Q = B.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # q(A) = a I + B
        else:
            Q = _symmetric_product(Q, B, Q, beta=a, blocks=symmetric)  # Q q(A) = a Q + Q B
        if j + 1 < length:
            AQ = _symmetric_product(A, B, A, beta=a, blocks=symmetric)  # A q(A)
            A = _symmetric_product(B, AQ, AQ, beta=a, blocks=symmetric)  # q(A) A q(A)
    return Q


# Rows below which a symmetric product is done as one matmul (smaller GEMMs lose efficiency).
_SYMMETRIC_MIN_BLOCK = 128


def _symmetric_product(
    L: Tensor,
    R: Tensor,
    C: Tensor | None = None,
    *,
    beta: float = 1.0,
    alpha: float = 1.0,
    blocks: bool = True,
    out: Tensor | None = None,
) -> Tensor:
    """``beta C + alpha L @ R`` for a result known to be symmetric (L [..., s, k], R [..., k, s]).

    With ``blocks``, only the diagonal and upper blocks are computed: split the rows in halves;
    the diagonal blocks are the halves' own products (recursively), the upper one is
    ``L1 R2`` and the lower one its transpose. Without, one (b)addbmm/matmul call.
    """
    s = L.shape[-2]
    if out is None:
        out = L.new_empty((*L.shape[:-2], s, s))
    h = s // 2
    if not blocks or h < _SYMMETRIC_MIN_BLOCK:
        if C is None:
            return torch.matmul(L, R, out=out)
        addmm = torch.addmm if L.ndim == 2 else torch.baddbmm
        return addmm(C, L, R, beta=beta, alpha=alpha, out=out)
    for rows in (slice(None, h), slice(h, None)):
        _symmetric_product(
            L[..., rows, :], R[..., :, rows], None if C is None else C[..., rows, rows],
            beta=beta, alpha=alpha, out=out[..., rows, rows],
        )
    upper = out[..., :h, h:]
    if C is None:
        torch.matmul(L[..., :h, :], R[..., :, h:], out=upper)
    else:
        addmm = torch.addmm if L.ndim == 2 else torch.baddbmm
        addmm(C[..., :h, h:], L[..., :h, :], R[..., :, h:], beta=beta, alpha=alpha, out=upper)
    out[..., h:, :h] = upper.mT
    return out
