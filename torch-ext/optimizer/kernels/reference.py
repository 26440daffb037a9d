"""Plain torch implementations of the kernels, with the kernels' signatures and semantics.

They define what the kernels compute and are the ``"torch"`` backend (``kernels/__init__.py``);
the dispatcher checks the operands first (operands.py), so these assume valid ones.

* :func:`matmul_add_reference`: ``beta * C + alpha * (L @ R)``, rounded once to ``out_dtype``.
  Operands and result of one dtype: one ``addmm``/``baddbmm`` (cuBLAS on CUDA, which accumulates
  16-bit products in fp32 and applies alpha and beta to the fp32 sum). Otherwise (an fp32 result
  of 16-bit operands, a C of another dtype) in fp32 or wider, where products of 16-bit numbers are
  exact: fp32 accumulation, one rounding.
* :func:`symmetric_matmul_reference`: the same for a result known to be symmetric, returned
  exactly symmetric: its lower triangle (diagonal included), mirrored. That is what the Triton
  kernel writes, since it computes only the tiles on and below the diagonal.
"""

from __future__ import annotations

import torch
from torch import Tensor


def matmul_add_reference(
    L: Tensor,
    R: Tensor,
    C: Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``beta * C + alpha * (L @ R)`` (L [.., m, k], R [.., k, n]); C is not read when beta is 0
    (as in torch.addmm, so NaN in it does not propagate)."""
    result = _matmul_add(L, R, C, float(alpha), float(beta), out_dtype or (out.dtype if out is not None else L.dtype))
    return result if out is None else out.copy_(result)


def symmetric_matmul_reference(
    L: Tensor,
    R: Tensor,
    C: Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """The lower triangle of ``beta * C + alpha * (L @ R)`` (L [.., m, k], R [.., k, m]), mirrored
    to the upper one: an exactly symmetric result."""
    full = _matmul_add(L, R, C, float(alpha), float(beta), out_dtype or (out.dtype if out is not None else L.dtype))
    m = full.shape[-1]
    lower = torch.ones(m, m, dtype=torch.bool, device=full.device).tril_()
    result = torch.where(lower, full, full.mT)
    return result if out is None else out.copy_(result)


def _matmul_add(L: Tensor, R: Tensor, C: Tensor | None, alpha: float, beta: float, out_dtype: torch.dtype) -> Tensor:
    use_c = C is not None and beta != 0.0
    native = L.dtype == out_dtype and (not use_c or C.dtype == out_dtype)
    compute = out_dtype if native else torch.promote_types(torch.promote_types(L.dtype, out_dtype), torch.float32)
    L, R = L.to(compute), R.to(compute)
    addmm = torch.addmm if L.ndim == 2 else torch.baddbmm
    if use_c:
        result = addmm(C.to(compute), L, R, beta=beta, alpha=alpha)
    else:
        # beta = 0: torch.addmm ignores its input then, so an uninitialised one is fine
        result = addmm(L.new_empty((*L.shape[:-1], R.shape[-1])), L, R, beta=0.0, alpha=alpha)
    return result.to(out_dtype)
