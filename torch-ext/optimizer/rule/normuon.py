"""NorMuon's per-row normalisation of an orthogonalised update (arXiv 2510.05491; dion's
``normuon.py``), for whole matrices and for a matrix cut over the ranks of a group."""

from __future__ import annotations

import torch
from torch import Tensor

from ..newton_schulz.cut_rows import row_sums_of_squares, squares_per_row, sum_over_group


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
