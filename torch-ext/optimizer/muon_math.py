"""The elementwise parts of a Muon step: momentum, learning-rate scaling, the update itself.

These follow torch.optim.Muon (torch/optim/_muon.py) line for line so that a single-device run
of our optimizer matches it; they work unchanged on local shards and on DTensors, since every
operation is elementwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor

ADJUST_LR_MODES = ("match_rms_adamw", "original", "none", None)


def adjust_lr(lr: float, shape: Sequence[int], mode: str | None) -> float:
    """Learning rate for a matrix update of ``shape`` (the last two dims are the matrix).

    - ``"match_rms_adamw"`` (Moonlight, https://arxiv.org/abs/2502.16982): ``lr * 0.2 *
      sqrt(max(A, B))`` gives the orthogonalised update the RMS of a typical AdamW update, so
      AdamW's lr and weight decay carry over.
    - ``"original"`` (Keller Jordan): ``lr * sqrt(max(1, A / B))``.
    - ``None`` / ``"none"``: ``lr`` unchanged. (torch.optim.Muon reads ``None`` as "original".)
    """
    if len(shape) < 2:
        raise ValueError(f"adjust_lr needs a matrix shape [..., A, B], got {tuple(shape)}")
    A, B = int(shape[-2]), int(shape[-1])
    if mode == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    if mode == "original":
        return lr * math.sqrt(max(1.0, A / B))
    if mode is None or mode == "none":
        return lr
    raise ValueError(
        f"adjust_lr: unknown mode {mode!r}; use 'match_rms_adamw', 'original' or None"
    )


def muon_momentum_(buf: Tensor, grad: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Update the momentum buffer in place and return the tensor to orthogonalise.

    ``buf <- momentum * buf + (1 - momentum) * grad`` (an EMA, as in torch.optim.Muon and
    KellerJordan/Muon). With Nesterov the update looks one step ahead, ``grad.lerp(buf,
    momentum)``, a new tensor; without it the update *is* ``buf`` (same storage: do not modify
    it in place).
    """
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def apply_update_(
    param: Tensor, update: Tensor, lr: float | Tensor, adjusted_lr: float | Tensor, weight_decay: float
) -> None:
    """Decoupled weight decay with the *unadjusted* lr, then ``param -= adjusted_lr * update``.

    Weight decay uses ``lr`` (not ``adjusted_lr``) exactly as torch.optim.Muon does. ``update``
    may be in a lower precision than ``param`` (bf16 NS output); ``add_`` promotes it.  ``lr``
    may be a 0-d tensor (schedulers, compiled steps): it is used as a tensor, never read.
    """
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if isinstance(adjusted_lr, Tensor):
        param.addcmul_(update, adjusted_lr.to(param.dtype), value=-1)
    else:
        param.add_(update, alpha=-adjusted_lr)
