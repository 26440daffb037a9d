"""The cost model of Newton–Schulz cut over k ranks (pure: numbers in, numbers out).

:func:`split_ns_cost` gives, for a shape cut over k ranks, every member's FLOPs, the bytes each
member sends (= receives) in the collectives, their count and the modelled time; the planner
(``cut_model.py``) compares that time with the unit's whole time to decide what to cut, and the
split iteration (``newton_schulz/cut.py``) asks :func:`choose_b_split` and
:func:`choose_recursion` how to run each step.  Every rank computes the same answers.

Time = max(kernels x launch, compute + collectives), with compute = the busiest member's FLOPs /
the rate and the collectives priced by :class:`~.cut_hardware.SplitHardware`.  Nothing is
overlapped within a straight run (a member waits for each collective before its next product).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ...newton_schulz.coefficients import CoefficientSpec, resolve_ns_coefficients
from ...newton_schulz.forms import check_ns_method
from ...newton_schulz.restarts import gram_restart_plan
from .cut_hardware import CUDA_NVLINK, SplitHardware
from .owners import split_range_evenly

B_SPLITS = ("auto", "replicated", "rows")
RECURSIONS = ("auto", "redundant", "rows")


# ----------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------


def column_blocks(n: int, k: int) -> list[slice]:
    """The default cut of n columns into k contiguous blocks, the first ``n % k`` one wider."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"column_blocks: k must be a positive int, got {k!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < k:
        raise ValueError(f"column_blocks: need n >= k columns (every block at least one wide), got n={n!r}, k={k}")
    return split_range_evenly(n, k)


def row_block(m: int, k: int, j: int) -> tuple[int, int, int]:
    """Rows of an m x m product that rank j computes when it is split by rows: (start, stop, p),
    p = ceil(m / k) rows per rank (the last ranks may have fewer, or none); padded to p for the
    all-gather, so the gathered [k p, m] rows are the product's rows in order, the padding after."""
    p = -(-m // k)
    start = min(j * p, m)
    return start, min(start + p, m), p


# ----------------------------------------------------------------------------
# Choices (pure, the same on every rank)
# ----------------------------------------------------------------------------


def wide_dtype(dtype: torch.dtype, input_dtype: torch.dtype = torch.float32) -> torch.dtype:
    return torch.promote_types(torch.promote_types(input_dtype, dtype), torch.float32)


def check_b_split(b_split) -> str:
    if b_split not in B_SPLITS:
        raise ValueError(f"b_split must be one of {', '.join(map(repr, B_SPLITS))}, got {b_split!r}")
    return b_split


def check_recursion(recursion) -> str:
    if recursion not in RECURSIONS:
        raise ValueError(f"recursion must be one of {', '.join(map(repr, RECURSIONS))}, got {recursion!r}")
    return recursion


def _gather_rows_s(shape: Sequence[int], k: int, dtype: torch.dtype, hardware: SplitHardware) -> float:
    """One all-gather of an m x m product's rows (per matrix of the batch), padded to p rows each."""
    batch, m = math.prod(shape[:-2]), min(shape[-2:])
    return hardware.all_gather_s(k * batch * -(-m // k) * m * dtype.itemsize, k)


def choose_b_split(
    shape: Sequence[int], k: int, dtype: torch.dtype | None = None, hardware: SplitHardware | None = None
) -> str:
    """``"rows"`` when computing B = b A + c A^2 by row blocks plus an all-gather is modelled
    faster than computing it on every rank, else ``"replicated"`` (always for k = 1).

    Per classic step and matrix batch: saved ``2 batch m^2 (m - p)`` FLOPs (p = ceil(m/k), the
    busiest rank's rows) at ``hardware.flops(dtype)``, against one all-gather of B's rows
    (:meth:`SplitHardware.all_gather_s`). Pure."""
    hardware = hardware or CUDA_NVLINK
    dtype = dtype or hardware.compute_dtype
    if k <= 1:
        return "replicated"
    batch = math.prod(shape[:-2])
    m = min(shape[-2:])
    p = -(-m // k)
    saved = 2 * batch * m * m * (m - p) / hardware.flops(dtype)
    return "rows" if saved > _gather_rows_s(shape, k, dtype, hardware) else "replicated"


def choose_recursion(
    shape: Sequence[int], k: int, length: int, dtype: torch.dtype | None = None, hardware: SplitHardware | None = None
) -> str:
    """How a Gram segment of ``length`` >= 2 steps runs its m x m recursion on k ranks:
    ``"redundant"`` (every member all of it, ``(4L - 3) 2 m^3`` FLOPs, no communication) or
    ``"rows"`` (each member its ceil(m/k) rows of every product, and 2L all-gathers: B every step,
    the next A every step but the last, the factor Q at the end), whichever is modelled faster.
    Pure."""
    hardware = hardware or CUDA_NVLINK
    dtype = dtype or hardware.compute_dtype
    if k <= 1 or length < 2:
        return "redundant"
    batch = math.prod(shape[:-2])
    m = min(shape[-2:])
    p = -(-m // k)
    saved = (4 * length - 3) * 2 * batch * m * m * (m - p) / hardware.flops(dtype)
    return "rows" if saved > 2 * length * _gather_rows_s(shape, k, dtype, hardware) else "redundant"


# ----------------------------------------------------------------------------
# The cost of one unit
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitCost:
    """Modelled cost of Newton-Schulz on one unit split over k ranks (k = 1: unsplit)."""

    shape: tuple[int, ...]
    k: int
    form: str  # "classic" | "gram"
    b_split: str  # "replicated" | "rows" (of the classic steps)
    plan: tuple[int, ...]  # segment lengths (all ones for the classic form)
    flops_per_rank: tuple[int, ...]  # matmul FLOPs of each member (block widths may differ)
    bytes_per_rank: int  # bytes each member sends (and receives) in the collectives
    collectives: int
    time_s: float  # critical path: the busiest member's FLOPs, plus the collectives
    recursion: tuple[str, ...] = ()  # per segment: "redundant" | "rows" ("-" for a classic step)
    comm_s: float = 0.0  # the collectives' seconds
    compute_s: float = 0.0  # the busiest member's products' seconds
    units: int = 1  # same-shape units orthogonalised together (their matrices in one batch)

    @property
    def flops(self) -> int:
        return max(self.flops_per_rank)

    @property
    def rank_seconds(self) -> float:
        """k x time: the devices' time the unit occupies (every member waits on the collectives)."""
        return self.k * self.time_s


def split_ns_cost(
    shape: Sequence[int],
    k: int,
    ns_steps: int = 5,
    method: str = "auto",
    dtype: torch.dtype | None = None,
    coefficients: CoefficientSpec = "fixed",
    b_split: str = "auto",
    hardware: SplitHardware | None = None,
    widths: Sequence[int] | None = None,
    recursion: str = "auto",
    units: int = 1,
) -> SplitCost:
    """FLOPs per rank, bytes per rank, collectives and modelled time of Newton-Schulz on ``shape``
    (``[..., m, n]``, either orientation: the long side is cut) over k ranks; with ``units``,
    of that many same-shape units in one call (their matrices one batch).

    A batch of two or more matrices runs as two halves, interleaved (each half's collectives
    overlapping the other's products): :func:`_interleaved`.  ``dtype``: the compute dtype as the
    user set it (None: the device's defaults, per form); the form and the dtype it runs in are
    :meth:`SplitHardware.form`'s, the unsplit call's own choice for the whole shape, which the
    split iteration takes too; ``widths``: the members' block widths (default
    :func:`column_blocks`).  FLOPs count the matmuls as
    :func:`~optimizer.newton_schulz.newton_schulz_flops` does (k = 1 gives exactly its count);
    the per-step counts are :class:`_Tally`'s.  Elementwise work is ignored.  Pure."""
    hardware = hardware or CUDA_NVLINK
    run = _straight_run(shape, k, ns_steps, method, dtype, coefficients, b_split, hardware, widths, recursion, units)
    if k > 1 and run.batch >= 2:
        return _interleaved(run, ns_steps, coefficients, hardware)
    return run.cost


@dataclass
class _Run:
    """A straight run's cost, and what its halves are run with when the batch is interleaved."""

    cost: SplitCost
    batch: int
    widths: Sequence[int]
    dtype: torch.dtype  # what it runs in
    kernels: int


def _straight_run(shape, k, ns_steps, method, dtype, coefficients, b_split, hardware, widths, recursion,
                  units) -> _Run:
    """One call's cost, the halves of a batch not interleaved (what each half is)."""
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"split_ns_cost needs a shape [..., m, n], got {shape}")
    check_ns_method(method)
    check_b_split(b_split)
    check_recursion(recursion)
    steps = resolve_ns_coefficients(coefficients, ns_steps)
    batch = math.prod(shape[:-2]) * units
    widths = _member_widths(widths, k, max(shape[-2:]))
    form, dtype = hardware.form(shape, ns_steps, method, dtype, steps)  # dtype: what it runs in
    plan = gram_restart_plan(steps, ns_steps, dtype) if form == "gram" else (1,) * ns_steps
    rows = k > 1 and (b_split == "rows" or (b_split == "auto" and choose_b_split(shape, k, dtype, hardware) == "rows"))
    tally = _Tally(shape, k, batch, widths, dtype, rows, hardware)
    for i, length in enumerate(plan):
        if k > 1:  # the segment's (or step's) Gram all-reduce
            tally.gram_all_reduce(first=i == 0)
        if length == 1:
            tally.classic_step()
        else:
            tally.gram_segment(length, recursion)
    compute = max(tally.flops) / hardware.flops(dtype)
    cost = SplitCost(
        shape=shape, k=k, form=form, b_split="rows" if rows else "replicated", plan=tuple(plan),
        flops_per_rank=tuple(tally.flops), bytes_per_rank=int(round(tally.sent)), collectives=tally.collectives,
        time_s=max(tally.kernels * hardware.kernel_launch, compute + tally.comm),
        recursion=tuple(tally.chosen), comm_s=tally.comm, compute_s=compute, units=units,
    )
    return _Run(cost, batch, widths, dtype, tally.kernels)


def _member_widths(widths: Sequence[int] | None, k: int, long: int) -> Sequence[int]:
    if widths is None:
        widths = [sl.stop - sl.start for sl in column_blocks(long, k)] if k <= long else None
    if widths is None or len(widths) != k or sum(widths) != long or min(widths) < 1:
        raise ValueError(f"split_ns_cost: cannot split {long} columns over k={k} ranks as {widths}")
    return widths


class _Tally:
    """A straight run's counts, step by step (per matrix of the batch, one collective for the whole
    batch; s = the short side, w a member's block width, r its rows of a product split by rows):

    * classic step: ``2 s^2 w`` (local Gram) + ``2 s^3`` (B, replicated) or ``2 r s^2`` (B, rows) +
      ``2 s^2 w`` (B X); one all-reduce of ``s^2`` (+ an all-gather of ``k p s`` with rows).
    * Gram segment of L >= 2 steps: ``2 s^2 w`` + ``(4 L - 3) 2 s^3`` (recursion redundant) or
      ``(4 L - 3) 2 r s^2`` and 2L all-gathers of ``k p s`` (by rows) + ``2 s^2 w``; one all-reduce.

    The first all-reduce is in the wide dtype (fp32 for bf16/fp32) and carries one more number per
    matrix (the norm)."""

    def __init__(self, shape, k, batch, widths, dtype, rows, hardware):
        self.shape, self.k, self.batch, self.widths, self.dtype, self.rows = shape, k, batch, widths, dtype, rows
        self.hardware = hardware
        self.s = s = min(shape[-2:])
        item, self.wide = dtype.itemsize, wide_dtype(dtype).itemsize
        self.gram_bytes = batch * s * s * item
        self.gather_bytes = k * batch * -(-s // k) * s * item  # an all-gather of padded rows, the gathered total
        self.flops = [0] * k
        self.sent, self.comm, self.collectives = 0.0, 0.0, 0
        self.kernels = 5  # normalisation: cast, norm, scale, divisions
        self.chosen: list[str] = []

    def gram_all_reduce(self, first: bool) -> None:
        k, s, wide = self.k, self.s, self.wide
        nbytes = self.batch * (s * s * wide + wide) if first else self.gram_bytes
        ring = 2 * (k - 1) / k  # all-reduce: share of the buffer each rank sends
        self.sent += ring * nbytes
        self.comm += self.hardware.all_reduce_s(nbytes, k)
        self.collectives += 1

    def classic_step(self) -> None:
        k, s, batch = self.k, self.s, self.batch
        self._outer_products()
        self.chosen.append("-")
        self.kernels += 3 + (k > 1)
        if self.rows:
            self._own_rows(2 * batch * s * s)
            self.sent += (k - 1) / k * self.gather_bytes
            self.comm += self.hardware.all_gather_s(self.gather_bytes, k)
            self.collectives += 1
            self.kernels += 2
        else:
            self.flops = [f + 2 * batch * s**3 for f in self.flops]

    def gram_segment(self, length: int, recursion: str) -> None:
        k, s, batch = self.k, self.s, self.batch
        self._outer_products()
        how = recursion if recursion != "auto" else choose_recursion(self.shape, k, length, self.dtype, self.hardware)
        how = how if k > 1 else "redundant"
        self.chosen.append(how)
        products = 4 * length - 3
        self.kernels += products + 4 + (k > 1)
        if how == "rows":
            self._own_rows(products * 2 * batch * s * s)
            self.sent += 2 * length * (k - 1) / k * self.gather_bytes
            self.comm += 2 * length * self.hardware.all_gather_s(self.gather_bytes, k)
            self.collectives += 2 * length
            self.kernels += 4 * length
        else:
            self.flops = [f + 2 * batch * products * s**3 for f in self.flops]

    def _outer_products(self) -> None:
        for j, w in enumerate(self.widths):
            self.flops[j] += 2 * self.batch * self.s * self.s * w * 2  # X_i X_i^T and the left product

    def _own_rows(self, product_flops_per_row) -> None:
        for j in range(self.k):
            r0, r1, _ = row_block(self.s, self.k, j)
            self.flops[j] += product_flops_per_row * (r1 - r0)


def _interleaved(run: _Run, ns_steps: int, coefficients, hardware: SplitHardware) -> SplitCost:
    """A batch run as two halves, each half's collectives overlapping the other's products: its time
    is ``max(C + overlap_cost x min(C, M), M)`` plus one phase of the first half to fill the
    pipeline, C and M the halves' products and collectives, and never more than the halves one
    after the other (each half a straight run: the runtime halves a batch once)."""
    cost = run.cost
    s, l = min(cost.shape[-2:]), max(cost.shape[-2:])
    recursion = cost.recursion[0] if cost.recursion and cost.recursion[0] != "-" else "redundant"
    halves = [_straight_run((h, s, l), cost.k, ns_steps, cost.form, run.dtype, coefficients, cost.b_split, hardware,
                            run.widths, recursion, 1).cost
              for h in (run.batch - run.batch // 2, run.batch // 2)]
    C, M = sum(h.compute_s for h in halves), sum(h.comm_s for h in halves)
    fill = min(halves[0].compute_s, halves[0].comm_s) / max(1, halves[0].collectives)
    overlapped = min(max(C + hardware.overlap_cost * min(C, M), M) + fill, C + M)
    time = max(2 * run.kernels * hardware.kernel_launch, overlapped)
    return dataclasses.replace(cost, time_s=time, comm_s=M, collectives=sum(h.collectives for h in halves))


def split_critical_path(
    shape: Sequence[int],
    k: int,
    hardware: SplitHardware | None = None,
    ns_steps: int = 5,
    method: str = "auto",
    dtype: torch.dtype | None = None,
    coefficients: CoefficientSpec = "fixed",
) -> float:
    """Modelled seconds from the first to the last kernel of a unit split over k ranks (all k
    members are busy, or waiting in its collectives, for that long). Compare it with the per-rank
    ideal share (model FLOPs / world / rate) to decide whether a unit needs splitting."""
    return split_ns_cost(shape, k, ns_steps, method, dtype, coefficients, "auto", hardware).time_s


def choose_split_ranks(
    shape: Sequence[int],
    max_ranks: int,
    hardware: SplitHardware | None = None,
    ns_steps: int = 5,
    method: str = "auto",
    dtype: torch.dtype | None = None,
    coefficients: CoefficientSpec = "fixed",
    candidates: Sequence[int] | None = None,
    target_s: float | None = None,
    tolerance: float = 0.1,
) -> int:
    """k (1: do not split) for ``shape``, from :func:`split_critical_path` of each candidate k.

    ``candidates``: the k to consider (default 1 and the powers of two up to ``max_ranks``;
    never more than the long side). The answer is the smallest k whose time is within
    ``tolerance`` of the fastest candidate's: past the point where the collectives dominate, more
    ranks buy almost nothing (a 512 x 512 fp32 matrix on CPU_GLOO: 16.3 ms at k = 64, 15.7 ms at
    k = 512) and every member is held for the whole unit. With ``target_s`` (e.g. the per-rank
    ideal share), the smallest k whose time is within it, if any: no more ranks than the unit
    needs. Pure: no tensors, the same answer on every rank."""
    if isinstance(max_ranks, bool) or not isinstance(max_ranks, int) or max_ranks < 1:
        raise ValueError(f"choose_split_ranks: max_ranks must be a positive int, got {max_ranks!r}")
    if not tolerance >= 0:
        raise ValueError(f"choose_split_ranks: tolerance must be >= 0, got {tolerance!r}")
    l = max(int(d) for d in tuple(shape)[-2:])
    if candidates is None:
        candidates = [1 << e for e in range(max_ranks.bit_length()) if (1 << e) <= max_ranks]
    ks = sorted({1, *(int(c) for c in candidates if 1 <= int(c) <= min(max_ranks, l))})
    times = [(split_critical_path(shape, k, hardware, ns_steps, method, dtype, coefficients), k) for k in ks]
    if target_s is not None:
        within = [k for t, k in times if t <= target_s]
        if within:
            return within[0]
    best = min(t for t, _ in times)
    return next(k for t, k in times if t <= best * (1 + tolerance))
