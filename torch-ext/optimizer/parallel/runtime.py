"""The runtime of parallel Muon: it moves tensors between ranks and calls the rule's stages.

Newton–Schulz needs whole matrices, but FSDP/HSDP/TP/solver placements leave each rank a
piece.  Rather than gathering every matrix on every rank, each matrix (or range of experts) has
one *owner*, and the step plan (``plan.py``, computed once) says who owns what and where every
piece sits in every buffer.  Each chunk of the plan goes through four stages, read top to
bottom below:

  1. gather        every rank writes its piece of what is orthogonalised (``step.input_into``)
                   straight into the send buffer, in the wire dtype, and one all_to_all_single
                   delivers the pieces to their owners, which assemble whole matrices with one
                   index kernel each (none at all where the pieces arrive as the matrix's rows);
  2. orthogonalize the owner runs the rule's owner stage (``step.orthogonalize``), one batched
                   call per shape; a block of a unit cut over k ranks (``ns_split``) runs the
                   split stage (``step.orthogonalize_split``) with its group's other owners,
                   every rank taking a chunk's cut units in one order (the unit's index);
  3. scatter       one all_to_all_single returns to every rank its piece of the update; when
                   the matrix was split over replicas (HSDP, replicated DTensors), one all_gather
                   on the replica group then hands every other replica the pieces this
                   replica's owners computed;
  4. update        the rule's local stages on every piece: ``step.apply_update`` (weight decay
                   and the update) and ``step.scale_rows`` (QK-clip).

Per-row state (NorMuon's v, ``step.row_bytes > 0``) rides along: every block of a piece has
``row_slots`` more columns holding its rows' state (``step.row_state_into``), the owner
assembles it with the rows' index and hands it to its stage with the matrix, and the scatter
(and the replica all-gather) return the new state in the same columns to ``step.apply_update``.
A block of a cut unit carries the state of its rows alike: every row of a wide unit cut along
its columns (each block owner computes the same new v for them, and every member's pieces get
them back), a row block's own rows of a tall unit cut along its rows.

Chunk i+1's gather is in flight while chunk i is orthogonalised, chunk i-1's scatter and chunk
i-2's replica all-gather too (``async_op=True``, gloo and NCCL alike).  Peak extra memory: the
buffers of ``lookahead + 2`` chunks, one more while a replica all-gather is in flight.

The runtime knows nothing of the update rule: ``steps[i]`` is any object with the four stage
methods of :class:`optimizer.rule.MatrixStep`.  It never reads device data back to the host:
every size and offset comes from the plan, every index tensor already lives on the parameter's
device.

Two other drivers run the same stages: :func:`run_local` (units a rank holds whole: plain
tensors, replicated or expert-sharded DTensors) and :func:`gather_everything`, the baseline
("Distributed Muon", Liu et al. 2025) where every rank all-gathers every matrix.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from . import moves
from .buffers import _Flight, _piece, _row_piece, _split
from .plan import Chunk, MoveChunk, Owned, StepPlan, row_slots
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


# --------------------------------------------------------------------------
# Buffers and index kernels
# --------------------------------------------------------------------------


def _assembled_shape(o: Owned) -> tuple[int, ...]:
    lead = o.shape[:-2]
    return (*lead, *(n + int(t) for n, t in zip(o.shape[-2:], o.trash)))


def _real(o: Owned) -> tuple:
    """Cut the spare slot (where padding was thrown) off an assembled matrix."""
    return tuple(slice(0, n) for n in o.shape)


def _indexer(o: Owned, index: tuple) -> tuple[tuple, int]:
    """Index of the unit tensor addressing every member's padded block at once, and where
    the member axis lands in the indexed result."""
    lead = [slice(None)] * (len(o.shape) - 2)
    rows, cols = index
    if rows is not None and cols is not None:
        return (*lead, rows[:, :, None], cols[:, None, :]), len(lead)
    if rows is not None:
        return (*lead, rows), len(lead)
    return (*lead, slice(None), cols), len(lead) + 1


def _assemble(target: torch.Tensor, blocks: torch.Tensor, o: Owned) -> torch.Tensor:
    """Write every member's padded block (``blocks``: ``[members, *padded matrix]``) to its place
    in ``target`` (one index kernel); return the real matrix."""
    indexer, axis = _indexer(o, o.write)
    target[indexer] = blocks.movedim(0, axis)
    return target[_real(o)]


def _rows_shape(o: Owned) -> tuple[int, ...]:
    return (*o.shape[:-1], o.row_slots)


def _assemble_rows(blocks: torch.Tensor, o: Owned) -> torch.Tensor:
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


def _cut_rows(rows: torch.Tensor, o: Owned) -> torch.Tensor:
    """Every member's rows of the unit's row state, ``[members, ..., padded rows, slots]`` (or
    broadcastable to it)."""
    if o.read[0] is None:
        return rows
    lead = len(o.shape) - 2
    return rows[(*[slice(None)] * lead, o.read[0])].movedim(lead, 0)


def _arrived(recv: torch.Tensor, chunk: Chunk, o: Owned) -> torch.Tensor:
    """A zero-copy job: its pieces already are the matrix, in order (with their row-state
    columns, if any: ``[..., rows, cols + slots]``)."""
    if chunk.shard_size == 1:
        return recv[o.offset: o.offset + math.prod(o.padded)].view(o.padded)
    rows = o.shape[0]
    return recv.view(chunk.shard_size * o.padded[0], o.padded[-1])[:rows]


def _region(t: torch.Tensor, region) -> torch.Tensor:
    return t[region] if region else t


def _all_to_all(recv, send, recv_splits, send_splits, chunk: Chunk, stats: PipelineStats):
    stats.all_to_alls += 1
    return dist.all_to_all_single(recv, send, recv_splits, send_splits, group=chunk.shard_group, async_op=True)


def _all_gather(out: torch.Tensor, mine: torch.Tensor, group, async_op: bool = False):
    # all_gather_into_tensor is deprecated in favour of all_gather_single (torch >= 2.10)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, mine, group=group, async_op=async_op)


# --------------------------------------------------------------------------
# Stage 1: gather pieces to owners.
# --------------------------------------------------------------------------


def start_gather(chunk: Chunk | MoveChunk, steps: Sequence[Stages], stats: PipelineStats) -> _Flight:
    if isinstance(chunk, MoveChunk):
        return moves.start_gather(chunk, steps, stats)
    with stats.time("gather"):
        send = torch.empty(chunk.send_numel, dtype=chunk.wire_dtype, device=chunk.device)
        for pack in chunk.packs:
            if pack.index is not None:  # every block of a cut unit: one momentum call, one index kernel
                piece = torch.empty(pack.mine, dtype=chunk.wire_dtype, device=chunk.device)
                steps[pack.param].input_into(piece, pack.region)
                send.index_copy_(0, pack.index, piece.view(-1))
                continue
            slot = _piece(send, pack.offset, pack.padded, pack.mine)
            if slot.numel():
                steps[pack.param].input_into(slot, pack.region)
            if pack.row_slots:
                rows = _row_piece(send, pack.offset, pack.padded, pack.mine, pack.row_slots)
                if rows.numel():
                    steps[pack.param].row_state_into(rows, pack.region)
        if chunk.shard_group is None:
            return _Flight(chunk, send, None)
        recv = torch.empty(chunk.segment * chunk.shard_size, dtype=chunk.wire_dtype, device=chunk.device)
        work = _all_to_all(recv, send, [chunk.segment] * chunk.shard_size, chunk.send_splits, chunk, stats)
    return _Flight(chunk, recv, work, send)


def finish_gather(flight: _Flight, stats: PipelineStats) -> list[torch.Tensor]:
    """Wait for the gather; assemble the whole matrices this rank owns (batched by shape), and
    their row state (``flight.rows``)."""
    if isinstance(flight.chunk, MoveChunk):
        return moves.finish_gather(flight, stats)
    with stats.time("gather"):
        if flight.work is not None:
            flight.work.wait()
        chunk, recv = flight.chunk, flight.recv
        batches = [None] * len(chunk.batches)
        row_batches = [None] * len(chunk.batches)
        for b, members in enumerate(chunk.batches):
            o = chunk.owned[members[0]]
            batches[b] = recv.new_empty((len(members), *_assembled_shape(o)))
            if o.row_slots:
                row_batches[b] = recv.new_empty((len(members), *_rows_shape(o)))
        fulls, rows = [], []
        for k, o in enumerate(chunk.owned):
            if o.zero_copy:
                full, row = _split(_arrived(recv, chunk, o), o.row_slots)
                fulls.append(full)
                rows.append(row)
                continue
            in_batch = chunk.batches[o.batch].index(k) if o.batch >= 0 else -1
            target = batches[o.batch][in_batch] if o.batch >= 0 else recv.new_empty(_assembled_shape(o))
            blocks = recv.view(chunk.shard_size, chunk.segment)[:, o.offset: o.offset + math.prod(o.padded)]
            matrix, row_blocks = _split(blocks.view(chunk.shard_size, *o.padded), o.row_slots)
            fulls.append(_assemble(target, matrix, o))
            row = None
            if row_blocks is not None:
                row = _assemble_rows(row_blocks, o)
                if in_batch >= 0:
                    row = row_batches[o.batch][in_batch].copy_(row)
            rows.append(row)
        flight.fulls = [(b, batches[b][(slice(None), *_real(chunk.owned[m[0]]))], row_batches[b])
                        for b, m in enumerate(chunk.batches)]
        flight.rows = rows
    return fulls


# --------------------------------------------------------------------------
# Stage 2: orthogonalise on the owner.
# --------------------------------------------------------------------------


def orthogonalize_owned(flight: _Flight, fulls: list[torch.Tensor], steps: Sequence[Stages],
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
        # batch, whose halves interleave: plan_world.batch_key).  A block's row state (NorMuon's v
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
                    rows_out[k] = new_rows.view(len(members), *_rows_shape(o))[i]
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
                  rows: Sequence[torch.Tensor | None] = ()) -> _Flight:
    """Cut every owned update (and its new row state, ``rows``) into the members' blocks and send them."""
    if isinstance(chunk, MoveChunk):
        return moves.start_scatter(chunk, updates, stats, rows)
    with stats.time("scatter"):
        length = max(chunk.scatter_recv_numel, chunk.exchange_length)  # what the exchange sends from
        alone = chunk.shard_group is None  # one member: what it sends is what it receives
        numel = chunk.segment * chunk.shard_size
        buffer = torch.empty(max(numel, length) if alone else numel, dtype=chunk.wire_dtype, device=chunk.device)
        send = buffer[:numel]
        for k, (o, u) in enumerate(zip(chunk.owned, updates)):
            row = rows[k] if rows else None
            if o.zero_copy:
                matrix, row_block = _split(_arrived(send, chunk, o), o.row_slots)
                matrix.copy_(u)
                if row_block is not None:
                    row_block.copy_(row)
                continue
            blocks = send.view(chunk.shard_size, chunk.segment)[:, o.offset: o.offset + math.prod(o.padded)]
            matrix, row_blocks = _split(blocks.view(chunk.shard_size, *o.padded), o.row_slots)
            indexer, axis = _indexer(o, o.read)
            matrix.copy_(u[indexer].movedim(axis, 0))
            if row_blocks is not None:
                row_blocks.copy_(_cut_rows(row, o))
        if alone:
            return _Flight(chunk, buffer, None)
        recv = torch.empty(length, dtype=chunk.wire_dtype, device=chunk.device)
        work = _all_to_all(recv[: chunk.scatter_recv_numel], send, chunk.scatter_recv_splits,
                           [chunk.segment] * chunk.shard_size, chunk, stats)
    return _Flight(chunk, recv, work, send)


def start_exchange(flight: _Flight, stats: PipelineStats) -> _Flight:
    """Wait for the scatter; hand the pieces of updates owned in this replica to the other replicas."""
    with stats.time("scatter"):
        if flight.work is not None:
            flight.work.wait()
    chunk = flight.chunk
    if not chunk.exchange_length:
        return _Flight(chunk, flight.recv, None)
    with stats.time("exchange"):
        out = torch.empty(chunk.exchange_length * chunk.replica_size, dtype=chunk.wire_dtype, device=chunk.device)
        mine = flight.recv[: chunk.exchange_length]
        stats.all_gathers += 1
        work = _all_gather(out, mine, chunk.replica_group, async_op=True)
    ex = _Flight(chunk, out, work, mine)
    ex.fulls = [flight.recv]  # this replica's own pieces stay in the scatter buffer
    return ex


# --------------------------------------------------------------------------
# Stage 4: update the local pieces, then QK-clip their rows.
# --------------------------------------------------------------------------


def finish_update(flight: _Flight, steps: Sequence[Stages], stats: PipelineStats) -> None:
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
            block = _piece(buffer, u.offset, u.padded, u.mine)
            rows = _row_piece(buffer, u.offset, u.padded, u.mine, u.row_slots) if u.row_slots else None
            if not block.numel() and (rows is None or not rows.numel()):
                continue
            steps[u.param].apply_update(u.region, block, rows)
            if block.numel():
                updated.append(steps[u.param])
    _scale_rows(updated, stats)


def _scale_rows(updated: Sequence[Stages], stats: PipelineStats) -> None:
    with stats.time("qk_clip"):
        for s in {id(s): s for s in updated}.values():  # once per parameter (a cut unit's blocks arrive apart)
            if s.scales_rows:
                s.scale_rows()


# --------------------------------------------------------------------------
# Units that need no communication.
# --------------------------------------------------------------------------


def run_local(plan: StepPlan, steps: Sequence[Stages], stats: PipelineStats) -> None:
    """Orthogonalise the units a rank holds whole (plain tensors, replicated or expert-sharded
    DTensors not split over replicas), same-shape ones in one batched call."""
    groups: dict[tuple, list] = {}
    for job in plan.local:
        s = steps[job.param]
        groups.setdefault((s.batch_key, job.shape, s.stack_dtype, s.row_bytes), []).append(job)
    cap = plan.local_batch_bytes
    batches = []
    for jobs in groups.values():  # batched by shape, each batch within the memory bound
        per = max(1, cap // max(1, jobs[0].bytes))
        batches += [jobs[k: k + per] for k in range(0, len(jobs), per)]
    for jobs in batches:
        with stats.time("orthogonalize"):
            s0 = steps[jobs[0].param]
            shape = jobs[0].shape
            stacked = torch.empty((len(jobs), *shape), dtype=s0.stack_dtype, device=s0.param.device)
            slots = row_slots(s0.row_bytes, s0.stack_dtype)
            rows = stacked.new_empty((len(jobs), *shape[:-1], slots)) if slots else None
            for i, job in enumerate(jobs):
                steps[job.param].input_into(stacked[i], job.region)
                if rows is not None:
                    steps[job.param].row_state_into(rows[i], job.region)
            flat = stacked.view(-1, *shape[-2:])
            flat_rows = None if rows is None else rows.view(-1, shape[-2], slots)
            result, new_rows = s0.orthogonalize(flat, flat_rows)
            result = result.view(len(jobs), *shape)
            new_rows = None if new_rows is None else new_rows.view(len(jobs), *shape[:-1], slots)
        with stats.time("update"):
            for i, job in enumerate(jobs):
                steps[job.param].apply_update(job.region, result[i], None if new_rows is None else new_rows[i])
        _scale_rows([steps[job.param] for job in jobs], stats)


# --------------------------------------------------------------------------
# The pipeline driver.
# --------------------------------------------------------------------------


def run_parallel_muon(plan: StepPlan, steps: Sequence[Stages], *, lookahead: int = 1,
                      stats: PipelineStats | None = None) -> PipelineStats:
    """Run the four stages over all chunks, overlapping communication with compute."""
    stats = stats if stats is not None else PipelineStats()
    chunks = plan.chunks
    gathers: deque[_Flight] = deque()
    launched = 0
    scattering: _Flight | None = None
    exchanging: _Flight | None = None
    for i, chunk in enumerate(chunks):
        # keep `lookahead` gathers in flight beyond the chunk being computed
        while launched < len(chunks) and launched <= i + lookahead:
            gathers.append(start_gather(chunks[launched], steps, stats))
            launched += 1
        if i == 0:
            run_local(plan, steps, stats)  # while the first gathers travel
        flight = gathers.popleft()
        fulls = finish_gather(flight, stats)  # 1. gather
        updates = orthogonalize_owned(flight, fulls, steps, stats)  # 2. orthogonalize
        del fulls
        scattered = start_scatter(chunk, updates, stats, flight.rows)  # 3. scatter (async)
        del updates
        if scattering is not None:
            exchanged = start_exchange(scattering, stats)  # 3b. replicas (async)
            if exchanging is not None:
                finish_update(exchanging, steps, stats)  # 4. update
            exchanging = exchanged
        scattering = scattered
    if not chunks:
        run_local(plan, steps, stats)
    if scattering is not None:
        exchanged = start_exchange(scattering, stats)
        if exchanging is not None:
            finish_update(exchanging, steps, stats)
        exchanging = exchanged
    if exchanging is not None:
        finish_update(exchanging, steps, stats)
    stats.chunks += len(chunks)
    stats.matrices += plan.jobs + len(plan.local)
    stats.owned += plan.owned + len(plan.local)
    stats.bytes_sent += plan.bytes_sent
    stats.bytes_received += plan.bytes_received
    stats.split_bytes += plan.split_bytes
    return stats


# --------------------------------------------------------------------------
# The baseline: every rank gathers every matrix.
# --------------------------------------------------------------------------


def gather_everything(plan: StepPlan, steps: Sequence[Stages], stats: PipelineStats | None = None) -> PipelineStats:
    """Every rank all-gathers every sharded matrix (padded pieces, one all_gather each),
    assembles it with the placement index math, orthogonalises it and keeps its piece."""
    stats = stats if stats is not None else PipelineStats()
    run_local(plan, steps, stats)
    for g in plan.gather_all:
        s = steps[g.param]
        o = g.owned
        with stats.time("gather"):
            mine = torch.zeros(math.prod(o.padded), dtype=g.wire_dtype, device=s.param.device)
            s.input_into(_piece(mine, 0, o.padded, g.mine), ())
            if o.row_slots:
                s.row_state_into(_row_piece(mine, 0, o.padded, g.mine, o.row_slots), ())
            out = mine.new_empty(mine.numel() * g.size)
            _all_gather(out, mine, g.group)
            stats.all_gathers += 1
            matrix, row_blocks = _split(out.view(g.size, *o.padded), o.row_slots)
            full = _assemble(out.new_empty(_assembled_shape(o)), matrix, o)
            rows = None if row_blocks is None else _assemble_rows(row_blocks, o)
        with stats.time("orthogonalize"):
            update, new_rows = s.orthogonalize(full, rows)
            update = update.to(full.dtype)
        with stats.time("update"):
            s.apply_update((), update[g.my_index], None if new_rows is None else new_rows[g.my_rows])
        _scale_rows([s], stats)
        item = out.element_size()
        stats.bytes_sent += mine.numel() * item * (g.size - 1)
        stats.bytes_received += mine.numel() * item * (g.size - 1)
    stats.matrices += len(plan.gather_all) + len(plan.local)
    return stats
