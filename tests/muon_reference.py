"""Muon's first step on one matrix (or one row block of one), written out from the formulas in
float64: the reference for tests that check which matrix, block or expert a weight is
orthogonalised as (its role, its row blocks, its ``[out, in]`` view), not the code under test.

From a zero momentum buffer (torch.optim.Muon's rule, Nesterov)::

    B = (1 - mu) G                 buf.lerp_(G, 1 - mu) from zeros
    X = (1 - mu) G + mu B          G.lerp(B, mu)
    O = NS(X)                      the quintic iteration below, on X / ||X||_F (tall ones transposed)
    W' = W (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) O      adjust_lr="match_rms_adamw"
"""

from __future__ import annotations

import math

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the "fixed" table


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    a, b, c = COEFFICIENTS
    X = G.double()
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / torch.linalg.matrix_norm(X, keepdim=True).clamp_min(eps)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def first_step(W: torch.Tensor, G: torch.Tensor, lr: float, weight_decay: float, momentum: float) -> torch.Tensor:
    """``W`` [rows, cols] after one Muon step with gradient ``G``, as a matrix of its own."""
    W, G = W.double(), G.double()
    B = (1 - momentum) * G
    X = (1 - momentum) * G + momentum * B
    scale = lr * 0.2 * math.sqrt(max(W.shape[-2], W.shape[-1]))
    return W * (1 - lr * weight_decay) - scale * newton_schulz(X)
