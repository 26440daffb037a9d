"""Triton kernel: ``beta * C + alpha * (L @ R)``, a general batched product with the epilogue fused.

In Newton–Schulz this is ``a X + B X`` (L = B symmetric [s, s], R = C = X [s, l], beta = a) and
the Gram form's ``Q X``. Nothing in it is symmetric, so it does the full product's FLOPs, and so
does cuBLAS's ``addmm``/``baddbmm(beta=a)``, which also fuses the ``a X`` term into its epilogue
(it reads C once while writing the result): the same FLOPs and bytes. The ``"auto"`` backend
therefore keeps torch (cuBLAS) for this product on CUDA; this kernel is the ``"triton"`` backend's,
tested under the interpreter like the symmetric one, and timed against cuBLAS by
``benchmarks/ns_kernels.py`` so the choice can be revisited on a GPU (docs/kernels.md).

Operands as in symmetric_kernel.py (any strides, fp16/bf16/fp32, fp32 accumulation, C and the
output of any of those dtypes). Tiles are walked in groups of ``group_m`` tile rows so that
consecutive programs share R's column panels in L2 (the usual grouped ordering).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError as error:  # only imported once environment.triton_import_error() said it works
    raise ImportError(f"optimizer.kernels.matmul_add_kernel needs Triton: {error}") from error

from . import environment
from .interpreter_rounding import bf16_round_to_nearest_even
from .tiles import MAX_BATCH_PER_LAUNCH, Tiles, as_batch, choose_tiles

INTERPRETED = environment.interpreting()


@triton.jit
def _matmul_add_kernel(
    L, R, C, Out,
    M, N, K,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    l_ptrs = L + batch * stride_lb + (rows % M)[:, None] * stride_lm + ks[None, :] * stride_lk
    r_ptrs = R + batch * stride_rb + ks[:, None] * stride_rk + (cols % N)[None, :] * stride_rn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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

    inside = (rows[:, None] < M) & (cols[None, :] < N)
    acc = acc * alpha
    if HAS_C:
        c_ptrs = C + batch * stride_cb + rows[:, None] * stride_cm + cols[None, :] * stride_cn
        acc += beta * tl.load(c_ptrs, mask=inside, other=0.0).to(tl.float32)
    out_ptrs = Out + batch * stride_ob + rows[:, None] * stride_om + cols[None, :] * stride_on
    if ROUND_BF16_IN_INTEGERS:  # the interpreter's own conversion does not round to nearest
        tile = bf16_round_to_nearest_even(acc)
    else:
        tile = acc.to(Out.dtype.element_ty)
    tl.store(out_ptrs, tile, mask=inside)


def matmul_add_triton(
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
    n = R.shape[-1]
    if out is None:
        out = torch.empty((*L.shape[:-1], n), dtype=out_dtype or L.dtype, device=L.device)
    has_c = C is not None and beta != 0.0
    L3, R3, O3 = as_batch(L), as_batch(R), as_batch(out)
    C3 = as_batch(C) if has_c else O3  # never read without HAS_C
    batch = L3.shape[0]
    if batch == 0 or m == 0 or n == 0:
        return out
    if tiles is None:
        tiles = choose_tiles("general", batch, m, n, k, L.dtype, *environment.device_key(L.device))
    grid_tiles = -(-m // tiles.block_m) * -(-n // tiles.block_n)
    for first in range(0, batch, MAX_BATCH_PER_LAUNCH):
        part = slice(first, first + MAX_BATCH_PER_LAUNCH)
        l, r, c, o = L3[part], R3[part], C3[part], O3[part]
        _matmul_add_kernel[(grid_tiles, l.shape[0])](
            l, r, c, o,
            m, n, k,
            *l.stride(), *r.stride(), *c.stride(), *o.stride(),
            float(alpha), float(beta),
            HAS_C=has_c,
            EVEN_K=k % tiles.block_k == 0,
            DOT_IN_FP32=INTERPRETED and L.dtype == torch.bfloat16,
            ROUND_BF16_IN_INTEGERS=INTERPRETED and out.dtype == torch.bfloat16,
            INPUT_PRECISION="ieee" if L.dtype == torch.float32 else "tf32",
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k,
            GROUP_M=tiles.group_m,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            enable_fp_fusion=False,  # the epilogue rounds as written (docs/kernels.md)
        )
    return out

