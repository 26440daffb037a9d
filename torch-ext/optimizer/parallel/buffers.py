"""Buffers shared by the pipeline's stages (``runtime.py``, ``moves.py``): a chunk in flight, and
views of a flat buffer as the padded blocks the plan laid out in it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch


def _piece(buffer: torch.Tensor, offset: int, padded: Sequence[int], mine: Sequence[int]) -> torch.Tensor:
    """A padded block of ``buffer`` at ``offset``, cut to the real block's shape."""
    block = buffer[offset: offset + math.prod(padded)].view(padded)
    if tuple(mine) != tuple(padded):
        block = block[tuple(slice(0, n) for n in mine)]
    return block


def _row_piece(buffer: torch.Tensor, offset: int, padded: Sequence[int], mine: Sequence[int],
               slots: int) -> torch.Tensor:
    """The row-state columns of the block at ``offset``, for the real block's rows."""
    block = buffer[offset: offset + math.prod(padded)].view(padded)
    return block[(..., slice(0, mine[-2]), slice(padded[-1] - slots, None))]


def _split(blocks: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[..., rows, cols + slots]`` blocks as (matrix part, row-state part or None)."""
    if not slots:
        return blocks, None
    cols = blocks.shape[-1] - slots
    return blocks[..., :cols], blocks[..., cols:]


@dataclass
class _Flight:
    chunk: object  # plan.Chunk or plan.MoveChunk
    recv: torch.Tensor
    work: object
    send: torch.Tensor | None = None  # kept alive until the collective completes
    fulls: list = field(default_factory=list)
    rows: list = field(default_factory=list)  # the owned units' row state (NorMuon's v), or None each
