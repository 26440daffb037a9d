"""What the cut iteration's cost model assumes of a rank and its links (:class:`SplitHardware`).

Each collective is a ring (NCCL's algorithm for these sizes): an all-reduce of S bytes over k
ranks costs ``latency + 2 (k-1) steps + 2 (k-1)/k S / bandwidth``, an all-gather of S gathered
bytes ``latency + (k-1) steps + (k-1)/k S / bandwidth``.  A group inside one node uses the node's
link; a group crossing nodes sends through the members' own NICs and its steps between nodes cost
the network's latency.  The figures' sources: docs/parallel.md, "The cost model's figures".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ...newton_schulz.coefficients import CoefficientSpec
from ...newton_schulz.forms import choose_ns_form, ns_form_dtypes


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
    # interleaved: ``newton_schulz.cut._interleaved``): 0 = free overlap, 1 = none (then the
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


# One H100 SXM per rank, nodes of 8 (NVLink 4 inside a node, one 400 Gb/s NIC per GPU between nodes).
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

# This machine (2-core AMD EPYC, torch 2.13.0+cpu), one thread per rank: ``benchmarks/split_ns.py --calibrate``.
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
