"""fp64 references and rounding-error bounds for the kernel tests (written here, independent of
optimizer.kernels).

A product ``beta C + alpha L R`` accumulated in fp32 in any order, with the two epilogue
operations, then rounded once to the output dtype, differs from the exact value by at most
``u_out |exact| + (1 + u_out) gamma_{k+3} (|alpha| |L| |R| + |beta| |C|) + u_out tiny_out`` per
element, where ``gamma_n = n u32 / (1 - n u32)`` (Higham, Accuracy and Stability of Numerical
Algorithms, 3.1), u is the unit roundoff (half the machine epsilon) and ``u_out tiny_out`` half
the spacing of the output dtype's subnormals (a result below its smallest normal number, 6e-5 in
fp16, is rounded on that absolute grid). Operands are the tensors as given (already in their
dtype), converted to fp64 exactly.
"""

from __future__ import annotations

import torch

from tolerances import gamma, unit_roundoff

U32 = unit_roundoff(torch.float32)


def lower_mirrored(full: torch.Tensor) -> torch.Tensor:
    """The lower triangle (diagonal included) of each matrix, copied to the upper one."""
    return full.tril() + full.tril(-1).mT


def exact_product(L, R, C=None, alpha=1.0, beta=0.0, symmetric=False):
    """(beta C + alpha L R in fp64, the bound's scale |alpha| |L| |R| + |beta| |C|)."""
    L64, R64 = L.double(), R.double()
    value = alpha * (L64 @ R64)
    scale = abs(alpha) * (L64.abs() @ R64.abs())
    if C is not None and beta != 0:
        value = value + beta * C.double()
        scale = scale + abs(beta) * C.double().abs()
    if symmetric:
        value, scale = lower_mirrored(value), lower_mirrored(scale)
    return value, scale


def rounding_bound(exact: torch.Tensor, scale: torch.Tensor, k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The per-element bound above."""
    u_out = unit_roundoff(out_dtype)
    return u_out * exact.abs() + (1 + u_out) * gamma(k + 3, torch.float32) * scale + u_out * torch.finfo(out_dtype).smallest_normal


def assert_within_rounding(got, L, R, C=None, alpha=1.0, beta=0.0, symmetric=False, out_dtype=None):
    """Every element of ``got`` within the bound of the exact product; for a symmetric product
    also exactly symmetric."""
    exact, scale = exact_product(L, R, C, alpha, beta, symmetric)
    out_dtype = out_dtype or got.dtype
    assert got.dtype == out_dtype, (got.dtype, out_dtype)
    assert got.shape == exact.shape, (got.shape, exact.shape)
    assert torch.isfinite(got).all(), "non-finite entries (a tile not written?)"
    error = (got.double() - exact).abs()
    bound = rounding_bound(exact, scale, L.shape[-1], out_dtype)
    bad = error > bound
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{int(bad.sum())} of {got.numel()} entries outside the rounding bound; first at {index}: "
            f"got {got[index].item()}, exact {exact[index].item()}, bound {bound[index].item():.3g}"
        )
    if symmetric:
        assert torch.equal(got, got.mT), "the result is not exactly symmetric"


# ---------------------------------------------------------------------------- the elementwise stages
#
# The fused elementwise stages (momentum, Nesterov input, weight decay and update) and torch's
# formulas for them (rule.py) compute the same few fp32 operations per element, but not always
# with the same roundings: torch's CPU kernels contract ``a * b + c`` into one FMA where ATen runs
# its AVX2/AVX-512 code and round twice where it runs its scalar or ``default`` code (a tail, a
# strided piece, ``ATEN_CPU_CAPABILITY=default``, another CPU), and its 16-bit ops may round their
# scalar operands to the tensor's dtype. So neither side is an oracle for the other's bits. Both
# are held instead to the formula in fp64 on the same operands, per element, within the bound of
# the roundings the formula allows, counted below (Higham 2.2: each fp32 operation rounds once,
# ``fl(x op y) = (x op y)(1 + d)``, ``|d| <= u``; ``gamma(n)`` bounds ``n`` such factors,
# ``|prod(1 + d_i) - 1| <= gamma(n)`` for ``n u < 1``). A bound holds whichever way each
# ``a * b + c`` is computed (an FMA rounds once, the two operations twice: the bound counts two).
# ``scalar_dtype``: the dtype the step's scalars (lerp's weight, the decay factor, the adjusted lr)
# are rounded to: fp32 for the kernels (the host rounds them), the tensor's own for torch's 16-bit
# ops. The fp64 formula's own rounding (a few u64 per operation) is counted too.

F32, F64 = torch.float32, torch.float64


def stored_bound(exact: torch.Tensor, error, dtype: torch.dtype):
    """A value within ``error`` of ``exact`` rounded to nearest in ``dtype``: within ``error + u (|exact|
    + error)`` of ``exact`` where the result is normal, ``error`` plus half a subnormal step
    (``u * smallest_normal``) below it; the bound adds both."""
    u_d = unit_roundoff(dtype)
    return error + u_d * (exact.abs() + error) + u_d * torch.finfo(dtype).smallest_normal


def lerp_fp64(start: torch.Tensor, end: torch.Tensor, weight: float, scalar_dtype: torch.dtype = F32):
    """(``start + weight (end - start)`` in fp64, the bound on how far torch's fp32 lerp of the same
    operands, before it is stored, may be from it).

    Lerp.h computes ``start + w' d`` for ``|w'| < 0.5``, else ``end - d (1 - w')``, with ``d = end -
    start`` (rounded once), ``w'`` the weight rounded once to ``scalar_dtype``, ``1 - w'`` rounded
    once, and the product-and-sum either one FMA or two roundings. In either branch the computed
    value is ``y (1 + d0)`` with ``|y - x| <= m |d| ((1 + gamma_3)(1 + u_w) - 1)``, ``m = max(|w|,
    |1 - w|)``: three factors ``(1 + d_i)`` (the difference, ``1 - w'``, the product) on the
    weight's branch term, and the weight's own rounding ``u_w |w|``, at most ``u_w m``. So
    ``|fl(lerp) - x| <= u |x| + (1 + u) m |d| ((1 + gamma_3)(1 + u_w) - 1)``. The fp64 formula rounds
    three times (difference, product, sum): ``gamma_3(u64) (|start| + |w d|)`` more."""
    s, e = start.double(), end.double()
    diff = e - s
    exact = s + weight * diff
    m = max(abs(weight), abs(1 - weight))
    per_term = (1 + gamma(3, F32)) * (1 + unit_roundoff(scalar_dtype)) - 1
    bound = (U32 * exact.abs() + (1 + U32) * m * diff.abs() * per_term
             + gamma(3, F64) * (s.abs() + abs(weight) * diff.abs()))
    return exact, bound


def momentum_fp64(buf, signed_grad, momentum: float, buf_dtype: torch.dtype, scalar_dtype: torch.dtype = F32):
    """(the momentum ``lerp(buf, g, 1 - momentum)`` in fp64, the bound on the stored fp32 lerp):
    :func:`lerp_fp64`, then one rounding to ``buf_dtype``."""
    exact, error = lerp_fp64(buf, signed_grad, 1 - momentum, scalar_dtype)
    return exact, stored_bound(exact, error, buf_dtype)


def nesterov_input_fp64(signed_grad, stored_buf, momentum: float, nesterov: bool, work: torch.dtype,
                        out_dtype: torch.dtype, scalar_dtype: torch.dtype = F32):
    """(the Newton–Schulz input in fp64 from the momentum *as stored*: ``lerp(g, buf, momentum)``, or
    ``buf`` without Nesterov; the bound on the stored result): rounded to the arithmetic dtype
    ``work`` where that is 16-bit, then to ``out_dtype`` (each a rounding; none where the dtype is
    the value's already)."""
    if nesterov:
        exact, error = lerp_fp64(signed_grad, stored_buf, momentum, scalar_dtype)
    else:
        exact, error = stored_buf.double(), torch.zeros_like(stored_buf, dtype=F64)
    if work != F32:
        error = stored_bound(exact, error, work)
    if out_dtype != work:
        error = stored_bound(exact, error, out_dtype)
    return exact, error


def scalar_error(dtype: torch.dtype) -> float:
    """The relative error of a step's scalar as it is used: at most four roundings in ``dtype``
    (a tensor lr's ``adjusted_lr = lr * 0.2 * sqrt(n)`` rounds both constants and both products in
    fp32; ``1 - lr wd`` rounds ``wd``, the product and the difference, each relative to a term no
    larger than ``|lr wd| + |1 - lr wd|``; torch's 16-bit ops may round the result once more, which
    a 16-bit ``dtype``'s four roundings cover), plus the fp64 formula's few u64."""
    return gamma(4, dtype) + gamma(4, F64)


def apply_update_fp64(param, update, lr: float, adjusted_lr: float, weight_decay: float, cautious: bool,
                      scalar_dtype: torch.dtype = F32):
    """(the new parameter in fp64, the bound on the stored result) for decoupled weight decay with
    ``lr`` (cautious: only where ``param * update >= 0``) then ``- adjusted_lr * update``; the
    parameter's dtype is ``param``'s.

    * Decay, plain: ``fl(p f')`` with ``f'`` the factor ``1 - lr wd`` within ``e_s (|1 - lr wd| + |lr wd|)``
      (:func:`scalar_error`): within ``u |D| + (1 + u) |p| e_s (|1 - lr wd| + |lr wd|)`` of ``D``.
      Cautious: ``fl(p + v' p)`` (one FMA or two roundings), ``v'`` within ``e_s |lr wd|`` of
      ``-lr wd``: within ``u |D| + (1 + u) |lr wd p| ((1 + e_s)(1 + u) - 1)``; ``D = p`` exactly
      where the mask is 0 (the mask is the sign of an fp32 product of the same operands: the same
      on both sides and in fp64 but for underflow, which these operands never reach).
    * The decayed parameter is stored in the parameter's dtype (torch's first pass), then
      ``fl(D_s - a' u)`` (one FMA or two roundings), ``a'`` within ``e_s`` of ``adjusted_lr``:
      within ``u |x| + (1 + u) |a u| ((1 + e_s)(1 + u) - 1)`` of ``x = D_s - a u``, and ``|x - (D -
      a u)| = |D_s - D|``; then stored once more."""
    dtype = param.dtype
    p, upd = param.double(), update.double()
    e_s = scalar_error(scalar_dtype)
    decay = lr * weight_decay
    if weight_decay == 0:
        decayed, decayed_error = p, torch.zeros_like(p)
    elif cautious:
        mask = p * upd >= 0
        decayed = torch.where(mask, p - decay * p, p)
        decayed_error = torch.where(
            mask, U32 * decayed.abs() + (1 + U32) * abs(decay) * p.abs() * ((1 + e_s) * (1 + U32) - 1), 0.0)
        decayed_error = stored_bound(decayed, decayed_error, dtype)
    else:
        decayed = p * (1 - decay)
        decayed_error = U32 * decayed.abs() + (1 + U32) * p.abs() * e_s * (abs(1 - decay) + abs(decay))
        decayed_error = stored_bound(decayed, decayed_error, dtype)
    step = adjusted_lr * upd
    exact = decayed - step
    error = (decayed_error + U32 * (exact.abs() + decayed_error)
             + (1 + U32) * step.abs() * ((1 + e_s) * (1 + U32) - 1) + gamma(3, F64) * (decayed.abs() + step.abs()))
    return exact, stored_bound(exact, error, dtype)


def assert_within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """Every element of ``got`` within ``bound`` of ``exact`` (fp64), with the first offender named."""
    assert got.shape == exact.shape, (what, got.shape, exact.shape)
    error = (got.double() - exact).abs()
    bad = ~(error <= bound)  # NaN fails
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.numel()} elements outside the rounding bound; first at {index}: "
            f"got {got[index].item()!r}, fp64 {exact[index].item()!r}, error {error[index].item():.3g}, "
            f"bound {bound[index].item():.3g}")
