"""Newton–Schulz of whole matrices (a batch of them): normalise, iterate in the chosen form,
return in the dtype Newton–Schulz reads and returns."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .coefficients import Coefficients, CoefficientSpec, norm_safety_for, resolve_ns_coefficients
from .forms import check_ns_method, choose_ns_form, ns_io_dtype
from .implementation import ON_TORCH, Implementation, implementation_for_call
from .iteration import classic_iterations, gram_iterations
from .restarts import gram_restart_plan


def zeropower_via_newtonschulz(
    G: Tensor,
    ns_steps: int = 5,
    coefficients: CoefficientSpec = "fixed",
    eps: float = 1e-7,
    compute_dtype: torch.dtype | None = None,
    norm_safety: float | None = None,
    method: str = "auto",
    ns_kernels: str | Implementation = "auto",
) -> Tensor:
    """Approximately orthogonalise every matrix in ``G`` (shape ``[..., m, n]``).

    Leading dims are a batch of independent matrices (a 3-D MoE weight ``[E, out, in]`` is E
    matrices done in one batched call). ``method`` is ``"classic"``, ``"gram"`` or ``"auto"``;
    with ``compute_dtype`` it fixes the form and the dtype it runs in (``forms.choose_ns_form``;
    the two forms compute the same polynomial and differ in rounding only). G is rounded to
    ``forms.ns_io_dtype`` (the run dtype, or bf16 for an fp16 run on a wider input) and each
    matrix divided by its own Frobenius norm in fp32 (times ``norm_safety``; default: what the
    named table needs, else 1), rounding once to the run dtype; tall matrices are transposed so
    the Gram matrix ``X X^T`` is the small one. Returns a tensor of ``G``'s shape in
    ``ns_io_dtype`` (the compute dtype, default ``forms.default_compute_dtype`` of ``G``'s
    device, except bf16 for an fp16 iteration on a wider input). ``ns_kernels`` (the option of
    that name, implementation.py) says what runs the products: ``"auto"``, ``"torch"`` or
    ``"triton"``, resolved for this call, or an ``Implementation`` resolved once.
    """
    if G.ndim < 2:
        raise ValueError(
            f"zeropower_via_newtonschulz expects a matrix or a batch of matrices [..., m, n], "
            f"got shape {tuple(G.shape)}"
        )
    check_ns_method(method)
    steps = resolve_ns_coefficients(coefficients, ns_steps)
    norm_safety = norm_safety_for(coefficients, norm_safety)
    form, dtype = choose_ns_form(G.shape, ns_steps, method, compute_dtype, steps, G.device)
    if G.numel() == 0:
        return torch.zeros(G.shape, dtype=ns_io_dtype(G.dtype, dtype), device=G.device)
    plan = gram_restart_plan(steps, ns_steps, dtype) if form == "gram" else None
    return zeropower_with_plan(G, steps, dtype, plan, norm_safety, eps,
                               implementation_for_call(ns_kernels, G.device, dtype))


def zeropower_output_dtype(shape: Sequence[int], input_dtype: torch.dtype, ns_steps: int = 5,
                           coefficients: CoefficientSpec = "fixed", compute_dtype: torch.dtype | None = None,
                           method: str = "auto", device: torch.device | str | None = None) -> torch.dtype:
    """The dtype :func:`zeropower_via_newtonschulz` returns for an input of ``shape`` and
    ``input_dtype`` with these options, without running it (pure: a rank that receives another
    rank's result knows its dtype; Dion2's owners send their submatrices' updates so)."""
    steps = resolve_ns_coefficients(coefficients, ns_steps)
    _, dtype = choose_ns_form(tuple(shape), ns_steps, method, compute_dtype, steps, device)
    return ns_io_dtype(input_dtype, dtype)


def zeropower_with_plan(G: Tensor, steps: Sequence[Coefficients], dtype: torch.dtype, plan: Sequence[int] | None,
                        norm_safety: float, eps: float, implementation: Implementation = ON_TORCH) -> Tensor:
    """The iteration on G in ``dtype``: the Gram form with restart ``plan``, or the classic form
    (``plan`` None), its products from ``implementation``. Also what
    benchmarks/ns_efficiency.py --restart-study runs other plans with."""
    shape = G.shape
    X = normalised(G, dtype, norm_safety, eps)  # [batch, s, l], s <= l
    single = X.shape[0] == 1
    if single:  # 2-D kernels (mm/addmm) for the common unbatched case
        X = X[0]
    products = implementation.products(X, dtype)
    X = classic_iterations(X, steps, products) if plan is None else gram_iterations(X, steps, plan, products)
    if single:
        X = X.unsqueeze(0)
    if shape[-2] > shape[-1]:
        X = X.mT
    return X.reshape(shape).to(ns_io_dtype(G.dtype, dtype))


def normalised(G: Tensor, dtype: torch.dtype, norm_safety: float, eps: float) -> Tensor:
    """G as [batch, s, l] (tall matrices transposed), each matrix divided by its Frobenius norm
    times ``norm_safety``, in ``dtype``, contiguous; the same numbers whatever G's memory layout.

    G is first rounded to ``ns_io_dtype`` (exactly the numbers a 16-bit all-gather delivers to
    the owner); the norm and the division are in fp32 (or wider), rounding once more, to
    ``dtype`` (a bf16-rounded norm would scale the matrix up to 0.4% off). Frobenius norm >=
    spectral norm, so singular values land in (0, 1 / norm_safety]. docs/newton_schulz.md.
    """
    m, n = G.shape[-2:]
    # Contiguous first: a reduction's rounding depends on the memory layout, and the same matrix
    # arrives strided on some paths and contiguous on others.
    X = G.to(ns_io_dtype(G.dtype, dtype)).reshape(-1, m, n).contiguous()
    if m > n:
        X = X.mT
    wide = torch.promote_types(torch.promote_types(G.dtype, dtype), torch.float32)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=wide)
    out = torch.empty(X.shape, dtype=dtype, device=G.device)
    return torch.div(X, (norm * norm_safety).clamp_min(eps), out=out)
