"""Buffers shared by the pipeline's stages (``chunk_stages.py``, ``move_stages.py``, ``pipeline.py``):
a chunk in flight, views of a flat buffer as the padded blocks the plan laid out in it, and the
index kernels that assemble a unit from its members' blocks and cut its update back into them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..planning.plan_data import Chunk, Owned


def block_at(buffer: torch.Tensor, offset: int, padded: Sequence[int], mine: Sequence[int]) -> torch.Tensor:
    """A padded block of ``buffer`` at ``offset``, cut to the real block's shape."""
    block = buffer[offset: offset + math.prod(padded)].view(padded)
    if tuple(mine) != tuple(padded):
        block = block[tuple(slice(0, n) for n in mine)]
    return block


def block_rows_at(buffer: torch.Tensor, offset: int, padded: Sequence[int], mine: Sequence[int],
                  slots: int) -> torch.Tensor:
    """The row-state columns of the block at ``offset``, for the real block's rows."""
    block = buffer[offset: offset + math.prod(padded)].view(padded)
    return block[(..., slice(0, mine[-2]), slice(padded[-1] - slots, None))]


def matrix_and_rows(blocks: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[..., rows, cols + slots]`` blocks as (matrix part, row-state part or None)."""
    if not slots:
        return blocks, None
    cols = blocks.shape[-1] - slots
    return blocks[..., :cols], blocks[..., cols:]


@dataclass
class Flight:
    """A chunk between the launch of its collective and the wait for it."""

    chunk: object  # plan_data.Chunk or plan_data.MoveChunk
    recv: torch.Tensor
    work: object
    send: torch.Tensor | None = None  # kept alive until the collective completes
    fulls: list = field(default_factory=list)
    rows: list = field(default_factory=list)  # the owned units' row state (NorMuon's v), or None each


# ----------------------------------------------------------------------------
# Index kernels: a unit from its members' padded blocks, and back
# ----------------------------------------------------------------------------


def assembled_shape(o: Owned) -> tuple[int, ...]:
    lead = o.shape[:-2]
    return (*lead, *(n + int(t) for n, t in zip(o.shape[-2:], o.trash)))


def real_part(o: Owned) -> tuple:
    """Cut the spare slot (where padding was thrown) off an assembled matrix."""
    return tuple(slice(0, n) for n in o.shape)


def unit_indexer(o: Owned, index: tuple) -> tuple[tuple, int]:
    """Index of the unit tensor addressing every member's padded block at once, and where
    the member axis lands in the indexed result."""
    lead = [slice(None)] * (len(o.shape) - 2)
    rows, cols = index
    if rows is not None and cols is not None:
        return (*lead, rows[:, :, None], cols[:, None, :]), len(lead)
    if rows is not None:
        return (*lead, rows), len(lead)
    return (*lead, slice(None), cols), len(lead) + 1


def assemble(target: torch.Tensor, blocks: torch.Tensor, o: Owned) -> torch.Tensor:
    """Write every member's padded block (``blocks``: ``[members, *padded matrix]``) to its place
    in ``target`` (one index kernel); return the real matrix."""
    indexer, axis = unit_indexer(o, o.write)
    target[indexer] = blocks.movedim(0, axis)
    return target[real_part(o)]


def rows_shape(o: Owned) -> tuple[int, ...]:
    return (*o.shape[:-1], o.row_slots)


def assemble_rows(blocks: torch.Tensor, o: Owned) -> torch.Tensor:
    """The unit's row state ``[..., rows, slots]`` from every member's (``blocks``: ``[members, ...,
    padded rows, slots]``): placed with the rows' index (members holding the same rows, i.e. other
    columns of them, carry identical values), or member 0's when every member holds every row."""
    rows = o.shape[-2]
    if o.write[0] is None:
        return blocks[0][..., :rows, :]
    lead = [slice(None)] * (len(o.shape) - 2)
    target = blocks.new_empty((*o.shape[:-2], rows + int(o.trash[0]), o.row_slots))
    target[(*lead, o.write[0])] = blocks.movedim(0, len(lead))
    return target[..., :rows, :]


def cut_rows(rows: torch.Tensor, o: Owned) -> torch.Tensor:
    """Every member's rows of the unit's row state, ``[members, ..., padded rows, slots]`` (or
    broadcastable to it)."""
    if o.read[0] is None:
        return rows
    lead = len(o.shape) - 2
    return rows[(*[slice(None)] * lead, o.read[0])].movedim(lead, 0)


def arrived(recv: torch.Tensor, chunk: Chunk, o: Owned) -> torch.Tensor:
    """A zero-copy job: its pieces already are the matrix, in order (with their row-state
    columns, if any: ``[..., rows, cols + slots]``)."""
    if chunk.shard_size == 1:
        return recv[o.offset: o.offset + math.prod(o.padded)].view(o.padded)
    rows = o.shape[0]
    return recv.view(chunk.shard_size * o.padded[0], o.padded[-1])[:rows]
