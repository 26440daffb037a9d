"""Before the kernels run for real on a GPU: compile each one and check its numbers, once.

Why: Triton compiles the kernels for the GPU at hand the first time they run, and ``ns_kernels``
defaults to ``"auto"``, which runs them on every supported CUDA GPU. A Triton release or a GPU the
kernels were never compiled on could fail to compile one (a shared-memory or constexpr limit) or,
worse, compile it wrongly; either would otherwise break, or silently corrupt, a user's step. So
once per process, device, dtype and kind of kernel, before the first step (``muon.py`` asks when a
group is added; :func:`failure` is cached), each kernel is run on small operands in every tile
configuration the rule (tiles.py) can pick on that device, and compared element by element with
the same arithmetic in fp64:

* the products (symmetric_kernel.py, matmul_add_kernel.py): sizes that no tile divides (partial
  tiles on every edge, a K tail and an even K), a batch of two, with and without ``beta C``, the
  transposed view ``syrk`` reads, 16-bit and fp32 outputs; each symmetric result must be exactly
  symmetric;
* the elementwise stages (elementwise_kernel.py): the momentum with the Nesterov input, and weight
  decay with the update, on a 3-D strided piece.

A kernel that raises, or an element outside the bound, is a failure: ``"auto"`` then runs torch on
that device and dtype, with a warning that gives the reason; ``"triton"`` is refused with it
(``backend.unavailable_reason``). CPU tensors are never checked here: there the kernels run only
under the interpreter, which the test suite checks in full. The check is a smoke test of the
compiled code (each configuration compiled, indices, edges, mirroring, epilogues, dtypes), not a
proof: the tests in ``tests/kernels`` are that, under the interpreter.

Bounds. A product ``beta C + alpha L R`` accumulated in fp32 and rounded once to the output dtype
is within ``u_out |exact| + gamma_{k+3} (|alpha| |L||R| + |beta| |C|)`` of the exact value (Higham,
3.1; ``gamma_n = n u / (1 - n u)``), the accumulation's unit roundoff u taken as 4 x fp32's,
because tensor cores need not round their fp32 sums to nearest (NVIDIA documents no rounding for
the alignment of addends). An indexing, mirroring or epilogue error moves an entry by O(1) of its
size, far outside that.
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import torch
from torch import Tensor

from .tiles import CUDA_CANDIDATES, INTERPRETER_TILES, Tiles, for_capability

KINDS = ("products", "elementwise")

# fp32's unit roundoff, with the tensor-core margin above
ACCUMULATION_ROUNDOFF = 4 * 2.0**-24


def failure(kind: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str | None:
    """None if the ``kind`` kernels ("products" in ``dtype``, or "elementwise") passed their check
    on CUDA ``device``, else why not; run once per process and cached. A failure is also warned
    (once), since ``"auto"`` then quietly runs torch."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cached_failure(kind, index, dtype if kind == "products" else None)


@lru_cache(maxsize=None)
def _cached_failure(kind: str, index: int, dtype: torch.dtype | None) -> str | None:
    device = torch.device("cuda", index)
    with torch.cuda.device(device):
        reason = check(kind, device, dtype, candidates(dtype, torch.cuda.get_device_capability(device)))
    if reason is not None:
        what = f"{kind} in {dtype}" if dtype is not None else kind
        warnings.warn(
            f"optimizer.kernels: the Triton {what} kernels failed their first-use check on {device}: {reason}. "
            "ns_kernels='auto' runs torch there instead (ns_kernels='triton' is refused); please report it "
            "with your torch, Triton and GPU versions.",
            RuntimeWarning,
            stacklevel=3,
        )
    return reason


def candidates(dtype: torch.dtype | None, capability: tuple[int, int] | None) -> list[Tiles]:
    """Every tile configuration :func:`~.tiles.choose_tiles` can pick for ``dtype`` on a GPU of
    ``capability`` (None: the interpreter, whose one tile the rule picks there)."""
    if capability is None:
        return [INTERPRETER_TILES]
    if dtype == torch.float32:
        return [CUDA_CANDIDATES["fp32"]]
    return [for_capability(CUDA_CANDIDATES[name], capability) for name in ("large16", "small16")]


def check(kind: str, device: torch.device, dtype: torch.dtype | None, tiles: list[Tiles]) -> str | None:
    """Run the ``kind`` kernels on ``device`` (products in ``dtype``, with each of ``tiles``) and
    compare them with fp64; None if every element is within its bound, else the first problem in
    words. Not cached: :func:`failure` is the cached entry point (tests call this on CPU tensors
    under the interpreter)."""
    if kind not in KINDS:
        raise ValueError(f"self_check: kind must be one of {KINDS}, got {kind!r}")
    try:
        if kind == "products":
            for t in tiles:
                problem = _check_products(device, dtype, t)
                if problem:
                    return problem
            return None
        return _check_elementwise(device)
    except Exception as error:  # a compile or launch failure is what this is here to catch
        return f"{type(error).__name__}: {error}"


# ---------------------------------------------------------------------------- the products


def _operand(shape, dtype, device, seed) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).to(device)


def _within_product_bound(got: Tensor, L: Tensor, R: Tensor, C: Tensor | None, alpha: float, beta: float,
                          symmetric: bool) -> str | None:
    L64, R64 = L.double(), R.double()
    exact = alpha * (L64 @ R64)
    scale = abs(alpha) * (L64.abs() @ R64.abs())
    if C is not None and beta != 0:
        exact = exact + beta * C.double()
        scale = scale + abs(beta) * C.double().abs()
    if symmetric:  # the kernel keeps the lower triangle of what it computed, mirrored
        exact = exact.tril() + exact.tril(-1).mT
        scale = scale.tril() + scale.tril(-1).mT
    n = L.shape[-1] + 3
    gamma = n * ACCUMULATION_ROUNDOFF / (1 - n * ACCUMULATION_ROUNDOFF)
    u_out = torch.finfo(got.dtype).eps / 2
    bound = u_out * exact.abs() + (1 + u_out) * gamma * scale + u_out * torch.finfo(got.dtype).smallest_normal
    error = (got.double() - exact).abs()
    if not torch.isfinite(got).all():
        return "non-finite entries (a tile not written?)"
    bad = error > bound
    if bad.any():
        at = tuple(int(i) for i in bad.nonzero()[0])
        return (f"{int(bad.sum())} of {got.numel()} entries outside the rounding bound, the first at {at}: "
                f"{got[at].item():.6g} against {exact[at].item():.6g} (bound {bound[at].item():.3g})")
    if symmetric and not torch.equal(got, got.mT):
        return "a symmetric result is not exactly symmetric (a tile not mirrored)"
    return None


def _check_products(device: torch.device, dtype: torch.dtype, tiles: Tiles) -> str | None:
    from .matmul_add_kernel import matmul_add_triton
    from .symmetric_kernel import symmetric_matmul_triton

    block, block_k = tiles.block_m, tiles.block_k
    m = 2 * block + 5  # three tile rows, the last partial: off-diagonal tiles to mirror, a ragged edge
    for k in (block_k + 7, 2 * block_k):  # a K tail, and K an exact multiple of the K tile
        X = _operand((2, m, k), dtype, device, seed=k)
        where = f"tiles {block}x{block}x{block_k}, k={k}"
        # syrk: X Xᵀ from X read in place for both operands, rounded to fp32 (an fp32 Gram of 16-bit X)
        got = symmetric_matmul_triton(X, X.mT, None, alpha=1.0, beta=0.0, out=None, out_dtype=torch.float32,
                                      tiles=tiles)
        problem = _within_product_bound(got, X, X.mT, None, 1.0, 0.0, True)
        if problem:
            return f"syrk ({where}): {problem}"
        # b A + c A A, in the operands' dtype, the symmetric epilogue with C read
        A = symmetric_matmul_triton(X, X.mT, None, alpha=1.0 / k, beta=0.0, out=None, out_dtype=dtype, tiles=tiles)
        got = symmetric_matmul_triton(A, A, A, alpha=2.0315, beta=-4.7750, out=None, out_dtype=dtype, tiles=tiles)
        problem = _within_product_bound(got, A, A, A, 2.0315, -4.7750, True)
        if problem:
            return f"symmetric_matmul ({where}): {problem}"
        # a X + B X: the general kernel, C read, a non-square result
        got = matmul_add_triton(A, X, X, alpha=1.0, beta=3.4445, out=None, out_dtype=dtype, tiles=tiles)
        problem = _within_product_bound(got, A, X, X, 1.0, 3.4445, False)
        if problem:
            return f"matmul_add ({where}): {problem}"
    return None


# ---------------------------------------------------------------------------- the elementwise stages


def _check_elementwise(device: torch.device) -> str | None:
    from .elementwise_kernel import apply_update_triton, momentum_nesterov_triton

    shape = (3, 37, 70)
    # a strided piece: every other column of a wider buffer
    buf = _operand((3, 37, 140), torch.float32, device, seed=1)[..., ::2]
    grad = _operand(shape, torch.bfloat16, device, seed=2)
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    buf64, grad64 = buf.double(), grad.double()
    momentum = 0.95
    momentum_nesterov_triton(buf, grad, out, momentum, True, False, update_momentum=True, dtype=torch.float32)
    new_buf = buf64 + (1 - momentum) * (grad64 - buf64)
    nesterov = grad64 + momentum * (new_buf - grad64)
    for name, got, exact, scale in (("momentum", buf, new_buf, buf64.abs() + grad64.abs()),
                                    ("Nesterov input", out, nesterov, new_buf.abs() + grad64.abs())):
        problem = _within_elementwise_bound(name, got, exact, scale)
        if problem:
            return problem

    param = _operand(shape, torch.float32, device, seed=3)
    update = _operand(shape, torch.bfloat16, device, seed=4)
    param64, update64 = param.double(), update.double()
    lr, adjusted_lr, weight_decay = 0.02, 0.1, 0.1
    apply_update_triton(param, update, 1.0 - lr * weight_decay, adjusted_lr, False)
    exact = param64 * (1 - lr * weight_decay) - adjusted_lr * update64
    return _within_elementwise_bound("weight decay and update", param, exact, param64.abs() + update64.abs())


def _within_elementwise_bound(name: str, got: Tensor, exact: Tensor, scale: Tensor) -> str | None:
    # a few fp32 operations per element, then one rounding to the stored dtype: 8 fp32 roundings of
    # the operands' size, plus the output's own rounding
    u_out = torch.finfo(got.dtype).eps / 2
    bound = u_out * exact.abs() + 8 * ACCUMULATION_ROUNDOFF * scale + u_out * torch.finfo(got.dtype).smallest_normal
    bad = (got.double() - exact).abs() > bound
    if not torch.isfinite(got).all():
        return f"{name}: non-finite entries"
    if bad.any():
        at = tuple(int(i) for i in bad.nonzero()[0])
        return f"{name}: {int(bad.sum())} of {got.numel()} entries outside the rounding bound, the first at {at}"
    return None
