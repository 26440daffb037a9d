"""Dion2 and NorDion2's update rule, as pure functions of local tensors (``dion2/step.py`` runs it in ``Muon.step``).

Dion2 (Ahn, Amsel, Langford, arXiv 2512.16928; microsoft/dion 0a059a4 ``dion/dion2.py``)
orthogonalises a fraction of each matrix: for a weight ``W`` ``[..., m, n]`` (each matrix of a
batch on its own, so a 3-D expert stack selects per expert) with gradient ``G`` and momentum ``M``:

    M <- M + G                                   the momentum is a sum; error feedback bounds it
    dim = rows if m <= n else columns            the shorter side (NorDion2: always rows), from the
                                                 matrix's global shape, never from its placement
    k   = min(s, max(1, ceil(fraction * s)))     s the size of dim; dion's float rounding
    K   = the k slices of largest L1 norm        norms accumulated in float64; equal norms: the
                                                 lower index first (see :func:`choose`)
    U   = M[K];  M[K] <- ef_decay M[K]           the chosen slices' momentum decays, the rest stays
    O   = orth(U)                                Newton–Schulz of the k-slice submatrix only
    NorDion2: NorMuon's normalisation of O with v[K] (``rule.normuon_normalize``), v[K] updated
    W   <- W (1 - lr wd);  W[K] <- W[K] - adjusted_lr O      decoupled weight decay everywhere,
                                                 the update on the chosen slices only

The functions work on a whole matrix or on a rank's piece of one: :func:`partial_slice_norms`
of a piece are summed over the pieces that split a slice (:func:`sum_partials`, in member order),
:func:`choose` then picks the same slices on every rank.  ``docs/dion2.md`` is the design of the
distributed step; :func:`dion2_step_` is the single-device step, composed from the parts, and
:func:`dion2_blocks_step_` the same per row block (``muon_row_blocks``: each block its own matrix).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..rule import apply_update_, normuon_normalize
from ..settings.checks import check_ef_decay, check_fraction  # noqa: F401 - declared with the options; re-exported

ROWS, COLUMNS = -2, -1
#: The selection's arithmetic: norms are sums of magnitudes accumulated in float64, so that
#: pieces summed in another order rarely move a norm by more than one float64 rounding.
NORM_DTYPE = torch.float64

# ---------------------------------------------------------------------------- checks


def check_matrix(name: str, shape: Sequence[int]) -> None:
    """A Dion2 parameter is a matrix, or a stack of them (``[E, m, n]``: experts)."""
    if len(shape) < 2:
        raise ValueError(f"Dion2: parameter `{name}` has shape {tuple(shape)}; Dion2 updates matrices [..., m, n] "
                         "(2-D weights, 3-D expert stacks): put it in an AdamW group (use_muon=False, or dion's "
                         "algorithm='adamw')")


# ---------------------------------------------------------------------------- the selection


def selection_dim(shape: Sequence[int], rows_only: bool = False) -> int:
    """The dim whose slices are chosen: rows (-2) when ``m <= n``, else columns (-1), from the
    matrix's global shape ``[..., m, n]``; ``rows_only`` (NorDion2, whose state is per row): rows."""
    if len(shape) < 2:
        raise ValueError(f"selection_dim: expected a matrix shape [..., m, n], got {tuple(shape)}")
    return ROWS if rows_only or shape[-2] <= shape[-1] else COLUMNS


def chosen_count(fraction: float, size: int) -> int:
    """k for ``size`` slices: dion's ``max(1, ceil(fraction * size))`` with the product rounded to
    float64 first, exactly as dion computes it (0.07 * 100 rounds to 7.000000000000001: k = 8),
    and never more than ``size`` (0 for an empty dim)."""
    check_fraction(fraction, "fraction")
    return min(int(size), max(1, math.ceil(fraction * size)))


def partial_slice_norms(piece: Tensor, dim: int) -> Tensor:
    """The L1 norm of every slice along ``dim`` of ``piece`` ``[..., r, c]`` (a matrix, or a rank's
    piece of one: then a partial sum over the columns it holds), each entry converted to float64
    before it is added.  Returns ``[..., r]`` (rows) or ``[..., c]`` (columns), float64."""
    other = COLUMNS if dim == ROWS else ROWS
    return piece.abs().sum(dim=other, dtype=NORM_DTYPE)


def sum_partials(partials: Sequence[Tensor]) -> Tensor:
    """The norms of slices split over several pieces: their partial norms added one piece after
    the other, in the order given (member order), so that every rank that adds them gets the
    same bits."""
    if not partials:
        raise ValueError("sum_partials: no partial norms")
    total = partials[0].to(NORM_DTYPE).clone()
    for p in partials[1:]:
        total.add_(p)
    return total


def choose(norms: Tensor, k: int) -> Tensor:
    """The indices of the ``k`` largest ``norms`` along the last dim (each leading index on its
    own), ascending.  Ties: equal norms are taken lower index first (a stable descending sort),
    on every device and layout, so a rank that computes the same norms picks the same slices.
    A NaN norm sorts above every number (torch's order), so a NaN slice is chosen first.
    Returns a LongTensor ``[..., k]`` on ``norms``' device."""
    if not 0 <= k <= norms.shape[-1]:
        raise ValueError(f"choose: k={k} outside [0, {norms.shape[-1]}]")
    order = torch.sort(norms, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


def _expanded(idx: Tensor, t: Tensor, dim: int) -> Tensor:
    """``idx`` ``[..., k]`` as gather/scatter's index over ``t`` ``[..., m, n]`` along ``dim``."""
    if dim == ROWS:
        return idx.unsqueeze(-1).expand(*idx.shape, t.shape[-1])
    return idx.unsqueeze(-2).expand(*idx.shape[:-1], t.shape[-2], idx.shape[-1])


def take_slices(t: Tensor, idx: Tensor, dim: int) -> Tensor:
    """The chosen slices of ``t`` ``[..., m, n]``: ``[..., k, n]`` (rows) or ``[..., m, k]`` (columns),
    in ``idx``'s order (ascending from :func:`choose`), a new tensor."""
    return torch.gather(t, dim, _expanded(idx, t, dim))


def put_slices_(t: Tensor, idx: Tensor, dim: int, src: Tensor) -> Tensor:
    """Write ``src`` (shaped as :func:`take_slices` returns) into the chosen slices of ``t``, in
    place; returns ``t``."""
    return t.scatter_(dim, _expanded(idx, t, dim), src.to(t.dtype))


# ---------------------------------------------------------------------------- the momentum


def momentum_sum_(buf: Tensor, grad: Tensor, maximize: bool = False, dtype: torch.dtype | None = None) -> None:
    """``M <- M + G`` (``-G`` when maximising), computed in ``dtype`` (default: the buffer's) and
    rounded once as stored: a bf16 buffer of fp32 parameters adds in fp32."""
    dtype = dtype or buf.dtype
    g = grad.to(dtype)
    if buf.dtype == dtype:
        if maximize:
            buf.sub_(g)
        else:
            buf.add_(g)
        return
    wide = buf.to(dtype)
    buf.copy_(wide.sub_(g) if maximize else wide.add_(g))


def decay_chosen_(buf: Tensor, idx: Tensor, dim: int, ef_decay: float, dtype: torch.dtype | None = None) -> None:
    """Error feedback: ``M[K] <- ef_decay M[K]`` on the chosen slices only (in ``dtype``, default the
    buffer's, rounded once as stored); the other slices keep their bits."""
    if idx.numel() == 0:
        return
    chosen = take_slices(buf, idx, dim).to(dtype or buf.dtype)
    put_slices_(buf, idx, dim, chosen.mul_(ef_decay))


# ---------------------------------------------------------------------------- the update


def normalize_chosen_rows(o: Tensor, v: Tensor, idx: Tensor, beta2: float) -> tuple[Tensor, Tensor]:
    """NorDion2: NorMuon's normalisation (``rule.normuon_normalize``: per row of the chosen
    submatrix ``o`` ``[..., k, n]``, Frobenius rescale per matrix) with the chosen rows of ``v``
    ``[..., m, 1]``.  Returns ``(Ô in o's dtype, v with its chosen rows updated)``; the other rows
    of ``v`` keep their bits."""
    hat, vk = normuon_normalize(o, take_slices(v, idx, ROWS), beta2, o.dtype)
    return hat, put_slices_(v.clone(), idx, ROWS, vk)


def apply_sparse_update_(param: Tensor, o: Tensor, idx: Tensor, dim: int, lr, adjusted: float,
                         weight_decay: float, cautious: bool = False) -> None:
    """Decoupled weight decay on every entry, the update ``-adjusted O`` on the chosen slices only:
    ``rule.apply_update_`` with the update ``D`` that is ``O`` on the chosen slices and 0 elsewhere,
    so an unchosen entry becomes exactly ``W (1 - lr wd)`` (cautious: decayed, since ``W * 0 >= 0``)."""
    full = torch.zeros(param.shape, dtype=o.dtype, device=param.device)
    if idx.numel():
        put_slices_(full, idx, dim, o)
    apply_update_(param, full, lr, adjusted, weight_decay, cautious)


# ---------------------------------------------------------------------------- one step, one device


@dataclass(frozen=True)
class Selection:
    """What a step chose: the dim (-2 rows, -1 columns) and the indices ``[..., k]`` per matrix."""

    dim: int
    indices: Tensor


def choose_slices(buf: Tensor, fraction: float, rows_only: bool = False) -> Selection:
    """The selection of a whole matrix (or batch) from its momentum as stored."""
    dim = selection_dim(buf.shape, rows_only)
    size = buf.shape[dim]
    return Selection(dim, choose(partial_slice_norms(buf, dim), chosen_count(fraction, size)))


def dion2_step_(param: Tensor, grad: Tensor, buf: Tensor, *, fraction: float, ef_decay: float, lr,
                adjusted: float, weight_decay: float, orthogonalize: Callable[[Tensor], Tensor],
                row_state: Tensor | None = None, normuon_beta2: float | None = None, cautious: bool = False,
                maximize: bool = False, dtype: torch.dtype | None = None) -> tuple[Selection, Tensor | None]:
    """One Dion2 step of a whole matrix ``[..., m, n]`` held on one device, in place on ``param``
    and ``buf``; NorDion2 with ``normuon_beta2`` and ``row_state`` (``[..., m, 1]``; rows only).
    ``dtype``: the momentum's arithmetic dtype (default: the wider of the parameter's and the
    buffer's).  ``orthogonalize`` takes ``[..., r, c]`` (``zeropower_via_newtonschulz`` does).
    Returns the selection and the new ``row_state`` (None without NorDion2)."""
    if normuon_beta2 is not None and row_state is None:
        raise ValueError("dion2_step_: NorDion2 (normuon_beta2) needs the row state v [..., m, 1]")
    dtype = dtype or torch.promote_types(param.dtype, buf.dtype)
    momentum_sum_(buf, grad, maximize, dtype)
    sel = choose_slices(buf, fraction, rows_only=normuon_beta2 is not None)
    u = take_slices(buf, sel.indices, sel.dim).to(dtype)  # before the decay
    decay_chosen_(buf, sel.indices, sel.dim, ef_decay, dtype)
    o = orthogonalize(u) if u.numel() else u
    v = row_state
    if normuon_beta2 is not None and sel.indices.numel():
        o, v = normalize_chosen_rows(o, row_state, sel.indices, normuon_beta2)
    apply_sparse_update_(param, o, sel.indices, sel.dim, lr, adjusted, weight_decay, cautious)
    return sel, v


def dion2_blocks_step_(param: Tensor, grad: Tensor, buf: Tensor, blocks: Sequence[Tensor], *,
                       adjusted: Sequence[float], row_state: Tensor | None = None,
                       **rule) -> tuple[list[Selection], Tensor | None]:
    """:func:`dion2_step_` on each row block of a matrix ``[..., m, n]`` as its own matrix: block
    ``b`` is the rows ``blocks[b]`` (a LongTensor on ``param``'s device; the blocks partition the
    ``m`` rows, of every matrix of a stack), with its own selection dim and ``k`` from its shape
    ``[..., rows_b, n]``, its own ``adjusted[b]`` lr and the chosen slices of its own momentum (and
    NorDion2's ``v`` rows).  ``rule``: :func:`dion2_step_`'s other keywords.  In place on ``param``,
    ``buf`` and ``row_state``; returns each block's selection (indices local to the block) and
    ``row_state``."""
    if len(adjusted) != len(blocks):
        raise ValueError(f"dion2_blocks_step_: {len(blocks)} blocks but {len(adjusted)} adjusted learning rates")
    selections = []
    for rows, block_lr in zip(blocks, adjusted):
        p, m = param.index_select(ROWS, rows), buf.index_select(ROWS, rows)
        v = None if row_state is None else row_state.index_select(ROWS, rows)
        sel, v = dion2_step_(p, grad.index_select(ROWS, rows), m, adjusted=block_lr, row_state=v, **rule)
        param.index_copy_(ROWS, rows, p)
        buf.index_copy_(ROWS, rows, m)
        if row_state is not None:
            row_state.index_copy_(ROWS, rows, v)
        selections.append(sel)
    return selections, row_state
