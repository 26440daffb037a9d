"""Row statistics of an orthogonalised matrix cut over a group (what NorMuon's normalisation
needs of the whole matrix): each member's sums, added over the group by one all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..parallel.planning.cut_cost import wide_dtype
from .cut import group_size_rank


def squares_per_row(block: Tensor) -> Tensor:
    """Each row's sum of squares of ``block`` ``[..., r, c]``: ``[..., r]`` in fp32 (or wider)."""
    return torch.linalg.vector_norm(block, dim=-1, dtype=wide_dtype(block.dtype, block.dtype)).square()


def sum_over_group(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``t`` summed over ``group``'s members, in place (one all-reduce; nothing alone). Collective."""
    k, _ = group_size_rank(group)
    if k > 1:
        dist.all_reduce(t, group=group)
    return t


def row_sums_of_squares(block: Tensor, group: dist.ProcessGroup | None, rows_whole: bool) -> tuple[Tensor, Tensor]:
    """For a post-processing that needs whole rows of the orthogonalised matrix (NorMuon's per-row
    ``mean(O*O, dim=-1)`` and its per-matrix Frobenius rescale) when O is split over ``group``.

    ``block``: this rank's block of O in the *parameter's* orientation ``[..., r, c]``.
    ``rows_whole``: the block holds whole rows (a tall matrix cut along its rows): the row sums
    are local, and only the squared Frobenius norm needs one all-reduce of one number per matrix.
    Otherwise (a wide matrix cut along its columns, every member holding every row) the members'
    row sums add up: one all-reduce of ``[..., r]`` numbers, and the norm follows from them.
    Returns (sum over the whole matrix's columns of each row's squares ``[..., r]``, squared
    Frobenius norm ``[...]``), in fp32 (or wider), the same on every member. Collective on
    ``group``; no host synchronisation.  (NorMuon on a row-cut block needs a second number per
    matrix, the normalised matrix's norm, which depends on the local rows' v:
    ``rule.normuon_normalize_split`` sends both in one :func:`sum_over_group` instead.)"""
    sums = squares_per_row(block)
    if rows_whole:
        return sums, sum_over_group(sums.sum(-1), group)
    sum_over_group(sums, group)
    return sums, sums.sum(-1)
