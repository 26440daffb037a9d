"""Where the Gram form restarts (re-forms ``A = X X^T`` from X), per coefficient table and dtype,
and the largest value its matrices can hold (fp16's range). The rule, its four parts and the
measurements behind each constant: docs/newton_schulz.md ("The restart rule", "fp16's range")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch

from .coefficients import Coefficients, CoefficientSpec, resolve_ns_coefficients

# How far off a Gram step's factor q(r) may be, within a segment, from the drift of an eigenvalue
# that rounding left at -u (rule 1; the restart study's 1%, docs/newton_schulz.md).
_GRAM_STEP_ERROR_LIMIT = 0.01

# Rounding no finer than bf16's leaves a Gram segment no headroom below the 16-bit band (rule 2).
_BAND_UNIT_ROUNDOFF = torch.finfo(torch.bfloat16).eps / 2
# Dtypes at least as coarse as fp16 are held to the 16-bit band: no segment across a stalled step (rule 3).
_SIXTEEN_BIT_UNIT_ROUNDOFF = torch.finfo(torch.float16).eps / 2

# Q's largest eigenvalue stays below the dtype's max / this (rule 4), and "auto" runs a table in
# fp16 only when every stored value does (fp16's range, docs/newton_schulz.md).
_RANGE_HEADROOM = 2.0**8


def gram_restart_plan(
    coefficients: CoefficientSpec, ns_steps: int, dtype: torch.dtype | None = None
) -> tuple[int, ...]:
    """Lengths of the Gram-space segments for ``ns_steps`` iterations (they sum to ``ns_steps``).

    Each segment forms ``A = X X^T`` from the current X, runs its steps on m x m matrices and
    ends with ``X <- Q X``; a segment of one step is exactly a classic step. ``dtype`` is the
    dtype the Gram form runs in (None: float32). With the tables here: fp32 5 steps -> (5,),
    10 -> (5, 5); fp16 5 steps -> (2, 2, 1) (fixed) and (1, 2, 2) (Polar Express); bf16 -> all
    ones (the classic iteration).
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
    and the width is not at least halved (the fixed table from its 6th step; Polar Express never)."""
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
    on 4097 points of [0, 1] in fp64."""
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


def fits_fp16(steps: Sequence[Coefficients], plan: Sequence[int]) -> bool:
    """Whether every value the iteration with ``plan`` stores stays below fp16's max / 2^8."""
    return _value_bound(tuple(steps), tuple(plan), torch.finfo(torch.float16).eps / 2) \
        <= torch.finfo(torch.float16).max / _RANGE_HEADROOM
