"""Which products the Triton product kernels can address: a pure rule of shapes and strides.

Inside one matrix both product kernels (symmetric_kernel.py, matmul_add_kernel.py) form element
offsets in int32: a row index times the row stride plus a column index times the column stride
(the batch offset is 64-bit; the K loop advances 64-bit pointers by ``BLOCK_K`` times the K
stride, a step that is used only when K > ``BLOCK_K`` and is then no larger than the offsets
below). An operand whose largest in-matrix offset passes 2^31 - 1 would be read or written at a
wrapped address. And an output with two elements at one address (a batch stride of 0 from ``expand``, say)
would be written by several tiles at once. Neither is refused by Triton.

So: ``"auto"`` runs such a product on torch (``kernels.symmetric_matmul``, ``matmul_add``), and
``"triton"`` refuses it; the optimizer refuses ``ns_kernels="triton"`` for a parameter whose
Newton–Schulz products would be such (:func:`newton_schulz_problem`) when its group is added.
Everything here takes sizes and strides, never memory: tested on both sides of 2^31 with no
allocation.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

# The largest offset an int32 holds.
MAX_OFFSET = 2**31 - 1

Layout = tuple[Sequence[int], Sequence[int]]  # (shape, strides) of an operand, in elements


def matrix_extent(shape: Sequence[int], strides: Sequence[int]) -> int:
    """The largest offset of an element of one matrix (the last two dims) from its first."""
    return sum((size - 1) * abs(stride) for size, stride in zip(shape[-2:], strides[-2:]) if size > 0)


def overlaps_itself(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether two elements may share an address: True unless the dims, ordered by stride, each
    step past everything the smaller ones span (conservative: an interleaving that happens not to
    collide is reported too; torch never makes one)."""
    reach = 0
    for stride, size in sorted((abs(t), s) for s, t in zip(shape, strides) if s > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def product_problem(L: Layout, R: Layout, C: Layout | None, out: Layout | None) -> str | None:
    """Why the kernels cannot address ``beta C + alpha L @ R`` (L [.., m, k], R [.., k, n], C the
    result's shape or None when not read, out the result or None when the launcher allocates it),
    naming the operand; None if they can."""
    m, n = L[0][-2], R[0][-1]
    if out is None:
        out = ((m, n), (n, 1))
    for name, layout in (("L", L), ("R", R), ("C", C), ("out", out)):
        if layout is None:
            continue
        shape, strides = layout
        extent = matrix_extent(shape, strides)
        if extent > MAX_OFFSET:
            return (f"{name} {tuple(shape)} with strides {tuple(strides)} spans {extent:,} elements inside one "
                    f"matrix, past the kernels' 32-bit offsets ({MAX_OFFSET:,})")
    if overlaps_itself(*out):
        return (f"out {tuple(out[0])} with strides {tuple(out[1])} has elements that share memory (a stride of 0, "
                "as from expand?): tiles would write them at once")
    return None


@lru_cache(maxsize=1024)
def newton_schulz_problem(shape: tuple[int, ...]) -> str | None:
    """Why the kernels cannot address the Newton–Schulz products of a parameter of ``shape``
    (its matrices, the last two dims, as newton_schulz/iteration.py lays them out: X [s, l] contiguous, s <=
    l, or the transposed view of a contiguous [l, s]; A, B, Q [s, s]), or None. Matrices cut over
    ranks (``ns_split``) or into row blocks are pieces of these, with offsets no larger."""
    s, l = sorted(shape[-2:])
    square = ((s, s), (s, 1))
    for X in (((s, l), (l, 1)), ((s, l), (1, s))):
        Xt = ((l, s), (X[1][1], X[1][0]))  # X.mT, as syrk reads it
        for L, R, C, out in ((X, Xt, None, square),  # A = X X^T
                             (square, square, square, square),  # b A + c A A, the Gram products
                             (square, X, X, None)):  # a X + B X, Q X
            problem = product_problem(L, R, C, out)
            if problem is not None:
                return problem
    return None
