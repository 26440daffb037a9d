"""Which global indices of a DTensor does each rank hold?

The optimizer gathers gradient shards into full matrices, orthogonalizes them and
scatters the updates back, so it must know, for every member of a shard group,
exactly which global rows/columns its local tensor holds and in what order.

We derive this from placement semantics alone (no private DTensor methods, whose
signatures keep moving: ``_StridedShard.local_shard_size_and_offset`` changed
between torch 2.10 and 2.13).  The ground truth is what ``redistribute`` and
``full_tensor()`` reconstruct, which is also how FSDP2 lays out its shards:

* ``Shard(d)`` follows ``torch.chunk``: chunk size ``ceil(n / k)``; trailing
  chunks may be short or empty.
* Placements apply left to right over mesh dims, each on the piece left by the
  previous ones.
* ``_StridedShard(d, sf)`` records that tensor dim ``d`` was sharded right to
  left (FSDP2 over TP: TP chunks first, then FSDP chunks each TP piece).  When
  every ``split_factor`` equals the product of the sizes of the mesh dims that
  shard ``d`` before it, DTensor decodes the placements into a *shard order* (per
  tensor dim, the mesh dims in the order they chunk it) and nests plain
  ``torch.chunk`` in that order.  Otherwise (``sf`` matches no such product),
  ``_StridedShard`` acts on its own mesh dim: split the current piece into ``sf``
  chunks, split each of those into ``k`` chunks and give coordinate ``c`` the
  concatenation of every ``c``-th sub-chunk.

The two readings agree when sizes divide evenly.  They differ for uneven sizes,
and torch 2.13 itself is inconsistent there: for 9 rows on a ``(dp=4, tp=2)``
mesh with ``(_StridedShard(0, sf=2), Shard(0))``, FSDP2, ``redistribute`` and
``full_tensor()`` put row 8 on coordinate ``(3, 1)`` (TP chunks [0:5] and [5:9],
FSDP then chunks each), while ``compute_local_shape_and_global_offset`` says
``(3, 0)`` and ``distribute_tensor`` refuses uneven strided splits.  We follow
``full_tensor()`` (tests/distributed/test_local_indices.py pins this down).
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

try:  # private, and outside the Shard hierarchy since torch 2.10
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - very old torch
    _StridedShard = None

Index = Union[slice, torch.Tensor]  # a slice (step 1) or a 1-D LongTensor of global indices

__all__ = [
    "Index",
    "as_indexer",
    "block_shape",
    "check_placements",
    "is_shard",
    "is_strided_shard",
    "local_indices",
    "numel_for_rank",
    "numel_of_indices",
    "row_placements",
]


# ----------------------------------------------------------------------------
# Placement predicates
# ----------------------------------------------------------------------------


def is_strided_shard(placement: Placement) -> bool:
    return _StridedShard is not None and isinstance(placement, _StridedShard)


def is_shard(placement: Placement) -> bool:
    """True for ``Shard`` and ``_StridedShard`` on every torch version.

    ``placement.is_shard()`` is False for ``_StridedShard`` since torch 2.10,
    when it stopped subclassing ``Shard``.
    """
    return isinstance(placement, Shard) or is_strided_shard(placement)


def _split_factor(placement: Placement) -> int:
    """1 for ``Shard``; the split factor for ``_StridedShard``."""
    return int(placement.split_factor) if is_strided_shard(placement) else 1


def check_placements(placements: Sequence[Placement], ndim: int | None) -> list[int | None]:
    """Validate placements; return the (non-negative) tensor dim each one shards, or None."""
    dims: list[int | None] = []
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(
                f"placements[{i}] is {p!r}: a Partial tensor holds unreduced partial sums, "
                "not a shard of its global value. Reduce the gradient first (redistribute "
                "that mesh dim to Shard or Replicate) before asking which indices a rank holds."
            )
        if isinstance(p, Replicate):
            dims.append(None)
            continue
        if not is_shard(p):
            raise ValueError(
                f"placements[{i}] is {p!r}: only Shard, _StridedShard and Replicate are supported."
            )
        d = p.dim
        if ndim is not None:
            if not -ndim <= d < ndim:
                raise ValueError(
                    f"placements[{i}] = {p!r} shards dim {d}, but the tensor has {ndim} dims."
                )
            d %= ndim
        if _split_factor(p) < 1:
            raise ValueError(f"placements[{i}] = {p!r} has split_factor < 1.")
        dims.append(d)
    return dims


def row_placements(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    """Placements of per-row state ``[..., rows, 1]`` (NorMuon's v) of a ``ndim``-D tensor placed
    with ``placements``: a shard of the last dim becomes ``Replicate`` (every rank holding a
    piece of a row holds that row's value), everything else is kept as it is, so that a rank's
    local rows (and leading indices) are exactly the tensor's, ``_StridedShard`` interleaving
    included (the rows dim and every shard of it are unchanged)."""
    dims = check_placements(placements, ndim)
    return tuple(Replicate() if d == ndim - 1 else p for p, d in zip(placements, dims))


# ----------------------------------------------------------------------------
# The pure index math
# ----------------------------------------------------------------------------


def _chunk_bounds(n: int, k: int, c: int) -> tuple[int, int]:
    """[start, stop) of chunk ``c`` when ``torch.chunk`` splits ``n`` items into ``k``."""
    size = -(-n // k)  # ceil; trailing chunks may be short or empty
    return min(c * size, n), min((c + 1) * size, n)


def _chunk(idx: Index, k: int, c: int) -> Index:
    """Chunk ``c`` of ``k`` of the index sequence ``idx`` (torch.chunk semantics)."""
    if isinstance(idx, slice):
        lo, hi = _chunk_bounds(idx.stop - idx.start, k, c)
        return slice(idx.start + lo, idx.start + hi)
    lo, hi = _chunk_bounds(idx.numel(), k, c)
    return idx[lo:hi]


def _strided_chunk(idx: Index, split_factor: int, k: int, c: int) -> torch.Tensor:
    """``_StridedShard`` on its own mesh dim: chunk into ``split_factor`` pieces,
    chunk each piece into ``k``, and concatenate the ``c``-th sub-chunk of each."""
    if isinstance(idx, slice):
        idx = torch.arange(idx.start, idx.stop, dtype=torch.long)
    pieces = [_chunk(_chunk(idx, split_factor, j), k, c) for j in range(split_factor)]
    return torch.cat(pieces)


def _shard_order(
    dims: Sequence[int | None], split_factors: Sequence[int], mesh_shape: Sequence[int]
) -> dict[int, list[int]] | None:
    """Decode placements into a shard order, as DTensor's redistribution does.

    Returns, per sharded tensor dim, the mesh dims in the order they chunk it, or
    None when some ``_StridedShard``'s split factor matches no position.  Walking
    mesh dims right to left, each sharding mesh dim is inserted at the first
    position where the product of the sizes of the mesh dims before it equals its
    split factor (1 for ``Shard``, i.e. at the front: plain left-to-right order).
    """
    order: dict[int, list[int]] = {}
    for m in reversed(range(len(dims))):
        d = dims[m]
        if d is None:
            continue
        seq = order.setdefault(d, [])
        acc = 1
        for pos in range(len(seq) + 1):
            if acc == split_factors[m]:
                seq.insert(pos, m)
                break
            if pos < len(seq):
                acc *= mesh_shape[seq[pos]]
        else:
            return None
    return order


def _normalise(idx: Index) -> Index:
    """A contiguous ascending index tensor becomes a slice (callers prefer views)."""
    if isinstance(idx, slice):
        return idx
    n = idx.numel()
    if n == 0:
        return slice(0, 0)
    first = int(idx[0])
    if torch.equal(idx, torch.arange(first, first + n, dtype=idx.dtype)):
        return slice(first, first + n)
    return idx


def local_indices(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> tuple[Index, ...]:
    """Global indices held by the rank at mesh ``coordinate``, per tensor dim.

    Each entry is a ``slice`` (step 1) when the owned indices are contiguous, else a
    1-D ``torch.long`` tensor of global indices in local storage order.  Needs no
    process group.  Raises ValueError for ``Partial`` and malformed input.
    """
    global_shape = tuple(int(s) for s in global_shape)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    coordinate = tuple(int(c) for c in coordinate)
    if not len(placements) == len(mesh_shape) == len(coordinate):
        raise ValueError(
            f"need one placement and one coordinate per mesh dim: mesh_shape={mesh_shape}, "
            f"placements={tuple(placements)}, coordinate={coordinate}"
        )
    if any(s < 0 for s in global_shape):
        raise ValueError(f"global_shape {global_shape} has a negative size")
    for m, (k, c) in enumerate(zip(mesh_shape, coordinate)):
        if k < 1 or not 0 <= c < k:
            raise ValueError(
                f"coordinate[{m}] = {c} is outside mesh dim {m} of size {k} "
                f"(mesh_shape={mesh_shape})"
            )
    dims = check_placements(placements, len(global_shape))
    split_factors = [_split_factor(p) for p in placements]

    result: list[Index] = [slice(0, n) for n in global_shape]
    order = _shard_order(dims, split_factors, mesh_shape)
    if order is not None:
        # Decodable (always the case without _StridedShard): nested torch.chunk
        # in shard order, which keeps every rank's block contiguous.
        for d, mesh_dims in order.items():
            for m in mesh_dims:
                result[d] = _chunk(result[d], mesh_shape[m], coordinate[m])
    else:
        # Not decodable: each placement acts on its own mesh dim, left to right.
        for m, d in enumerate(dims):
            if d is None:
                continue
            if not is_strided_shard(placements[m]):
                result[d] = _chunk(result[d], mesh_shape[m], coordinate[m])
            else:
                result[d] = _strided_chunk(result[d], split_factors[m], mesh_shape[m], coordinate[m])
    return tuple(_normalise(i) for i in result)


def block_shape(indices: Sequence[Index]) -> tuple[int, ...]:
    """Shape of the block the per-dim ``indices`` select (step-1 slices or index tensors)."""
    return tuple(max(0, i.stop - i.start) if isinstance(i, slice) else int(i.numel()) for i in indices)


def numel_of_indices(indices: Sequence[Index]) -> int:
    """Number of elements the per-dim ``indices`` select."""
    return math.prod(block_shape(indices))


def numel_for_rank(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> int:
    """Number of elements of the local tensor at mesh ``coordinate`` (pure)."""
    return numel_of_indices(local_indices(global_shape, mesh_shape, placements, coordinate))


def as_indexer(indices: Sequence[Index]) -> tuple:
    """Make per-dim ``indices`` usable as ``target[indexer]`` / ``target[indexer] = v``.

    Selects the local block in storage order, shaped like the local tensor.  With at
    most one index tensor, the tuple is used as is (a lone advanced index keeps its
    dim's position).  With several, plain ``t[i0, i1]`` would pair them pointwise
    (and a slice between advanced indices moves dims to the front), so every dim
    becomes an index tensor shaped to broadcast as an outer product (``np.ix_``).
    """
    indices = tuple(indices)
    if sum(not isinstance(i, slice) for i in indices) <= 1:
        return indices
    ndim = len(indices)
    device = next(i.device for i in indices if not isinstance(i, slice))
    out = []
    for d, i in enumerate(indices):
        if isinstance(i, slice):
            start, stop, _ = i.indices(1 << 62)
            i = torch.arange(start, stop, dtype=torch.long, device=device)
        shape = [1] * ndim
        shape[d] = -1
        out.append(i.reshape(shape))
    return tuple(out)
