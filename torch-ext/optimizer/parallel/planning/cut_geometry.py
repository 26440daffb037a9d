"""Which indices form each block of a unit cut over k ranks (pure index math).

A unit ``[..., M, N]`` is cut along its long side into k blocks; block j takes one contiguous
slice of every distinct index set the shard group's members hold along that side
(:func:`cut_blocks`), so every member sends every block owner 1/k of its piece and the plan's
padded buffers apply unchanged (docs/parallel.md, "One matrix over k ranks").
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

from ...distributed.placements import Index
from .owners import split_range_evenly


class Cut(NamedTuple):
    """Sub-job ``j`` of a unit cut into ``k`` blocks along tensor dim ``dim`` (negative: -1 or -2)."""

    dim: int
    k: int
    j: int


def cut_dim(shape: Sequence[int]) -> int:
    """The long side: -1 (columns) for a wide or square matrix, -2 (rows) for a tall one."""
    return -1 if shape[-1] >= shape[-2] else -2


def _length(ix: Index) -> int:
    return max(0, ix.stop - ix.start) if isinstance(ix, slice) else int(ix.numel())


def _first(ix: Index) -> int:
    if isinstance(ix, slice):
        return ix.start
    return int(ix.min()) if ix.numel() else -1


def _key(ix: Index):
    if isinstance(ix, slice):
        return ("slice", ix.start, ix.stop) if ix.stop > ix.start else ("empty",)
    return ("index", tuple(ix.tolist())) if ix.numel() else ("empty",)


def canonical_sets(indices: Sequence[Index]) -> tuple[list[int], list[int]]:
    """The distinct index sets among members' indices along one dim, ordered by their smallest
    index (so every shard group of a layout lists them alike): each member's set number and each
    set's length.  Members holding nothing along the dim share one empty set, listed last."""
    keys = [_key(ix) for ix in indices]
    first: dict = {}
    for key, ix in zip(keys, indices):
        if key not in first:
            first[key] = (_first(ix) if key != ("empty",) else math.inf, _length(ix))
    order = sorted(first, key=lambda k: first[k][0])
    number = {k: n for n, k in enumerate(order)}
    return [number[k] for k in keys], [first[k][1] for k in order]


def cut_blocks(lengths: Sequence[int], k: int) -> tuple[tuple[slice, ...], ...]:
    """``[j][t]``: the slice of set t's local positions that goes to block j.

    Each set is cut into k contiguous near-equal slices (:func:`split_range_evenly`); set t's
    slice s goes to block ``(s + c_t) mod k``, with ``c_t`` the sets before it's total length mod
    k, so the longer slices of consecutive sets land on consecutive blocks: block widths differ by
    at most one, and every block is non-empty when the sets hold at least k indices in all."""
    return _cut_blocks(tuple(int(n) for n in lengths), int(k))


@functools.lru_cache(maxsize=4096)
def _cut_blocks(lengths: tuple[int, ...], k: int) -> tuple[tuple[slice, ...], ...]:
    out = [[slice(0, 0)] * len(lengths) for _ in range(k)]
    c = 0
    for t, n in enumerate(lengths):
        for s, sl in enumerate(split_range_evenly(n, k)):
            out[(s + c) % k][t] = sl
        c = (c + n) % k
    return tuple(tuple(row) for row in out)


def block_widths(lengths: Sequence[int], k: int) -> tuple[int, ...]:
    return tuple(sum(sl.stop - sl.start for sl in row) for row in cut_blocks(lengths, k))


def block_offsets(row: Sequence[slice]) -> list[int]:
    """Where each set's slice of one block (a row of :func:`cut_blocks`) starts in the block
    (sets in canonical order, end to end)."""
    out, off = [], 0
    for sl in row:
        out.append(off)
        off += sl.stop - sl.start
    return out


@functools.lru_cache(maxsize=4096)
def _layout_lengths(layout, dim: int) -> tuple[int, ...]:
    members = layout.shard_group(layout.grid.coordinate(layout.grid.ranks[0]))
    _, lengths = canonical_sets([layout.indices(layout.grid.coordinate(r))[dim] for r in members])
    return tuple(lengths)


def set_lengths(layout, shape: Sequence[int]) -> tuple[int, ...]:
    """Lengths of the distinct index sets a layout's shard group holds along the cut dim of ``shape``."""
    if layout is None:
        return (shape[cut_dim(shape)],)
    return _layout_lengths(layout, len(layout.shape) + cut_dim(shape))


def lengths_along(layout, ndim: int, dim: int) -> tuple[int, ...]:
    """Lengths of the distinct index sets a layout's shard group holds along (negative) ``dim``."""
    return _layout_lengths(layout, ndim + dim)


def piece_length(lengths: Sequence[int], k: int, j: int) -> int:
    """The longest member slice of block j: what every member's piece is padded to along the cut dim."""
    return max(sl.stop - sl.start for sl in cut_blocks(lengths, k)[j])


def sub_shape(shape: Sequence[int], cut: Cut, width: int) -> tuple[int, ...]:
    out = list(shape)
    out[cut.dim] = width
    return tuple(out)
