"""The owner's stage of a Muon parameter: Newton–Schulz of whole matrices (or of each declared row
block as its own matrix, with its own lr factor), then NorMuon's normalisation; and the same for
a matrix cut over the ranks of a group (``ns_split``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..row_blocks import RowBlocks, compile_blocks
from .formulas import block_lr_factor, decode_rows, encode_rows
from .normuon import normuon_normalize, normuon_normalize_split


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
