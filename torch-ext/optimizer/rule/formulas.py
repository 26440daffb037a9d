"""The Muon step's elementwise formulas on local tensors (the module docstring of ``optimizer.rule``
has the whole step): the momentum, the Nesterov input, the update with decoupled (optionally
cautious) weight decay, the learning-rate adjustment per matrix shape, and the dtypes a step
stores and computes in.  Each works unchanged on any local piece of a weight."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..settings import dtype_of


def adjust_lr(lr: float, shape: Sequence[int], mode: str | None) -> float:
    """Learning rate for a matrix update of ``shape`` (the last two dims are the matrix).

    - ``"match_rms_adamw"`` (Moonlight, https://arxiv.org/abs/2502.16982): ``lr * 0.2 *
      sqrt(max(A, B))`` gives the orthogonalised update the RMS of a typical AdamW update, so
      AdamW's lr and weight decay carry over.
    - ``"original"`` (Keller Jordan): ``lr * sqrt(max(1, A / B))``.
    - ``"spectral_norm"`` (dion's Dion2 default): ``lr * sqrt(A / B)`` (no ``max(1, .)``).
    - ``None`` / ``"none"``: ``lr`` unchanged. (torch.optim.Muon reads ``None`` as "original".)
    """
    if len(shape) < 2:
        raise ValueError(f"adjust_lr needs a matrix shape [..., A, B], got {tuple(shape)}")
    A, B = int(shape[-2]), int(shape[-1])
    if mode == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    if mode == "original":
        return lr * math.sqrt(max(1.0, A / B))
    if mode == "spectral_norm":
        return lr * math.sqrt(A / B)
    if mode is None or mode == "none":
        return lr
    raise ValueError(f"adjust_lr: unknown mode {mode!r}; use 'match_rms_adamw', 'original', 'spectral_norm' or None")


def momentum_(bufs: list[Tensor], grads: list[Tensor], momentum: float, maximize: bool = False,
              dtypes: Sequence[torch.dtype] | None = None) -> list[Tensor]:
    """``B <- momentum * B + (1 - momentum) * G`` for every local piece.

    ``dtypes``: the arithmetic dtype of each buffer (None: the buffer's own).  Buffers kept in
    their arithmetic dtype take one foreach call; a narrower buffer (``momentum_dtype=bfloat16``
    for fp32 parameters) is read into the arithmetic dtype, updated there and rounded once when
    stored.  Returns the gradients as the momentum saw them (in the arithmetic dtype, negated
    when maximising): the Nesterov input (:func:`nesterov_input_`) mixes the same values in.
    """
    dtypes = [b.dtype for b in bufs] if dtypes is None else list(dtypes)
    gs = [g if g.dtype == d else g.to(d) for g, d in zip(grads, dtypes)]  # bf16 grads of fp32 params
    if maximize:
        gs = torch._foreach_neg(gs)
    same = [i for i, (b, d) in enumerate(zip(bufs, dtypes)) if b.dtype == d]
    if same:
        torch._foreach_lerp_([bufs[i] for i in same], [gs[i] for i in same], 1 - momentum)
    for i, (b, d) in enumerate(zip(bufs, dtypes)):
        if b.dtype != d:  # stored narrower than it is computed
            b.copy_(b.to(d).lerp_(gs[i], 1 - momentum))
    return gs


def nesterov_input_(out: Tensor, grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """``out`` <- what Newton–Schulz orthogonalises: ``grad.lerp(buf, momentum)`` with Nesterov
    (``(1 - mu) G + mu B``, looking one step ahead), else the momentum ``B`` itself; computed in
    the wider of ``grad``'s and ``buf``'s dtypes (a bf16 buffer is read as it is stored)."""
    if not nesterov:
        return out.copy_(buf)
    if grad.dtype != buf.dtype:  # a narrower buffer (momentum_dtype), or bf16 gradients
        wide = torch.promote_types(grad.dtype, buf.dtype)
        grad, buf = grad.to(wide), buf.to(wide)
    return torch.lerp(grad, buf, momentum, out=out)


def cautious_mask(param: Tensor, update: Tensor) -> Tensor:
    """Cautious weight decay's mask: 1 where ``param * update >= 0`` (the parameter and the step it
    takes, ``-update``, point opposite ways: decay and update agree in direction), 0 elsewhere
    (dion's ``min(sign(W U) + 1, 1)``; arXiv 2510.12402), as a float tensor (one buffer, in place)."""
    return torch.mul(param, update).ge_(0)


def apply_update_(
    param: Tensor, update: Tensor, lr: float | Tensor, adjusted_lr: float | Tensor, weight_decay: float,
    cautious: bool = False,
) -> None:
    """Decoupled weight decay with the *unadjusted* lr, then ``param -= adjusted_lr * update``.

    Weight decay uses ``lr`` (not ``adjusted_lr``) exactly as torch.optim.Muon does. ``update``
    may be in a lower precision than ``param`` (bf16 NS output); ``add_`` promotes it.  ``lr``
    may be a 0-d tensor (schedulers, compiled steps): it is used as a tensor, never read.
    ``cautious``: decay only where ``param * update >= 0`` (:func:`cautious_mask`), with
    ``update`` the direction actually applied (after NorMuon and a row block's lr factor: both
    positive scalings per row or block, so the sign is that of the orthogonalised update).
    """
    if weight_decay != 0 and cautious:  # p -= lr wd p [p u >= 0]: three passes over the piece
        mask = cautious_mask(param, update)
        if isinstance(lr, Tensor):
            param.addcmul_(param, mask.mul_(lr.to(mask.device, mask.dtype) * weight_decay), value=-1)
        else:
            param.addcmul_(param, mask, value=-lr * weight_decay)
    elif weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if isinstance(adjusted_lr, Tensor):
        param.addcmul_(update, adjusted_lr.to(param.dtype), value=-1)
    else:
        param.add_(update, alpha=-adjusted_lr)


def block_lr_factor(rows_per_block: int, full_shape: Sequence[int], mode: str | None) -> float:
    """``adjust_lr(1, [rows_per_block, in]) / adjust_lr(1, full_shape)`` (1 without adjustment)."""
    return adjust_lr(1.0, (rows_per_block, full_shape[-1]), mode) / adjust_lr(1.0, tuple(full_shape), mode)


def normuon_on(group) -> bool:
    """Whether a param group runs NorMuon (``normuon_beta2`` set)."""
    return group.get("normuon_beta2") is not None


def momentum_dtype(p: Tensor, group) -> torch.dtype:
    """Where a parameter's momentum is stored: the group's ``momentum_dtype``, else the parameter's."""
    return dtype_of(group.get("momentum_dtype")) or p.dtype


def work_dtype(p: Tensor, group) -> torch.dtype:
    """The momentum's arithmetic dtype: the wider of the parameter's and the buffer's."""
    return torch.promote_types(p.dtype, momentum_dtype(p, group))


def row_state_dtype(arithmetic: torch.dtype) -> torch.dtype:
    """NorMuon's ``v``: at least fp32, and at least the momentum's arithmetic dtype (fp64 runs stay fp64)."""
    return torch.promote_types(arithmetic, torch.float32)


def encode_rows(v: Tensor, carrier: torch.dtype) -> Tensor:
    """``v`` ``[..., R, 1]`` as ``[..., R, k]`` elements of ``carrier``: its bits, so that a bf16
    wire carries fp32 state exactly (the collectives move bytes; nothing rounds them)."""
    return v if v.dtype == carrier else v.contiguous().view(carrier)


def decode_rows(rows: Tensor) -> Tensor:
    """The inverse of :func:`encode_rows`: ``[..., R, k]`` carrier elements -> ``[..., R, 1]`` state
    (a float of ``k`` carrier elements' bytes)."""
    size = rows.shape[-1] * rows.element_size()
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[size] if rows.shape[-1] > 1 else rows.dtype
    return rows if dtype == rows.dtype else rows.contiguous().view(dtype)
