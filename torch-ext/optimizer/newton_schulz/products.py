"""The matrix products Newton–Schulz is written on, and the two objects that run them.

Every form of the iteration (iteration.py, and a matrix cut over ranks, cut.py) asks a products
object for three things:

* ``gram(X, out=None)``: ``X X^T`` (``out`` may be wider than X: the cut's first Gram matrix,
  written into its all-reduce buffer);
* ``symmetric(L, R, C=None, alpha=, beta=, out=None)``: ``beta C + alpha L R`` for a result
  known to be symmetric (``b A + c A A`` and every product of the Gram recursion: polynomials in
  one symmetric matrix);
* ``general(L, R, C=None, alpha=, beta=, out=None)``: the same with nothing symmetric (``a X +
  B X``, ``Q X``, the row blocks of a cut's products). ``alpha`` applies with C.

:class:`TorchProducts` runs torch's matmuls; on the CPU a product known to be symmetric computes
only its diagonal and upper blocks (:func:`symmetric_product`; measured in docs/newton_schulz.md).
:class:`KernelProducts` runs the Triton kernels of :mod:`optimizer.kernels` where its route
(``kernels.backend.ProductRoute``, decided once for the device) sends each product, torch's
references elsewhere: the same polynomial in the same order, each product rounded once from an
fp32 accumulation. Which of the two a call gets is decided once (implementation.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.backend import ProductRoute
from ..kernels.reference import matmul_add_reference, symmetric_matmul_reference

# Rows below which a symmetric product is one matmul (smaller GEMMs lose efficiency).
_SYMMETRIC_MIN_BLOCK = 128


def uses_symmetric_blocks(X: Tensor) -> bool:
    """Whether torch's products of X's iteration take the symmetric-block shortcut: on the CPU,
    from two blocks' rows (not on CUDA: cuBLAS has no symmetric-output GEMM to call)."""
    return X.device.type == "cpu" and X.shape[-2] >= 2 * _SYMMETRIC_MIN_BLOCK


def symmetric_product(L: Tensor, R: Tensor, C: Tensor | None = None, *, beta: float = 1.0, alpha: float = 1.0,
                      blocks: bool = True, out: Tensor | None = None) -> Tensor:
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
        symmetric_product(
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


@dataclass(frozen=True)
class TorchProducts:
    """torch's matmuls; ``blocks``: the CPU's symmetric-block shortcut (:func:`uses_symmetric_blocks`)."""

    blocks: bool

    def gram(self, X: Tensor, out: Tensor | None = None) -> Tensor:
        if out is not None and out.dtype != X.dtype:
            # the product in X's dtype, then widened (exactly) into out
            return out.copy_(symmetric_product(X, X.mT, blocks=self.blocks))
        return symmetric_product(X, X.mT, blocks=self.blocks, out=out)

    def symmetric(self, L: Tensor, R: Tensor, C: Tensor | None = None, *, alpha: float = 1.0, beta: float = 0.0,
                  out: Tensor | None = None) -> Tensor:
        return symmetric_product(L, R, C, beta=beta, alpha=alpha, blocks=self.blocks, out=out)

    def general(self, L: Tensor, R: Tensor, C: Tensor | None = None, *, alpha: float = 1.0, beta: float = 0.0,
                out: Tensor | None = None) -> Tensor:
        if C is None:
            return (torch.mm if L.ndim == 2 else torch.bmm)(L, R, out=out)
        return (torch.addmm if L.ndim == 2 else torch.baddbmm)(C, L, R, beta=beta, alpha=alpha, out=out)


@dataclass(frozen=True)
class KernelProducts:
    """The kernels' products, each sent where ``route`` says (tiles chosen per shape by the pure,
    cached tile rule; no device query, no backend resolution per product)."""

    route: ProductRoute

    def gram(self, X: Tensor, out: Tensor | None = None) -> Tensor:
        # fp32 accumulation rounded once, to out's dtype (the wide buffer's, for a cut's first Gram)
        return self.symmetric(X, X.mT, out=out)

    def symmetric(self, L: Tensor, R: Tensor, C: Tensor | None = None, *, alpha: float = 1.0, beta: float = 0.0,
                  out: Tensor | None = None) -> Tensor:
        out_dtype = out.dtype if out is not None else L.dtype
        tiles = self.route.symmetric(L, R, C, beta, out)
        if tiles is None:
            return symmetric_matmul_reference(L, R, C, alpha=alpha, beta=beta, out=out, out_dtype=out_dtype)
        from ..kernels.symmetric_kernel import symmetric_matmul_triton

        return symmetric_matmul_triton(L, R, C, alpha=alpha, beta=beta, out=out, out_dtype=out_dtype, tiles=tiles)

    def general(self, L: Tensor, R: Tensor, C: Tensor | None = None, *, alpha: float = 1.0, beta: float = 0.0,
                out: Tensor | None = None) -> Tensor:
        out_dtype = out.dtype if out is not None else L.dtype
        tiles = self.route.general(L, R, C, beta, out)
        if tiles is None:
            return matmul_add_reference(L, R, C, alpha=alpha, beta=beta, out=out, out_dtype=out_dtype)
        from ..kernels.matmul_add_kernel import matmul_add_triton

        return matmul_add_triton(L, R, C, alpha=alpha, beta=beta, out=out, out_dtype=out_dtype, tiles=tiles)
