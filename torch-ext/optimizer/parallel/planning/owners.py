"""Which rank orthogonalises which matrix in parallel Muon, and in which chunk.

Parallel Muon gives every work unit (a matrix, or a contiguous range of an expert
weight's experts) one owner among the ranks that hold it: the owner gathers the
pieces, runs Newton-Schulz and scatters the update back.  Newton-Schulz dominates the
step, so owners are chosen to balance its FLOPs (longest-processing-time first), and
the pipeline's chunks are cut so that every owner has similar work in each.

Everything here is pure Python on numbers (costs come from ``newton_schulz_flops``;
the step plan in ``plan.py`` decides the units), with no process groups and no
randomness: every rank computes the same result from the same inputs, so no rank has
to broadcast it.  Ties are broken by index and list order, never by hash or dict order.
"""

from __future__ import annotations

import heapq
import math
import numbers
from typing import Sequence


__all__ = [
    "assign_owners",
    "assign_owners_among",
    "assign_owners_grouped",
    "chunk_order",
    "chunked_critical_path",
    "cut_chunks",
    "split_range_evenly",
]


def _check_num_ranks(num_ranks: int) -> None:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int (the shard group size), got {num_ranks!r}")


def _check_costs(costs: Sequence[float]) -> None:
    for i, c in enumerate(costs):
        if not (isinstance(c, numbers.Real) and math.isfinite(c) and c >= 0):
            raise ValueError(
                f"costs[{i}] = {c!r}: every cost must be a finite non-negative number "
                "(use newton_schulz_flops(shape, ns_steps) for a matrix)"
            )


def assign_owners(costs: Sequence[float], num_ranks: int) -> list[int]:
    """Longest-processing-time-first: the owner rank (0..num_ranks-1) of every item.

    Items are taken by cost, largest first (equal costs: lower index first), and each
    goes to the currently least-loaded rank (equal loads: lower rank).  LPT's makespan
    is at most (4/3 - 1/(3 num_ranks)) times the optimum (Graham, 1969).
    """
    _check_num_ranks(num_ranks)
    everyone = tuple(range(num_ranks))
    return assign_owners_among(costs, [everyone] * len(costs))


def assign_owners_among(costs: Sequence[float], candidates: Sequence[Sequence[int]]) -> list[int]:
    """LPT where item ``i`` may only go to a rank in ``candidates[i]``.

    The same rule as :func:`assign_owners` (largest item first, to the least-loaded
    allowed rank), over global rank ids; ties go to the lower item index and to the
    candidate listed first (so the caller decides how ties spread: parallel Muon lists a
    matrix's holders with replicas varying fastest, so that a world with fewer
    matrices than ranks spreads them over every replica).  Parallel Muon uses it
    across replicas: a matrix may be owned by any rank that holds a copy of its
    shards, an expert range only by ranks that hold those experts.  One heap per
    distinct candidate list; a rank's entry in the other heaps goes stale when it
    takes an item, and is refreshed when it surfaces (loads only grow, so a stale
    entry is never too high).  O(items x log ranks) for the few candidate lists a
    model has.
    """
    owners, _ = assign_owners_grouped(costs, candidates, None)
    return owners


def assign_owners_grouped(
    costs: Sequence[float],
    candidates: Sequence[Sequence[int] | None],
    groups: Sequence[Sequence[Sequence[int]] | None] | None,
    loads: dict[int, float] | None = None,
) -> tuple[list[int], dict[int, float]]:
    """LPT over two kinds of items: whole items (``groups[i] is None``: one owner among
    ``candidates[i]``, as :func:`assign_owners_among`) and split items (``groups[i]`` lists
    the rank groups that may run it together: every member of the chosen group is charged
    ``costs[i]``, the time the split item holds each of them).

    Items are taken largest first (ties: lower index); a split item goes to the group whose
    busiest member is least loaded (ties: the group listed first), a whole item to the
    least-loaded candidate.  Returns, per item, the owner rank (whole) or the index of the
    chosen group in ``groups[i]`` (split), and every rank's load.  ``loads``: what ranks carry
    already (not modified; the result includes it).  With no split items and no loads it is
    exactly :func:`assign_owners_among`.  Pure and deterministic.
    """
    _check_costs(costs)
    if len(candidates) != len(costs):
        raise ValueError(f"candidates has {len(candidates)} entries but costs has {len(costs)}; give one per item")
    if groups is not None and len(groups) != len(costs):
        raise ValueError(f"groups has {len(groups)} entries but costs has {len(costs)}; give one per item")
    loads = dict(loads or {})
    heaps: dict[tuple[int, ...], list[tuple[float, int, int]]] = {}
    group_heaps: dict[tuple, list[tuple[float, int]]] = {}
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        options = groups[i] if groups is not None else None
        if options is not None:
            owners[i] = _take_group(options, group_heaps, loads, costs[i], i)
            continue
        allowed = tuple(candidates[i])
        if not allowed:
            raise ValueError(f"candidates[{i}] is empty: every item needs at least one rank that may own it")
        heap = heaps.get(allowed)
        if heap is None:
            first = {}
            for pos, r in enumerate(allowed):
                first.setdefault(r, pos)
            heap = heaps[allowed] = [(loads.get(r, 0), pos, r) for r, pos in first.items()]
            heapq.heapify(heap)
        load, pos, rank = heap[0]
        while load != loads.get(rank, 0):  # stale: the rank took items through another heap
            heapq.heapreplace(heap, (loads[rank], pos, rank))
            load, pos, rank = heap[0]
        owners[i] = rank
        loads[rank] = load + costs[i]
        heapq.heapreplace(heap, (loads[rank], pos, rank))
    return owners, loads


def _take_group(options: Sequence[Sequence[int]], heaps: dict, loads: dict[int, float], cost: float, i: int) -> int:
    """The group (index into ``options``) whose busiest member is least loaded; charge its members.

    One heap per ``options`` object (callers pass the same object for the same choice of
    groups), entries (busiest member's load, position); loads only grow, so a stale entry is
    too low, never too high, and is refreshed when it surfaces."""
    hit = heaps.get(id(options))
    if hit is None:
        if not options or any(len(g) == 0 for g in options):
            raise ValueError(f"groups[{i}] must list at least one non-empty group of ranks")
        hit = heaps[id(options)] = (options, [(max(loads.get(r, 0) for r in g), pos) for pos, g in enumerate(options)])
        heapq.heapify(hit[1])
    heap = hit[1]
    while True:
        load, pos = heap[0]
        now = max(loads.get(r, 0) for r in options[pos])
        if now == load:
            break
        heapq.heapreplace(heap, (now, pos))
    for r in options[pos]:
        loads[r] = loads.get(r, 0) + cost
    heapq.heapreplace(heap, (max(loads[r] for r in options[pos]), pos))
    return pos


def chunk_order(costs: Sequence[float], owners: Sequence[int], num_ranks: int, chunk_size: int) -> list[list[int]]:
    """Cut owned items into pipeline chunks (lists of item indices), by cumulative load.

    Owners are ranks 0..num_ranks-1 (see :func:`cut_chunks` for the rule).
    """
    _check_num_ranks(num_ranks)
    bad = [i for i, o in enumerate(owners) if not (isinstance(o, int) and 0 <= o < num_ranks)]
    if len(owners) == len(costs) and bad:
        raise ValueError(f"owners[{bad[0]}] = {owners[bad[0]]!r} is not a rank in [0, {num_ranks})")
    return cut_chunks(costs, owners, chunk_size)


def cut_chunks(costs: Sequence[float], owners: Sequence[int], chunk_size: int) -> list[list[int]]:
    """Cut owned items into pipeline chunks so that every chunk holds similar work for every owner.

    Ranks meet at every chunk's all-to-alls, so a step costs about the sum over
    chunks of the busiest owner's work in that chunk.  Each owner's items are laid
    end to end, largest first (ties: lower index), on a common time axis of length
    T (the busiest owner's total); the axis is cut into C equal windows, and an
    item goes to the window holding its midpoint.  C is ceil(items / chunk_size)
    (``chunk_size`` items per chunk on average), but never more than T divided by
    the largest item: a window shorter than an item would leave that item alone
    in its chunk while every other owner's work in the other chunks adds up.
    Within a chunk items are ordered by owner, then largest first.  Empty windows
    are dropped.  Deterministic.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (items per chunk), got {chunk_size!r}")
    if len(owners) != len(costs):
        raise ValueError(f"owners has {len(owners)} entries but costs has {len(costs)}; give one owner per item")
    _check_costs(costs)
    if not costs:
        return []
    per_owner: dict[int, list[int]] = {}
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        per_owner.setdefault(owners[i], []).append(i)
    total = max(sum(costs[i] for i in items) for items in per_owner.values())
    largest = max(costs)
    num_chunks = math.ceil(len(costs) / chunk_size)
    if largest > 0:
        num_chunks = max(1, min(num_chunks, math.floor(total / largest)))
    window = [[] for _ in range(num_chunks)]
    for owner in sorted(per_owner):
        start = 0.0
        for position, i in enumerate(per_owner[owner]):
            if total > 0:
                k = min(num_chunks - 1, math.floor((start + costs[i] / 2) * num_chunks / total))
            else:  # nothing costs anything: spread by count
                k = min(num_chunks - 1, position * num_chunks // len(per_owner[owner]))
            window[k].append(i)
            start += costs[i]
    return [w for w in window if w]


def chunked_critical_path(chunks: Sequence[Sequence[int]], costs: Sequence[float], owners: Sequence[int]) -> float:
    """Sum over chunks of the busiest owner's work in it (chunks meeting at barriers)."""
    path = 0.0
    for chunk in chunks:
        loads: dict[int, float] = {}
        for i in chunk:
            loads[owners[i]] = loads.get(owners[i], 0.0) + costs[i]
        path += max(loads.values(), default=0.0)
    return path


def split_range_evenly(length: int, pieces: int) -> list[slice]:
    """``range(length)`` as ``pieces`` contiguous, near-equal slices (the first ``length % pieces`` one longer)."""
    base, extra = divmod(length, pieces)
    slices, start = [], 0
    for p in range(pieces):
        stop = start + base + (1 if p < extra else 0)
        slices.append(slice(start, stop))
        start = stop
    return slices
