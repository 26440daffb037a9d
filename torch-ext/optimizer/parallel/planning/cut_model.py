"""Which k a unit may be cut into, on which rank groups, and what each member then costs.

The k owners of a cut unit are one process group: for ``"auto"`` an aligned block of k
consecutive ranks of the sorted candidates, k a power of two up to :data:`SPLIT_MAX_RANKS` (one
NVLink node) that the cost model (``cut_cost.py``) says is faster; for ``"always"`` a whole shard
group.  Group rank j (sorted global ranks, as ``new_group`` orders them) owns block j.  The groups
are created at construction (:func:`rank_sets`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .cut_cost import SplitCost, split_ns_cost
from .cut_hardware import SplitHardware

# Largest k for "auto": the GPUs of one NVLink node (CUDA_NVLINK models a group inside one).
SPLIT_MAX_RANKS = 8


@functools.lru_cache(maxsize=8192)
def _cost(shape: tuple[int, ...], k: int, ns_steps: int, method: str, coefficients, dtype: torch.dtype | None,
          hardware: SplitHardware, units: int = 1) -> SplitCost:
    return split_ns_cost(shape, k, ns_steps, method, dtype, coefficients, "auto", hardware, units=units)


def _hashable(coefficients):
    """A table name as it is; one triple, or one triple per step, as nested tuples of floats."""
    if isinstance(coefficients, str):
        return coefficients
    items = list(coefficients)
    if items and not isinstance(items[0], (tuple, list)):  # one (a, b, c) for every step
        return tuple(float(c) for c in items)
    return tuple(tuple(float(c) for c in t) for t in items)


@dataclass(frozen=True)
class SplitModel:
    """How a parameter's units may be split: the mode and the split iteration's cost model."""

    mode: str  # "auto" | "always"
    hardware: SplitHardware
    ns_steps: int
    method: str
    coefficients: object  # a table name or a tuple of triples
    dtype: torch.dtype | None  # Newton–Schulz's compute dtype as the user set it (None: the device's, per form)
    max_ranks: int = SPLIT_MAX_RANKS

    @staticmethod
    def of(mode: str, hardware: SplitHardware, ns_steps: int, method: str, coefficients, dtype: torch.dtype | None,
           max_ranks: int = SPLIT_MAX_RANKS) -> "SplitModel":
        return SplitModel(mode, hardware, ns_steps, method, _hashable(coefficients), dtype, max_ranks)

    def cost(self, shape: Sequence[int], k: int, units: int = 1) -> SplitCost:
        return _cost(tuple(int(d) for d in shape), int(k), self.ns_steps, self.method, self.coefficients,
                     self.dtype, self.hardware, int(units))

    def member_cost(self, shape: Sequence[int], k: int, units: int | None = None) -> float:
        """FLOP-equivalents that each of the k members is busy with one unit: its modelled time x
        rate, in a call with ``units`` same-shape units (their halves interleaved).  By default a
        single matrix cut over k > 1 ranks is assumed to find a partner of its shape on its group
        (two units); the plan then charges every cut unit what the call it runs in costs
        (``world.batch_costs``)."""
        if units is None:
            units = 2 if k > 1 and math.prod(tuple(shape)[:-2]) == 1 else 1
        return self.cost(shape, k, units).time_s * self.hardware.rate(self.dtype) / units


def auto_ks(model: SplitModel, matrix: Sequence[int], group_size: int) -> tuple[int, ...]:
    """The k (> 1) that ``"auto"`` may pick for a parameter of matrix shape ``[M, N]`` when its
    candidates number ``group_size``: powers of two up to the cap, the group and the long side,
    whose split iteration on one matrix is modelled faster than the unsplit one.  The groups
    created at construction and the planner's choices both come from here."""
    matrix = (1, *tuple(matrix)[-2:])
    whole = model.member_cost(matrix, 1)
    out = []
    k = 2
    while k <= min(model.max_ranks, group_size, max(matrix[-2:])):
        if model.member_cost(matrix, k) < whole:
            out.append(k)
        k *= 2
    return tuple(out)


def always_k(shape: Sequence[int], shard_size: int) -> int:
    """``"always"``: the whole shard group, for units whose short side has at least as many rows."""
    return shard_size if shard_size > 1 and min(shape[-2:]) >= shard_size else 1


@functools.lru_cache(maxsize=4096)
def aligned_groups(candidates: tuple[int, ...], k: int) -> tuple[tuple[int, ...], ...]:
    """Aligned blocks of k consecutive ranks of the sorted candidates (full blocks only)."""
    ranks = tuple(sorted(candidates))
    return tuple(ranks[i: i + k] for i in range(0, len(ranks) - k + 1, k))


def rank_sets(shape: Sequence[int], layout, model: SplitModel | None) -> set[tuple[int, ...]]:
    """Every rank set a split of this parameter may run on (all of the world's, members or not):
    for ``"auto"``, the aligned k-blocks of each shard group and, with replicas, of each batch
    coordinate's replica x shard holders, for every k :func:`auto_ks` allows; for ``"always"``
    each shard group.  Pure; created once, collectively, at construction."""
    if model is None or layout is None or len(shape) < 2:
        return set()
    out: set[tuple[int, ...]] = set()
    shard = layout.shard_group_size
    if model.mode == "always":
        if always_k(shape, shard) > 1:
            out.update(tuple(sorted(s)) for s in layout.grid.partition(layout.matrix_dims))
        return out
    candidate_sets = [tuple(sorted(s)) for s in layout.grid.partition(layout.matrix_dims)] if shard > 1 else []
    if layout.num_replicas > 1:
        for b in layout.batch_coordinates():
            candidate_sets.append(tuple(sorted(layout.holders(b))))
    if movable_layout(layout, len(shape), model):  # experts held whole move over the mesh (expert_moves.py)
        everyone = tuple(sorted(layout.grid.ranks))
        candidate_sets.append(everyone)
        out.add(everyone)  # the moves' all-to-all
    for cands in dict.fromkeys(candidate_sets):
        for k in auto_ks(model, shape[-2:], len(cands)):
            out.update(aligned_groups(cands, k))
    return out


def movable_layout(layout, ndim: int, model: SplitModel | None) -> bool:
    """Experts held whole whose units may move to other ranks (``expert_moves.py``): a stack of
    matrices whose every mesh dim shards the stack's dim (no matrix dim sharded, no replicas),
    with ``ns_split="auto"``."""
    return (model is not None and model.mode == "auto" and layout is not None and ndim >= 3
            and layout.shard_group_size == 1 and layout.num_replicas == 1 and bool(layout.batch_dims))


@dataclass
class CutOptions:
    """What the choice needs of one unit: its whole cost and candidates, and per k its member
    cost and groups (``forced``: the k it must use, "always")."""

    cost: float
    candidates: tuple[int, ...]
    ks: tuple[int, ...] = ()  # allowed k > 1, ascending
    member_cost: Callable[[int], float] | None = None
    groups: Callable[[int], tuple[tuple[int, ...], ...]] | None = None
    forced: int = 1
    alone: Callable[[int], float] | None = None  # member cost at k with no partner (member_cost assumes one)

    def next_k(self, k: int) -> int | None:
        """The next allowed k above k that is faster than k run the same way: paired (two units
        as one call, ``member_cost``) or alone (``alone``).

        Each way against itself: whether a unit runs paired or alone is decided by the assignment
        (:func:`assign_paired`: alone where its groups outnumber the units), and a k that is
        slower paired than k paired may still be faster alone than k alone (Llama-3-8B's
        14336 x 4096 at 1,024 ranks: 4 -> 8 alone, 3.81x -> 3.30x the ideal share)."""
        for c in self.ks:
            if c > k and self.faster(c, k):
                return c
        return None

    def faster(self, c: int, k: int) -> bool:
        """Whether k = c is modelled faster than k, paired against paired or alone against alone
        (k = 1: the whole cost)."""
        paired = self.member_cost(c) < self.at(k)
        alone = self.alone is not None and self.alone(c) < (self.cost if k == 1 else self.alone(k))
        return paired or alone

    def at(self, k: int) -> float:
        return self.cost if k == 1 else self.member_cost(k)

    def at_alone(self, k: int) -> float:
        """Member cost at k > 1 with no partner (``member_cost`` where ``alone`` is not given)."""
        return self.alone(k) if self.alone is not None else self.member_cost(k)
