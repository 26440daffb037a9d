"""Newton–Schulz iterations on the kernels' products: drop-in versions of
``newton_schulz._classic_iterations``, ``_gram_iterations`` and ``_gram_segment_factor``.

Same polynomial, same arguments (X already normalised, [s, l] or [batch, s, l] with s <= l;
``steps`` a list of (a, b, c); ``plan`` from ``newton_schulz.gram_restart_plan``), same order of
operations; they differ from the torch versions only in rounding: every symmetric product is
its lower triangle mirrored, accumulated in fp32 and rounded once, each with its epilogue fused
(``b A + c A A``, ``a Q + Q B``, ...). ``backend`` is passed to every product
(``kernels.BACKENDS``).

Multiply-adds per classic step on an s x l matrix: ``f (s^2 l + s^3) + s^2 l`` instead of torch's
``2 s^2 l + s^3``, where ``f = (r + 1) / (2 r)`` is the share of tiles computed for r tile rows
(``X X^T`` and ``b A + c A A`` on one triangle, ``a X + B X`` in full): 0.73x at 4096 x 14336.
docs/kernels.md has the counts per shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import matmul_add, symmetric_matmul, syrk

Coefficients = tuple[float, float, float]


def classic_iterations(X: Tensor, steps: Sequence[Coefficients], *, backend: str = "auto") -> Tensor:
    """``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, per step; X is not modified.

    Two s x l buffers alternate as the new X, and the s x s A and B are reused across steps: the
    same peak as the torch version (the input, the previous X and the new one; A and B).
    """
    if not steps:
        return X
    s = X.shape[-2]
    A = X.new_empty((*X.shape[:-1], s))
    B = torch.empty_like(A)
    first = X
    spare = None  # the buffer the next step writes: never the X it reads, never the caller's X
    for a, b, c in steps:
        syrk(X, out=A, backend=backend)  # A = X X^T
        symmetric_matmul(A, A, A, alpha=c, beta=b, out=B, backend=backend)  # B = b A + c A A
        target = spare if spare is not None else torch.empty_like(X)
        spare = X if X is not first else None
        X = matmul_add(B, X, X, beta=a, out=target, backend=backend)  # a X + B X
    return X


def gram_segment_factor(A: Tensor, segment: Sequence[Coefficients], *, backend: str = "auto") -> Tensor:
    """Q of one Gram segment (then ``X <- Q X``): the product of the steps' ``q(A_j) = a I + B_j``,
    ``B_j = b A_j + c A_j^2``, run on the segment's first Gram matrix ``A`` ([s, s] or
    [batch, s, s]) alone, with ``Q <- a Q + Q B`` and ``A <- q(A) A q(A) = a (A q(A)) + B (A q(A))``:
    the recursion of ``newton_schulz._gram_segment_factor``, every product on one triangle."""
    Q = None
    length = len(segment)
    for j, (a, b, c) in enumerate(segment):
        B = symmetric_matmul(A, A, A, alpha=c, beta=b, backend=backend)  # b A + c A A
        if Q is None:
            Q = B.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # q(A) = a I + B
        else:
            Q = symmetric_matmul(Q, B, Q, beta=a, backend=backend)  # Q q(A) = a Q + Q B
        if j + 1 < length:
            AQ = symmetric_matmul(A, B, A, beta=a, backend=backend)  # A q(A) = a A + A B
            A = symmetric_matmul(B, AQ, AQ, beta=a, backend=backend)  # q(A) A q(A) = a AQ + B AQ
    return Q


def gram_iterations(
    X: Tensor, steps: Sequence[Coefficients], plan: Sequence[int], *, backend: str = "auto"
) -> Tensor:
    """The classic iteration's polynomial run in Gram-space segments (``plan``: their lengths):
    a segment of one step is a classic step; a longer one forms ``A = X X^T``, runs
    :func:`gram_segment_factor` and ends with ``X <- Q X``."""
    if sum(plan) != len(steps):
        raise ValueError(f"gram_iterations: the plan {tuple(plan)} covers {sum(plan)} steps, not {len(steps)}")
    first = 0
    for length in plan:
        segment, first = steps[first : first + length], first + length
        if length == 1:
            X = classic_iterations(X, segment, backend=backend)
            continue
        A = syrk(X, backend=backend)
        X = matmul_add(gram_segment_factor(A, segment, backend=backend), X, backend=backend)
    return X
