"""The iteration, once per form, on a products object (products.py: torch's matmuls or the Triton
kernels'), for a normalised X ([s, l] or [batch, s, l], s <= l) and the coefficients of each step.

* classic: ``X <- a X + B X`` with ``B = b A + c A^2``, ``A = X X^T``, per step;
* Gram: the same polynomial in segments (``plan``: their lengths, ``restarts.gram_restart_plan``);
  a segment of one step is a classic step, a longer one forms ``A = X X^T`` once, runs the s x s
  recursion of :func:`gram_segment_factor` and ends with ``X <- Q X``.

A matrix cut over ranks (cut.py) runs the same steps on its all-reduced Gram matrices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .coefficients import Coefficients


def step_polynomial(A: Tensor, b: float, c: float, products, out: Tensor | None = None) -> Tensor:
    """``B = b A + c A^2``: a step's factor ``q(A) = a I + B`` without ``a I``, so that in low
    precision B keeps its own relative accuracy (``a X + B X``, as the classic form applies it)."""
    return products.symmetric(A, A, A, alpha=c, beta=b, out=out)


def classic_iterations(X: Tensor, steps: Sequence[Coefficients], products) -> Tensor:
    """``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, per step; X is not modified. Two s x l
    buffers alternate as the new X, and the s x s A and B are reused across steps."""
    if not steps:
        return X
    s = X.shape[-2]
    A = X.new_empty((*X.shape[:-1], s))
    B = torch.empty_like(A)
    first = X
    spare = None  # the buffer the next step writes: never the X it reads, never the caller's X
    for a, b, c in steps:
        products.gram(X, out=A)
        step_polynomial(A, b, c, products, out=B)
        target = spare if spare is not None else torch.empty_like(X)
        spare = X if X is not first else None
        X = products.general(B, X, X, beta=a, out=target)  # a X + B X
    return X


def gram_segment_factor(A: Tensor, segment: Sequence[Coefficients], products) -> Tensor:
    """Q of one Gram segment: the product of its steps' ``q(A_j) = a I + B_j``, run on the s x s
    Gram matrix ``A`` ([s, s] or [batch, s, s]) of the segment's first X alone (then
    ``X <- Q X``): ``Q <- a Q + Q B`` and ``A <- q(A) A q(A) = a (A q(A)) + B (A q(A))``, all
    polynomials in the first A, hence symmetric."""
    Q = None
    length = len(segment)
    for j, (a, b, c) in enumerate(segment):
        B = step_polynomial(A, b, c, products)
        if Q is None:
            Q = B.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # q(A) = a I + B
        else:
            Q = products.symmetric(Q, B, Q, beta=a)  # Q q(A) = a Q + Q B
        if j + 1 < length:
            AQ = products.symmetric(A, B, A, beta=a)  # A q(A) = a A + A B
            A = products.symmetric(B, AQ, AQ, beta=a)  # q(A) A q(A) = a AQ + B AQ
    return Q


def gram_iterations(X: Tensor, steps: Sequence[Coefficients], plan: Sequence[int], products) -> Tensor:
    """The classic iteration's polynomial run in Gram-space segments of ``plan``'s lengths."""
    if sum(plan) != len(steps):
        raise ValueError(f"gram_iterations: the plan {tuple(plan)} covers {sum(plan)} steps, not {len(steps)}")
    first = 0
    for length in plan:
        segment, first = steps[first : first + length], first + length
        if length == 1:
            X = classic_iterations(X, segment, products)
            continue
        X = products.general(gram_segment_factor(products.gram(X), segment, products), X)
    return X
