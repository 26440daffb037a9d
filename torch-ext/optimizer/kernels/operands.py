"""Checks of a product's operands, shared by the dispatcher (``kernels/__init__.py``): every
problem is found before anything is computed or written, and named."""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_product(
    name: str,
    L: Tensor,
    R: Tensor,
    C: Tensor | None,
    alpha,
    beta,
    out: Tensor | None,
    out_dtype: torch.dtype | None,
    symmetric: bool,
) -> tuple[float, float, torch.dtype]:
    """Validate ``beta * C + alpha * (L @ R)`` and return ``(alpha, beta, out_dtype)`` as used.

    L is [m, k] or [batch, m, k], R [k, n] or [batch, k, n] with the same batch (and n = m when
    ``symmetric``); C and ``out`` have the result's shape; ``out`` must not share memory with L
    or R (other tiles still read them), and may be C itself (each tile reads its C block before
    writing it) but not overlap C otherwise.
    """
    for arg, tensor in (("L", L), ("R", R)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name}: {arg} must be a tensor, got {type(tensor).__name__}")
        if tensor.ndim not in (2, 3):
            raise ValueError(f"{name}: {arg} must be [m, k] or [batch, m, k], got shape {tuple(tensor.shape)}")
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: {arg} must be float16, bfloat16, float32 or float64, got {tensor.dtype}")
    if L.ndim != R.ndim:
        raise ValueError(f"{name}: L and R must both be 2-D or both 3-D, got shapes {tuple(L.shape)} and {tuple(R.shape)}")
    if L.dtype != R.dtype:
        raise ValueError(f"{name}: L and R must have one dtype, got {L.dtype} and {R.dtype}; cast one first")
    if L.device != R.device:
        raise ValueError(f"{name}: L and R must be on one device, got {L.device} and {R.device}")
    batch = tuple(L.shape[:-2])
    if tuple(R.shape[:-2]) != batch or L.shape[-1] != R.shape[-2]:
        raise ValueError(f"{name}: L {tuple(L.shape)} and R {tuple(R.shape)} do not multiply (L's last dim is R's rows, batches equal)")
    if symmetric and R.shape[-1] != L.shape[-2]:
        raise ValueError(
            f"{name}: a symmetric result is square, so R must be [k, m] for L [m, k]; got L {tuple(L.shape)}, R {tuple(R.shape)}"
        )
    shape = (*batch, L.shape[-2], R.shape[-1])
    alpha, beta = _scalar(name, "alpha", alpha), _scalar(name, "beta", beta)
    if C is not None:
        _check_result_like(name, "C", C, shape, L.device)
    if out is not None:
        _check_result_like(name, "out", out, shape, L.device)
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"{name}: out has dtype {out.dtype} but out_dtype={out_dtype}; pass one of them")
        out_dtype = out.dtype
        for arg, tensor in (("L", L), ("R", R)):
            if _overlap(out, tensor):
                raise ValueError(
                    f"{name}: out shares memory with {arg} (their memory ranges overlap), which other tiles still "
                    "read; pass a separate out"
                )
        if C is not None and _overlap(out, C) and not _same_view(out, C):
            raise ValueError(f"{name}: out overlaps C without being C itself; pass out=C (in place) or a separate out")
    if out_dtype is None:
        out_dtype = L.dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: out_dtype must be float16, bfloat16, float32 or float64, got {out_dtype}")
    return alpha, beta, out_dtype


def _scalar(name: str, arg: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name}: {arg} must be a finite real number, got {value!r}")
    return float(value)


def _check_result_like(name: str, arg: str, tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name}: {arg} must be a tensor or None, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: {arg} must have the result's shape {shape}, got {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name}: {arg} is on {tensor.device}, the operands on {device}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: {arg} must be a floating tensor, got {tensor.dtype}")


def _byte_span(t: Tensor) -> tuple[int, int]:
    """[first, last) bytes a tensor's elements may occupy (conservative for strided views)."""
    start = t.data_ptr()
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    return start, start + extent * t.element_size()


def _overlap(a: Tensor, b: Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def _same_view(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
