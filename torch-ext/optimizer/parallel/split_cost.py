"""The cost model of Newton–Schulz split over k ranks (pure: numbers in, numbers out).

:func:`split_ns_cost` gives, for a shape split over k ranks, every member's FLOPs, the bytes each
member sends (= receives) in the collectives, their count and the modelled time; the planner
(``split_plan.py``) compares that time with the unit's whole time to decide what to cut, and the
split iteration (``split_newton_schulz.py``) asks :func:`choose_b_split` and
:func:`choose_recursion` how to run each step.  Every rank computes the same answers.

Time = max(kernels x launch, compute + collectives), with compute = the busiest member's FLOPs /
the rate, and each collective a ring (NCCL's algorithm for these sizes): an all-reduce of S bytes
over k ranks costs ``latency + 2 (k-1) steps + 2 (k-1)/k S / bandwidth``, an all-gather of S
gathered bytes ``latency + (k-1) steps + (k-1)/k S / bandwidth``.  A group inside one node uses
the node's link (NVLink); a group crossing nodes (aligned groups of k consecutive ranks: k / node
size nodes, ``node size`` ranks in each) sends through the members' own NICs, ``per node x NIC``
bytes/s per node and never more than the node's link, and its steps between nodes cost the
network's latency.  Nothing is overlapped (a member waits for each collective before its next
product).  :class:`SplitHardware` holds the figures; ``benchmarks/README.md`` gives their sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..newton_schulz import (CoefficientSpec, check_ns_method, choose_ns_form, gram_restart_plan, ns_form_dtypes,
                             resolve_ns_coefficients)
from .owners import split_range_evenly

B_SPLITS = ("auto", "replicated", "rows")
RECURSIONS = ("auto", "redundant", "rows")


# ----------------------------------------------------------------------------
# Hardware figures
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitHardware:
    """What the cost model assumes of one rank and its links.

    ``bandwidth`` is what one rank sends (and receives) per second inside a collective among
    ranks of one node, i.e. nccl-tests' "bus bandwidth": a ring all-reduce of S bytes takes
    ``2 (k-1)/k S / bandwidth``.  ``latency`` is the fixed cost of one collective; ``step_latency``
    what each of a ring's steps adds inside a node, ``inter_step_latency`` a step between nodes.
    ``node_size`` ranks (consecutive global ranks) share a node; 0: every group is inside one.
    ``inter_bandwidth``: bytes/s of one rank's own link out of its node (one NIC per GPU).
    ``kernel_launch``: host seconds per kernel, so that a call of few FLOPs is launch-bound.
    ``device``: the device type these figures describe ("cuda" or "cpu"; empty: "cuda" when
    ``compute_dtype`` is 16-bit): with ``compute_dtype=None`` the form and the dtype it runs in
    are the device's defaults (:func:`~optimizer.newton_schulz.choose_ns_form`), as at run time.
    """

    name: str
    bf16_flops: float  # FLOP/s of the Newton-Schulz matmuls in bf16 (and fp16)
    fp32_flops: float  # ... in fp32 (fp64: half of it)
    bandwidth: float  # bytes/s
    latency: float  # s per collective
    compute_dtype: torch.dtype  # Newton-Schulz's default compute dtype there
    step_latency: float = 0.0
    node_size: int = 0
    inter_bandwidth: float = 0.0
    inter_step_latency: float = 0.0
    kernel_launch: float = 0.0
    # How much of a collective's time it costs the products it overlaps (two halves of a batch,
    # interleaved: ``split_newton_schulz._interleaved``): 0 = free overlap, 1 = none (then the
    # halves cost what they cost one after the other).
    overlap_cost: float = 1.0
    device: str = ""

    @property
    def device_type(self) -> str:
        return self.device or ("cuda" if self.compute_dtype.itemsize == 2 else "cpu")

    def form(self, shape: Sequence[int], ns_steps: int, method: str, compute_dtype: torch.dtype | None,
             coefficients: CoefficientSpec = "fixed") -> tuple[str, torch.dtype]:
        """The form and the dtype Newton–Schulz runs ``shape`` in on this device, for the user's
        ``compute_dtype`` (None: the device's defaults): the unsplit call's own choice
        (:func:`~optimizer.newton_schulz.choose_ns_form`), which the split iteration makes too."""
        return choose_ns_form(shape, ns_steps, method, compute_dtype, coefficients, self.device_type)

    def rate(self, compute_dtype: torch.dtype | None) -> float:
        """FLOP/s of the products for the user's ``compute_dtype`` (None: the device's defaults;
        both 16-bit forms run at one rate): what turns a modelled time into FLOP-equivalents."""
        return self.flops(ns_form_dtypes(compute_dtype, self.device_type)["classic"])

    def flops(self, dtype: torch.dtype) -> float:
        if dtype in (torch.bfloat16, torch.float16):
            return self.bf16_flops
        if dtype == torch.float64:
            return self.fp32_flops / 2
        return self.fp32_flops

    def span(self, k: int) -> tuple[int, int]:
        """(nodes, ranks per node) of an aligned group of k consecutive ranks."""
        if self.node_size <= 0 or k <= self.node_size:
            return 1, k
        return -(-k // self.node_size), self.node_size

    def group_bandwidth(self, k: int) -> float:
        nodes, per_node = self.span(k)
        if nodes == 1:
            return self.bandwidth
        return min(self.bandwidth, per_node * self.inter_bandwidth)

    def _steps_s(self, steps: int, inter_steps: int) -> float:
        return self.latency + (steps - inter_steps) * self.step_latency + inter_steps * self.inter_step_latency

    def all_reduce_s(self, nbytes: float, k: int) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over an aligned group of k ranks."""
        if k <= 1:
            return 0.0
        nodes, _ = self.span(k)
        inter = 2 * nodes if nodes > 1 else 0  # NCCL's count of a ring all-reduce's steps between nodes
        return self._steps_s(2 * (k - 1), inter) + 2 * (k - 1) / k * nbytes / self.group_bandwidth(k)

    def all_gather_s(self, nbytes: float, k: int) -> float:
        """Seconds of a ring all-gather whose result is ``nbytes``, over an aligned group of k ranks."""
        if k <= 1:
            return 0.0
        nodes, _ = self.span(k)
        return self._steps_s(k - 1, nodes - 1) + (k - 1) / k * nbytes / self.group_bandwidth(k)

    def transfer_s(self, nbytes: float, same_node: bool) -> float:
        """Seconds to move ``nbytes`` from one rank to another (inside an all-to-all): the node's
        link, or the sender's NIC between nodes."""
        if nbytes <= 0:
            return 0.0
        if same_node or self.node_size <= 0 or self.inter_bandwidth <= 0:
            return nbytes / self.bandwidth
        return nbytes / self.inter_bandwidth

    def node_of(self, rank: int) -> int:
        return rank // self.node_size if self.node_size > 0 else 0


# One H100 SXM per rank, nodes of 8 (HGX/DGX H100: NVLink 4 through NVSwitch inside a node, one
# 400 Gb/s InfiniBand NIC per GPU between nodes).  Sources and the measurements behind each figure:
# benchmarks/README.md, "Scale (issue 29): the cost model's figures, and the rows at 512 and 1,024 ranks".
# - bf16 680 TFLOP/s: what the project's own Newton-Schulz achieved on one H100 at the large shapes
#   (4096x4096 672, 4096x14336 663, 8192x28672 679 TFLOP/s; the classic FLOP count over the measured
#   time, ../shared/gpu-h100-2026-11-26.md).  Batched expert stacks ran at 564 (32x2048x7168) and
#   16 stacked 1024x4096 at 450: below the rate, which only cut units (large) are timed at.
# - fp32 50 TFLOP/s: not measured (TF32 off: the datasheet's 67 TFLOP/s non-tensor-core fp32).
# - kernel_launch 22 us: a single 1024x4096 Newton-Schulz (5 steps, ~20 kernels) took 0.44 ms,
#   3.1x its FLOPs at the rate: launch-bound, 0.44 ms / 20 kernels.
# - NVLink 360 GB/s bus bandwidth: 80% of NVLink 4's 450 GB/s per direction (datasheet: 900 GB/s
#   bidirectional); nccl-tests reach 460-480 GB/s on 8 x H100 only for GiB messages (NVLS), and
#   the Gram matrices here are 2-512 MiB.
# - InfiniBand 45 GB/s per GPU: 90% of one 400 Gb/s ConnectX-7 (50 GB/s); 8 per node give the
#   360-400 GB/s multi-node all-reduce bus bandwidth that nccl-tests report for H100 clusters.
# - latencies from NCCL's own tuning model (src/graph/tuning.cc): ring/Simple base 8.4 us, 3.4 us
#   per step over NVLink, 14 us per step over the network.
# - overlap_cost 0.1: while a collective runs, NCCL's kernels hold some of the SMs (one per channel,
#   up to 32 of the H100's 132) and the HBM they stream through; assumed to slow the products it
#   overlaps by a tenth of its time (not measured here).
CUDA_NVLINK = SplitHardware(
    name="cuda: H100 SXM, nodes of 8 (bf16 680 TFLOP/s measured; NVLink 360 GB/s, InfiniBand 45 GB/s/GPU; "
         "NCCL latencies 8.4 us + 3.4 us/step, 14 us/step between nodes; 22 us/kernel; overlap costs 10%)",
    bf16_flops=680e12,
    fp32_flops=50e12,
    bandwidth=360e9,
    latency=8.4e-6,
    compute_dtype=torch.bfloat16,
    step_latency=3.4e-6,
    node_size=8,
    inter_bandwidth=45e9,
    inter_step_latency=14e-6,
    kernel_launch=22e-6,
    overlap_cost=0.1,
    device="cuda",
)

# This machine (2-core AMD EPYC with AVX512-BF16, torch 2.13.0+cpu), one thread per rank, measured
# with ``python benchmarks/split_ns.py --calibrate`` (three runs, load average ~1.5-4 from other jobs):
# - matmul on one thread: fp32 65-88 GFLOP/s at 1024^3 (X X^T shapes 72); bf16 176-192 GFLOP/s at
#   256^3 (210 at 1024: this CPU has native bf16 dot products, unlike the machines behind
#   default_compute_dtype's "bf16 ~100x slower" note).
# - gloo all-reduce between 2 forked ranks over loopback: 236-291 us for 8 bytes; bus bandwidth
#   0.6-1.6 GB/s for 1-64 MiB (1.0-1.55 GB/s at 64 MiB).
CPU_GLOO = SplitHardware(
    name="cpu: gloo over loopback, 1 thread per rank (measured: fp32 70 GFLOP/s, bf16 180 GFLOP/s, 1.2 GB/s, 250 us)",
    bf16_flops=180e9,
    fp32_flops=70e9,
    bandwidth=1.2e9,
    latency=250e-6,
    compute_dtype=torch.float32,
    device="cpu",
)


def hardware_for(device: torch.device | str) -> SplitHardware:
    """:data:`CUDA_NVLINK` for CUDA devices, :data:`CPU_GLOO` otherwise."""
    return CUDA_NVLINK if torch.device(device).type == "cuda" else CPU_GLOO


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
    interleave: bool = True,
) -> SplitCost:
    """FLOPs per rank, bytes per rank, collectives and modelled time of Newton-Schulz on ``shape``
    (``[..., m, n]``, either orientation: the long side is split) over k ranks; with ``units``,
    of that many same-shape units in one call (their matrices one batch).

    A batch of two or more matrices runs as two halves, interleaved (each half's collectives
    overlapping the other's products): its time is ``max(C + overlap_cost x min(C, M), M)`` plus
    one phase of the first half to fill the pipeline, C and M the halves' products and
    collectives, and never more than the halves one after the other (``interleave=False``: one
    call's straight run, what each half is; the runtime halves a batch once).

    ``dtype``: the compute dtype as the user set it (None: the device's defaults, per form); the
    form and the dtype it runs in are :meth:`SplitHardware.form`'s, the unsplit call's own choice
    for the whole shape (on CUDA with None: the Gram form in fp16 with fp16's restart plan where
    it saves FLOPs, else the classic form in bf16), which the split iteration takes too; ``widths``: the members' block
    widths (default :func:`column_blocks`). FLOPs count the matmuls as
    :func:`~optimizer.newton_schulz.newton_schulz_flops` does (2 per multiply-add; k = 1 gives
    exactly its count), per member with block width w, s = min(m, n):

    * classic step: ``2 s^2 w`` (local Gram) + ``2 s^3`` (B, replicated) or ``2 r s^2`` (B, rows;
      r = that member's rows) + ``2 s^2 w`` (B X); one all-reduce of ``s^2`` (+ an all-gather of
      ``k p s`` with rows).
    * Gram segment of L >= 2 steps: ``2 s^2 w`` + ``(4 L - 3) 2 s^3`` (recursion redundant) or
      ``(4 L - 3) 2 r s^2`` and 2L all-gathers of ``k p s`` (by rows) + ``2 s^2 w``; one all-reduce.

    All per matrix of the batch, one collective for the whole batch. The first all-reduce is in
    the wide dtype (fp32 for bf16/fp32) and carries one more number per matrix (the norm).
    Elementwise work is ignored. Pure: the same answer on every rank."""
    hardware = hardware or CUDA_NVLINK
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"split_ns_cost needs a shape [..., m, n], got {shape}")
    check_ns_method(method)
    check_b_split(b_split)
    check_recursion(recursion)
    steps = resolve_ns_coefficients(coefficients, ns_steps)
    batch = math.prod(shape[:-2]) * units
    s, l = min(shape[-2:]), max(shape[-2:])
    if widths is None:
        widths = [sl.stop - sl.start for sl in column_blocks(l, k)] if k <= l else None
    if widths is None or len(widths) != k or sum(widths) != l or min(widths) < 1:
        raise ValueError(f"split_ns_cost: cannot split {l} columns over k={k} ranks as {widths}")
    form, dtype = hardware.form(shape, ns_steps, method, dtype, steps)  # dtype: what it runs in
    plan = gram_restart_plan(steps, ns_steps, dtype) if form == "gram" else (1,) * ns_steps
    rows = k > 1 and (b_split == "rows" or (b_split == "auto" and choose_b_split(shape, k, dtype, hardware) == "rows"))
    item, wide = dtype.itemsize, wide_dtype(dtype).itemsize
    gram_bytes = batch * s * s * item
    gather_bytes = k * batch * -(-s // k) * s * item  # an all-gather of padded rows, the gathered total
    ring = 2 * (k - 1) / k  # all-reduce: share of the buffer each rank sends
    flops = [0] * k
    sent, comm, collectives, kernels = 0.0, 0.0, 0, 5  # normalisation: cast, norm, scale, divisions
    chosen = []

    def own_rows(product_flops_per_row):
        for j in range(k):
            r0, r1, _ = row_block(s, k, j)
            flops[j] += product_flops_per_row * (r1 - r0)

    for i, length in enumerate(plan):
        if k > 1:  # the segment's (or step's) Gram all-reduce
            nbytes = batch * (s * s * wide + wide) if i == 0 else gram_bytes
            sent += ring * nbytes
            comm += hardware.all_reduce_s(nbytes, k)
            collectives += 1
        for j, w in enumerate(widths):
            flops[j] += 2 * batch * s * s * w * 2  # X_i X_i^T and the left product
        if length == 1:
            chosen.append("-")
            kernels += 3 + (k > 1)
            if rows:
                own_rows(2 * batch * s * s)
                sent += (k - 1) / k * gather_bytes
                comm += hardware.all_gather_s(gather_bytes, k)
                collectives += 1
                kernels += 2
            else:
                flops = [f + 2 * batch * s**3 for f in flops]
            continue
        how = recursion if recursion != "auto" else choose_recursion(shape, k, length, dtype, hardware)
        how = how if k > 1 else "redundant"
        chosen.append(how)
        products = 4 * length - 3
        kernels += products + 4 + (k > 1)
        if how == "rows":
            own_rows(products * 2 * batch * s * s)
            sent += 2 * length * (k - 1) / k * gather_bytes
            comm += 2 * length * hardware.all_gather_s(gather_bytes, k)
            collectives += 2 * length
            kernels += 4 * length
        else:
            flops = [f + 2 * batch * products * s**3 for f in flops]
    compute = max(flops) / hardware.flops(dtype)
    time = max(kernels * hardware.kernel_launch, compute + comm)
    if interleave and k > 1 and batch >= 2:  # two halves, interleaved
        halves = [split_ns_cost((h, s, l), k, ns_steps, form, dtype, coefficients, "rows" if rows else "replicated",
                                hardware, widths, chosen[0] if chosen and chosen[0] != "-" else "redundant",
                                interleave=False)
                  for h in (batch - batch // 2, batch // 2)]
        C, M = sum(h.compute_s for h in halves), sum(h.comm_s for h in halves)
        fill = min(halves[0].compute_s, halves[0].comm_s) / max(1, halves[0].collectives)
        overlapped = min(max(C + hardware.overlap_cost * min(C, M), M) + fill, C + M)
        time = max(2 * kernels * hardware.kernel_launch, overlapped)
        comm, collectives = M, sum(h.collectives for h in halves)
    return SplitCost(
        shape=shape, k=k, form=form, b_split="rows" if rows else "replicated", plan=tuple(plan),
        flops_per_rank=tuple(flops), bytes_per_rank=int(round(sent)), collectives=collectives, time_s=time,
        recursion=tuple(chosen), comm_s=comm, compute_s=compute, units=units,
    )


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
