"""Triton kernel: ``beta * C + alpha * (L @ R)`` for a result known to be symmetric, one triangle.

The m x m output is cut into square T x T tiles; only the tiles on and below the diagonal are
computed (``r (r + 1) / 2`` of ``r^2`` for ``r = ceil(m / T)`` tile rows, so the product costs
``(r + 1) / (2 r)`` of a full GEMM: 56 % at r = 8, 52 % at r = 32), each written to its own
position and, transposed, to its mirror. A diagonal tile keeps its lower half and mirrors it, so
the result is exactly symmetric (reference.symmetric_matmul_reference says what that means).

Products the Newton–Schulz iteration needs (newton_schulz/iteration.py): ``X X^T`` (L = X,
R = X.mT: a strided view, X is read in place for both operands), ``b A + c A A``, and the Gram
form's ``a Q + Q B``, ``a A + A B``, ``a AQ + B AQ``: products of polynomials in one symmetric
matrix, which commute, hence symmetric.

Operands: L [m, k] or [batch, m, k], R [k, m] / [batch, k, m] of one dtype (fp16, bf16, fp32),
any strides; accumulation in fp32; C and the output of any of those dtypes. fp32 operands use
``input_precision="ieee"`` (true fp32, like torch with TF32 off, its default). Edges: rows past m
are loaded wrapped (``% m``, always in bounds) and never stored; the K edge is masked unless T_K
divides k. Launch: grid (triangle tiles, batch), batches past 65,535 in several launches.

Imports Triton at module level: only the dispatcher imports this module, after checking that
Triton imports (kernels/backend.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError as error:  # only imported once environment.triton_import_error() said it works
    raise ImportError(f"optimizer.kernels.symmetric_kernel needs Triton: {error}") from error

from . import environment
from .interpreter_rounding import bf16_round_to_nearest_even
from .tiles import MAX_BATCH_PER_LAUNCH, Tiles, as_batch, choose_tiles

# Whether TRITON_INTERPRET was set when the kernel below was defined (Triton decides then).
INTERPRETED = environment.interpreting()

# Tiles of one triangle: the tile numbering computes 8 pid + 1 in int32 (a 741,000-row output at
# 32-wide tiles; 128-wide tiles reach it at 2.9 million rows).
MAX_TILES = 1 << 28


@triton.jit
def _triangle_tile(pid):
    """Tile (i, j), i >= j, numbered row by row through the lower triangle: pid = i (i + 1) / 2 + j."""
    i = ((tl.sqrt((8 * pid + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    # the float square root may be one off either way: correct it with integers
    i = i - (i * (i + 1) // 2 > pid).to(tl.int32)
    i = i + ((i + 1) * (i + 2) // 2 <= pid).to(tl.int32)
    return i, pid - i * (i + 1) // 2


@triton.jit
def _symmetric_matmul_kernel(
    L, R, C, Out,
    M, K,
    stride_lb, stride_lm, stride_lk,
    stride_rb, stride_rk, stride_rn,
    stride_cb, stride_cm, stride_cn,
    stride_ob, stride_om, stride_on,
    alpha, beta,
    HAS_C: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    ROUND_BF16_IN_INTEGERS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i, j = _triangle_tile(tl.program_id(0))
    batch = tl.program_id(1).to(tl.int64)
    rows = i * BLOCK + tl.arange(0, BLOCK)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    # rows and columns past M are read wrapped (in bounds) and never stored
    l_ptrs = L + batch * stride_lb + (rows % M)[:, None] * stride_lm + ks[None, :] * stride_lk
    r_ptrs = R + batch * stride_rb + ks[:, None] * stride_rk + (cols % M)[None, :] * stride_rn

    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            l_tile = tl.load(l_ptrs)
            r_tile = tl.load(r_ptrs)
        else:
            l_tile = tl.load(l_ptrs, mask=ks[None, :] < K - k0, other=0.0)
            r_tile = tl.load(r_ptrs, mask=ks[:, None] < K - k0, other=0.0)
        if DOT_IN_FP32:  # the interpreter's bf16 dot is wrong: fp32 tiles (exact), interpreter_rounding.py
            l_tile = l_tile.to(tl.float32)
            r_tile = r_tile.to(tl.float32)
        acc = tl.dot(l_tile, r_tile, acc, input_precision=INPUT_PRECISION)
        l_ptrs += BLOCK_K * stride_lk
        r_ptrs += BLOCK_K * stride_rk

    inside = (rows[:, None] < M) & (cols[None, :] < M)
    acc = acc * alpha
    if HAS_C:
        c_ptrs = C + batch * stride_cb + rows[:, None] * stride_cm + cols[None, :] * stride_cn
        acc += beta * tl.load(c_ptrs, mask=inside, other=0.0).to(tl.float32)
    if ROUND_BF16_IN_INTEGERS:  # the interpreter's own conversion does not round to nearest
        tile = bf16_round_to_nearest_even(acc)
    else:
        tile = acc.to(Out.dtype.element_ty)
    tile_t = tl.trans(tile)
    # a diagonal tile keeps its lower half and mirrors it: the output is exactly symmetric
    tile = tl.where((rows[:, None] >= cols[None, :]) | (i != j), tile, tile_t)
    out_ptrs = Out + batch * stride_ob + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, tile, mask=inside)
    if i != j:
        mirror_ptrs = Out + batch * stride_ob + cols[:, None] * stride_om + rows[None, :] * stride_on
        tl.store(mirror_ptrs, tile_t, mask=(cols[:, None] < M) & (rows[None, :] < M))


def symmetric_matmul_triton(
    L: Tensor,
    R: Tensor,
    C: Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    tiles: Tiles | None = None,
) -> Tensor:
    """Launch the kernel (operands as checked by operands.check_product; ``tiles`` overrides the
    rule in tiles.py). C is not read when ``beta`` is 0."""
    m, k = L.shape[-2:]
    if out is None:
        out = torch.empty((*L.shape[:-1], m), dtype=out_dtype or L.dtype, device=L.device)
    has_c = C is not None and beta != 0.0
    L3, R3, O3 = as_batch(L), as_batch(R), as_batch(out)
    C3 = as_batch(C) if has_c else O3  # never read without HAS_C
    batch = L3.shape[0]
    if batch == 0 or m == 0:
        return out
    if tiles is None:
        tiles = choose_tiles("symmetric", batch, m, m, k, L.dtype, *environment.device_key(L.device))
    if tiles.block_m != tiles.block_n:
        raise ValueError(f"symmetric_matmul: tiles must be square, got {tiles}")
    rows = -(-m // tiles.block_m)
    if rows * (rows + 1) // 2 >= MAX_TILES:
        raise ValueError(f"symmetric_matmul: {m} rows at {tiles.block_m}-wide tiles make 2^28 tiles or more; use larger tiles")
    for first in range(0, batch, MAX_BATCH_PER_LAUNCH):
        part = slice(first, first + MAX_BATCH_PER_LAUNCH)
        l, r, c, o = L3[part], R3[part], C3[part], O3[part]
        _symmetric_matmul_kernel[(rows * (rows + 1) // 2, l.shape[0])](
            l, r, c, o,
            m, k,
            *l.stride(), *r.stride(), *c.stride(), *o.stride(),
            float(alpha), float(beta),
            HAS_C=has_c,
            EVEN_K=k % tiles.block_k == 0,
            DOT_IN_FP32=INTERPRETED and L.dtype == torch.bfloat16,
            ROUND_BF16_IN_INTEGERS=INTERPRETED and out.dtype == torch.bfloat16,
            INPUT_PRECISION="ieee" if L.dtype == torch.float32 else "tf32",
            BLOCK=tiles.block_m,
            BLOCK_K=tiles.block_k,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            enable_fp_fusion=False,  # the epilogue rounds as written (docs/kernels.md)
        )
    return out

