"""The symmetric-output kernel (optimizer/kernels/symmetric_kernel.py) under Triton's interpreter,
against fp64 products written in the test (kernel_bounds.py): every element within the fp32
accumulation + one output rounding bound, the result exactly symmetric and equal to the lower
triangle mirrored, at shapes that are multiples of no tile (the interpreter's tile is 32), with
batches, strided operands, fp16/bf16/fp32 and every epilogue the Newton–Schulz iteration uses.

Random (non-symmetric) L and R are used on purpose where the contract allows: the kernel then
has one right answer (the lower triangle, mirrored), so a tile computed from the wrong blocks or
mirrored the wrong way cannot hide behind the symmetry of a true Gram matrix.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kernel_bounds import assert_within_rounding, lower_mirrored  # noqa: E402

from optimizer import kernels  # noqa: E402
from optimizer.kernels import symmetric_kernel  # noqa: E402
from optimizer.kernels.symmetric_kernel import _triangle_tile, symmetric_matmul_triton  # noqa: E402
from optimizer.kernels.tiles import INTERPRETER_TILES, Tiles  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
T = INTERPRETER_TILES.block_m


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_interpreter_tile_leaves_partial_tiles():
    # the shapes below exercise partial tiles only if no tile size divides them
    assert T == 32 and all(n % T for n in (37, 53, 65, 130))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 53), (65, 130), (3, 37, 53)])
def test_syrk(shape, dtype):
    X = randn(*shape, dtype=dtype)
    got = kernels.syrk(X, backend="triton")
    assert_within_rounding(got, X, X.mT, symmetric=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_product_with_epilogue_is_lower_triangle_mirrored(dtype):
    """beta C + alpha L R for random L, R, C: the kernel's contract is the lower triangle of that
    (diagonal included), mirrored; the upper triangle of the full product differs."""
    L, R, C = randn(2, 37, 53, dtype=dtype, seed=1), randn(2, 53, 37, dtype=dtype, seed=2), randn(2, 37, 37, dtype=dtype, seed=3)
    got = kernels.symmetric_matmul(L, R, C, alpha=1.3, beta=-0.7, backend="triton")
    assert_within_rounding(got, L, R, C, alpha=1.3, beta=-0.7, symmetric=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_newton_schulz_products(dtype):
    """The products the iteration runs, on a real (normalised) X: A = X X^T, B = b A + c A A, and
    the Gram form's a Q + Q B, a A + A B, a AQ + B AQ; each against its fp64 value, and each
    equal (within rounding) to the full product, which is symmetric here."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = randn(2, 37, 53, dtype=torch.float64, seed=4)
    X = (X / torch.linalg.matrix_norm(X, keepdim=True)).to(dtype)
    A = kernels.syrk(X, backend="triton")
    assert_within_rounding(A, X, X.mT, symmetric=True)
    B = kernels.symmetric_matmul(A, A, A, alpha=c, beta=b, backend="triton")
    assert_within_rounding(B, A, A, A, alpha=c, beta=b, symmetric=True)
    Q = B.clone()
    Q.diagonal(dim1=-2, dim2=-1).add_(a)
    for L, R, C in [(Q, B, Q), (A, B, A)]:
        got = kernels.symmetric_matmul(L, R, C, beta=a, backend="triton")
        assert_within_rounding(got, L, R, C, beta=a, symmetric=True)
    AQ = kernels.symmetric_matmul(A, B, A, beta=a, backend="triton")
    got = kernels.symmetric_matmul(B, AQ, AQ, beta=a, backend="triton")
    assert_within_rounding(got, B, AQ, AQ, beta=a, symmetric=True)


def test_strided_operands_and_untouched_surroundings():
    """Every operand with its own batch stride and layout (a slice of every other matrix, a
    batch-last permute, a transposed view, an interior window of a larger buffer); the output's
    surroundings stay NaN (no store outside the m x m windows) and its inside has no NaN left
    (every tile and mirror written)."""
    batch, m, k = 3, 37, 53
    L = randn(2 * batch, m, k, seed=5)[::2]
    R = randn(m, k, batch, seed=6).permute(2, 1, 0)  # [batch, k, m], batch stride 1
    C = randn(batch, m, m, seed=7).mT
    frame = torch.full((batch + 2, m + 3, m + 5), float("nan"))
    out = frame[1:-1, 1:-2, 2:-3]
    assert not out.is_contiguous() and len({L.stride(0), R.stride(0), C.stride(0), out.stride(0)}) == 4
    kernels.symmetric_matmul(L, R, C, alpha=0.9, beta=1.1, out=out, backend="triton")
    assert_within_rounding(out, L, R, C, alpha=0.9, beta=1.1, symmetric=True)
    outside = torch.ones_like(frame, dtype=torch.bool)
    outside[1:-1, 1:-2, 2:-3] = False
    assert frame[outside].isnan().all(), "the kernel wrote outside the output"


def test_in_place_on_C():
    """out=C: each tile reads its C block before writing it and its mirror (b A + c A A in place)."""
    L, R, C = randn(2, 37, 53, seed=8), randn(2, 53, 37, seed=19), randn(2, 37, 37, seed=20)
    C0 = C.clone()
    got = kernels.symmetric_matmul(L, R, C, alpha=0.5, beta=-2.0, out=C, backend="triton")
    assert got.data_ptr() == C.data_ptr()
    assert_within_rounding(C, L, R, C0, alpha=0.5, beta=-2.0, symmetric=True)


def test_fp32_result_of_16_bit_operands():
    """A Gram matrix accumulated and kept in fp32 (out_dtype), and a C of another dtype."""
    X = randn(37, 53, dtype=torch.bfloat16, seed=9)
    A = kernels.syrk(X, out_dtype=torch.float32, backend="triton")
    assert_within_rounding(A, X, X.mT, symmetric=True, out_dtype=torch.float32)
    C = randn(37, 37, seed=10)  # fp32 C, bf16 operands, bf16 result
    got = kernels.symmetric_matmul(X, X.mT, C, beta=0.25, backend="triton")
    assert_within_rounding(got, X, X.mT, C, beta=0.25, symmetric=True, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("m, k", [(1, 5), (T, T), (T + 1, 2 * T), (5, 0)])
def test_edge_sizes(m, k):
    """One row; exactly one tile with k a multiple of the K tile (the unmasked loop); one row
    past a tile; k = 0 (the product is zero: beta C)."""
    L, R, C = randn(2, m, k, seed=11), randn(2, k, m, seed=12), randn(2, m, m, seed=13)
    got = kernels.symmetric_matmul(L, R, C, alpha=2.0, beta=0.5, backend="triton")
    assert_within_rounding(got, L, R, C, alpha=2.0, beta=0.5, symmetric=True)


def test_empty_results():
    for L in (torch.ones(0, 4, 3), torch.ones(2, 0, 3)):
        got = kernels.syrk(L, backend="triton")
        assert got.shape == (*L.shape[:-1], L.shape[-2])


def test_beta_zero_does_not_read_C():
    X = randn(37, 53, seed=14)
    C = torch.full((37, 37), float("nan"))
    got = kernels.symmetric_matmul(X, X.mT, C, alpha=1.0, beta=0.0, backend="triton")
    assert_within_rounding(got, X, X.mT, symmetric=True)


def test_batches_past_one_launch(monkeypatch):
    """Batches beyond the grid's batch axis run in several launches, each on its own slice."""
    monkeypatch.setattr(symmetric_kernel, "MAX_BATCH_PER_LAUNCH", 2)
    L, C = randn(5, 33, 20, seed=15), randn(5, 33, 33, seed=16)
    got = kernels.symmetric_matmul(L, L.mT, C, beta=1.0, backend="triton")
    assert_within_rounding(got, L, L.mT, C, beta=1.0, symmetric=True)


def test_other_tile_sizes():
    """Square tiles of 16 with a K tile of 32, and 64 with 16: the kernel holds for any tile."""
    L, R = randn(2, 37, 53, seed=17), randn(2, 53, 37, seed=18)
    for tiles in (Tiles(16, 16, 32, 1, 1), Tiles(64, 64, 16, 1, 1)):
        assert_within_rounding(symmetric_matmul_triton(L, R, tiles=tiles), L, R, symmetric=True)


@triton.jit
def _number_tiles(pids, out_i, out_j, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i, j = _triangle_tile(tl.load(pids + offsets))
    tl.store(out_i + offsets, i)
    tl.store(out_j + offsets, j)


def test_triangle_numbering():
    """Program ids walk the lower triangle row by row, pid = i (i + 1) / 2 + j with j <= i: every
    id below 2^16, and the first and last id of every tile row up to the launcher's limit of 2^28
    tiles (8 pid + 1 < 2^31), where fp32 holds only every 256th integer and the float square
    root's guess is off by one at many row ends: the integer correction must fix it."""
    rows = torch.arange(1, 23170)
    firsts = rows * (rows + 1) // 2
    pids = torch.cat([torch.arange(1 << 16), firsts, firsts - 1])
    expected_i = torch.cat([torch.repeat_interleave(torch.arange(362), torch.arange(1, 363))[: 1 << 16], rows, rows - 1])
    expected_j = torch.cat([torch.arange(1 << 16) - expected_i[: 1 << 16] * (expected_i[: 1 << 16] + 1) // 2,
                            torch.zeros_like(rows), rows - 1])
    assert int(pids.max()) < 1 << 28 == symmetric_kernel.MAX_TILES
    block = 1 << 16
    padded = torch.zeros(-(-len(pids) // block) * block, dtype=torch.int32)
    padded[: len(pids)] = pids
    i, j = torch.empty_like(padded), torch.empty_like(padded)
    _number_tiles[(len(padded) // block,)](padded, i, j, BLOCK=block)
    assert torch.equal(i[: len(pids)].long(), expected_i) and torch.equal(j[: len(pids)].long(), expected_j)


def test_too_many_tiles_is_refused_before_launch():
    with pytest.raises(ValueError, match="2\\^28 tiles"):
        symmetric_matmul_triton(torch.empty(46340, 1), torch.empty(1, 46340), tiles=Tiles(2, 2, 16, 1, 1))


def test_lower_mirrored_helper():
    M = torch.arange(9.0).view(3, 3)
    assert torch.equal(lower_mirrored(M), torch.tensor([[0.0, 3, 6], [3, 4, 7], [6, 7, 8]]))
