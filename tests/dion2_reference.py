"""Single-device Dion2 and NorDion2 in float64, written from the formulas (the tests' reference).

Dion2 (Ahn, Amsel, Langford, arXiv 2512.16928) as microsoft/dion 0a059a4 runs it on one device
(``dion/dion2.py``, ``dion/nordion2.py``), for a weight ``W`` ``[..., m, n]`` (each matrix of a
batch on its own: 3-D expert stacks select per expert) with gradient ``G`` and momentum ``M``:

    M <- M + G                                        (no beta: error feedback replaces it)
    dim = rows if m <= n else columns                 (the shorter side; NorDion2: always rows)
    s   = size of dim;   k = min(s, max(1, ceil(fraction * s)))   (dion's float rounding)
    ||slice_i||_1 = sum_j |M_ij| (rows) or sum_j |M_ji| (columns)
    K   = the k slices with the largest L1 norm; equal norms: the lower index first
    U   = M[K]                                        (k x n, or m x k)
    M[K] <- ef_decay * M[K]                           (error feedback: only the chosen slices decay)
    O   = orth(U)                                     (passed in: an fp64 Newton–Schulz or polar factor)
    NorDion2 (rows): v[K] <- beta2 v[K] + (1 - beta2) mean_j O_ij^2;  Ô = O / (sqrt(v[K]) + 1e-8);
                     Ô <- Ô ||O||_F / max(||Ô||_F, 1e-8);  O <- Ô;  v of the other rows unchanged
    W   <- W (1 - lr wd)                              (every entry; cautious: W - lr wd W [W D >= 0])
    W[K] <- W[K] - adjust(lr, m, n) O                 (D: O on the chosen slices, 0 elsewhere)

    adjust: "spectral_norm" lr sqrt(m / n); "rms_norm" lr 0.2 sqrt(max(m, n)); None lr
    (the matrix's shape, not the submatrix's).

The slice norms here are ``math.fsum`` of the entries' magnitudes: the exact sum, rounded once,
so they do not depend on any summation order.  Independent of the code under test: nothing here
imports ``optimizer``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

ROWS, COLUMNS = -2, -1
NORMUON_EPS = 1e-8


def chosen_count(fraction: float, size: int) -> int:
    """k: dion's ``max(1, int(math.ceil(fraction * size)))`` (the product in floating point, as
    dion computes it: 0.07 * 100 is 7.000000000000001, so k = 8), at most ``size``."""
    return min(size, max(1, math.ceil(fraction * size)))


def selection_dim(shape, rows_only: bool = False) -> int:
    """Rows (-2) when the matrix is not tall (m <= n), else columns (-1); NorDion2: always rows."""
    m, n = shape[-2], shape[-1]
    return ROWS if rows_only or m <= n else COLUMNS


def slice_norms(matrix: torch.Tensor, dim: int) -> list[float]:
    """The exact L1 norm of every slice along ``dim`` of one matrix, rounded once (``math.fsum``)."""
    slices = matrix if dim == ROWS else matrix.T
    return [math.fsum(abs(x) for x in row) for row in slices.double().tolist()]


def choose(norms: list[float], k: int) -> list[int]:
    """The indices of the ``k`` largest norms (equal norms: the lower index first), ascending."""
    order = sorted(range(len(norms)), key=lambda i: (-norms[i], i))
    return sorted(order[:k])


def adjust(lr: float, shape, mode: str | None) -> float:
    m, n = shape[-2], shape[-1]
    if mode == "spectral_norm":
        return lr * math.sqrt(m / n)
    if mode == "rms_norm":
        return lr * 0.2 * math.sqrt(max(m, n))
    if mode is None:
        return lr
    raise ValueError(f"unknown adjust_lr {mode!r}")


def polar_factor(x: torch.Tensor) -> torch.Tensor:
    """The exact orthogonal polar factor ``U V^T`` of each matrix of ``x`` (fp64, by SVD)."""
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return u @ vh


@dataclass
class Result:
    weight: torch.Tensor
    momentum: torch.Tensor
    row_state: torch.Tensor | None
    dim: int
    chosen: list[list[int]]  # per matrix of the batch (row-major over the leading dims)
    update: torch.Tensor  # D: the orthogonalised (and normalised) chosen slices, zero elsewhere


def step(weight: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, *, fraction: float,
         ef_decay: float, lr: float, weight_decay: float, adjust_lr: str | None = "spectral_norm",
         orthogonalize: Callable[[torch.Tensor], torch.Tensor] = polar_factor,
         row_state: torch.Tensor | None = None, beta2: float | None = None, rows_only: bool | None = None,
         cautious: bool = False, maximize: bool = False,
         store: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Result:
    """One Dion2 step (NorDion2 with ``beta2`` and ``row_state`` ``[..., m, 1]``), in float64 on
    copies: the inputs are not changed.  ``store`` rounds the momentum as it is stored (e.g.
    ``lambda t: t.bfloat16().double()`` for a bf16 buffer): the sum and the decay each round once,
    and everything reads the momentum as stored."""
    if rows_only is None:
        rows_only = beta2 is not None
    W, M = weight.double().clone(), momentum.double().clone()
    G = -grad.double() if maximize else grad.double()
    M = store(M + G)
    V = None if row_state is None else row_state.double().clone()
    m, n = W.shape[-2:]
    batch = math.prod(W.shape[:-2])  # matrices in the stack (1 for a matrix; 0 for no experts)
    Wf, Mf = W.reshape(batch, m, n), M.reshape(batch, m, n)
    Vf = None if V is None else V.reshape(batch, m, 1)
    D = torch.zeros_like(Wf)
    dim = selection_dim(W.shape, rows_only)
    s = m if dim == ROWS else n
    k = chosen_count(fraction, s)
    chosen = []
    for b in range(Wf.shape[0]):
        idx = choose(slice_norms(Mf[b], dim), k) if k else []
        chosen.append(idx)
        if not idx:
            continue
        ix = torch.tensor(idx)
        U = Mf[b][ix] if dim == ROWS else Mf[b][:, ix]
        decayed = store(ef_decay * U)
        if dim == ROWS:
            Mf[b][ix] = decayed
        else:
            Mf[b][:, ix] = decayed
        O = orthogonalize(U).double()
        if beta2 is not None:
            if dim != ROWS or Vf is None:
                raise ValueError("NorDion2 selects rows and needs the row state")
            vk = beta2 * Vf[b][ix] + (1 - beta2) * (O * O).mean(dim=-1, keepdim=True)
            hat = O / (vk.sqrt() + NORMUON_EPS)
            O = hat * torch.linalg.matrix_norm(O) / torch.linalg.matrix_norm(hat).clamp_min(NORMUON_EPS)
            Vf[b][ix] = vk
        if dim == ROWS:
            D[b][ix] = O
        else:
            D[b][:, ix] = O
    if cautious:
        W = W - lr * weight_decay * W * (W * D.reshape(W.shape) >= 0)
    else:
        W = W * (1 - lr * weight_decay)
    W = W - adjust(lr, (m, n), adjust_lr) * D.reshape(W.shape)
    return Result(W, Mf.reshape(M.shape), None if Vf is None else Vf.reshape(V.shape), dim, chosen,
                  D.reshape(W.shape))


def lion_step(weight: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, *, lr: float,
              betas: tuple[float, float], weight_decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Lion as dion's ``scalar_opts.lion_update`` defines it: ``U = sign(b1 M + (1 - b1) G)``,
    ``M <- b2 M + (1 - b2) G``, ``W <- W (1 - lr wd) - lr U`` (sign(0) = 0; lr never adjusted)."""
    b1, b2 = betas
    W, M, G = weight.double(), momentum.double(), grad.double()
    U = torch.sign(b1 * M + (1 - b1) * G)
    return W * (1 - lr * weight_decay) - lr * U, b2 * M + (1 - b2) * G
