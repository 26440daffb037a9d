"""Newton-Schulz for one matrix (or one batch of matrices) split by columns over k ranks.

Parallel Muon gives each matrix one owner. With more ranks than matrices, the largest matrix sets
the step time (Llama-3-70B's ``[28672, 8192]`` alone is 3.4x the ideal per-rank share at 1,024
ranks). Here the k ranks of a group each hold a column block ``X_i`` ([..., m, n_i], m <= n, the
matrix in "short side first" orientation: the caller transposes a tall one) and together compute
their blocks of exactly what :func:`~optimizer.newton_schulz.zeropower_via_newtonschulz` returns
for the whole matrix.

The iteration ``X <- a X + (b A + c A^2) X``, ``A = X X^T``, only ever multiplies X on the *left*
by an m x m matrix, so column blocks never mix: ``X_i <- a X_i + B X_i``. The one global
quantity is ``A = sum_i X_i X_i^T``: an all-reduce of m x m numbers (per matrix of a batch; one
collective for the whole batch).

Classic form, per step (``method="classic"``, or one-step Gram segments):

* ``A``: every rank computes ``X_i X_i^T`` (2 m^2 n_i FLOPs) and all-reduces it (m^2 numbers in
  the compute dtype).
* ``B = b A + c A^2``: 2 m^3 FLOPs, the same on every rank. Two ways (``b_split``):

  - ``"replicated"``: every rank computes all of B. What NVIDIA's Emerging-Optimizers
    ``newton_schulz_tp(mode="distributed")`` does (Megatron-LM's Muon for tensor-parallel weights:
    ``A = X @ X.mT``, ``all_reduce(A)``, ``B = addmm(A, A, A)``, ``X = addmm(X, B, X)``; the norm
    by a separate all-reduce of the sum of squares first). No extra communication, but the
    m^3 term does not shrink with k: at m = 8192, k = 8 it is half of each rank's FLOPs.
  - ``"rows"``: rank j computes rows ``[j p, (j+1) p)`` of B (p = ceil(m / k); 2 p m^2 FLOPs) and
    an all-gather assembles B (each rank sends (k-1) p m numbers and takes one more collective).
    Worth it when the FLOPs saved, 2 m^2 (m - p), take longer than the all-gather:
    ``2 m^2 (m - p) / rate > (k-1) p m itemsize / bandwidth + latency``. With p = m / k the
    bandwidth term alone gives ``m > rate itemsize / (2 bandwidth)`` whatever k; with the latency,
    on the CUDA model (400 TFLOP/s, 150 GB/s, 20 us, bf16) rows pay from m = 3,100-3,400
    (m = 1024 stays replicated, Llama-3-70B's m = 8192 splits), on this CPU (fp32 70 GFLOP/s,
    1.2 GB/s, 250 us) from m = 260-310. ``"auto"`` applies that inequality
    (:func:`choose_b_split`), a pure function of shape, k, dtype and hardware, so every rank
    decides alike.

  Microsoft's dion takes neither route: its Muon re-shards with all-to-alls so that each rank
  orthogonalises whole matrices (one matrix per rank and batch of world-size matrices), as our
  unsplit path does; its Dion orthogonalises a row-sharded factor by all-reducing the small
  r x r Gram matrix (Cholesky QR), the same "reduce the short side's Gram" idea as here.

* ``X_i <- a X_i + B X_i``: 2 m^2 n_i FLOPs, local.

Gram form (``gram_restart_plan`` segments of L >= 2 steps): one all-reduce of ``X X^T`` per
segment, the m x m recursion of :func:`~optimizer.newton_schulz._gram_segment_factor` on every
rank (``(4 L - 3) 2 m^3`` FLOPs, not split), then ``X_i <- Q X_i``. Segments of one step are classic
steps (as in the unsplit code). The form is chosen exactly as the unsplit call would choose it
for the whole matrix (``choose_ns_method`` on the full shape): the two forms differ by up to ~1e-3
in fp32, so results must not depend on whether the planner split a matrix. The price: where the
Gram form is picked (fp32, n > 1.5 m) its replicated m x m recursion, ``17 m^3`` multiply-adds for
5 steps, caps the gain (2048 x 4096 over 2 ranks: modelled 1.10x, the classic form 1.93x). In
bf16, the CUDA default, "auto" is always the classic form. Splitting the recursion's products by
rows as well (like B) would lift the cap for 3-4 all-gathers per step; not done.

Normalisation, folded into the first collective. The unsplit code divides the compute-dtype
matrix by ``max(||X||_F * norm_safety, eps)`` with the norm taken in fp32 (or wider). The first
Gram matrix is formed from the *unscaled* blocks instead, and its all-reduce carries one more
number per matrix, the block's sum of squares: one buffer of ``batch (m^2 + 1)`` numbers in that
wide dtype, ``[G_i G_i^T ..., ||G_i||^2 ...]``. After the all-reduce each rank has ``||G||^2``,
divides its block by the scale (rounding once to the compute dtype, as the unsplit code does) and
takes ``A = (sum G_i G_i^T) / scale^2``. (The trace of the Gram matrix is also ``||G||^2``, but in
bf16 its diagonal is rounded; the extra number keeps the norm fp32-exact.) So the norm costs no
collective of its own; the first all-reduce is sent in the wide dtype (2x its bytes in bf16),
later ones in the compute dtype. The fold assumes ``||G||_F^2`` is representable in the wide dtype
(fp32: ``1e-19 < ||G||_F < 1e19``); outside it the unsplit code's own fp32 norm under/overflows
too. An all-zero matrix gives zeros, like the unsplit code.

Numerics (measured; tests/test_split_newton_schulz.py asserts them with margin):

* fp32, Gaussian inputs (wide, tall, square, batched), 2-8 ranks, even and uneven blocks, both
  forms and tables, 5 and 10 steps, B replicated or by rows: within 5.5e-6 of the unsplit result
  (1.15e-5 at 2048 x 4096 on 2 ranks, both forms).
* fp32, hard inputs (rank-deficient, condition number 1e4, the Gram form forced on a square
  Gaussian matrix): rounding below the noise floor is amplified; the unsplit call itself moves by
  up to 1e-2 (Gram) / 3e-3 (classic) when its columns are merely permuted, and the split deviates
  by about as much (at most 1.25x that). Without the Gram restarts it would be 1e23 off.
* bf16: the partial Gram matrices are rounded to bf16 on each rank and summed in bf16, so the
  split is another bf16 rounding path: max |split - unsplit| 3.3e-2, rms 5.5e-3 (outputs up to
  ~0.6; 2-8 ranks). That is bf16 Newton-Schulz's own sensitivity: changing one input element by
  one bf16 ulp moves the unsplit result by up to 1.6e-2 (rms 2.3e-3). Against the fp32 result,
  the split's rms error is 1.1-1.3x the unsplit's (median; at most 1.9x at 8 ranks). Summing
  fp32 partial Gram matrices (``torch.mm(..., out_dtype=torch.float32)`` on CUDA) in an fp32
  all-reduce would remove most of that, for 2x the all-reduce bytes; not done.

Every replicated quantity (A, B, Q) is the output of one collective or of the same kernels on
identical inputs, hence bitwise identical on every rank of the group (asserted), which keeps the
blocks consistent.

No host synchronisation (no ``.item()``), no process-group creation: the caller passes a group
created once, elsewhere. Every member must call with the same shapes and arguments (``widths`` is
every member's block width, in group-rank order).

Cost model (pure, no tensors): :func:`split_ns_cost` gives per-rank FLOPs, bytes each rank sends
(= receives) and the collective count for a shape split over k; :func:`choose_split_ranks` picks
k; :func:`split_critical_path` is the time of a split unit, to compare with the per-rank ideal
share. Time = FLOPs / rate + bytes / bandwidth + collectives x latency, with ring collectives
(all-reduce: each rank sends ``2 (k-1) / k`` of the buffer, all-gather ``(k-1) / k`` of the
gathered result), nothing overlapped. See :class:`SplitHardware` for the figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..newton_schulz import (
    NS_NORM_SAFETY,
    CoefficientSpec,
    _gram_segment_factor,
    _symmetric_product,
    _uses_symmetric_blocks,
    check_ns_method,
    choose_ns_method,
    default_compute_dtype,
    gram_restart_plan,
    resolve_ns_coefficients,
)
from .owners import split_range_evenly

__all__ = [
    "B_SPLITS",
    "CPU_GLOO",
    "CUDA_NVLINK",
    "SplitCost",
    "SplitHardware",
    "choose_b_split",
    "choose_split_ranks",
    "column_blocks",
    "hardware_for",
    "row_sums_of_squares",
    "split_critical_path",
    "split_ns_cost",
    "split_zeropower_via_newtonschulz",
    "squares_per_row",
    "sum_over_group",
]

B_SPLITS = ("auto", "replicated", "rows")


# ----------------------------------------------------------------------------
# Hardware figures
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitHardware:
    """What the cost model assumes of one rank and its links.

    ``bandwidth`` is what one rank sends (and receives) per second inside a collective, i.e.
    nccl-tests' "bus bandwidth": a ring all-reduce of S bytes takes ``2 (k-1)/k S / bandwidth``.
    ``latency`` is the fixed cost of one collective (launch and synchronisation).
    """

    name: str
    bf16_flops: float  # FLOP/s of the Newton-Schulz matmuls in bf16 (and fp16)
    fp32_flops: float  # ... in fp32 (fp64: half of it)
    bandwidth: float  # bytes/s
    latency: float  # s per collective
    compute_dtype: torch.dtype  # Newton-Schulz's default compute dtype there

    def flops(self, dtype: torch.dtype) -> float:
        if dtype in (torch.bfloat16, torch.float16):
            return self.bf16_flops
        if dtype == torch.float64:
            return self.fp32_flops / 2
        return self.fp32_flops


# One H100 SXM per rank, the k ranks of a group inside one NVLink node (assumed, not measured
# here: no GPU was available for this work).
# - bf16 400 TFLOP/s: effective, not peak. The H100 SXM datasheet gives 989 TFLOP/s dense bf16;
#   large cuBLAS GEMMs reach ~600-750; Newton-Schulz's skinny blocks and m x m products less.
# - fp32 50 TFLOP/s: the datasheet's 67 TFLOP/s non-tensor-core fp32 (torch's default
#   float32_matmul_precision "highest" does not use TF32).
# - 150 GB/s bus bandwidth: NVLink 4 gives 450 GB/s per direction per GPU; nccl-tests all-reduce
#   bus bandwidth on 8x H100 is 350-480 GB/s for >= 256 MiB messages but well under half that at
#   the 1-100 MiB that an m x m Gram matrix is. Across nodes (one 400 Gb/s NIC per GPU) it is at
#   most 50 GB/s: groups should stay inside a node.
# - 20 us per collective: NCCL's small-message all-reduce latency on one node (~10-20 us in
#   nccl-tests) plus a kernel launch.
CUDA_NVLINK = SplitHardware(
    name="cuda: H100 SXM, NVLink node (modelled: bf16 400 TFLOP/s, fp32 50 TFLOP/s, 150 GB/s, 20 us)",
    bf16_flops=400e12,
    fp32_flops=50e12,
    bandwidth=150e9,
    latency=20e-6,
    compute_dtype=torch.bfloat16,
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


def _row_block(m: int, k: int, j: int) -> tuple[int, int, int]:
    """Rows of B that rank j computes with ``b_split="rows"``: (start, stop, p), p = ceil(m / k)
    rows per rank (the last ranks may have fewer, or none); padded to p for the all-gather, so the
    gathered [k p, m] rows are B's rows in order, the padding after them."""
    p = -(-m // k)
    start = min(j * p, m)
    return start, min(start + p, m), p


# ----------------------------------------------------------------------------
# Cost model
# ----------------------------------------------------------------------------


def _item(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _wide(dtype: torch.dtype, input_dtype: torch.dtype = torch.float32) -> torch.dtype:
    return torch.promote_types(torch.promote_types(input_dtype, dtype), torch.float32)


def _check_b_split(b_split) -> str:
    if b_split not in B_SPLITS:
        raise ValueError(f"b_split must be one of {', '.join(map(repr, B_SPLITS))}, got {b_split!r}")
    return b_split


def choose_b_split(
    shape: Sequence[int], k: int, dtype: torch.dtype | None = None, hardware: SplitHardware | None = None
) -> str:
    """``"rows"`` when computing B = b A + c A^2 by row blocks plus an all-gather is modelled
    faster than computing it on every rank, else ``"replicated"`` (always for k = 1).

    Per classic step and matrix batch: saved ``2 batch m^2 (m - p)`` FLOPs (p = ceil(m/k), the
    busiest rank's rows) at ``hardware.flops(dtype)``, against ``(k-1) batch p m`` elements sent
    at ``hardware.bandwidth`` plus one collective's latency. Pure."""
    hardware = hardware or CUDA_NVLINK
    dtype = dtype or hardware.compute_dtype
    if k <= 1:
        return "replicated"
    batch = math.prod(shape[:-2])
    m = min(shape[-2:])
    p = -(-m // k)
    saved = 2 * batch * m * m * (m - p) / hardware.flops(dtype)
    cost = (k - 1) * batch * p * m * _item(dtype) / hardware.bandwidth + hardware.latency
    return "rows" if saved > cost else "replicated"


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
    time_s: float  # critical path: the busiest member's FLOPs, plus bytes and latencies

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
) -> SplitCost:
    """FLOPs per rank, bytes per rank, collectives and modelled time of Newton-Schulz on ``shape``
    (``[..., m, n]``, either orientation: the long side is split) over k ranks.

    ``dtype``: the compute dtype (None: the hardware's default); ``widths``: the members' block
    widths (default :func:`column_blocks`). FLOPs count the matmuls as
    :func:`~optimizer.newton_schulz.newton_schulz_flops` does (2 per multiply-add; k = 1 gives
    exactly its count), per member with block width w, s = min(m, n):

    * classic step: ``2 s^2 w`` (local Gram) + ``2 s^3`` (B, replicated) or ``2 r s^2`` (B, rows;
      r = that member's rows) + ``2 s^2 w`` (B X); one all-reduce of ``s^2`` (+ an all-gather of
      ``k p s`` with rows).
    * Gram segment of L >= 2 steps: ``2 s^2 w`` + ``(4 L - 3) 2 s^3`` + ``2 s^2 w``; one all-reduce.

    All per matrix of the batch, one collective for the whole batch. The first all-reduce is in
    the wide dtype (fp32 for bf16/fp32) and carries one more number per matrix (the norm).
    Elementwise work is ignored. Pure: the same answer on every rank."""
    hardware = hardware or CUDA_NVLINK
    dtype = dtype or hardware.compute_dtype
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"split_ns_cost needs a shape [..., m, n], got {shape}")
    check_ns_method(method)
    _check_b_split(b_split)
    steps = resolve_ns_coefficients(coefficients, ns_steps)
    batch = math.prod(shape[:-2])
    s, l = min(shape[-2:]), max(shape[-2:])
    if widths is None:
        widths = [sl.stop - sl.start for sl in column_blocks(l, k)] if k <= l else None
    if widths is None or len(widths) != k or sum(widths) != l or min(widths) < 1:
        raise ValueError(f"split_ns_cost: cannot split {l} columns over k={k} ranks as {widths}")
    form = choose_ns_method(shape, ns_steps, method, dtype, steps)
    plan = gram_restart_plan(steps, ns_steps, dtype) if form == "gram" else (1,) * ns_steps
    rows = k > 1 and (b_split == "rows" or (b_split == "auto" and choose_b_split(shape, k, dtype, hardware) == "rows"))
    p = -(-s // k)
    item, wide = _item(dtype), _item(_wide(dtype))
    ring = 2 * (k - 1) / k  # all-reduce: share of the buffer each rank sends
    flops = [0] * k
    sent = 0.0
    collectives = 0
    for i, length in enumerate(plan):
        if k > 1:  # the segment's (or step's) Gram all-reduce
            sent += ring * batch * (s * s * wide + wide if i == 0 else s * s * item)
            collectives += 1
        for j, w in enumerate(widths):
            flops[j] += 2 * batch * s * s * w * 2  # X_i X_i^T and the left product
        if length == 1:
            if rows:
                for j in range(k):
                    r0, r1, _ = _row_block(s, k, j)
                    flops[j] += 2 * batch * (r1 - r0) * s * s
                sent += (k - 1) * batch * p * s * item
                collectives += 1
            else:
                flops = [f + 2 * batch * s**3 for f in flops]
        else:
            flops = [f + 2 * batch * (4 * length - 3) * s**3 for f in flops]
    time = max(flops) / hardware.flops(dtype) + sent / hardware.bandwidth + collectives * hardware.latency
    return SplitCost(
        shape=shape, k=k, form=form, b_split="rows" if rows else "replicated", plan=tuple(plan),
        flops_per_rank=tuple(flops), bytes_per_rank=int(round(sent)), collectives=collectives, time_s=time,
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


# ----------------------------------------------------------------------------
# The distributed iteration
# ----------------------------------------------------------------------------


def _group_size_rank(group) -> tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def split_zeropower_via_newtonschulz(
    X: Tensor,
    widths: Sequence[int],
    group: dist.ProcessGroup | None = None,
    ns_steps: int = 5,
    coefficients: CoefficientSpec = "fixed",
    eps: float = 1e-7,
    compute_dtype: torch.dtype | None = None,
    norm_safety: float | None = None,
    method: str = "auto",
    *,
    b_split: str = "auto",
    hardware: SplitHardware | None = None,
) -> Tensor:
    """This rank's column block of ``zeropower_via_newtonschulz(G, ...)``, G split over ``group``.

    ``X`` is this rank's block ``[..., m, n_i]`` of G in short-side-first orientation (m <= n;
    transpose a tall matrix first, and its result back); ``widths`` the block widths of every
    member of ``group`` in group-rank order (``widths[rank] == n_i``, each >= 1; see
    :func:`column_blocks`). Leading dims are a batch (expert stacks), done with one collective per
    iteration. The other arguments are :func:`~optimizer.newton_schulz.zeropower_via_newtonschulz`'s
    and mean the same (the form "auto" picks is the one it picks for the whole matrix).
    ``b_split``: how B = b A + c A^2 is computed in classic steps ("replicated", "rows" or "auto":
    :func:`choose_b_split` with ``hardware``, default :func:`hardware_for` the device). Returns
    the block in the compute dtype. Collective: every member calls it with the same arguments.
    """
    return _split_ns(X, widths, group, ns_steps, coefficients, eps, compute_dtype, norm_safety, method,
                     b_split, hardware, None)


def _split_ns(X, widths, group, ns_steps, coefficients, eps, compute_dtype, norm_safety, method, b_split,
              hardware, record):
    """The implementation; ``record`` (tests): a list that receives every replicated matrix."""
    k, rank, widths, steps, norm_safety, dtype = _checked_call(X, widths, group, ns_steps, coefficients,
                                                                norm_safety, method, b_split, compute_dtype)
    if X.numel() == 0:  # no rows, or an empty batch: the same on every member, no collective
        return torch.zeros(X.shape, dtype=dtype, device=X.device)
    m, ni = X.shape[-2], X.shape[-1]
    full = (*X.shape[:-1], sum(widths))
    form = choose_ns_method(full, ns_steps, method, dtype, steps)
    plan = gram_restart_plan(steps, ns_steps, dtype) if form == "gram" else (1,) * ns_steps
    if b_split == "auto":
        b_split = choose_b_split(full, k, dtype, hardware or hardware_for(X.device))
    rows = k > 1 and b_split == "rows"

    Xb = X.to(dtype).reshape(-1, m, ni)
    if Xb.shape[0] == 1:  # 2-D kernels for a single matrix, as the unsplit code
        Xb = Xb[0]
    symmetric = _uses_symmetric_blocks(Xb)
    Xb, A = _normalise_first_gram(Xb, X.dtype, dtype, norm_safety, eps, symmetric, k, group)
    Xb = _iterate(Xb, A, steps, plan, rows, symmetric, k, rank, group, record)
    return Xb.reshape(X.shape)


def _checked_call(X, widths, group, ns_steps, coefficients, norm_safety, method, b_split, compute_dtype):
    """The group's size and this rank's place in it, the widths as ints, the coefficient triples,
    the norm safety factor and the compute dtype; a clear error for anything inconsistent."""
    if X.ndim < 2:
        raise ValueError(f"split_zeropower_via_newtonschulz expects a block [..., m, n_i], got shape {tuple(X.shape)}")
    check_ns_method(method)
    _check_b_split(b_split)
    k, rank = _group_size_rank(group)
    widths = tuple(int(w) for w in widths)
    m, ni = X.shape[-2], X.shape[-1]
    if len(widths) != k or min(widths) < 1 or widths[rank] != ni:
        raise ValueError(
            f"split_zeropower_via_newtonschulz: widths {widths} must give each of the group's {k} members "
            f"a block at least one column wide, this rank's ({rank}) being {ni}"
        )
    n = sum(widths)
    if m > n:
        raise ValueError(
            f"split_zeropower_via_newtonschulz: the matrix is [{m}, {n}]: pass it short side first "
            "(transpose a tall matrix, split its columns, transpose the result back)"
        )
    steps = resolve_ns_coefficients(coefficients, ns_steps)
    if norm_safety is None:
        norm_safety = NS_NORM_SAFETY.get(coefficients, 1.0) if isinstance(coefficients, str) else 1.0
    if not norm_safety > 0:
        raise ValueError(f"norm_safety must be positive, got {norm_safety!r}")
    dtype = compute_dtype if compute_dtype is not None else default_compute_dtype(X.device)
    return k, rank, widths, steps, norm_safety, dtype


def _iterate(Xb, A, steps, plan, rows, symmetric, k, rank, group, record):
    """The segments of ``plan`` on this rank's normalised block ``Xb``, ``A`` being its first Gram
    matrix (already summed over the group): one all-reduce of the next Gram matrix per segment
    after the first; a one-step segment is a classic step (B replicated, or by ``rows`` and
    an all-gather), a longer one runs the m x m recursion and applies its factor Q."""
    addmm = torch.addmm if Xb.ndim == 2 else torch.baddbmm
    mm = torch.mm if Xb.ndim == 2 else torch.bmm
    first = 0
    for length in plan:
        segment, first = steps[first : first + length], first + length
        if A is None:
            A = _symmetric_product(Xb, Xb.mT, blocks=symmetric)
            if k > 1:
                dist.all_reduce(A, group=group)
        if record is not None:
            record.append(A)
        if length == 1:
            a, b, c = segment[0]
            if rows:
                B = _b_rows(A, b, c, k, rank, group)
            else:
                B = _symmetric_product(A, A, A, beta=b, alpha=c, blocks=symmetric)
            if record is not None:
                record.append(B)
            Xb = addmm(Xb, B, Xb, beta=a)  # a X_i + B X_i
        else:
            Q = _gram_segment_factor(A, segment, symmetric)
            if record is not None:
                record.append(Q)
            Xb = mm(Q, Xb)
        A = None
    return Xb


def _normalise_first_gram(Xb, input_dtype, dtype, norm_safety, eps, symmetric, k, group):
    """The block divided by the whole matrix's norm (times ``norm_safety``, at least ``eps``) and
    the first Gram matrix, from one all-reduce of ``[G_i G_i^T, ||G_i||^2]`` in the wide dtype."""
    wide = _wide(dtype, input_dtype)
    lead, m = Xb.shape[:-2], Xb.shape[-2]
    count = math.prod(lead)
    buf = torch.empty(count * m * m + count, dtype=wide, device=Xb.device)
    gram = buf[: count * m * m].view(*lead, m, m)
    if dtype == wide:
        _symmetric_product(Xb, Xb.mT, blocks=symmetric, out=gram)
    else:
        gram.copy_(_symmetric_product(Xb, Xb.mT, blocks=symmetric))
    squares = buf[count * m * m :].view(*lead, 1, 1)
    norm = torch.linalg.vector_norm(Xb, dim=(-2, -1), keepdim=True, dtype=wide)
    torch.mul(norm, norm, out=squares)
    if k > 1:
        dist.all_reduce(buf, group=group)
    scale = (squares.sqrt() * norm_safety).clamp_min(eps)
    X = torch.div(Xb, scale, out=torch.empty(Xb.shape, dtype=dtype, device=Xb.device))
    A = torch.div(gram, scale * scale, out=torch.empty(gram.shape, dtype=dtype, device=Xb.device))
    return X, A


def _b_rows(A: Tensor, b: float, c: float, k: int, rank: int, group) -> Tensor:
    """B = b A + c A^2 with each member computing its rows, then one all-gather."""
    m = A.shape[-1]
    start, stop, p = _row_block(m, k, rank)
    lead = A.shape[:-2]
    addmm = torch.addmm if A.ndim == 2 else torch.baddbmm
    part = addmm(A[..., start:stop, :], A[..., start:stop, :], A, beta=b, alpha=c)
    if stop - start < p:  # pad to p rows (the last members); the padding is dropped below
        padded = A.new_zeros((*lead, p, m))
        padded[..., : stop - start, :] = part
        part = padded
    gathered = A.new_empty((k, *lead, p, m))
    _all_gather(gathered.view(-1), part.contiguous().view(-1), group=group)  # flat: what every backend takes
    if A.ndim == 2:
        return gathered.view(k * p, m)[:m]
    return gathered.movedim(0, -3).reshape(*lead, k * p, m)[..., :m, :]


def squares_per_row(block: Tensor) -> Tensor:
    """Each row's sum of squares of ``block`` ``[..., r, c]``: ``[..., r]`` in fp32 (or wider)."""
    return torch.linalg.vector_norm(block, dim=-1, dtype=_wide(block.dtype, block.dtype)).square()


def sum_over_group(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``t`` summed over ``group``'s members, in place (one all-reduce; nothing alone). Collective."""
    k, _ = _group_size_rank(group)
    if k > 1:
        dist.all_reduce(t, group=group)
    return t


def row_sums_of_squares(block: Tensor, group: dist.ProcessGroup | None, rows_whole: bool) -> tuple[Tensor, Tensor]:
    """For a post-processing that needs whole rows of the orthogonalised matrix (NorMuon's per-row
    ``mean(O*O, dim=-1)`` and its per-matrix Frobenius rescale) when O is split over ``group``.

    ``block``: this rank's block of O in the *parameter's* orientation ``[..., r, c]``.
    ``rows_whole``: the block holds whole rows (a tall matrix cut along its rows): the row sums
    are local, and only the squared Frobenius norm needs one all-reduce of one number per matrix.
    Otherwise (a wide matrix cut along its columns, every member holding every row) the members'
    row sums add up: one all-reduce of ``[..., r]`` numbers, and the norm follows from them.
    Returns (sum over the whole matrix's columns of each row's squares ``[..., r]``, squared
    Frobenius norm ``[...]``), in fp32 (or wider), the same on every member. Collective on
    ``group``; no host synchronisation.  (NorMuon on a row-cut block needs a second number per
    matrix, the normalised matrix's norm, which depends on the local rows' v:
    ``rule.normuon_normalize_split`` sends both in one :func:`sum_over_group` instead.)"""
    sums = squares_per_row(block)
    if rows_whole:
        return sums, sum_over_group(sums.sum(-1), group)
    sum_over_group(sums, group)
    return sums, sums.sum(-1)
