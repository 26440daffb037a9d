"""The pipeline's stages for a chunk of moved units (``plan_data.MoveChunk``; ``planning/expert_moves.py``).

Experts held whole by one rank, orthogonalised by another (or cut over a group): the holder
writes each block it sends (its momentum update, and NorMuon's row state after its columns)
into the send buffer at the plan's offset, one all-to-all over the mesh's ranks delivers them
(uneven splits: only holders send, only owners receive), and each block arrives whole, so an
owner's matrix is a view of the receive buffer (same-shape ones batched: a view when they arrive
side by side, one copy when not).  The way back mirrors it: the owner writes each update where
its block arrived, one all-to-all returns the updates to the holders, and the runtime's update
stage applies them (``finish_update``, with the plan's ``Update`` entries).  The owner's stage
itself is the runtime's (``orthogonalize_owned``): whole units batched by shape, blocks of cut
units by the split iteration with their group.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from ..planning.plan_data import MoveChunk, Owned
from .buffers import Flight, matrix_and_rows
from .stats import PipelineStats


def _block(buffer: torch.Tensor, o) -> torch.Tensor:
    return buffer[o.offset: o.offset + math.prod(o.padded)].view(o.padded)


def _all_to_all(recv, send, recv_splits, send_splits, chunk: MoveChunk, stats: PipelineStats):
    stats.all_to_alls += 1
    return dist.all_to_all_single(recv, send, recv_splits, send_splits, group=chunk.group, async_op=True)


def start_gather(chunk: MoveChunk, steps: Sequence, stats: PipelineStats) -> Flight:
    """Write the blocks this rank holds into the send buffer and send them to their owners."""
    with stats.time("gather"):
        send = torch.empty(chunk.send_numel, dtype=chunk.wire_dtype, device=chunk.device)
        for pack in chunk.packs:
            matrix, rows = matrix_and_rows(_block(send, pack), pack.row_slots)
            steps[pack.param].input_into(matrix, pack.region)
            if rows is not None:
                steps[pack.param].row_state_into(rows, pack.region)
        recv = torch.empty(chunk.recv_numel, dtype=chunk.wire_dtype, device=chunk.device)
        work = _all_to_all(recv, send, chunk.recv_splits, chunk.send_splits, chunk, stats)
    return Flight(chunk, recv, work, send)


def finish_gather(flight: Flight, stats: PipelineStats) -> list[torch.Tensor]:
    """Wait for the blocks; the owned matrices are views of the receive buffer (same-shape ones
    batched), their row state in ``flight.rows``."""
    with stats.time("gather"):
        flight.work.wait()
        chunk, recv = flight.chunk, flight.recv
        stats.moved_units += len(chunk.owned)
        fulls, rows = [], []
        for o in chunk.owned:
            matrix, row = matrix_and_rows(_block(recv, o), o.row_slots)
            fulls.append(matrix)
            rows.append(row)
        flight.fulls = []
        for b, members in enumerate(chunk.batches):
            batch = _batched(recv, [chunk.owned[k] for k in members])
            matrices, row_batch = matrix_and_rows(batch, chunk.owned[members[0]].row_slots)
            flight.fulls.append((b, matrices, row_batch))
        flight.rows = rows
    return fulls


def _batched(recv: torch.Tensor, owned: Sequence[Owned]) -> torch.Tensor:
    """``[n, *padded]``: a view when the blocks lie side by side in ``recv``, else one copy."""
    size = math.prod(owned[0].padded)
    start = owned[0].offset
    if all(o.offset == start + n * size for n, o in enumerate(owned)):
        return recv[start: start + len(owned) * size].view(len(owned), *owned[0].padded)
    return torch.stack([_block(recv, o) for o in owned])


def start_scatter(chunk: MoveChunk, updates: list[torch.Tensor], stats: PipelineStats,
                  rows: Sequence[torch.Tensor | None] = ()) -> Flight:
    """Write every owned block's update (and new row state) where the block arrived; send them back."""
    with stats.time("scatter"):
        send = torch.empty(chunk.recv_numel, dtype=chunk.wire_dtype, device=chunk.device)
        for k, (o, u) in enumerate(zip(chunk.owned, updates)):
            matrix, row_block = matrix_and_rows(_block(send, o), o.row_slots)
            matrix.copy_(u)
            if row_block is not None:
                row_block.copy_(rows[k])
        recv = torch.empty(chunk.send_numel, dtype=chunk.wire_dtype, device=chunk.device)
        work = _all_to_all(recv, send, chunk.send_splits, chunk.recv_splits, chunk, stats)
    return Flight(chunk, recv, work, send)
