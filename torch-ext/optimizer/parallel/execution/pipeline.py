"""The runtime of parallel Muon: it moves tensors between ranks and calls the rule's stages.

Newton–Schulz needs whole matrices, but FSDP/HSDP/TP/solver placements leave each rank a
piece.  Rather than gathering every matrix on every rank, each matrix (or range of experts) has
one *owner*, and the step plan (``planning/plan.py``, computed once) says who owns what and where every
piece sits in every buffer.  Each chunk of the plan goes through four stages
(``chunk_stages.py``):

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
from typing import Sequence

import torch

from ..planning.plan_data import StepPlan, row_slots
from .buffers import Flight, assemble, assemble_rows, assembled_shape, block_at, block_rows_at, matrix_and_rows
from .chunk_stages import (Stages, all_gather, finish_gather, finish_update, orthogonalize_owned, scale_rows,
                           start_exchange, start_gather, start_scatter)
from .stats import PipelineStats


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
        scale_rows([steps[job.param] for job in jobs], stats)


# --------------------------------------------------------------------------
# The pipeline driver.
# --------------------------------------------------------------------------


def run_parallel_muon(plan: StepPlan, steps: Sequence[Stages], *, lookahead: int = 1,
                      stats: PipelineStats | None = None) -> PipelineStats:
    """Run the four stages over all chunks, overlapping communication with compute."""
    stats = stats if stats is not None else PipelineStats()
    chunks = plan.chunks
    gathers: deque[Flight] = deque()
    launched = 0
    scattering: Flight | None = None
    exchanging: Flight | None = None
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
            s.input_into(block_at(mine, 0, o.padded, g.mine), ())
            if o.row_slots:
                s.row_state_into(block_rows_at(mine, 0, o.padded, g.mine, o.row_slots), ())
            out = mine.new_empty(mine.numel() * g.size)
            all_gather(out, mine, g.group)
            stats.all_gathers += 1
            matrix, row_blocks = matrix_and_rows(out.view(g.size, *o.padded), o.row_slots)
            full = assemble(out.new_empty(assembled_shape(o)), matrix, o)
            rows = None if row_blocks is None else assemble_rows(row_blocks, o)
        with stats.time("orthogonalize"):
            update, new_rows = s.orthogonalize(full, rows)
            update = update.to(full.dtype)
        with stats.time("update"):
            s.apply_update((), update[g.my_index], None if new_rows is None else new_rows[g.my_rows])
        scale_rows([s], stats)
        item = out.element_size()
        stats.bytes_sent += mine.numel() * item * (g.size - 1)
        stats.bytes_received += mine.numel() * item * (g.size - 1)
    stats.matrices += len(plan.gather_all) + len(plan.local)
    return stats
