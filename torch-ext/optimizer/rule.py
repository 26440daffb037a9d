"""The Muon update rule, as functions of local tensors.

One Muon step for a weight ``W`` with gradient ``G`` (KellerJordan/Muon; torch.optim.Muon):

    B <- mu B + (1 - mu) G                         momentum, an EMA        every local piece
    X <- (1 - mu) G + mu B   (Nesterov)   or  B    what is orthogonalised  every local piece
    O <- NS(X)                                     Newton–Schulz           the owner, whole matrices
    v <- beta2 v + (1 - beta2) mean_j O_ij^2       NorMuon (optional)      the owner, one value per row
    O <- O / (sqrt(v) + 1e-8) * ||O||_F / ||.||_F
    W <- W (1 - lr wd) - adjust_lr(lr, shape) O    decoupled weight decay  every local piece
         (cautious: decay only where W O >= 0)
    W[rows of head h] *= gamma_h ** (1/2 or 1)     QK-clip (MuonClip)      every local piece

``maximize`` negates G first.  Newton–Schulz runs on each matrix of a 3-D expert stack
``[E, out, in]``, and on each declared row block of a fused weight (``row_blocks.py``), each
block with the learning rate adjusted for its own shape.  The variants are data of a step, not
branches of the runtime: NorMuon is part of the owner's stage (per matrix, per expert, per row
block, before a block's lr factor), its per-row state ``v`` travels with the rows of the pieces
(``row_state_into`` / the owner stage's second argument / ``apply_update``'s), cautious weight
decay is part of ``apply_update``, and a narrower momentum buffer (``momentum_dtype``) only
changes where the momentum is stored: every stage computes in the wider dtype.

Everything elementwise works unchanged on a local shard, so momentum, weight decay, the update
and QK-clip run where the pieces are; only Newton–Schulz needs whole matrices.  The parallel
runtime (``parallel/execution/pipeline.py``) moves the pieces and calls a :class:`MatrixStep`'s stages:
``input_into`` (a piece of X), ``row_state_into`` (its rows of v), ``orthogonalize`` (the owner's
stage), ``apply_update`` and ``scale_rows``.  The single-device path and the gather baseline call
the same stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .kernels import elementwise
from .momentum_progress import MomentumProgress
from .newton_schulz import default_compute_dtype, ns_io_dtype, zeropower_via_newtonschulz
from .parallel.split_newton_schulz import (row_sums_of_squares, split_zeropower_via_newtonschulz, squares_per_row,
                                           sum_over_group)
from .qk_clip.step import apply_clip_
from .row_blocks import RowBlocks, compile_blocks
from .settings import dtype_of

ADJUST_LR_MODES = ("match_rms_adamw", "original", "none", None)


# ---------------------------------------------------------------------------- the formulas


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


def fused_elementwise(ns_kernels: str, *pieces: Tensor) -> bool:
    """Whether a parameter's elementwise stages (momentum, Nesterov input, weight decay and update)
    run on the fused Triton kernels (kernels/elementwise.py): where its group's ``ns_kernels``
    resolves to the kernels on the pieces' device, and the pieces (parameter, momentum, gradient)
    are 16/32-bit floats of at most 3 dims.  Elsewhere (``"torch"``, ``"auto"`` off CUDA, fp64,
    more dims) the torch formulas above run, unchanged.  ``"triton"`` where the kernels cannot run
    was refused before the step (``ns_kernels.kernels_problem``)."""
    if ns_kernels == "torch":
        return False
    if not elementwise.takes(*(t.dtype for t in pieces)) or any(t.ndim > elementwise.MAX_DIMS for t in pieces):
        return False
    return elementwise.resolve(ns_kernels, pieces[0].device) == "triton"


# ---------------------------------------------------------------------------- NorMuon

NORMUON_EPS = 1e-8  # dion's _normuon_normalization_core: 1e-8 in the denominator and as the norm floor


def normuon_normalize(o: Tensor, v: Tensor, beta2: float,
                      out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """NorMuon's normalisation of orthogonalised matrices ``o`` ``[..., R, C]`` (each matrix of
    the batch on its own) with their per-row second moments ``v`` ``[..., R, 1]``:

        v <- beta2 v + (1 - beta2) mean_j(O_ij^2)
        Ô = O / (sqrt(v) + 1e-8);   Ô <- Ô ||O||_F / max(||Ô||_F, 1e-8)

    computed in ``v``'s dtype (fp32 state).  Returns ``(Ô, v_new)``, Ô in ``out_dtype`` (default
    ``v``'s: the update's dtype, rounded once) (dion ``normuon.py``; arXiv 2510.05491).

    Both norms come from the row sums of squares, ``||O||^2 = sum_i s_i`` and ``||Ô||^2 = sum_i
    s_i / d_i^2``, as :func:`normuon_normalize_split` takes them, and Ô is O times one factor per
    row: two passes over O (the row sums, then the scaled copy) where the formula as written takes
    seven over wide copies (~6 B per entry of a bf16 O instead of ~48: on a GPU the difference is
    NorMuon's extra time).
    """
    # Contiguous: a reduction's rounding depends on the memory layout (a tall matrix's Newton–Schulz
    # result is a transposed view), and every path (local, owner, gather) must round alike.
    o = o.contiguous()
    sums = torch.linalg.vector_norm(o, dim=-1, dtype=v.dtype).square()  # [..., R]
    v, denom, norms2 = _normuon_statistics(sums, v, beta2, o.shape[-1])
    scale = _normuon_scale(norms2)
    hat = torch.empty(o.shape, dtype=out_dtype or v.dtype, device=o.device)
    torch.mul(o, scale[..., None, None] / denom, out=hat)  # in v's dtype, rounded once into hat's
    return hat, v


def normuon_normalize_split(o: Tensor, v: Tensor, beta2: float, group, rows_whole: bool,
                            columns: int) -> tuple[Tensor, Tensor]:
    """:func:`normuon_normalize` of a matrix cut over ``group`` (``ns_split``), from this rank's
    block ``o`` ``[..., r, c]`` of O (the parameter's orientation) and its rows of ``v``
    ``[..., r, 1]``, with the whole matrix's statistics (each matrix of a batch on its own):

    - a wide matrix cut along its columns (``rows_whole`` False: every member holds every row):
      one all-reduce of the ``r`` row sums of squares (``row_sums_of_squares``); every member
      then computes the same ``v`` of every row, ``||O||^2`` as the sum of the row sums and
      ``||Ô||^2 = sum_i rowsum_i / (sqrt(v_i) + 1e-8)^2``, with no second collective;
    - a tall matrix cut along its rows (``rows_whole``): the row sums and ``v`` are local, and
      ``||O||^2`` and ``||Ô||^2`` take one all-reduce of two numbers per matrix.

    ``columns``: the whole matrix's column count (the mean's divisor).  Returns ``(Ô block,
    v_new)`` in ``v``'s dtype.  Collective on ``group``; no host synchronisation."""
    o = o.to(v.dtype).contiguous()
    # every row's sum of squares over the whole matrix's columns: local when the block holds whole
    # rows, else the members' partial sums added up (one all-reduce of r numbers)
    sums = squares_per_row(o) if rows_whole else row_sums_of_squares(o, group, rows_whole=False)[0]
    v, denom, norms2 = _normuon_statistics(sums, v, beta2, columns)
    if rows_whole:  # over the members' rows: one all-reduce of two numbers per matrix
        sum_over_group(norms2, group)
    hat = o / denom
    return hat * _normuon_scale(norms2)[..., None, None].to(hat.dtype), v


def _normuon_statistics(sums: Tensor, v: Tensor, beta2: float, columns: int) -> tuple[Tensor, Tensor, Tensor]:
    """From the row sums of squares ``sums`` ``[..., R]`` over ``columns`` columns: the new ``v``
    ``[..., R, 1]``, the rows' denominators ``sqrt(v) + eps`` and ``[||O||², ||Ô||²]`` ``[..., 2]``
    (each matrix of the batch on its own; a cut matrix's are partial sums until summed over its
    group)."""
    v = torch.lerp(v, (sums / columns).unsqueeze(-1), 1 - beta2)
    denom = v.sqrt() + NORMUON_EPS
    norms2 = torch.stack([sums.sum(-1), (sums / denom.squeeze(-1).square()).sum(-1)], dim=-1)
    return v, denom, norms2


def _normuon_scale(norms2: Tensor) -> Tensor:
    """The Frobenius rescale ``||O|| / max(||Ô||, eps)`` from ``[||O||², ||Ô||²]``."""
    return norms2[..., 0].sqrt() / norms2[..., 1].sqrt().clamp_min(NORMUON_EPS)


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


# ---------------------------------------------------------------------------- the owner's stage


@dataclass(frozen=True)
class NewtonSchulz:
    """How a group's matrices are orthogonalised (``zeropower_via_newtonschulz``'s arguments)."""

    ns_steps: int
    coefficients: object  # a table name (so NS applies the table's own norm safety factor), or triples
    method: str
    eps: float
    compute_dtype: torch.dtype | None
    kernels: str = "auto"  # what runs the products (``optimizer.ns_kernels``)

    def __call__(self, x: Tensor) -> Tensor:
        return zeropower_via_newtonschulz(x, ns_steps=self.ns_steps, coefficients=self.coefficients, eps=self.eps,
                                          compute_dtype=self.compute_dtype, method=self.method, kernels=self.kernels)

    def split(self, x: Tensor, widths: Sequence[int], group) -> Tensor:
        """This rank's column block of ``self(whole)``, the matrix's column blocks (``widths``, in
        group-rank order) spread over ``group`` (``x`` short side first; collective)."""
        return split_zeropower_via_newtonschulz(x, widths, group, ns_steps=self.ns_steps,
                                                coefficients=self.coefficients, eps=self.eps,
                                                compute_dtype=self.compute_dtype, method=self.method,
                                                kernels=self.kernels)


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
    return _in_blocks(matrix, blocks, orthogonalize, adjust_lr_mode, None, None)[0]


def _in_blocks(matrix: Tensor, blocks, orthogonalize, adjust_lr_mode, v: Tensor | None, beta2: float | None):
    """:func:`orthogonalize_in_blocks`; with NorMuon (``v`` ``[..., R, 1]``, ``beta2``) each block is
    normalised with its rows of ``v`` after Newton–Schulz and *before* its lr factor (so ``v`` holds
    the statistics of the orthogonalised block itself, as a separate parameter's would).
    Returns ``(update, v_new)``."""
    if matrix.ndim < 2:
        raise ValueError(f"orthogonalize_in_blocks: expected a matrix [..., R, C], got shape {tuple(matrix.shape)}")
    lead, (num_rows, cols) = tuple(matrix.shape[:-2]), matrix.shape[-2:]
    if not isinstance(blocks, RowBlocks):
        blocks = compile_blocks(blocks, num_rows)
    if blocks.num_rows != num_rows:
        raise ValueError(f"orthogonalize_in_blocks: blocks cover {blocks.num_rows} rows, the matrix has {num_rows}")
    out = v_out = None
    for cls, rows in zip(blocks.classes, blocks.class_rows(matrix.device)):
        x = matrix.index_select(-2, rows).view(*lead, cls.count, cls.rows_per_block, cols)
        y = orthogonalize(x.reshape(-1, cls.rows_per_block, cols))
        if v is not None:
            vb = v.index_select(-2, rows).reshape(-1, cls.rows_per_block, 1)
            # the update in Newton–Schulz's dtype, as every path sends it
            y, vb = normuon_normalize(y, vb, beta2, y.dtype)
            if v_out is None:
                v_out = torch.empty_like(v)
            v_out.index_copy_(v.ndim - 2, rows, vb.reshape(*lead, -1, 1))
        factor = block_lr_factor(cls.rows_per_block, (num_rows, cols), adjust_lr_mode)
        if factor != 1.0:
            y = y * factor
        if out is None:
            out = torch.empty(matrix.shape, dtype=y.dtype, device=matrix.device)
        out.index_copy_(matrix.ndim - 2, rows, y.reshape(*lead, -1, cols))
    return out, v_out


@dataclass(frozen=True)
class OwnerStage:
    """The owner's stage of a parameter: Newton–Schulz of whole matrices (a batch of them: its
    experts, or several parameters of one group), per row block when the weight has blocks, then
    NorMuon's normalisation when ``normuon_beta2`` is set.

    ``stage(x, rows)`` returns ``(update, rows_new)``: ``rows`` is NorMuon's ``v`` of the same
    matrices as ``[..., R, k]`` elements of a buffer (:func:`encode_rows`), and ``rows_new`` the
    updated ``v`` in the same form (None without NorMuon).  The normalisation computes in ``v``'s
    dtype (fp32) and the update is returned in Newton–Schulz's dtype, as Muon's is: with a bf16
    Newton–Schulz every path (local, parallel, gather) applies the same bf16-rounded update.
    """

    newton_schulz: Callable[[Tensor], Tensor]
    blocks: RowBlocks | None = None
    adjust_lr_mode: str | None = None
    normuon_beta2: float | None = None

    def __call__(self, x: Tensor, rows: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        beta2 = self.normuon_beta2
        if beta2 is not None and rows is None:
            raise ValueError("OwnerStage: NorMuon needs the rows of v with the matrices")
        v = decode_rows(rows) if beta2 is not None else None
        if self.blocks is not None:
            # x: one matrix, or a batch of this one parameter's matrices (its experts, split alike)
            out, v = _in_blocks(x, self.blocks, self.newton_schulz, self.adjust_lr_mode, v, beta2)
        else:
            out = self.newton_schulz(x)
            if v is not None:
                # the update in Newton–Schulz's dtype, as every path sends it
                out, v = normuon_normalize(out, v, beta2, out.dtype)
        return out, (None if v is None else encode_rows(v, rows.dtype))

    def split(self, x: Tensor, widths: Sequence[int], group, rows: Tensor | None = None,
              transpose: bool = False) -> tuple[Tensor, Tensor | None]:
        """This rank's block of what ``self(whole, rows)`` returns for a matrix cut over ``group``:
        ``x`` its column block short side first (``transpose``: the transpose of a row block of
        a tall matrix), ``widths`` every member's block width in group-rank order, ``rows`` this
        block's rows of v (:func:`encode_rows`; NorMuon only).  Newton–Schulz of the block
        (``NewtonSchulz.split``), then NorMuon's normalisation with the whole matrix's statistics
        (:func:`normuon_normalize_split`).  Returns ``(update block in x's orientation, new rows
        of v or None)``.  Units with row blocks are never cut (their blocks are orthogonalised
        apart).  Collective on ``group``."""
        if self.blocks is not None:
            raise AssertionError("OwnerStage.split: a unit with row blocks is never cut")
        y = self.newton_schulz.split(x, widths, group)
        beta2 = self.normuon_beta2
        if beta2 is None:
            return y, None
        if rows is None:
            raise ValueError("OwnerStage.split: NorMuon needs the rows of v with the block")
        o = y.mT if transpose else y  # the parameter's orientation: v has one value per row
        hat, v = normuon_normalize_split(o, decode_rows(rows), beta2, group, rows_whole=transpose,
                                         columns=o.shape[-1] if transpose else sum(widths))
        hat = hat.to(y.dtype)  # the update in Newton–Schulz's dtype, as every path sends it
        return (hat.mT if transpose else hat), encode_rows(v, rows.dtype)


# ---------------------------------------------------------------------------- one parameter's step


@dataclass(eq=False)
class MatrixStep:
    """One Muon parameter's local tensors and this step's hyper-parameters: the stages the
    runtime calls (see the module docstring).  ``grad`` is the gradient as the momentum saw it
    (:func:`momentum_`'s return, in the arithmetic dtype), ``buf`` the momentum (in its storage
    dtype) already updated this step, or, fused, updated as the input is formed (``pending``),
    ``row_state`` NorMuon's ``v`` for the local rows (``[..., local rows, 1]``; None without
    NorMuon)."""

    param: Tensor  # local piece, updated in place
    grad: Tensor
    buf: Tensor
    momentum: float
    nesterov: bool
    lr: float | Tensor
    adjusted_lr: float | Tensor
    weight_decay: float
    orthogonalize: OwnerStage  # the owner's stage: (x, rows) -> (update, rows)
    clip: tuple[Tensor, Tensor] | None = None  # QK-clip: (scale table, table slot of every local row)
    row_state: Tensor | None = None  # NorMuon's v of the local rows
    cautious: bool = False  # cautious weight decay
    # The elementwise stages on the fused Triton kernels (kernels/elementwise.py; ``ns_kernels``
    # resolved to Triton for this piece, :func:`fused_elementwise`): then ``grad`` is the gradient
    # as stored (not negated, not converted), ``maximize`` says its sign, and ``buf`` is updated
    # by the kernels: in the pass that forms each region's input (``pending`` says which parts
    # are not yet), the rest by :meth:`finish_momentum` after the pipeline.  False: the torch
    # formulas above, unchanged (``buf`` updated before the step is built).
    fused: bool = False
    maximize: bool = False
    pending: MomentumProgress | None = None  # fused: this step's momentum not yet applied everywhere

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype a piece of X is formed in where it is stacked locally: the momentum's
        arithmetic dtype (never a narrower storage dtype of the buffer)."""
        if self.fused:  # grad as stored (bf16 grads of fp32 params): the parameter's dtype is the arithmetic one
            return torch.promote_types(self.param.dtype, self.buf.dtype)
        return torch.promote_types(self.grad.dtype, self.buf.dtype)

    @property
    def stack_dtype(self) -> torch.dtype:
        """The dtype a unit orthogonalised where it is (held whole) is stacked in: what
        Newton–Schulz reads (``ns_io_dtype``: the compute dtype, bf16 for an fp16 run) when the
        compute dtype is narrower than :attr:`input_dtype` (bf16 on CUDA for fp32 momentum), else
        :attr:`input_dtype`.  The input is formed in the arithmetic dtype and rounded
        once as it is stored: exactly the cast Newton–Schulz would do first (``_normalised``), as a
        sharded piece's wire dtype does, without writing and re-reading a wide copy."""
        ns = getattr(self.orthogonalize, "newton_schulz", None)
        compute = getattr(ns, "compute_dtype", None) or default_compute_dtype(self.param.device)
        wide = self.input_dtype
        return ns_io_dtype(wide, compute) if compute.itemsize < wide.itemsize else wide

    @property
    def row_bytes(self) -> int:
        """Bytes of state that travel with each row of a piece (NorMuon's v; 0: none)."""
        return 0 if self.row_state is None else self.row_state.element_size()

    @property
    def batch_key(self) -> object:
        """Steps with the same key (and shape) are orthogonalised in one batched call."""
        return id(self.orthogonalize)

    @property
    def scales_rows(self) -> bool:
        return self.clip is not None

    def orthogonalize_split(self, x: Tensor, widths: Sequence[int], group, rows: Tensor | None = None,
                            transpose: bool = False) -> tuple[Tensor, Tensor | None]:
        """The owner's stage for one block of a matrix cut over ``group`` (``ns_split``): ``x`` is
        this rank's column block, short side first (the runtime transposes a tall matrix's row
        block: ``transpose``), ``widths`` every member's block width in group-rank order, ``rows``
        the block's rows of v (NorMuon).  Returns this rank's block of what :attr:`orthogonalize`
        returns for the whole matrix, and the block's new rows of v (None without NorMuon).
        Collective on ``group``.

        NorMuon's per-row mean of O*O and per-matrix Frobenius rescale need the whole matrix:
        ``OwnerStage.split`` takes them from one all-reduce after the split call (of the ``r``
        row sums for a wide matrix cut by columns, of two numbers per matrix for a tall one cut
        by rows; :func:`normuon_normalize_split`), and v's rows travel with the blocks as they
        do with whole units."""
        return self.orthogonalize.split(x, widths, group, rows, transpose)

    def input_into(self, out: Tensor, region: tuple = ()) -> None:
        """``out`` <- the region's Newton–Schulz input (:func:`nesterov_input_`).  Fused, the
        region's momentum is updated in the same pass where none of it is yet (reads grad and
        buf, writes buf and out), after a momentum-only pass over whatever else must be brought
        up to date first (``momentum_progress.py``): every entry of buf is updated exactly once,
        and every input is formed from buf as this step stores it."""
        if self.fused:
            catch_up, fuse = self.pending.claim(region) if self.pending is not None else ([], False)
            for part in catch_up:
                self._momentum_only(part)
            elementwise.momentum_nesterov_(_region(self.buf, region), _region(self.grad, region), out, self.momentum,
                                           self.nesterov, self.maximize, update_momentum=fuse,
                                           dtype=self.input_dtype, backend="triton")
            return
        nesterov_input_(out, _region(self.grad, region), _region(self.buf, region), self.momentum, self.nesterov)

    def finish_momentum(self) -> None:
        """The momentum of every part of the piece whose input this rank never formed this step
        (a unit owned in another replica, nothing to send), one momentum-only pass each; a no-op
        on the torch formulas (their momentum ran before the step was built) and once done."""
        if self.pending is not None:
            for part in self.pending.finish():
                self._momentum_only(part)

    def _momentum_only(self, region: tuple) -> None:
        buf = _region(self.buf, region)
        if buf.numel():
            elementwise.momentum_nesterov_(buf, _region(self.grad, region), None, self.momentum, self.nesterov,
                                           self.maximize, dtype=self.input_dtype, backend="triton")

    def row_state_into(self, out: Tensor, region: tuple = ()) -> None:
        """``out`` ``[..., rows, k]`` <- the piece's rows of v, as ``out``'s dtype carries them."""
        out.copy_(encode_rows(_region(self.row_state, self._rows_region(region)), out.dtype))

    def apply_update(self, region: tuple, update: Tensor, rows: Tensor | None = None) -> None:
        """Weight decay and the update of the piece; with NorMuon, store its rows of the new v."""
        if rows is not None and self.row_state is not None:
            _region(self.row_state, self._rows_region(region)).copy_(decode_rows(rows))
        if self.fused:  # one pass: reads param and update, writes param
            elementwise.apply_update_(_region(self.param, region), update, self.lr, self.adjusted_lr,
                                      self.weight_decay, self.cautious, backend="triton")
            return
        apply_update_(_region(self.param, region), update, self.lr, self.adjusted_lr, self.weight_decay,
                      self.cautious)

    def _rows_region(self, region: tuple) -> tuple:
        """The part of v (``[..., rows, 1]``) holding a region's rows: the region without its
        column slice (a block of a matrix cut along its columns holds some columns of its rows)."""
        return region[: self.row_state.ndim - 1]

    def scale_rows(self) -> None:
        """QK-clip: scale each local row by its head's factor (2-D weights: one region, the whole piece)."""
        apply_clip_(self.param, *self.clip)


def _region(t: Tensor, region: tuple) -> Tensor:
    return t[region] if region else t
