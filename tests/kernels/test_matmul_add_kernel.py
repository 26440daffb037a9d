"""The general product kernel (optimizer/kernels/matmul_add_kernel.py, ``beta C + alpha L R``;
``a X + B X`` in Newton–Schulz) under Triton's interpreter, against fp64 products written in the
test: every element within the fp32-accumulation and output-rounding bound (kernel_bounds.py), at
shapes that are multiples of no tile, with batches, strided operands, fp16/bf16/fp32."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_bounds import assert_within_rounding  # noqa: E402

from optimizer import kernels  # noqa: E402
from optimizer.kernels import matmul_add_kernel  # noqa: E402
from optimizer.kernels.matmul_add_kernel import matmul_add_triton  # noqa: E402
from optimizer.kernels.tiles import Tiles  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 53), (3, 37, 53)])
def test_a_x_plus_b_x(shape, dtype):
    """The classic step's last product, a X + B X with B symmetric, as the iteration calls it."""
    X = randn(*shape, dtype=dtype, seed=1)
    B = randn(*shape[:-1], shape[-2], dtype=torch.float64, seed=2)
    B = ((B + B.mT) / 2).to(dtype)
    got = kernels.matmul_add(B, X, X, beta=3.4445, backend="triton")
    assert_within_rounding(got, B, X, X, beta=3.4445)


@pytest.mark.parametrize("dtype", DTYPES)
def test_general_epilogue(dtype):
    L, R, C = randn(2, 65, 40, dtype=dtype, seed=3), randn(2, 40, 130, dtype=dtype, seed=4), randn(2, 65, 130, dtype=dtype, seed=5)
    got = kernels.matmul_add(L, R, C, alpha=-1.7, beta=0.6, backend="triton")
    assert_within_rounding(got, L, R, C, alpha=-1.7, beta=0.6)


def test_strided_operands_and_untouched_surroundings():
    batch, m, k, n = 3, 37, 45, 53
    L = randn(m, batch, k, seed=6).transpose(0, 1)  # [batch, m, k], batch stride k
    R = randn(2 * batch, k, n, seed=7)[1::2]
    C = randn(batch, n, m, seed=8).mT
    frame = torch.full((batch + 1, m + 2, n + 3), float("nan"))
    out = frame[1:, 1:-1, 1:-2]
    assert len({L.stride(0), R.stride(0), C.stride(0), out.stride(0)}) == 4
    kernels.matmul_add(L, R, C, alpha=1.2, beta=-0.4, out=out, backend="triton")
    assert_within_rounding(out, L, R, C, alpha=1.2, beta=-0.4)
    outside = torch.ones_like(frame, dtype=torch.bool)
    outside[1:, 1:-1, 1:-2] = False
    assert frame[outside].isnan().all(), "the kernel wrote outside the output"


def test_grouped_tile_order_with_a_partial_group():
    """Groups of 2 tile rows over 5 (the last group has one): every tile computed once."""
    L, R = randn(130, 40, seed=9), randn(40, 100, seed=10)
    tiles = Tiles(32, 32, 32, num_warps=1, num_stages=1, group_m=2)
    out = torch.full((130, 100), float("nan"))
    matmul_add_triton(L, R, out=out, tiles=tiles)
    assert_within_rounding(out, L, R)


def test_in_place_on_C_and_fp32_result():
    L, R = randn(2, 37, 53, dtype=torch.bfloat16, seed=11), randn(2, 53, 40, dtype=torch.bfloat16, seed=12)
    C = randn(2, 37, 40, seed=13)
    C0 = C.clone()
    got = kernels.matmul_add(L, R, C, beta=0.5, out=C, backend="triton")  # fp32 C and result
    assert got.data_ptr() == C.data_ptr()
    assert_within_rounding(C, L, R, C0, beta=0.5, out_dtype=torch.float32)


@pytest.mark.parametrize("m, k, n", [(1, 5, 3), (32, 32, 32), (33, 64, 1), (5, 0, 7)])
def test_edge_sizes(m, k, n):
    L, R, C = randn(m, k, seed=14), randn(k, n, seed=15), randn(m, n, seed=16)
    got = kernels.matmul_add(L, R, C, alpha=2.0, beta=0.5, backend="triton")
    assert_within_rounding(got, L, R, C, alpha=2.0, beta=0.5)


def test_beta_zero_does_not_read_C_and_batches_past_one_launch(monkeypatch):
    monkeypatch.setattr(matmul_add_kernel, "MAX_BATCH_PER_LAUNCH", 2)
    L, R = randn(5, 20, 33, seed=17), randn(5, 33, 21, seed=18)
    C = torch.full((5, 20, 21), float("nan"))
    got = kernels.matmul_add(L, R, C, alpha=0.75, beta=0.0, backend="triton")
    assert_within_rounding(got, L, R, alpha=0.75)
