"""Triton kernels: the elementwise stages of a Muon step, each one pass over a local piece.

* ``momentum_nesterov``: the momentum and what Newton–Schulz orthogonalises, together:
  ``buf <- lerp(buf, g, 1 - mu)`` (stored in buf's dtype) and ``out <- lerp(g, buf, mu)`` (or buf,
  without Nesterov) from buf as stored: reads g and buf, writes buf and out (14 bytes per fp32
  entry with a bf16 out, where torch's ``_foreach_lerp_`` and ``lerp(out=)`` move 22, and a
  maximised or bf16 gradient is not first copied into a signed fp32 one). Flags also give the
  momentum alone (no out) and the input alone (buf already this step's).
* ``apply_update``: weight decay (cautious or not) and the update, ``p <- decay(p) - lr' u``:
  reads p and u, writes p (10 bytes per fp32 entry with a bf16 update, where torch's ``mul_`` and
  ``add_`` move 18, and cautious decay's mask 20 more).

The arithmetic is torch's, op for op (elementwise_reference.py states it and is the ``"torch"``
backend): fp32, lerp's two branches as one FMA each, the momentum and the decayed parameter
rounded to their storage dtypes where torch stores them, the update added by one FMA. Kernels
are compiled with ``enable_fp_fusion=False`` and the FMAs written out (``tl.fma``), so the
compiler contracts nothing else: the results are the reference's bit for bit on any GPU, and
torch's where torch's CUDA kernels are contracted as Lerp.h and ``add_`` are (docs/kernels.md).
Scalars arrive as fp32 arguments, or, for a tensor learning rate, as 0-d device tensors the kernel
loads (no host read, no synchronisation).

Layout: operands of up to 3 dims, each with its own strides (regions of DTensor local tensors,
``muon_transposed`` views, blocks of padded communication buffers). When every operand is
contiguous the index space is flat (one block of ``FLAT_BLOCK`` entries per program, no index
arithmetic); otherwise ``[batch, rows, cols]`` in ``TILE`` tiles, each operand addressed by its own
strides, batches past 65,535 in several launches. Offsets are 64-bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError as error:  # only imported once environment.triton_import_error() said it works
    raise ImportError(f"optimizer.kernels.elementwise_kernel needs Triton: {error}") from error

from . import environment
from .interpreter_rounding import bf16_round_to_nearest_even
from .tiles import MAX_BATCH_PER_LAUNCH

INTERPRETED = environment.interpreting()
# Entries per program: the interpreter runs programs one by one in numpy, so larger blocks there.
FLAT_BLOCK, FLAT_WARPS = (8192, 4) if INTERPRETED else (2048, 8)
TILE, TILE_WARPS = ((64, 64), 4) if INTERPRETED else ((32, 64), 4)
# A 16-bit dtype an intermediate is rounded through: 0 none (fp32), 1 bf16, 2 fp16.
_THROUGH = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _lerp(start, end, coefficient, SMALL: tl.constexpr):
    """torch's lerp (aten/src/ATen/native/Lerp.h) with a scalar weight w: ``start + w (end - start)``
    for |w| < 0.5, else ``end - (end - start)(1 - w)``, each one FMA. ``coefficient``: w, or w - 1,
    formed on the host in fp32 (:func:`_lerp_coefficient`), so the kernel does no scalar arithmetic
    (the interpreter would do it in fp64 on a Python float, a GPU in fp32)."""
    diff = end - start
    if SMALL:
        return tl.fma(diff, coefficient, start)
    return tl.fma(diff, coefficient, end)


@triton.jit
def _store_dtype(x, dtype: tl.constexpr, BF16_IN_INTEGERS: tl.constexpr):
    """``x`` (fp32) rounded to nearest even into ``dtype`` for a store; the interpreter's own bf16
    conversion does not round to nearest (interpreter_rounding.py)."""
    if BF16_IN_INTEGERS:
        return bf16_round_to_nearest_even(x)
    return x.to(dtype)


@triton.jit
def _through(x, THROUGH: tl.constexpr, INTERPRETED_: tl.constexpr):
    """``x`` (fp32) rounded to a 16-bit dtype (THROUGH: 1 bf16, 2 fp16) and back, where torch
    stores an intermediate in it; unchanged for 0."""
    if THROUGH == 1:
        if INTERPRETED_:
            x = bf16_round_to_nearest_even(x).to(tl.float32)
        else:
            x = x.to(tl.bfloat16).to(tl.float32)
    elif THROUGH == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows and columns (64-bit) and the mask of those inside ``M x N``."""
    pid = tl.program_id(0).to(tl.int64)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    return rows, cols, inside


@triton.jit
def _momentum_nesterov_kernel(
    Buf, Grad, Out,
    M, N,
    stride_bb, stride_bm, stride_bn,
    stride_gb, stride_gm, stride_gn,
    stride_ob, stride_om, stride_on,
    ema_coefficient, nesterov_coefficient,
    UPDATE: tl.constexpr,
    HAS_OUT: tl.constexpr,
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    EMA_SMALL: tl.constexpr,
    NESTEROV_SMALL: tl.constexpr,
    WORK_THROUGH: tl.constexpr,
    BUF_BF16_IN_INTEGERS: tl.constexpr,
    OUT_BF16_IN_INTEGERS: tl.constexpr,
    INTERPRETED_: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    batch = tl.program_id(1).to(tl.int64)
    rows, cols, inside = _tile(M, N, BLOCK_M, BLOCK_N)
    g_ptrs = Grad + batch * stride_gb + rows[:, None] * stride_gm + cols[None, :] * stride_gn
    b_ptrs = Buf + batch * stride_bb + rows[:, None] * stride_bm + cols[None, :] * stride_bn
    g = tl.load(g_ptrs, mask=inside, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    b = tl.load(b_ptrs, mask=inside, other=0.0).to(tl.float32)
    if UPDATE:
        stored = _store_dtype(_lerp(b, g, ema_coefficient, EMA_SMALL), Buf.dtype.element_ty, BUF_BF16_IN_INTEGERS)
        tl.store(b_ptrs, stored, mask=inside)
        b = stored.to(tl.float32)  # the Nesterov input reads the momentum as stored
    if HAS_OUT:
        if NESTEROV:
            x = _lerp(g, b, nesterov_coefficient, NESTEROV_SMALL)
        else:
            x = b
        x = _through(x, WORK_THROUGH, INTERPRETED_)
        o_ptrs = Out + batch * stride_ob + rows[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(o_ptrs, _store_dtype(x, Out.dtype.element_ty, OUT_BF16_IN_INTEGERS), mask=inside)


@triton.jit
def _apply_update_kernel(
    P, U, FactorPtr, AdjustedLrPtr,
    M, N,
    stride_pb, stride_pm, stride_pn,
    stride_ub, stride_um, stride_un,
    factor, neg_adjusted_lr,
    DECAY: tl.constexpr,
    CAUTIOUS: tl.constexpr,
    FACTOR_ON_DEVICE: tl.constexpr,
    LR_ON_DEVICE: tl.constexpr,
    P_THROUGH: tl.constexpr,
    P_BF16_IN_INTEGERS: tl.constexpr,
    INTERPRETED_: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    batch = tl.program_id(1).to(tl.int64)
    rows, cols, inside = _tile(M, N, BLOCK_M, BLOCK_N)
    p_ptrs = P + batch * stride_pb + rows[:, None] * stride_pm + cols[None, :] * stride_pn
    u_ptrs = U + batch * stride_ub + rows[:, None] * stride_um + cols[None, :] * stride_un
    p = tl.load(p_ptrs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(u_ptrs, mask=inside, other=0.0).to(tl.float32)
    if DECAY:
        if FACTOR_ON_DEVICE:
            f = tl.load(FactorPtr).to(tl.float32)
        else:
            f = factor
        if CAUTIOUS:  # f = -lr wd, added where the parameter and the update agree in sign
            if FACTOR_ON_DEVICE:  # torch's addcmul_(p, mask * lr wd, value=-1): one FMA
                p = tl.where(p * u >= 0, tl.fma(p, f, p), p)
            else:  # torch's addcmul_(p, mask, value=-lr wd): the product rounded, then the sum
                p = tl.where(p * u >= 0, p + f * p, p)
        else:  # f = 1 - lr wd
            p = p * f
        p = _through(p, P_THROUGH, INTERPRETED_)  # torch stores the decayed parameter first
    if LR_ON_DEVICE:
        a = -tl.load(AdjustedLrPtr).to(tl.float32)
    else:
        a = neg_adjusted_lr
    p = tl.fma(u, a, p)
    tl.store(p_ptrs, _store_dtype(p, P.dtype.element_ty, P_BF16_IN_INTEGERS), mask=inside)


# ---------------------------------------------------------------------------- launchers


def momentum_nesterov_triton(
    buf: Tensor, grad: Tensor, out: Tensor | None, momentum: float, nesterov: bool, maximize: bool, *,
    update_momentum: bool = True, dtype: torch.dtype | None = None,
) -> Tensor | None:
    """Launch the momentum/Nesterov kernel (operands checked by ``elementwise.py``)."""
    work = dtype or torch.promote_types(buf.dtype, grad.dtype)
    (ema_small, ema_coefficient), (nesterov_small, nesterov_coefficient) = (
        _lerp_coefficient(1.0 - momentum), _lerp_coefficient(momentum))
    operands = [buf, grad] + ([out] if out is not None else [])
    for launch, (b, g, o) in _launches(operands, 3):
        launch(_momentum_nesterov_kernel)(
            b.tensor, g.tensor, (o or b).tensor,
            *b.size, *b.strides, *g.strides, *(o or b).strides,
            ema_coefficient, nesterov_coefficient,
            UPDATE=update_momentum, HAS_OUT=out is not None, NESTEROV=nesterov, MAXIMIZE=maximize,
            EMA_SMALL=ema_small, NESTEROV_SMALL=nesterov_small,
            WORK_THROUGH=_through_code(work, out),
            BUF_BF16_IN_INTEGERS=INTERPRETED and buf.dtype == torch.bfloat16,
            OUT_BF16_IN_INTEGERS=INTERPRETED and out is not None and out.dtype == torch.bfloat16,
            INTERPRETED_=INTERPRETED,
        )
    return out


def apply_update_triton(
    param: Tensor, update: Tensor, factor: float | Tensor | None, adjusted_lr: float | Tensor, cautious: bool,
) -> None:
    """Launch the update kernel. ``factor``: :func:`elementwise_reference.decay_factor`'s (None:
    no weight decay), a float or a 0-d tensor on the parameter's device; ``adjusted_lr`` likewise."""
    factor_on_device = isinstance(factor, Tensor)
    lr_on_device = isinstance(adjusted_lr, Tensor)
    for launch, (p, u) in _launches([param, update], 2):
        launch(_apply_update_kernel)(
            p.tensor, u.tensor, factor if factor_on_device else p.tensor, adjusted_lr if lr_on_device else p.tensor,
            *p.size, *p.strides, *u.strides,
            0.0 if factor is None or factor_on_device else _fp32(factor),
            0.0 if lr_on_device else -_fp32(adjusted_lr),
            DECAY=factor is not None, CAUTIOUS=cautious,
            FACTOR_ON_DEVICE=factor_on_device, LR_ON_DEVICE=lr_on_device,
            P_THROUGH=_THROUGH[param.dtype],
            P_BF16_IN_INTEGERS=INTERPRETED and param.dtype == torch.bfloat16,
            INTERPRETED_=INTERPRETED,
        )


def _fp32(value: float) -> float:
    """``value`` rounded to fp32 on the host, as a GPU kernel receives a float argument (the
    interpreter would keep a Python float's fp64 value)."""
    return float(torch.tensor(float(value), dtype=torch.float32))


def _lerp_coefficient(weight: float) -> tuple[bool, float]:
    """(|w| < 0.5, the FMA's coefficient): torch's weight rounded to fp32 (its opmath), and for the
    second branch w - 1 in fp32 (exact for w in [0.5, 2], Sterbenz; rounded once otherwise)."""
    w32 = _fp32(weight)
    if abs(w32) < 0.5:
        return True, w32
    return False, float(torch.tensor(w32, dtype=torch.float32) - 1)


def _through_code(work: torch.dtype, out: Tensor | None) -> int:
    """Round the Nesterov input through ``work`` (the momentum's arithmetic dtype, where torch forms
    it) only where that is narrower than fp32 and is not ``out``'s dtype itself (once is enough)."""
    if out is None or work == out.dtype:
        return 0
    return _THROUGH.get(work, 0)


class _Operand:
    """A tensor's view as ``[batch, rows, cols]``: its sizes and strides (in elements)."""

    def __init__(self, tensor: Tensor, flat: bool):
        self.tensor = tensor
        self.flat_view = flat
        if flat:
            self.size, self.strides = (1, tensor.numel()), (0, 0, 1)
            self.batch = 1
            return
        shape, strides = list(tensor.shape), list(tensor.stride())
        while len(shape) < 3:
            shape.insert(0, 1)
            strides.insert(0, 0)
        self.batch = shape[0]
        self.size, self.strides = (shape[1], shape[2]), tuple(strides)

    def batch_slice(self, first: int, count: int) -> _Operand:
        """Batches ``first`` to ``first + count`` (only a 3-D operand has more than one)."""
        part = object.__new__(_Operand)
        part.tensor = self.tensor[first: first + count] if self.tensor.ndim == 3 and not self.flat_view else self.tensor
        part.size, part.strides, part.batch, part.flat_view = self.size, self.strides, count, self.flat_view
        return part


def _launches(tensors: list[Tensor], arity: int):
    """(launch(kernel) -> a grid-bound launcher, operands) per launch: one, or one per 65,535
    batches. Flat when every operand is contiguous."""
    flat = all(t.is_contiguous() for t in tensors)
    ops = [_Operand(t, flat) for t in tensors]
    while len(ops) < arity:
        ops.append(None)
    rows, cols = ops[0].size
    if tensors[0].numel() == 0:
        return
    block_m, block_n, warps = (1, FLAT_BLOCK, FLAT_WARPS) if flat else (*TILE, TILE_WARPS)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n)
    batch = ops[0].batch
    for first in range(0, batch, MAX_BATCH_PER_LAUNCH):
        count = min(MAX_BATCH_PER_LAUNCH, batch - first)
        parts = [None if o is None else o.batch_slice(first, count) for o in ops]

        def launch(kernel, count=count):
            def run(*args, **kwargs):
                kernel[(tiles, count)](*args, **kwargs, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                                       enable_fp_fusion=False)
            return run

        yield launch, parts
