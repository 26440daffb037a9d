"""The step plan's data: what planning takes in, and what one rank's plan holds (pure data).

The terms (unit, job, pattern, chunk, block, row state, cut) are explained in ``plan.py``, which
builds these from shapes and placements; ``execution/pipeline.py`` runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ...distributed.layout import ParamLayout
from ...distributed.placements import Index
from .cut_model import SplitModel

# ----------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanParam:
    """One Muon parameter with a gradient this step, as planning sees it."""

    name: str
    shape: tuple[int, ...]  # global
    layout: ParamLayout | None  # None: a plain tensor, orthogonalised where it is
    wire_dtype: torch.dtype  # what its shards travel as
    device: torch.device
    ns_key: object  # same key and same shape: one batched Newton-Schulz call
    cost: Callable[[tuple[int, ...]], float]  # Newton-Schulz FLOPs of a (sub-)shape
    mesh: object = None  # the DeviceMesh (for its groups)
    compute_itemsize: int = 4  # bytes per element of Newton-Schulz's workspace
    state_itemsize: int = 4  # bytes per element of the momentum's arithmetic (the stacked input)
    row_bytes: int = 0  # bytes of per-row state travelling with each row (NorMuon's v); 0: none
    split: SplitModel | None = None  # how its units may be cut over several ranks (None: never)


@dataclass(frozen=True)
class PlanSettings:
    chunk_size: int | None = None  # jobs per chunk (None: the pattern's number of ranks)
    replica_split: str = "auto"  # "always" | "never" | "auto"
    replica_min_flops_per_byte: float = 0.0  # "auto": split units at least this compute-heavy
    mode: str = "parallel"  # "gather": the gather-everything baseline


# ----------------------------------------------------------------------------
# Outputs (this rank's view)
# ----------------------------------------------------------------------------

Region = tuple  # slices selecting a unit's part of a local tensor (leading dims only)


def row_slots(row_bytes: int, dtype: torch.dtype) -> int:
    """Elements of a ``dtype`` buffer that carry one row's state of ``row_bytes`` bytes (0: none)."""
    return max(1, row_bytes // dtype.itemsize) if row_bytes else 0


@dataclass
class LocalJob:
    """A unit this rank orthogonalises alone, with no communication."""

    param: int
    region: Region
    shape: tuple[int, ...]
    bytes: int = 0  # its momentum update and Newton-Schulz workspace (local_unit_bytes)


@dataclass
class Pack:
    """Gather stage: this rank's piece of a job, written into the send buffer."""

    param: int
    region: Region
    offset: int
    padded: tuple[int, ...]  # the block in the buffer (its last ``row_slots`` columns: row state)
    mine: tuple[int, ...]  # this rank's piece of the matrix (<= padded)
    row_slots: int = 0
    # Every block of a cut unit at once (rank_chunk._fused): where each element of this rank's
    # piece of the unit (``mine``, row-major) goes in the buffer; offset and padded unused, the
    # blocks it stands for in ``blocks`` as (offset, padded, mine).
    index: object = None
    blocks: tuple = ()


@dataclass
class Owned:
    """A job this rank owns: how to assemble it from the gather buffer and cut it for the scatter."""

    param: int
    shape: tuple[int, ...]  # the unit's global shape
    offset: int  # within each member's segment
    padded: tuple[int, ...]  # every member's block (its last ``row_slots`` columns: row state)
    batch: int = -1  # index into Chunk.batches, or -1
    # Zero-copy: the members' padded pieces, in member order, are the matrix's rows
    # (then the gather buffer is the matrix, and the update is the scatter buffer).
    zero_copy: bool = False
    # index per unit dim: None (not sharded) or [S, padded_d] global indices; padded
    # entries point one past the end (``write``) or at 0 (``read``).
    write: tuple = ()
    read: tuple = ()
    trash: tuple[bool, ...] = ()  # per dim: the assembled tensor needs one spare slot
    experts: Index | None = None  # global indices of its leading dim (3-D units); None for a matrix
    row_slots: int = 0  # columns of row state after the matrix's padded columns
    split: SplitOwned | None = None  # a block of a cut unit: orthogonalised with its group


@dataclass
class SplitOwned:
    """An owned block of a unit cut over a group: the split Newton-Schulz call's arguments."""

    group: object  # ProcessGroup of ``ranks`` (group rank j = ranks[j] owns block j)
    ranks: tuple[int, ...]
    widths: tuple[int, ...]  # every block's width, in group-rank order
    transpose: bool  # cut along rows (a tall unit): the block's transpose is the column block
    unit: int  # the unit's index in its pattern: every rank runs a chunk's cut units in this order


@dataclass
class Update:
    """Update stage: where this rank's block of a job's update lands."""

    param: int
    region: Region
    source: str  # "scatter" (owned in this replica) or "exchange" (owned in another)
    offset: int
    padded: tuple[int, ...]
    mine: tuple[int, ...]
    row_slots: int = 0
    index: object = None  # as Pack.index: every block of a cut unit at once
    blocks: tuple = ()


@dataclass
class Chunk:
    pattern: int
    shard_group: object  # ProcessGroup or None (one member)
    shard_size: int
    member: int  # this rank's position in the shard group (sorted ranks: the group's order)
    replica_group: object
    replica_size: int
    wire_dtype: torch.dtype
    device: torch.device
    send_splits: list[int] = field(default_factory=list)  # gather
    packs: list[Pack] = field(default_factory=list)
    segment: int = 0  # gather: what each member sends to this rank (its owned jobs, padded)
    owned: list[Owned] = field(default_factory=list)
    batches: list[list[int]] = field(default_factory=list)  # owned jobs orthogonalised together
    scatter_recv_splits: list[int] = field(default_factory=list)
    exchange_length: int = 0  # padded contribution to the replica all-gather; 0: no exchange
    updates: list[Update] = field(default_factory=list)

    @property
    def send_numel(self) -> int:
        return sum(self.send_splits)

    @property
    def scatter_recv_numel(self) -> int:
        return sum(self.scatter_recv_splits)


@dataclass
class MoveChunk:
    """Units held whole by one rank (experts on ``Shard(0)``) orthogonalised by others, or cut over a
    group (``expert_moves.py``): one all-to-all over the mesh's ranks takes every block from its
    holder to its owner, one brings the update back.  Blocks travel whole, as they are (their row
    state after their columns): no padding, no index kernels; what is sent to member j sits at
    ``sum(send_splits[:j])``, and the way back mirrors the way out."""

    pattern: int
    group: object  # ProcessGroup of ``ranks`` (the mesh's)
    ranks: tuple[int, ...]  # sorted: a member's position is its place in the all-to-all
    member: int
    wire_dtype: torch.dtype
    device: torch.device
    send_splits: list[int] = field(default_factory=list)  # elements to each member (holder -> owner)
    recv_splits: list[int] = field(default_factory=list)  # elements from each member
    packs: list[Pack] = field(default_factory=list)  # the blocks this rank holds, in the send buffer
    owned: list[Owned] = field(default_factory=list)  # the blocks it orthogonalises, in the receive buffer
    batches: list[list[int]] = field(default_factory=list)
    updates: list[Update] = field(default_factory=list)  # where the returned blocks land (= packs' offsets)
    exchange_length: int = 0  # never a replica exchange

    @property
    def send_numel(self) -> int:
        return sum(self.send_splits)

    @property
    def recv_numel(self) -> int:
        return sum(self.recv_splits)


@dataclass
class GatherAll:
    """The baseline for one parameter: all-gather its padded pieces over the shard group."""

    param: int
    group: object
    size: int
    owned: Owned  # how to assemble the whole matrix from every member's piece
    mine: tuple[int, ...]  # this rank's block shape
    my_index: tuple  # indexer of this rank's block in the whole matrix
    wire_dtype: torch.dtype
    my_rows: tuple = ()  # indexer of this rank's rows (of the row state) in the whole unit


@dataclass
class StepPlan:
    local: list[LocalJob] = field(default_factory=list)
    chunks: list[Chunk | MoveChunk] = field(default_factory=list)
    jobs: int = 0  # distributed jobs in the world
    owned: int = 0  # of which this rank owns
    load: float = 0.0  # Newton-Schulz FLOPs this rank runs (owned jobs and local units)
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_chunk_bytes: int = 0  # the largest buffer bytes of one chunk on this rank
    peak_workspace_bytes: int = 0  # the largest Newton-Schulz workspace of one chunk on this rank
    local_unit_bytes: int = 0  # the largest unit orthogonalised where it is (momentum + workspace)
    gather_all: list[GatherAll] = field(default_factory=list)
    split_jobs: int = 0  # of ``owned``: blocks of cut units
    split_bytes: int = 0  # what this rank sends (= receives) in the split iterations' collectives (modelled)

    def memory_bound(self, lookahead: int) -> int:
        """Extra bytes a step may hold at once on this rank: the buffers of ``lookahead + 2``
        chunks (gathers ahead, the chunk being computed, the previous chunk's scatter; one
        more while replica all-gathers are in flight; never more chunks than there are) and
        the Newton-Schulz workspace of the chunk being computed; or one batch of the units
        orthogonalised where they are, with the first gathers in flight."""
        exchanging = any(c.exchange_length for c in self.chunks)
        in_flight = min(len(self.chunks), lookahead + 2 + int(exchanging))
        pipeline = in_flight * self.peak_chunk_bytes + self.peak_workspace_bytes
        ahead = min(len(self.chunks), lookahead + 1) * self.peak_chunk_bytes
        return max(pipeline, ahead + self.local_batch_bytes)

    @property
    def local_batch_bytes(self) -> int:
        """What one batch of units orthogonalised where they are may hold: a chunk's
        buffers, or one unit when a single unit is larger."""
        return max(self.peak_chunk_bytes, self.local_unit_bytes)


def ns_workspace(shape: Sequence[int]) -> int:
    """Elements of Newton–Schulz's live tensors for ``shape``: X, the next X, A = X Xᵀ and B."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * (2 * m * n + 2 * m * m)


def split_workspace(block: Sequence[int], transpose: bool, k: int) -> int:
    """Elements of the split iteration's live tensors for one block ``[..., s, w]`` (or its
    transpose): X, the next X, the Gram matrix (its first one in the wide dtype, with the norm),
    B, and B's gathered rows."""
    s, w = (block[-1], block[-2]) if transpose else (block[-2], block[-1])
    return math.prod(block[:-2]) * (2 * s * w + 3 * s * s + k * -(-s // k) * s + 1)


def local_unit_bytes(p: PlanParam, shape: Sequence[int]) -> int:
    """One unit orthogonalised where it is: its stacked momentum update and the workspace."""
    return math.prod(shape) * p.state_itemsize + ns_workspace(shape) * p.compute_itemsize
