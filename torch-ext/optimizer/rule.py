"""The Muon update rule, as functions of local tensors.

One Muon step for a weight ``W`` with gradient ``G`` (KellerJordan/Muon; torch.optim.Muon):

    B <- mu B + (1 - mu) G                         momentum, an EMA        every local piece
    X <- (1 - mu) G + mu B   (Nesterov)   or  B    what is orthogonalised  every local piece
    O <- NS(X)                                     Newton–Schulz           the owner, whole matrices
    W <- W (1 - lr wd) - adjust_lr(lr, shape) O    decoupled weight decay  every local piece
    W[rows of head h] *= gamma_h ** (1/2 or 1)     QK-clip (MuonClip)      every local piece

``maximize`` negates G first.  Newton–Schulz runs on each matrix of a 3-D expert stack
``[E, out, in]``, and on each declared row block of a fused weight (``row_blocks.py``), each
block with the learning rate adjusted for its own shape.

Everything elementwise works unchanged on a local shard, so momentum, weight decay, the update
and QK-clip run where the pieces are; only Newton–Schulz needs whole matrices.  The parallel
runtime (``parallel/runtime.py``) moves the pieces and calls a :class:`MatrixStep`'s stages:
``input_into`` (a piece of X), ``orthogonalize`` (the owner's stage), ``apply_update`` and
``scale_rows``.  The single-device path and the gather baseline call the same stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .newton_schulz import zeropower_via_newtonschulz
from .parallel.split_newton_schulz import split_zeropower_via_newtonschulz
from .qk_clip.step import apply_clip_
from .row_blocks import RowBlocks, compile_blocks

ADJUST_LR_MODES = ("match_rms_adamw", "original", "none", None)


# ---------------------------------------------------------------------------- the formulas


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


def momentum_(bufs: list[Tensor], grads: list[Tensor], momentum: float, maximize: bool = False) -> list[Tensor]:
    """``B <- momentum * B + (1 - momentum) * G`` for every local piece (one foreach call).

    Returns the gradients as the momentum saw them (in the buffer's dtype, negated when
    maximising): the Nesterov input (:func:`nesterov_input_`) mixes the same values in.
    """
    gs = [g if g.dtype == b.dtype else g.to(b.dtype) for g, b in zip(grads, bufs)]  # bf16 grads of fp32 params
    if maximize:
        gs = torch._foreach_neg(gs)
    torch._foreach_lerp_(bufs, gs, 1 - momentum)
    return gs


def nesterov_input_(out: Tensor, grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """``out`` <- what Newton–Schulz orthogonalises: ``grad.lerp(buf, momentum)`` with Nesterov
    (``(1 - mu) G + mu B``, looking one step ahead), else the momentum ``B`` itself."""
    if not nesterov:
        return out.copy_(buf)
    if grad.dtype != buf.dtype:  # e.g. bf16 gradients of fp32 parameters
        grad = grad.to(buf.dtype)
    return torch.lerp(grad, buf, momentum, out=out)


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


# ---------------------------------------------------------------------------- the owner's stage


@dataclass(frozen=True)
class NewtonSchulz:
    """How a group's matrices are orthogonalised (``zeropower_via_newtonschulz``'s arguments)."""

    ns_steps: int
    coefficients: object  # a table name (so NS applies the table's own norm safety factor), or triples
    method: str
    eps: float
    compute_dtype: torch.dtype | None

    def __call__(self, x: Tensor) -> Tensor:
        return zeropower_via_newtonschulz(x, ns_steps=self.ns_steps, coefficients=self.coefficients, eps=self.eps,
                                          compute_dtype=self.compute_dtype, method=self.method)

    def split(self, x: Tensor, widths: Sequence[int], group) -> Tensor:
        """This rank's column block of ``self(whole)``, the matrix's column blocks (``widths``, in
        group-rank order) spread over ``group`` (``x`` short side first; collective)."""
        return split_zeropower_via_newtonschulz(x, widths, group, ns_steps=self.ns_steps,
                                                coefficients=self.coefficients, eps=self.eps,
                                                compute_dtype=self.compute_dtype, method=self.method)


def block_lr_factor(rows_per_block: int, full_shape: Sequence[int], mode: str | None) -> float:
    """``adjust_lr(1, [rows_per_block, in]) / adjust_lr(1, full_shape)`` (1 without adjustment)."""
    return adjust_lr(1.0, (rows_per_block, full_shape[-1]), mode) / adjust_lr(1.0, tuple(full_shape), mode)


def orthogonalize_in_blocks(
    matrix: Tensor,
    blocks: RowBlocks | Sequence,
    orthogonalize: Callable[[Tensor], Tensor],
    *,
    adjust_lr_mode: str | None = None,
) -> Tensor:
    """Orthogonalise each row block of a ``[R, C]`` matrix as its own matrix; same-shape blocks batched.

    ``matrix`` may also be a batch ``[..., R, C]`` of matrices split alike (stacked experts): every
    matrix's blocks go into the same batched calls.  ``orthogonalize`` takes ``[batch, rows, cols]``
    (``zeropower_via_newtonschulz`` does).  With ``adjust_lr_mode`` every block's result is
    multiplied by :func:`block_lr_factor`, so that the caller's usual ``param -= adjust_lr(lr,
    full_shape) * update`` gives each block its own adjusted lr.  Returns a tensor of ``matrix``'s
    shape in ``orthogonalize``'s output dtype.
    """
    if matrix.ndim < 2:
        raise ValueError(f"orthogonalize_in_blocks: expected a matrix [..., R, C], got shape {tuple(matrix.shape)}")
    lead, (num_rows, cols) = tuple(matrix.shape[:-2]), matrix.shape[-2:]
    if not isinstance(blocks, RowBlocks):
        blocks = compile_blocks(blocks, num_rows)
    if blocks.num_rows != num_rows:
        raise ValueError(f"orthogonalize_in_blocks: blocks cover {blocks.num_rows} rows, the matrix has {num_rows}")
    out = None
    for cls, rows in zip(blocks.classes, blocks.class_rows(matrix.device)):
        x = matrix.index_select(-2, rows).view(*lead, cls.count, cls.rows_per_block, cols)
        y = orthogonalize(x.reshape(-1, cls.rows_per_block, cols))
        factor = block_lr_factor(cls.rows_per_block, (num_rows, cols), adjust_lr_mode)
        if factor != 1.0:
            y = y * factor
        if out is None:
            out = torch.empty(matrix.shape, dtype=y.dtype, device=matrix.device)
        out.index_copy_(matrix.ndim - 2, rows, y.reshape(*lead, -1, cols))
    return out


@dataclass(frozen=True)
class InBlocks:
    """The owner's stage for a weight with row blocks: each block orthogonalised on its own."""

    orthogonalize: Callable[[Tensor], Tensor]
    blocks: RowBlocks
    adjust_lr_mode: str | None

    def __call__(self, x: Tensor) -> Tensor:
        # x: one matrix, or a batch of this one parameter's matrices (its experts, split alike)
        return orthogonalize_in_blocks(x, self.blocks, self.orthogonalize, adjust_lr_mode=self.adjust_lr_mode)


# ---------------------------------------------------------------------------- one parameter's step


@dataclass(eq=False)
class MatrixStep:
    """One Muon parameter's local tensors and this step's hyper-parameters: the stages the
    runtime calls (see the module docstring).  ``grad`` is the gradient as the momentum saw it
    (:func:`momentum_`'s return), ``buf`` the momentum already updated this step."""

    param: Tensor  # local piece, updated in place
    grad: Tensor
    buf: Tensor
    momentum: float
    nesterov: bool
    lr: float | Tensor
    adjusted_lr: float | Tensor
    weight_decay: float
    orthogonalize: Callable[[Tensor], Tensor]  # the owner's stage: NewtonSchulz or InBlocks
    clip: tuple[Tensor, Tensor] | None = None  # QK-clip: (scale table, table slot of every local row)

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype a piece of X is formed in where it is stacked locally."""
        return self.buf.dtype

    @property
    def batch_key(self) -> object:
        """Steps with the same key (and shape) are orthogonalised in one batched call."""
        return id(self.orthogonalize)

    @property
    def scales_rows(self) -> bool:
        return self.clip is not None

    def orthogonalize_split(self, x: Tensor, widths: Sequence[int], group) -> Tensor:
        """The owner's stage for one block of a matrix cut over ``group`` (``ns_split``): ``x`` is
        this rank's column block, short side first (the runtime transposes a tall matrix's row
        block), ``widths`` every member's block width in group-rank order.  Returns this rank's
        block of what :attr:`orthogonalize` returns for the whole matrix.  Collective on ``group``.

        A post-processing of O that needs whole rows (NorMuon's per-row mean of O*O, then a
        per-matrix Frobenius rescale) hooks in here, after the split call:
        ``split_newton_schulz.row_sums_of_squares(block, group, rows_whole)`` gives every row's
        sum over the whole matrix and the squared Frobenius norm with one all-reduce: of ``rows``
        numbers for a wide matrix cut by columns (every member holds every row), of one number for
        a tall one (its row blocks hold whole rows: the row sums are local); every member then
        computes the same row statistics."""
        return self.orthogonalize.split(x, widths, group)

    def input_into(self, out: Tensor, region: tuple = ()) -> None:
        nesterov_input_(out, _region(self.grad, region), _region(self.buf, region), self.momentum, self.nesterov)

    def apply_update(self, region: tuple, update: Tensor) -> None:
        apply_update_(_region(self.param, region), update, self.lr, self.adjusted_lr, self.weight_decay)

    def scale_rows(self) -> None:
        """QK-clip: scale each local row by its head's factor (2-D weights: one region, the whole piece)."""
        apply_clip_(self.param, *self.clip)


def _region(t: Tensor, region: tuple) -> Tensor:
    return t[region] if region else t
