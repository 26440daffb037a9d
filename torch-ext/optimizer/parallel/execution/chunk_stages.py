"""The four stages of one chunk of the plan (``planning/plan_data.Chunk``), in the order they run.

1. gather: every rank writes its piece of each job into the send buffer; one all-to-all delivers
   the pieces to their owners, which assemble whole units (``buffers.py``);
2. orthogonalize: the owner's stage on every owned unit, blocks of cut units with their group;
3. scatter: one all-to-all returns every rank its piece of the update, then (split over replicas)
   one all-gather hands the other replicas theirs (the exchange);
4. update: the rule's local stages on every piece, then QK-clip's row scaling.

A chunk of moved experts (``MoveChunk``) runs ``move_stages.py``'s gather and scatter instead.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from ..planning.plan_data import Chunk, MoveChunk
from . import move_stages
from .buffers import (Flight, arrived, assemble, assemble_rows, assembled_shape, block_at, block_rows_at, cut_rows,
                      matrix_and_rows, real_part, rows_shape, unit_indexer)
from .stats import PipelineStats


class Stages(Protocol):
    """What the runtime calls on one parameter's step (``optimizer.rule.MatrixStep``)."""

    param: torch.Tensor  # its local piece

    @property
    def input_dtype(self) -> torch.dtype: ...

    @property
    def stack_dtype(self) -> torch.dtype: ...

    @property
    def row_bytes(self) -> int: ...

    def input_into(self, out: torch.Tensor, region: tuple) -> None: ...

    def row_state_into(self, out: torch.Tensor, region: tuple) -> None: ...

    def orthogonalize(self, x: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def orthogonalize_split(self, x: torch.Tensor, widths: Sequence[int], group, rows: torch.Tensor | None,
                            transpose: bool) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def apply_update(self, region: tuple, update: torch.Tensor, rows: torch.Tensor | None) -> None: ...

    def scale_rows(self) -> None: ...

    @property
    def scales_rows(self) -> bool: ...

    @property
    def batch_key(self) -> object: ...


def _all_to_all(recv, send, recv_splits, send_splits, chunk: Chunk, stats: PipelineStats):
    stats.all_to_alls += 1
    return dist.all_to_all_single(recv, send, recv_splits, send_splits, group=chunk.shard_group, async_op=True)


def all_gather(out: torch.Tensor, mine: torch.Tensor, group, async_op: bool = False):
    # all_gather_into_tensor is deprecated in favour of all_gather_single (torch >= 2.10)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, mine, group=group, async_op=async_op)


# --------------------------------------------------------------------------
# Stage 1: gather pieces to owners.
# --------------------------------------------------------------------------


def start_gather(chunk: Chunk | MoveChunk, steps: Sequence[Stages], stats: PipelineStats) -> Flight:
    if isinstance(chunk, MoveChunk):
        return move_stages.start_gather(chunk, steps, stats)
    with stats.time("gather"):
        send = torch.empty(chunk.send_numel, dtype=chunk.wire_dtype, device=chunk.device)
        for pack in chunk.packs:
            if pack.index is not None:  # every block of a cut unit: one momentum call, one index kernel
                piece = torch.empty(pack.mine, dtype=chunk.wire_dtype, device=chunk.device)
                steps[pack.param].input_into(piece, pack.region)
                send.index_copy_(0, pack.index, piece.view(-1))
                continue
            slot = block_at(send, pack.offset, pack.padded, pack.mine)
            if slot.numel():
                steps[pack.param].input_into(slot, pack.region)
            if pack.row_slots:
                rows = block_rows_at(send, pack.offset, pack.padded, pack.mine, pack.row_slots)
                if rows.numel():
                    steps[pack.param].row_state_into(rows, pack.region)
        if chunk.shard_group is None:
            return Flight(chunk, send, None)
        recv = torch.empty(chunk.segment * chunk.shard_size, dtype=chunk.wire_dtype, device=chunk.device)
        work = _all_to_all(recv, send, [chunk.segment] * chunk.shard_size, chunk.send_splits, chunk, stats)
    return Flight(chunk, recv, work, send)


def finish_gather(flight: Flight, stats: PipelineStats) -> list[torch.Tensor]:
    """Wait for the gather; assemble the whole matrices this rank owns (batched by shape), and
    their row state (``flight.rows``)."""
    if isinstance(flight.chunk, MoveChunk):
        return move_stages.finish_gather(flight, stats)
    with stats.time("gather"):
        if flight.work is not None:
            flight.work.wait()
        chunk, recv = flight.chunk, flight.recv
        batches = [None] * len(chunk.batches)
        row_batches = [None] * len(chunk.batches)
        for b, members in enumerate(chunk.batches):
            o = chunk.owned[members[0]]
            batches[b] = recv.new_empty((len(members), *assembled_shape(o)))
            if o.row_slots:
                row_batches[b] = recv.new_empty((len(members), *rows_shape(o)))
        fulls, rows = [], []
        for k, o in enumerate(chunk.owned):
            if o.zero_copy:
                full, row = matrix_and_rows(arrived(recv, chunk, o), o.row_slots)
                fulls.append(full)
                rows.append(row)
                continue
            in_batch = chunk.batches[o.batch].index(k) if o.batch >= 0 else -1
            target = batches[o.batch][in_batch] if o.batch >= 0 else recv.new_empty(assembled_shape(o))
            blocks = recv.view(chunk.shard_size, chunk.segment)[:, o.offset: o.offset + math.prod(o.padded)]
            matrix, row_blocks = matrix_and_rows(blocks.view(chunk.shard_size, *o.padded), o.row_slots)
            fulls.append(assemble(target, matrix, o))
            row = None
            if row_blocks is not None:
                row = assemble_rows(row_blocks, o)
                if in_batch >= 0:
                    row = row_batches[o.batch][in_batch].copy_(row)
            rows.append(row)
        flight.fulls = [(b, batches[b][(slice(None), *real_part(chunk.owned[m[0]]))], row_batches[b])
                        for b, m in enumerate(chunk.batches)]
        flight.rows = rows
    return fulls


# --------------------------------------------------------------------------
# Stage 2: orthogonalise on the owner.
# --------------------------------------------------------------------------


def orthogonalize_owned(flight: Flight, fulls: list[torch.Tensor], steps: Sequence[Stages],
                        stats: PipelineStats) -> list[torch.Tensor]:
    """The owner's stage on every owned unit (one call per batch); returns the updates, and
    leaves the new row state in ``flight.rows``."""
    with stats.time("orthogonalize"):
        chunk = flight.chunk
        out: list[torch.Tensor | None] = [None] * len(fulls)
        rows_out: list[torch.Tensor | None] = [None] * len(fulls)
        # Blocks of cut units first (their group's other owners wait on them), in the unit order
        # every rank shares: each call is a sequence of collectives on its group.  Cut units of one
        # group with the same block, orientation and stage run as one call (their matrices one
        # batch, whose halves interleave: planning/world.batch_key).  A block's row state (NorMuon's v
        # of its rows) goes in and comes out like a whole unit's; its statistics over the whole
        # matrix are the split stage's own collective.
        calls: dict[tuple, list[int]] = {}
        for k in sorted((k for k, o in enumerate(chunk.owned) if o.split is not None),
                        key=lambda k: chunk.owned[k].split.unit):
            o = chunk.owned[k]
            block = o.shape[:-2] + (o.shape[-1:] + o.shape[-2:-1] if o.split.transpose else o.shape[-2:])
            calls.setdefault((steps[o.param].batch_key, o.split.ranks, o.split.widths, block, o.row_slots,
                              o.split.transpose if o.row_slots else None), []).append(k)
        for ks in calls.values():
            o = chunk.owned[ks[0]]
            xs = [fulls[k].mT if chunk.owned[k].split.transpose else fulls[k] for k in ks]  # short side first
            rows = [flight.rows[k] for k in ks]
            x = xs[0] if len(ks) == 1 else torch.stack(xs)
            r = rows[0] if len(ks) == 1 or rows[0] is None else torch.stack(rows)
            y, new_rows = steps[o.param].orthogonalize_split(x, o.split.widths, o.split.group, r, o.split.transpose)
            for i, k in enumerate(ks):
                yi = y if len(ks) == 1 else y[i]
                out[k] = (yi.mT if chunk.owned[k].split.transpose else yi).to(fulls[k].dtype)
                rows_out[k] = new_rows if len(ks) == 1 or new_rows is None else new_rows[i]
            stats.split_units += len(ks)
        for b, batch, row_batch in flight.fulls:
            members = chunk.batches[b]
            o = chunk.owned[members[0]]
            flat = batch.reshape(-1, *o.shape[-2:])  # experts of every member, one batch
            flat_rows = None if row_batch is None else row_batch.reshape(-1, *row_batch.shape[-2:])
            result, new_rows = steps[o.param].orthogonalize(flat, flat_rows)
            result = result.to(batch.dtype).view(len(members), *o.shape)
            for i, k in enumerate(members):
                out[k] = result[i]
                if new_rows is not None:
                    rows_out[k] = new_rows.view(len(members), *rows_shape(o))[i]
        for k, (o, full) in enumerate(zip(chunk.owned, fulls)):
            if out[k] is None:
                result, rows_out[k] = steps[o.param].orthogonalize(full, flight.rows[k])
                out[k] = result.to(full.dtype)
        flight.fulls = []
        flight.rows = rows_out
    return out


# --------------------------------------------------------------------------
# Stage 3: scatter each rank's piece of the update back (and across replicas).
# --------------------------------------------------------------------------


def start_scatter(chunk: Chunk, updates: list[torch.Tensor], stats: PipelineStats,
                  rows: Sequence[torch.Tensor | None] = ()) -> Flight:
    """Cut every owned update (and its new row state, ``rows``) into the members' blocks and send them."""
    if isinstance(chunk, MoveChunk):
        return move_stages.start_scatter(chunk, updates, stats, rows)
    with stats.time("scatter"):
        length = max(chunk.scatter_recv_numel, chunk.exchange_length)  # what the exchange sends from
        alone = chunk.shard_group is None  # one member: what it sends is what it receives
        numel = chunk.segment * chunk.shard_size
        buffer = torch.empty(max(numel, length) if alone else numel, dtype=chunk.wire_dtype, device=chunk.device)
        send = buffer[:numel]
        for k, (o, u) in enumerate(zip(chunk.owned, updates)):
            row = rows[k] if rows else None
            if o.zero_copy:
                matrix, row_block = matrix_and_rows(arrived(send, chunk, o), o.row_slots)
                matrix.copy_(u)
                if row_block is not None:
                    row_block.copy_(row)
                continue
            blocks = send.view(chunk.shard_size, chunk.segment)[:, o.offset: o.offset + math.prod(o.padded)]
            matrix, row_blocks = matrix_and_rows(blocks.view(chunk.shard_size, *o.padded), o.row_slots)
            indexer, axis = unit_indexer(o, o.read)
            matrix.copy_(u[indexer].movedim(axis, 0))
            if row_blocks is not None:
                row_blocks.copy_(cut_rows(row, o))
        if alone:
            return Flight(chunk, buffer, None)
        recv = torch.empty(length, dtype=chunk.wire_dtype, device=chunk.device)
        work = _all_to_all(recv[: chunk.scatter_recv_numel], send, chunk.scatter_recv_splits,
                           [chunk.segment] * chunk.shard_size, chunk, stats)
    return Flight(chunk, recv, work, send)


def start_exchange(flight: Flight, stats: PipelineStats) -> Flight:
    """Wait for the scatter; hand the pieces of updates owned in this replica to the other replicas."""
    with stats.time("scatter"):
        if flight.work is not None:
            flight.work.wait()
    chunk = flight.chunk
    if not chunk.exchange_length:
        return Flight(chunk, flight.recv, None)
    with stats.time("exchange"):
        out = torch.empty(chunk.exchange_length * chunk.replica_size, dtype=chunk.wire_dtype, device=chunk.device)
        mine = flight.recv[: chunk.exchange_length]
        stats.all_gathers += 1
        work = all_gather(out, mine, chunk.replica_group, async_op=True)
    ex = Flight(chunk, out, work, mine)
    ex.fulls = [flight.recv]  # this replica's own pieces stay in the scatter buffer
    return ex


# --------------------------------------------------------------------------
# Stage 4: update the local pieces, then QK-clip their rows.
# --------------------------------------------------------------------------


def finish_update(flight: Flight, steps: Sequence[Stages], stats: PipelineStats) -> None:
    with stats.time("exchange"):
        if flight.work is not None:
            flight.work.wait()
    chunk = flight.chunk
    scatter = flight.fulls[0] if flight.fulls else flight.recv
    updated = []
    with stats.time("update"):
        for u in chunk.updates:
            buffer = scatter if u.source == "scatter" else flight.recv
            if u.index is not None:  # every block of a cut unit at once (Pack.index)
                steps[u.param].apply_update(u.region, buffer.index_select(0, u.index).view(u.mine), None)
                updated.append(steps[u.param])
                continue
            block = block_at(buffer, u.offset, u.padded, u.mine)
            rows = block_rows_at(buffer, u.offset, u.padded, u.mine, u.row_slots) if u.row_slots else None
            if not block.numel() and (rows is None or not rows.numel()):
                continue
            steps[u.param].apply_update(u.region, block, rows)
            if block.numel():
                updated.append(steps[u.param])
    scale_rows(updated, stats)


def scale_rows(updated: Sequence[Stages], stats: PipelineStats) -> None:
    with stats.time("qk_clip"):
        for s in {id(s): s for s in updated}.values():  # once per parameter (a cut unit's blocks arrive apart)
            if s.scales_rows:
                s.scale_rows()
