"""Tile configurations for the kernels: a fixed candidate list and a pure rule that picks one.

Why a rule and not ``triton.autotune``: an optimizer calls a handful of shapes once per step,
and autotuning would (1) time every candidate for every new shape key on the first step (seconds
per key, with host synchronisations inside what is otherwise a sync-free step, and no CUDA-graph
capture), and (2) choose by timing, so two processes, or two ranks, could pick different tiles for
the same shape; a tile changes how the K sum is split and so the last bits of the result, and the
distributed path promises the same bits as single-device Muon. A pure function of (kind, sizes,
dtype, compute capability, SM count) gives the same answer everywhere, costs one compile per
config actually used (Triton caches binaries on disk across processes) and is cached here with
``lru_cache``. ``benchmarks/ns_kernels.py`` times every candidate on a GPU, to check or re-fit the
rule; the rule below was written without a GPU (see docs/kernels.md).

Under ``TRITON_INTERPRET=1`` (CPU tensors, how the tests run every kernel) one small fixed tile
keeps the interpreted grid cheap while shapes like 37 x 53 still span several partial tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from torch import Tensor

# Grid axis 1 (the batch) is limited to 65,535 on CUDA: every launcher splits larger batches.
MAX_BATCH_PER_LAUNCH = 65_535


def as_batch(t: Tensor) -> Tensor:
    """``t`` as ``[batch, m, n]``: a matrix becomes a batch of one (a view)."""
    return t if t.ndim == 3 else t.unsqueeze(0)


@dataclass(frozen=True)
class Tiles:
    """One launch configuration. ``block_m == block_n`` for the symmetric kernel (square tiles,
    so a tile and its mirror cover the same index ranges)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # general kernel only: tile rows walked together for L2 reuse


# Shared memory one block may use (the opt-in maximum, bytes) by compute capability, from the CUDA
# C++ Programming Guide's table of technical specifications: A100 (8.0) and Orin (8.7) 163 KiB;
# the RTX 30/40 series (8.6, 8.9) and RTX 50 / DGX Spark (12.0, 12.1) 99 KiB; H100/H200 (9.0) and
# B200/B300 (10.0, 10.3) 227 KiB. tests/kernels/test_aot_compile.py holds every kernel to it.
SHARED_MEMORY: dict[tuple[int, int], int] = {
    (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376, (9, 0): 232_448,
    (10, 0): 232_448, (10, 3): 232_448, (12, 0): 101_376, (12, 1): 101_376,
}
# The 99 KiB of the RTX parts: a capability not in the table is taken to have this little.
SMALL_SHARED_MEMORY = 101_376

# The interpreter's tile. It costs ~1 ms of Python per operation per program, so the tile is
# large enough to keep test grids small, and small enough that test shapes (37, 53, 65, 130) span
# 2 to 5 tiles each way, the last one partial, and have off-diagonal tiles to mirror.
INTERPRETER_TILES = Tiles(32, 32, 32, num_warps=1, num_stages=1)

# Candidates on NVIDIA GPUs of compute capability >= 8.0 (A100, H100, H200, B200; Triton's tl.dot
# lowers to mma on sm80, wgmma on sm90, tcgen05 on sm100). An operand stage of 128 x 128 x 64 in
# 16-bit is 32 KiB: compiled (tests/kernels/test_aot_compile.py, docs/kernels.md), 4 stages take
# 131,072 B on sm90 and sm100 and 98,304 B on sm80 (where Triton keeps stages - 1 buffers), well
# within their 227 and 163 KiB; on the 99 KiB parts they would leave 3 KiB, so 3 there
# (for_capability).
CUDA_CANDIDATES: dict[str, Tiles] = {
    "large16": Tiles(128, 128, 64, num_warps=8, num_stages=4),
    "small16": Tiles(64, 64, 64, num_warps=4, num_stages=4),
    # fp32 with input_precision="ieee" runs on the FMA units, not tensor cores: smaller tiles, as
    # in Triton's own fp32 matmul configurations.
    "fp32": Tiles(64, 64, 32, num_warps=4, num_stages=3),
}


@lru_cache(maxsize=1024)
def choose_tiles(
    kind: str, batch: int, m: int, n: int, k: int, dtype: torch.dtype, capability: tuple[int, int] | None,
    sm_count: int,
) -> Tiles:
    """The tile for one launch: ``kind`` is ``"symmetric"`` (an m x m output, one triangle of
    tiles) or ``"general"`` (m x n); ``capability`` None means the interpreter.

    The rule: 128-wide tiles, unless the grid they give has fewer tiles than the GPU has SMs (a
    1024 x 1024 output has 36 triangle tiles at 128 on 132 SMs, 136 at 64), then 64-wide; at most
    3 pipeline stages where a block gets 99 KiB of shared memory. fp32 uses its own FMA-sized
    tile. Pure and cached: the same answer on every rank.
    """
    if capability is None:
        return INTERPRETER_TILES
    if dtype == torch.float32:
        return CUDA_CANDIDATES["fp32"]
    large = CUDA_CANDIDATES["large16"]
    if kind == "symmetric":
        rows = -(-m // large.block_m)
        count = batch * rows * (rows + 1) // 2
    else:
        count = batch * -(-m // large.block_m) * -(-n // large.block_n)
    return for_capability(large if count >= sm_count else CUDA_CANDIDATES["small16"], capability)


def for_capability(tiles: Tiles, capability: tuple[int, int]) -> Tiles:
    """A 16-bit candidate as it runs on a GPU of ``capability``: at most 3 pipeline stages where a
    block gets no more than 99 KiB of shared memory (sm86, sm89, sm120, sm121, and a capability
    not in :data:`SHARED_MEMORY`), where 4 would fill all but 3 KiB of it."""
    if SHARED_MEMORY.get(tuple(capability), SMALL_SHARED_MEMORY) > SMALL_SHARED_MEMORY:
        return tiles
    return replace(tiles, num_stages=min(tiles.num_stages, 3))


def tile_rows(m: int, tiles: Tiles) -> int:
    """How many tile rows an m-row output spans."""
    return -(-m // tiles.block_m)
