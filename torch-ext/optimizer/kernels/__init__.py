"""Matrix products for Newton–Schulz: Triton kernels with plain torch references beside them.

    from optimizer import kernels
    A = kernels.syrk(X)                                          # X X^T, one triangle computed
    B = kernels.symmetric_matmul(A, A, A, alpha=c, beta=b)       # b A + c A A
    X = kernels.matmul_add(B, X, X, beta=a)                      # a X + B X

Every function takes ``backend``: ``"auto"`` (default: the Triton kernels on NVIDIA GPUs of
compute capability 8.0+ where Triton imports, torch elsewhere), ``"torch"``, or ``"triton"``
(the kernels, also on CPU tensors under ``TRITON_INTERPRET=1``; a RuntimeError saying why when
they cannot run). :func:`available` says whether ``"triton"`` can run on a device. Operands are
checked before anything runs (operands.py); results are rounded once from an fp32 accumulation.

Files: symmetric_kernel.py and matmul_add_kernel.py (the kernels), reference.py (the torch versions,
same signatures), tiles.py (the tile rule), addressing.py (what the kernels' 32-bit offsets reach),
backend.py (which implementation runs: the one place that decides), environment.py (Triton, the
interpreter, the device), self_check.py (the first-use check on a GPU); elementwise.py,
elementwise_kernel.py and elementwise_reference.py: the fused elementwise stages of a step
(momentum, Nesterov input, weight decay with the update). Newton–Schulz runs on these products
through ``optimizer.newton_schulz.products``. Triton is imported only when a kernel is first used,
so this package imports without it. docs/kernels.md has the details.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import backend as kernel_backend
from . import environment
from .backend import BACKENDS, ProductRoute, available, check_backend, unavailable_reason
from .operands import check_product
from .reference import matmul_add_reference, symmetric_matmul_reference
from .tiles import Tiles

__all__ = [
    "BACKENDS",
    "Tiles",
    "available",
    "check_backend",
    "matmul_add",
    "matmul_add_reference",
    "symmetric_matmul",
    "symmetric_matmul_reference",
    "syrk",
    "unavailable_reason",
]


def symmetric_matmul(
    L: Tensor,
    R: Tensor,
    C: Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> Tensor:
    """``beta * C + alpha * (L @ R)`` for a product the caller knows is symmetric (L [.., m, k],
    R [.., k, m], batched or not), returned exactly symmetric: its lower triangle, mirrored.

    The Triton kernel computes only the tiles on and below the diagonal. ``"auto"`` uses it on
    CUDA when the result spans at least two tile rows (with one, there is nothing to skip and
    cuBLAS does the same work) and the kernel can address the operands (addressing.py: 32-bit
    offsets inside a matrix, an output without shared elements; ``"triton"`` refuses the others);
    the torch path is :func:`symmetric_matmul_reference`. ``out_dtype``
    (default: L's, or ``out``'s) may differ from the operands', e.g. an fp32 Gram matrix of bf16
    X. C is not read when ``beta`` is 0.
    """
    alpha, beta, out_dtype = check_product("symmetric_matmul", L, R, C, alpha, beta, out, out_dtype, symmetric=True)
    tiles = None
    if kernel_backend.resolve(backend, L.device, L.dtype) == "triton":
        tiles = ProductRoute(backend, environment.device_key(L.device)).symmetric(L, R, C, beta, out)
    if tiles is None:
        return symmetric_matmul_reference(L, R, C, alpha=alpha, beta=beta, out=out, out_dtype=out_dtype)
    from .symmetric_kernel import symmetric_matmul_triton

    return symmetric_matmul_triton(L, R, C, alpha=alpha, beta=beta, out=out, out_dtype=out_dtype, tiles=tiles)


def syrk(
    X: Tensor,
    C: Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> Tensor:
    """``beta * C + alpha * X X^T`` (X [.., m, k]): :func:`symmetric_matmul` of X and its
    transposed view, which reads X in place for both operands."""
    if not isinstance(X, Tensor):
        raise TypeError(f"syrk: X must be a tensor, got {type(X).__name__}")
    return symmetric_matmul(X, X.mT, C, alpha=alpha, beta=beta, out=out, out_dtype=out_dtype, backend=backend)


def matmul_add(
    L: Tensor,
    R: Tensor,
    C: Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> Tensor:
    """``beta * C + alpha * (L @ R)``, general (L [.., m, k], R [.., k, n]); ``a X + B X`` is
    ``matmul_add(B, X, X, beta=a)``.

    ``"auto"`` is torch everywhere: cuBLAS's addmm/baddbmm already fuses the ``beta * C`` term,
    with the same FLOPs and bytes as a Triton kernel (matmul_add_kernel.py says why). ``"triton"`` runs
    the kernel, and refuses operands it cannot address (addressing.py). C is not read when ``beta`` is 0.
    """
    alpha, beta, out_dtype = check_product("matmul_add", L, R, C, alpha, beta, out, out_dtype, symmetric=False)
    tiles = None
    if kernel_backend.resolve(backend, L.device, L.dtype) == "triton":
        tiles = ProductRoute(backend, environment.device_key(L.device)).general(L, R, C, beta, out)
    if tiles is None:
        return matmul_add_reference(L, R, C, alpha=alpha, beta=beta, out=out, out_dtype=out_dtype)
    from .matmul_add_kernel import matmul_add_triton

    return matmul_add_triton(L, R, C, alpha=alpha, beta=beta, out=out, out_dtype=out_dtype, tiles=tiles)
