"""The FLOP model of the Newton–Schulz iteration: the products of each form, per restart plan
(docs/newton_schulz.md, "The two forms"). Pure numbers; used to pick the form and to balance
owners across ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence


def plan_flops(shape: Sequence[int], plan: Sequence[int], symmetric: bool = False) -> int:
    """Floating-point operations (2 per multiply-add) of the matmuls for ``shape`` (batch
    included) run in segments of ``plan``'s lengths; the classic form is the plan of all ones.

    With ``s = min(m, n)`` and ``l = max(m, n)``, a segment of L steps does ``X X^T`` and
    ``Q @ X`` (``B @ X`` for L = 1; s*s*l multiply-adds each) and ``4 L - 3`` products of s x s
    matrices (``A @ A`` every step, ``Q q(A)`` every step but the first, ``A q(A)`` and
    ``q(A) (A q(A))`` every step but the last). ``symmetric`` counts the products known to be
    symmetric (``X X^T`` and every s x s product, all polynomials in one symmetric matrix) as one
    triangle, ``s (s + 1) k`` FLOPs for an s x k by k x s product: what symmetric kernels do.
    Elementwise work and the normalisation are lower order and not counted.
    """
    shape = tuple(int(d) for d in shape)
    batch = math.prod(shape[:-2])
    s, l = min(shape[-2:]), max(shape[-2:])
    gram_xxt = s * (s + 1) * l if symmetric else 2 * s * s * l  # X X^T
    square = s * (s + 1) * s if symmetric else 2 * s**3  # a product of two s x s matrices
    left = 2 * s * s * l  # B X or Q X: not symmetric
    return batch * sum(gram_xxt + left + (4 * length - 3) * square for length in plan)
