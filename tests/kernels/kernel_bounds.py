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

U32 = torch.finfo(torch.float32).eps / 2


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


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
    n = k + 3
    gamma = n * U32 / (1 - n * U32)
    u_out = unit_roundoff(out_dtype)
    return u_out * exact.abs() + (1 + u_out) * gamma * scale + u_out * torch.finfo(out_dtype).smallest_normal


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
