"""What runs the matrix products of Newton–Schulz on a matrix cut over ranks
(``split_newton_schulz.py``): torch's matmuls or the Triton kernels of :mod:`optimizer.kernels`,
chosen once per call by the ``ns_kernels`` option (:func:`cut_products`), exactly as the unsplit
call chooses (``ns_kernels.resolve`` on the device and the compute dtype).

Both objects have the same five methods, so the cut iteration has one code path:

* ``gram_into(X, out)``: ``X X^T`` written into ``out`` (the first Gram matrix, in the wide
  dtype of the all-reduce buffer); ``gram(X)``: ``X X^T`` in X's dtype;
* ``b_of(A, b, c)``: ``b A + c A A``;
* ``general(L, R, C, alpha=, beta=)``: ``beta C + alpha L R`` with nothing known to be symmetric
  (``a X_i + B X_i``, ``Q X_i``, and the row blocks of the rows-split products);
* ``segment_factor(A, segment)``: Q of one Gram segment, the recursion run whole (redundantly).

:class:`TorchProducts` is the code path of earlier releases, bit for bit (on the CPU with the
symmetric-block shortcut of ``newton_schulz._symmetric_product``). :class:`KernelProducts` runs
every product on the kernels' functions with the backend the unsplit call gives its products
(``newton_schulz.kernel_backend``): ``"triton"`` forced runs every product on the Triton kernels;
``"auto"`` runs the products known to be symmetric on one triangle (``kernels.syrk``/
``symmetric_matmul``, ``kernels.newton_schulz.gram_segment_factor``) where they span two tile
rows, and the general ones on cuBLAS (``matmul_add``'s ``"auto"``: nothing symmetric to save, and
cuBLAS fuses the ``a X`` term already; docs/kernels.md). Its first Gram matrix is accumulated in
fp32 and written straight into the wide all-reduce buffer (``out_dtype``), where torch's path
rounds the product to the compute dtype first and copies it (bf16, fp16): one rounding fewer,
the same bytes sent.

The row blocks of the rows-split products (``b_split="rows"``, ``recursion="rows"``) are not
symmetric (a block of rows of a symmetric product is not a square symmetric matrix), so they go
to ``general``: torch's ``addmm`` on the torch path, ``matmul_add`` (cuBLAS under "auto") on the
kernel path; no triangle to save there, each member already computes 1/k of the rows.

Every member of a cut group gets the same object: the option is agreed across ranks, and the
members hold their blocks on one device type, so they resolve alike; the kernels are
deterministic (fixed tiles, no atomics), so a replicated product of identical inputs is bitwise
identical on every member, as with torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import kernels
from ..kernels import newton_schulz as kernel_ns
from ..newton_schulz import _gram_segment_factor, _symmetric_product, kernel_backend
from ..ns_kernels import check_ns_kernels

Coefficients = tuple[float, float, float]


@dataclass(frozen=True)
class TorchProducts:
    """torch's matmuls; ``blocks``: the CPU's symmetric-block shortcut (``_uses_symmetric_blocks``)."""

    blocks: bool

    kind = "torch"

    def gram_into(self, X: Tensor, out: Tensor) -> Tensor:
        if X.dtype == out.dtype:
            return _symmetric_product(X, X.mT, blocks=self.blocks, out=out)
        # the product in X's dtype, then widened (exactly) into the buffer: as earlier releases did
        return out.copy_(_symmetric_product(X, X.mT, blocks=self.blocks))

    def gram(self, X: Tensor) -> Tensor:
        return _symmetric_product(X, X.mT, blocks=self.blocks)

    def b_of(self, A: Tensor, b: float, c: float) -> Tensor:
        return _symmetric_product(A, A, A, beta=b, alpha=c, blocks=self.blocks)

    def general(self, L: Tensor, R: Tensor, C: Tensor | None = None, *, alpha: float = 1.0,
                beta: float = 0.0) -> Tensor:
        if C is None:
            return torch.mm(L, R) if L.ndim == 2 else torch.bmm(L, R)
        addmm = torch.addmm if L.ndim == 2 else torch.baddbmm
        return addmm(C, L, R, beta=beta, alpha=alpha)

    def segment_factor(self, A: Tensor, segment: Sequence[Coefficients]) -> Tensor:
        return _gram_segment_factor(A, segment, self.blocks)


@dataclass(frozen=True)
class KernelProducts:
    """The kernels' products with ``backend``: ``"triton"`` (every product on the Triton kernels)
    or ``"auto"`` (symmetric products on one triangle from two tile rows up, general ones on
    cuBLAS), as the unsplit call runs them."""

    backend: str

    kind = "triton"

    def gram_into(self, X: Tensor, out: Tensor) -> Tensor:
        # fp32 accumulation rounded once, to out's (wide) dtype
        return kernels.syrk(X, out=out, backend=self.backend)

    def gram(self, X: Tensor) -> Tensor:
        return kernels.syrk(X, backend=self.backend)

    def b_of(self, A: Tensor, b: float, c: float) -> Tensor:
        return kernels.symmetric_matmul(A, A, A, alpha=c, beta=b, backend=self.backend)

    def general(self, L: Tensor, R: Tensor, C: Tensor | None = None, *, alpha: float = 1.0,
                beta: float = 0.0) -> Tensor:
        return kernels.matmul_add(L, R, C, alpha=alpha, beta=beta, backend=self.backend)

    def segment_factor(self, A: Tensor, segment: Sequence[Coefficients]) -> Tensor:
        return kernel_ns.gram_segment_factor(A, segment, backend=self.backend)


def cut_products(mode: str, device: torch.device, compute_dtype: torch.dtype,
                 blocks: bool) -> TorchProducts | KernelProducts:
    """The products one cut Newton–Schulz call runs, for ``ns_kernels=mode``: what
    ``ns_kernels.resolve`` gives the unsplit call on ``device`` in ``compute_dtype`` ("auto": the
    kernels on supported CUDA GPUs only; "triton" where they cannot run: its RuntimeError).
    ``blocks``: the torch path's symmetric-block shortcut (CPU)."""
    backend = kernel_backend(check_ns_kernels(mode), device, compute_dtype)
    return TorchProducts(blocks) if backend == "torch" else KernelProducts(backend)
