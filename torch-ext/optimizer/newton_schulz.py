"""Quintic Newton-Schulz orthogonalisation (the "zeroth power" of a matrix).

Muon replaces each matrix update ``G = U S V^T`` by (approximately) ``U V^T``. Newton-Schulz
gets there with matmuls only: normalise ``X = G / ||G||_F`` (so every singular value is in
(0, 1]), then repeat ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, which applies the odd
polynomial ``p(s) = a s + b s^3 + c s^5`` to every singular value.

Two ways to run the same iteration (``method``):

* ``"classic"``: the loop above, on the m x n matrix (m <= n after transposing tall ones).
* ``"gram"``: every step multiplies X on the left by ``q(A) = a I + b A + c A^2``, a polynomial
  in the m x m Gram matrix, so the steps can run on m x m matrices alone and touch X only at
  the start and end of a segment: ``A_{k+1} = q_k(A_k) A_k q_k(A_k)``, ``Q_{k+1} = Q_k q_k(A_k)``,
  ``X_K = Q_K X_0``. Fewer FLOPs once n > 1.5 m (see :func:`newton_schulz_flops`). In finite
  precision the m x m recursion drifts, so it restarts (re-forms A from X) on a schedule that
  depends on the coefficients and the compute dtype (:func:`gram_restart_plan`).
* ``"auto"`` (default) picks whichever does fewer FLOPs for the shape and compute dtype
  (:func:`choose_ns_method`): the Gram form for rectangular matrices in fp32, the classic one in
  bf16, where accurate Gram segments are one step long.

Everything here is a pure function of its inputs: no process groups, no optimizer state. The
distributed code gathers a full matrix (or a batch of them) and calls this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Union

import torch
from torch import Tensor

from .ns_kernels import resolve as resolve_kernels

Coefficients = tuple[float, float, float]
CoefficientSpec = Union[str, Coefficients, Sequence[Coefficients]]

NS_COEFFICIENTS: dict[str, list[Coefficients]] = {
    # Keller Jordan's Muon (also torch.optim.Muon, Moonlight and Kimi K2): one (a, b, c) for every
    # iteration, chosen to maximise the slope at zero. Singular values end in roughly [0.7, 1.2]
    # rather than at 1, which does not hurt training.
    # https://github.com/KellerJordan/Muon/blob/master/muon.py
    "fixed": [(3.4445, -4.7750, 2.0315)],
    # Polar Express (Amsel, Persson, Musco, Gower 2025, https://arxiv.org/abs/2505.16932): a
    # different minimax-optimal polynomial for each iteration, so small singular values are pulled
    # up fast early on and all of them converge to 1 at the end. Numbers as published in
    # modded-nanogpt's train_gpt.py ("Computed for num_iters=5, safety_factor=2e-2, cushion=2"),
    # https://github.com/KellerJordan/modded-nanogpt. They assume the input is divided by
    # (1 + 2e-2) * ||X||_F, see NS_NORM_SAFETY. Steps past the table use NS_TAIL.
    "polar_express": [
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ],
}

# What a named table does past its end. Polar Express's optimal quintic on [l, u] tends to the
# classic Newton-Schulz quintic (15/8, -10/8, 3/8) as l/u -> 1 (the paper's `optimal_quintic`), whose
# fixed point at 1 is superattracting; repeating the table's last, still aggressive entry would
# instead settle near 1.035. Tables not listed here repeat their last entry.
NS_TAIL: dict[str, Coefficients] = {"polar_express": (15 / 8, -10 / 8, 3 / 8)}

# Extra factor on the Frobenius norm that a named table was designed for. The Polar Express
# polynomials grow fast above 1, so bf16 rounding that nudges a singular value past 1 must not be
# amplified; the table above was fitted to inputs scaled by 1 / 1.02.
NS_NORM_SAFETY: dict[str, float] = {"fixed": 1.0, "polar_express": 1.0 + 2e-2}


def _check_triple(triple, where: str) -> Coefficients:
    try:
        a, b, c = (float(v) for v in triple)
    except (TypeError, ValueError):
        raise ValueError(
            f"ns_coefficients: {where} must be three numbers (a, b, c), got {triple!r}"
        ) from None
    if not all(math.isfinite(v) for v in (a, b, c)):
        raise ValueError(f"ns_coefficients: {where} must be finite, got {(a, b, c)!r}")
    return (a, b, c)


def resolve_ns_coefficients(spec: CoefficientSpec, ns_steps: int) -> list[Coefficients]:
    """Return the ``(a, b, c)`` to use at each of ``ns_steps`` iterations.

    ``spec`` is a name from :data:`NS_COEFFICIENTS` (past the table's end: :data:`NS_TAIL`, or
    the table's last entry), a single ``(a, b, c)`` used at every step, or an explicit list with exactly
    ``ns_steps`` entries.
    """
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be a positive int, got {ns_steps!r}")
    if isinstance(spec, str):
        if spec not in NS_COEFFICIENTS:
            raise ValueError(
                f"ns_coefficients: unknown name {spec!r}; use one of {sorted(NS_COEFFICIENTS)}, "
                "a single (a, b, c) tuple, or a list of ns_steps such tuples"
            )
        table = NS_COEFFICIENTS[spec]
        tail = NS_TAIL.get(spec, table[-1])
        return [table[i] if i < len(table) else tail for i in range(ns_steps)]
    if not isinstance(spec, Sequence) or len(spec) == 0:
        raise ValueError(
            f"ns_coefficients must be a name, an (a, b, c) tuple or a list of them, got {spec!r}"
        )
    if all(isinstance(v, (int, float)) for v in spec):
        return [_check_triple(spec, "the tuple")] * ns_steps
    if len(spec) != ns_steps:
        raise ValueError(
            f"ns_coefficients: a per-iteration list needs exactly ns_steps={ns_steps} entries, "
            f"got {len(spec)}; pass ns_steps={len(spec)} or a list of that length"
        )
    return [_check_triple(t, f"entry {i}") for i, t in enumerate(spec)]


NS_METHODS = ("auto", "classic", "gram")


def check_ns_method(method) -> str:
    """Return ``method`` if it is one of :data:`NS_METHODS`, else raise a ValueError saying which are."""
    if not isinstance(method, str) or method not in NS_METHODS:
        raise ValueError(
            f"ns_method must be one of {', '.join(map(repr, NS_METHODS))}, got {method!r} "
            '("auto" picks the form with fewer FLOPs for each shape and compute dtype; '
            '"classic" and "gram" force one form)'
        )
    return method


def default_compute_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 where tensor cores make it fast (CUDA); fp32 elsewhere.

    On CPU a bf16 matmul is roughly 100x slower than fp32, and fp32 is more accurate anyway.
    """
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


# ------------------------------------------------------------------ Gram-space restarts

# How much a Gram-space step's polynomial may be off, within one segment, because of drift.
#
# Rounding makes the computed A = X X^T slightly indefinite: an eigenvalue that should be 0, or
# any below the rounding level (singular values under sqrt(u) of the largest), comes out near
# -u * ||A|| (u: the compute dtype's unit roundoff). The m x m recursion multiplies every
# eigenvalue r of A by q(r)^2 per step, q(r) = a + b r + c r^2, so such an r drifts from -u
# geometrically. Two things go wrong (Zhang, Amsel, Chen and Dao, "Gram Newton-Schulz", Dao AI Lab
# blog, 2026; github.com/Dao-AILab/gram-newton-schulz): while |r| is small, the directions below
# the rounding level get the step factor q(r) instead of q(r_true), an error of about
# |b r| / |a|; and since, unlike a positive r, a negative one is never damped (q grows with -r),
# it eventually blows up, taking the result with it. The classic form has neither problem: it
# re-forms A from X every step, and an odd polynomial cannot flip a singular value's sign. The
# cure is to restart part-way: X <- Q X, A <- X X^T, which resets the drift to -u.
#
# Dao et al. place restarts by simulating a negatively perturbed eigenvalue through the table and
# minimising the condition number of Q (autotuned: after step 2 of 5-step Polar Express in fp16,
# which Microsoft's dion and others hard-code). We make it a rule evaluated per (coefficients,
# dtype), aimed at accuracy rather than only at avoiding blow-up: follow r_0 = -u through
# r <- r q(r)^2 and restart before a step whose factor would be off by more than this fraction,
# (|b| |r| + |c| r^2) / |a|. With 1%, fp32 runs 5 steps in one segment (the 5th is 0.2% off
# with the fixed table, 0.8% with Polar Express) and 10 in two of 5 (a 6th would be 2% off;
# measured, 6+4 steps left singular values of ill-conditioned inputs up to 0.16 off the fp64
# iteration, 5+5 at most 4e-3, 1.3e-2 at condition number 1e6: tests/rule/test_newton_schulz_gram.py,
# benchmarks/ns_efficiency.py --restart-study). In bf16 the second step would already be 6.4%
# off, so every segment is one step (up to Polar Express's converged steps past the 5th), which
# is the classic iteration: the Gram form has no accurate FLOP saving in bf16. (There 2-step
# segments do not blow up but were measured 1.5-3.5x less accurate than the classic form; one
# restart after step 2 or 3, as in fp16 practice, blew up on rank-deficient and power-law inputs.)
_GRAM_STEP_ERROR_LIMIT = 0.01


def gram_restart_plan(
    coefficients: CoefficientSpec, ns_steps: int, dtype: torch.dtype | None = None
) -> tuple[int, ...]:
    """Lengths of the Gram-space segments for ``ns_steps`` iterations (they sum to ``ns_steps``).

    Each segment forms ``A = X X^T`` from the current X, runs its steps on m x m matrices and
    ends with ``X <- Q X``; a segment of one step is exactly a classic step. ``dtype`` is the
    compute dtype (None: float32). See ``_GRAM_STEP_ERROR_LIMIT`` for the rule; with the tables
    here: fp32 5 steps -> (5,), 10 -> (5, 5); bf16 up to 5 steps -> all ones.
    """
    steps = tuple(resolve_ns_coefficients(coefficients, ns_steps))
    return _restart_plan(steps, torch.finfo(dtype or torch.float32).eps / 2)


def _drift_error(r: float, a: float, b: float, c: float) -> float:
    """Relative error of the step factor q(r) = a + b r + c r^2 at a drifted eigenvalue r."""
    return (abs(b * r) + abs(c * r * r)) / abs(a) if a != 0 else math.inf


@lru_cache(maxsize=512)
def _restart_plan(steps: tuple[Coefficients, ...], unit_roundoff: float) -> tuple[int, ...]:
    lengths: list[int] = []
    r = math.nan
    for a, b, c in steps:
        # not <=: restarts on the first step (r is nan) and on an overflowed r
        if not lengths or not _drift_error(r, a, b, c) <= _GRAM_STEP_ERROR_LIMIT:
            lengths.append(0)
            r = -unit_roundoff
        lengths[-1] += 1
        r = r * (a + b * r + c * r * r) ** 2
    return tuple(lengths)


# ------------------------------------------------------------------ FLOPs and the choice


def newton_schulz_flops(
    shape: Sequence[int],
    ns_steps: int,
    method: str = "classic",
    dtype: torch.dtype | None = None,
    coefficients: CoefficientSpec = "fixed",
) -> int:
    """Floating-point operations (2 per multiply-add) of the NS matmuls for ``shape``.

    With ``s = min(m, n)`` and ``l = max(m, n)``, every matrix of a batched shape counting:

    * classic: per step ``X X^T`` (s*s*l), ``A @ A`` (s^3) and ``B @ X`` (s*s*l) multiply-adds.
    * gram: per segment of L steps (:func:`gram_restart_plan`, which depends on the
      coefficients and ``dtype``) ``X X^T`` and ``Q @ X`` (s*s*l each) plus ``4 L - 3`` products
      of s x s matrices (``A @ A`` every step, ``Q q(A)`` every step but the first, ``A q(A)`` and
      ``q(A) (A q(A))`` every step but the last).

    Per segment of L >= 2 steps the gram form saves ``2 (L - 1) s^2 (2 l - 3 s)`` FLOPs: fewer
    exactly when ``l > 1.5 s``, whatever the plan. ``method="auto"`` counts the form
    :func:`choose_ns_method` picks. Elementwise work and the normalisation are ignored (lower
    order). Nominal counts: the CPU's symmetric-block shortcut does less. Used to balance owners
    across ranks.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"newton_schulz_flops needs a shape [..., m, n], got {shape}")
    if ns_steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {ns_steps}")
    check_ns_method(method)
    if ns_steps == 0:
        return 0
    if method == "auto":
        method = choose_ns_method(shape, ns_steps, "auto", dtype, coefficients)
    batch = math.prod(shape[:-2])
    s, l = min(shape[-2:]), max(shape[-2:])
    if method == "classic":
        return 2 * ns_steps * batch * (2 * s * s * l + s**3)
    segments = len(gram_restart_plan(coefficients, ns_steps, dtype))
    return 2 * batch * (2 * segments * s * s * l + (4 * ns_steps - 3 * segments) * s**3)


def choose_ns_method(
    shape: Sequence[int],
    ns_steps: int,
    method: str = "auto",
    dtype: torch.dtype | None = None,
    coefficients: CoefficientSpec = "fixed",
) -> str:
    """``"classic"`` or ``"gram"``: ``method`` itself unless it is ``"auto"``, which picks the
    Gram form when it saves at least :data:`GRAM_MIN_SAVED_FLOPS` FLOPs (:func:`newton_schulz_flops`)
    for this shape (batch included), compute ``dtype`` (None: float32) and coefficient table.

    The Gram form saves FLOPs exactly when ``max(m, n) > 1.5 min(m, n)`` and its restart plan
    (:func:`gram_restart_plan`, where the dtype and coefficients enter) has a segment of two or
    more steps. That holds in fp32 and fp64; in bf16 the plan is one step per segment (the classic
    iteration, for accuracy; up to 5 steps, and for the fixed table always), so "auto" is classic
    there. A small matrix saves too few FLOPs to pay for the Gram form's extra, smaller
    products (measured on CPU: 1.1-1.5x slower at 4 x 64 to 64 x 128). Pure: no tensors, the same
    answer on every rank.
    """
    check_ns_method(method)
    if method != "auto":
        return method
    classic = newton_schulz_flops(shape, ns_steps, "classic")
    gram = newton_schulz_flops(shape, ns_steps, "gram", dtype, coefficients)
    return "gram" if classic - gram >= GRAM_MIN_SAVED_FLOPS else "classic"


# FLOPs the Gram form must save before "auto" takes it: its extra kernels cost ~100 µs on a CPU
# core. Measured (fp32, 1 thread, classic vs gram): 64 x 128 saves 2.1 MFLOP and runs 1.07x
# slower, 48 x 192 saves 4.4 MFLOP and runs 0.92x, 64 x 256 saves 10 MFLOP and runs 0.75x.
GRAM_MIN_SAVED_FLOPS = 4_000_000


# ------------------------------------------------------------------ the iteration


def zeropower_via_newtonschulz(
    G: Tensor,
    ns_steps: int = 5,
    coefficients: CoefficientSpec = "fixed",
    eps: float = 1e-7,
    compute_dtype: torch.dtype | None = None,
    norm_safety: float | None = None,
    method: str = "auto",
    kernels: str = "auto",
) -> Tensor:
    """Approximately orthogonalise every matrix in ``G`` (shape ``[..., m, n]``).

    Leading dims are a batch of independent matrices (a 3-D MoE weight ``[E, out, in]`` is E
    matrices done in one batched call). G is cast to the compute dtype and each matrix divided
    by its own Frobenius norm in fp32 (times ``norm_safety``; default: what the named table
    needs, else 1), rounding once to the compute dtype; tall matrices are transposed
    so the Gram matrix ``X X^T`` is the small one. ``method`` is ``"classic"``, ``"gram"`` or
    ``"auto"`` (:func:`choose_ns_method`; the two forms compute the same polynomial and differ
    in rounding only). ``kernels`` (``optimizer.ns_kernels``) says what runs the products: the
    Triton kernels of :mod:`optimizer.kernels` or torch's matmuls. Returns a tensor of ``G``'s shape
    in the compute dtype (default :func:`default_compute_dtype` of ``G``'s device).
    """
    if G.ndim < 2:
        raise ValueError(
            f"zeropower_via_newtonschulz expects a matrix or a batch of matrices [..., m, n], "
            f"got shape {tuple(G.shape)}"
        )
    check_ns_method(method)
    steps = resolve_ns_coefficients(coefficients, ns_steps)
    if norm_safety is None:
        norm_safety = NS_NORM_SAFETY.get(coefficients, 1.0) if isinstance(coefficients, str) else 1.0
    if not norm_safety > 0:
        raise ValueError(f"norm_safety must be positive, got {norm_safety!r}")
    dtype = compute_dtype if compute_dtype is not None else default_compute_dtype(G.device)
    shape = G.shape
    if G.numel() == 0:
        return torch.zeros(shape, dtype=dtype, device=G.device)
    form = choose_ns_method(shape, ns_steps, method, dtype, steps)
    impl = resolve_kernels(kernels, G.device, dtype)

    X = _normalised(G, dtype, norm_safety, eps)  # [batch, s, l], s <= l
    single = X.shape[0] == 1
    if single:  # 2-D kernels (mm/addmm) for the common unbatched case
        X = X[0]
    if impl == "triton":
        from .kernels import newton_schulz as on_kernels

        if form == "gram":
            X = on_kernels.gram_iterations(X, steps, gram_restart_plan(steps, ns_steps, dtype), backend="triton")
        else:
            X = on_kernels.classic_iterations(X, steps, backend="triton")
    elif form == "gram":
        X = _gram_iterations(X, steps, gram_restart_plan(steps, ns_steps, dtype))
    else:
        X = _classic_iterations(X, steps)
    if single:
        X = X.unsqueeze(0)
    if shape[-2] > shape[-1]:
        X = X.mT
    return X.reshape(shape)


def _normalised(G: Tensor, dtype: torch.dtype, norm_safety: float, eps: float) -> Tensor:
    """G as [batch, s, l] (tall matrices transposed), each matrix divided by its Frobenius norm
    times ``norm_safety``, in ``dtype``, contiguous; the same numbers whatever G's memory layout.

    G is first cast to ``dtype``: exactly the numbers a bf16 all-gather delivers to the owner, so
    parallel and single-device Muon see the same matrix. The norm of that matrix and the division
    are then in fp32 (or wider, if G or dtype is), rounding once more: dividing by a bf16-rounded
    norm would scale the matrix by up to 2^-8 (0.4%) off, a fifth of Polar Express's 2% safety
    margin. Frobenius norm >= spectral norm, so singular values land in (0, 1 / norm_safety].
    """
    m, n = G.shape[-2:]
    # Contiguous first: a reduction's rounding depends on the memory layout, and the same matrix
    # arrives as a strided view on some paths (an owner's zero-copy piece with NorMuon's row-state
    # columns beside it, an assembled matrix cut from its padding) and contiguous on others.
    X = G.to(dtype).reshape(-1, m, n).contiguous()
    if m > n:
        X = X.mT
    wide = torch.promote_types(torch.promote_types(G.dtype, dtype), torch.float32)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=wide)
    out = torch.empty(X.shape, dtype=dtype, device=G.device)
    return torch.div(X, (norm * norm_safety).clamp_min(eps), out=out)


def _uses_symmetric_blocks(X: Tensor) -> bool:
    # On CPU, computing only the diagonal and upper blocks of a product known to be symmetric
    # saves 1/4 of its FLOPs per level. Single matrices: 5-20% faster from 768 wide
    # (benchmarks/ns_efficiency.py). Batches of experts, [4..16, 256..1024, ...]: 3-22% faster
    # for the classic form and 7-25% for the Gram form (minima of 7 interleaved repeats, one
    # thread). Not used on CUDA (not measured; cuBLAS has no symmetric-output GEMM to call).
    return X.device.type == "cpu" and X.shape[-2] >= 2 * _SYMMETRIC_MIN_BLOCK


def _classic_iterations(X: Tensor, steps: Sequence[Coefficients]) -> Tensor:
    """``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, per step; X is [s, l] or [batch, s, l]."""
    symmetric = _uses_symmetric_blocks(X)
    addmm = torch.addmm if X.ndim == 2 else torch.baddbmm
    for a, b, c in steps:
        A = _symmetric_product(X, X.mT, blocks=symmetric)  # [s, s]
        # B = b*A + c*A@A in one fused call; A@A is A^T A as well, no extra transpose.
        B = _symmetric_product(A, A, A, beta=b, alpha=c, blocks=symmetric)
        X = addmm(X, B, X, beta=a)  # a*X + B@X
    return X


def _gram_iterations(X: Tensor, steps: Sequence[Coefficients], plan: Sequence[int]) -> Tensor:
    """The same polynomial as :func:`_classic_iterations`, run on s x s matrices.

    Within a segment, with ``q(A) = a I + B`` and ``B = b A + c A^2``: ``Q <- Q q(A)`` and
    ``A <- q(A) A q(A)``, all products of polynomials in the segment's first A, hence symmetric;
    at its end ``X <- Q X``. ``a I`` is kept out of the stored B so that in low precision B keeps
    its own relative accuracy (as the classic form's ``a X + B X`` does).
    """
    symmetric = _uses_symmetric_blocks(X)
    mm = torch.mm if X.ndim == 2 else torch.bmm
    first = 0
    for length in plan:
        segment, first = steps[first : first + length], first + length
        if length == 1:  # a classic step
            X = _classic_iterations(X, segment)
            continue
        A = _symmetric_product(X, X.mT, blocks=symmetric)
        X = mm(_gram_segment_factor(A, segment, symmetric), X)
    return X


def _gram_segment_factor(A: Tensor, segment: Sequence[Coefficients], symmetric: bool) -> Tensor:
    """Q of one Gram segment: the product of its steps' ``q(A_j) = a I + b A_j + c A_j^2``, run on
    the s x s Gram matrix ``A`` ([s, s] or [batch, s, s]) of the segment's first X alone (then
    ``X <- Q X``). Also used by parallel/split_newton_schulz.py, which all-reduces A over ranks first."""
    Q = None
    length = len(segment)
    for j, (a, b, c) in enumerate(segment):
        B = _symmetric_product(A, A, A, beta=b, alpha=c, blocks=symmetric)
        if Q is None:
            Q = B.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # q(A) = a I + B
        else:
            Q = _symmetric_product(Q, B, Q, beta=a, blocks=symmetric)  # Q q(A) = a Q + Q B
        if j + 1 < length:
            AQ = _symmetric_product(A, B, A, beta=a, blocks=symmetric)  # A q(A)
            A = _symmetric_product(B, AQ, AQ, beta=a, blocks=symmetric)  # q(A) A q(A)
    return Q


# Rows below which a symmetric product is done as one matmul (smaller GEMMs lose efficiency).
_SYMMETRIC_MIN_BLOCK = 128


def _symmetric_product(
    L: Tensor,
    R: Tensor,
    C: Tensor | None = None,
    *,
    beta: float = 1.0,
    alpha: float = 1.0,
    blocks: bool = True,
    out: Tensor | None = None,
) -> Tensor:
    """``beta C + alpha L @ R`` for a result known to be symmetric (L [..., s, k], R [..., k, s]).

    With ``blocks``, only the diagonal and upper blocks are computed: split the rows in halves;
    the diagonal blocks are the halves' own products (recursively), the upper one is
    ``L1 R2`` and the lower one its transpose. Without, one (b)addbmm/matmul call.
    """
    s = L.shape[-2]
    if out is None:
        out = L.new_empty((*L.shape[:-2], s, s))
    h = s // 2
    if not blocks or h < _SYMMETRIC_MIN_BLOCK:
        if C is None:
            return torch.matmul(L, R, out=out)
        addmm = torch.addmm if L.ndim == 2 else torch.baddbmm
        return addmm(C, L, R, beta=beta, alpha=alpha, out=out)
    for rows in (slice(None, h), slice(h, None)):
        _symmetric_product(
            L[..., rows, :], R[..., :, rows], None if C is None else C[..., rows, rows],
            beta=beta, alpha=alpha, out=out[..., rows, rows],
        )
    upper = out[..., :h, h:]
    if C is None:
        torch.matmul(L[..., :h, :], R[..., :, h:], out=upper)
    else:
        addmm = torch.addmm if L.ndim == 2 else torch.baddbmm
        addmm(C[..., :h, h:], L[..., :h, :], R[..., :, h:], beta=beta, alpha=alpha, out=upper)
    out[..., h:, :h] = upper.mT
    return out
