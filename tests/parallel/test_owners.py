"""Owner assignment for parallel Muon: LPT against brute force, and expert splitting.

References are independent of the code under test: an exhaustive optimum over every
assignment, a separately written list-scheduling loop with the documented tie rules,
Graham's LPT bound, and FLOPs counted by torch's FlopCounterMode while the real
Newton-Schulz runs.
"""

import itertools
import math
import random

import pytest

from optimizer.parallel.planning.owners import assign_owners, assign_owners_among, chunk_order, chunked_critical_path


def rank_loads(owners, costs, num_ranks):
    """Total cost owned by each rank (written out here, independent of the code under test)."""
    loads = [0] * num_ranks
    for rank, cost in zip(owners, costs):
        loads[rank] += cost
    return loads


def _optimal_makespan(costs, num_ranks):
    # Every one of num_ranks ** len(costs) assignments; fine for <= 8 items.
    best = math.inf
    for assignment in itertools.product(range(num_ranks), repeat=len(costs)):
        loads = [0] * num_ranks
        for rank, cost in zip(assignment, costs):
            loads[rank] += cost
        best = min(best, max(loads))
    return best


def _reference_lpt(costs, num_ranks):
    # The documented rule, written as plainly as possible: largest cost first (ties:
    # lower index), to the least-loaded rank (ties: lower rank).
    loads = [0] * num_ranks
    owners = [None] * len(costs)
    remaining = list(range(len(costs)))
    while remaining:
        item = remaining[0]
        for i in remaining:
            if costs[i] > costs[item]:
                item = i
        remaining.remove(item)
        rank = 0
        for r in range(num_ranks):
            if loads[r] < loads[rank]:
                rank = r
        owners[item] = rank
        loads[rank] += costs[item]
    return owners


def _makespan(owners, costs, num_ranks):
    return max(rank_loads(owners, costs, num_ranks))


def _random_instances(seed, count):
    rng = random.Random(seed)
    for _ in range(count):
        num_items = rng.randint(1, 8)
        num_ranks = rng.choice([2, 3])
        # Small integer costs make ties (and so the tie rules) common.
        costs = [rng.randint(1, 12) for _ in range(num_items)]
        yield costs, num_ranks


def test_lpt_within_graham_bound_of_exhaustive_optimum():
    worst = 1.0
    for costs, num_ranks in _random_instances(seed=0, count=150):
        owners = assign_owners(costs, num_ranks)
        lpt, opt = _makespan(owners, costs, num_ranks), _optimal_makespan(costs, num_ranks)
        assert opt <= lpt <= (4 / 3 - 1 / (3 * num_ranks)) * opt + 1e-9, (costs, num_ranks, lpt, opt)
        worst = max(worst, lpt / opt)
    # The instances must actually exercise the bound, not only trivially optimal cases.
    assert worst > 1.0


def test_lpt_graham_tight_example():
    # The classic worst case for 2 ranks: LPT gives 3+2+2 | 3+2 = 7, the optimum 3+3 | 2+2+2 = 6.
    costs = [3, 3, 2, 2, 2]
    owners = assign_owners(costs, 2)
    assert owners == [0, 1, 0, 1, 0]
    assert _makespan(owners, costs, 2) == 7
    assert _optimal_makespan(costs, 2) == 6


def test_lpt_matches_reference_rule_including_ties():
    for costs, num_ranks in _random_instances(seed=1, count=300):
        assert assign_owners(costs, num_ranks) == _reference_lpt(costs, num_ranks), (costs, num_ranks)
    rng = random.Random(2)
    for _ in range(30):
        costs = [rng.choice([0, 1.5, 2.0, 7.25]) for _ in range(rng.randint(0, 40))]
        num_ranks = rng.randint(1, 9)
        assert assign_owners(costs, num_ranks) == _reference_lpt(costs, num_ranks)


def test_ties_go_to_lower_index_and_lower_rank():
    assert assign_owners([1, 1, 1, 1], 2) == [0, 1, 0, 1]
    assert assign_owners([5, 5, 5], 4) == [0, 1, 2]
    assert assign_owners([2, 4, 2, 4], 2) == [0, 0, 1, 1]


def test_every_item_assigned_exactly_once_to_a_valid_rank():
    rng = random.Random(3)
    for _ in range(20):
        costs = [rng.random() * 1e12 for _ in range(rng.randint(0, 200))]
        num_ranks = rng.randint(1, 64)
        owners = assign_owners(costs, num_ranks)
        assert len(owners) == len(costs)
        assert all(0 <= r < num_ranks for r in owners)
        # Loads account for every cost once.
        assert sum(rank_loads(owners, costs, num_ranks)) == pytest.approx(sum(costs))


def test_deterministic_and_independent_of_container_and_number_type():
    costs = [7, 3, 7, 1, 3, 3, 9, 0]
    first = assign_owners(costs, 3)
    assert all(assign_owners(costs, 3) == first for _ in range(5))
    assert assign_owners(tuple(costs), 3) == first
    assert assign_owners([float(c) for c in costs], 3) == first


def test_more_ranks_than_items_puts_one_item_per_rank():
    assert assign_owners([4, 9, 1], 8) == [1, 0, 2]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: assign_owners([1, 2], 0), "num_ranks"),
        (lambda: assign_owners([1, 2], 2.0), "num_ranks"),
        (lambda: assign_owners([1, -2], 2), r"costs\[1\]"),
        (lambda: assign_owners([float("nan")], 2), r"costs\[0\]"),
    ],
)
def test_bad_input_names_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- planning work units -----------------------------------------------------------


# --- pipeline chunks ---------------------------------------------------------------


def _reference_chunks(costs, owners, chunk_size):
    """The documented rule, written out plainly: each owner's items end to end, largest
    first (ties: lower index), on one axis as long as the busiest owner's total; C windows
    (C = ceil(items / chunk_size), at most total / largest item, at least 1); an item goes
    to the window holding its midpoint; empty windows are dropped; inside a window, items
    by owner, then in the owner's order."""
    if not costs:
        return []
    owner_ids = sorted(set(owners))
    lists = {o: [] for o in owner_ids}
    for i in range(len(costs)):
        lists[owners[i]].append(i)
    for o in owner_ids:
        lists[o].sort(key=lambda i: (-costs[i], i))
    total = max(sum(costs[i] for i in lists[o]) for o in owner_ids)
    c = math.ceil(len(costs) / chunk_size)
    if max(costs) > 0:
        c = max(1, min(c, int(total // max(costs))))
    windows = [[] for _ in range(c)]
    for o in owner_ids:
        start = 0
        for pos, i in enumerate(lists[o]):
            if total > 0:
                k = min(c - 1, math.floor((start + costs[i] / 2) * c / total))
            else:
                k = min(c - 1, pos * c // len(lists[o]))
            windows[k].append(i)
            start += costs[i]
    return [w for w in windows if w]


def _random_chunk_instance(rng, equal_counts=False):
    num_ranks = rng.randint(1, 5)
    if equal_counts:
        per_owner = rng.randint(1, 4)
        owners = [r for r in range(num_ranks) for _ in range(per_owner)]
        rng.shuffle(owners)
    else:
        # Some ranks may own nothing, others several: uneven, as LPT leaves them.
        owners = [rng.randrange(num_ranks) for _ in range(rng.randint(0, 14))]
    costs = [rng.randint(1, 6) for _ in owners]  # small integers: ties are common
    return costs, owners, num_ranks


def test_chunks_follow_the_cumulative_load_rule():
    rng = random.Random(1)
    for _ in range(400):
        costs, owners, num_ranks = _random_chunk_instance(rng)
        chunk_size = rng.randint(1, 7)
        got = chunk_order(costs, owners, num_ranks, chunk_size)
        assert got == _reference_chunks(costs, owners, chunk_size), (costs, owners, chunk_size)


def test_every_index_exactly_once_and_no_empty_chunk():
    rng = random.Random(2)
    for _ in range(300):
        costs, owners, num_ranks = _random_chunk_instance(rng)
        chunk_size = rng.randint(1, 7)
        chunks = chunk_order(costs, owners, num_ranks, chunk_size)
        assert sorted(i for c in chunks for i in c) == list(range(len(costs)))
        assert all(chunks) and len(chunks) <= max(1, math.ceil(len(costs) / chunk_size)) * bool(costs)
        # each owner's items keep their order (largest first) across chunks
        for r in range(num_ranks):
            seq = [i for c in chunks for i in c if owners[i] == r]
            assert seq == sorted(seq, key=lambda i: (-costs[i], i))


def test_equal_items_give_each_owner_one_item_per_chunk():
    # Equal costs and equal counts: chunk k holds every owner's k-th item.
    rng = random.Random(5)
    for _ in range(200):
        num_ranks, per_owner = rng.randint(1, 6), rng.randint(1, 5)
        owners = [r for r in range(num_ranks) for _ in range(per_owner)]
        rng.shuffle(owners)
        costs = [3.0] * len(owners)
        chunks = chunk_order(costs, owners, num_ranks, num_ranks)
        assert len(chunks) == per_owner
        for chunk in chunks:
            assert [owners[i] for i in chunk] == list(range(num_ranks))


def test_a_large_item_does_not_sit_alone_while_the_others_work_piles_up():
    # Owner 0 has one item of 10, owner 1 ten items of 1.  Cut by count (2 per chunk,
    # round robin) the chunks would cost 10 + 9 = 19 in lockstep; by load they cost 10.
    costs = [10] + [1] * 10
    owners = [0] + [1] * 10
    chunks = chunk_order(costs, owners, 2, 2)
    assert chunked_critical_path(chunks, costs, owners) == 10
    # The chunked path is never below the busiest owner's load, and never above it by
    # more than one largest item per chunk.
    rng = random.Random(6)
    for _ in range(300):
        costs, owners, num_ranks = _random_chunk_instance(rng)
        if not costs:
            continue
        chunks = chunk_order(costs, owners, num_ranks, rng.randint(1, 7))
        busiest = max(rank_loads(owners, costs, num_ranks))
        path = chunked_critical_path(chunks, costs, owners)
        assert busiest <= path <= busiest + len(chunks) * max(costs), (costs, owners, chunks)


def test_ties_keep_index_order_and_result_is_deterministic():
    # Hand-worked: equal costs, owner 0 holds 0 and 1, owner 1 holds 2 and 3.
    assert chunk_order([5, 5, 5, 5], [0, 0, 1, 1], 2, 2) == [[0, 2], [1, 3]]
    # Larger cost first within an owner, whatever its index: owner 0 runs 1, 2, then 0
    # (costs 2, 2, 1); T = 6, three windows of 2; midpoints 1, 3, 4.5 and 1, 3, 5.
    assert chunk_order([1, 2, 2, 2, 2, 2], [0, 0, 0, 1, 1, 1], 2, 2) == [[1, 3], [2, 4], [0, 5]]
    # A window never shorter than the largest item: T = 10, largest 9, so one chunk.
    assert chunk_order([1, 9, 4, 4], [0, 0, 1, 1], 2, 2) == [[1, 0, 2, 3]]
    costs, owners = [3, 1, 3, 2, 3, 1, 2], [1, 0, 1, 0, 2, 0, 2]
    first = chunk_order(costs, owners, 3, 2)
    assert chunk_order(tuple(costs), tuple(owners), 3, 2) == first
    assert chunk_order([float(c) for c in costs], owners, 3, 2) == first
    assert all(chunk_order(costs, owners, 3, 2) == first for _ in range(5))


def test_no_items_gives_no_chunks():
    assert chunk_order([], [], 4, 4) == []


@pytest.mark.parametrize(
    "chunk_size, num_ranks, match",
    [(0, 2, "chunk_size"), (-3, 2, "chunk_size"), (2, 0, "num_ranks")],
)
def test_chunk_order_bad_sizes_name_the_parameter(chunk_size, num_ranks, match):
    with pytest.raises(ValueError, match=match):
        chunk_order([1.0, 2.0], [0, 1], num_ranks, chunk_size)


@pytest.mark.parametrize(
    "costs, owners, ranks, chunk, match",
    [
        ([1, 2], [0, 1], 2, True, "chunk_size"),
        ([1, 2], [0, 1], 2, 1.5, "chunk_size"),
        ([1, 2], [0], 2, 2, "one owner per item"),
        ([1, 2], [0, 2], 2, 2, r"owners\[1\] = 2"),
    ],
)
def test_chunk_order_rejects_bad_input_by_name(costs, owners, ranks, chunk, match):
    with pytest.raises(ValueError, match=match):
        chunk_order(costs, owners, ranks, chunk)


# --- owners restricted to candidate ranks (replicas, expert holders) -----------------


def _reference_lpt_among(costs, candidates):
    # ties: the candidate listed first
    loads = {}
    owners = [None] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        best = None
        for r in candidates[i]:
            if best is None or loads.get(r, 0) < loads.get(best, 0):
                best = r
        owners[i] = best
        loads[best] = loads.get(best, 0) + costs[i]
    return owners


def test_lpt_among_candidates_matches_the_plain_rule():
    rng = random.Random(7)
    for _ in range(300):
        ranks = list(range(rng.randint(1, 9)))
        sets = [tuple(rng.sample(ranks, rng.randint(1, len(ranks)))) for _ in range(3)] + [tuple(ranks)]  # any order
        n = rng.randint(0, 30)
        costs = [rng.choice([1, 2, 2.5, 7]) for _ in range(n)]
        candidates = [rng.choice(sets) for _ in range(n)]
        owners = assign_owners_among(costs, candidates)
        assert owners == _reference_lpt_among(costs, candidates), (costs, candidates)
        assert all(o in c for o, c in zip(owners, candidates))


def test_lpt_among_everyone_is_assign_owners():
    rng = random.Random(8)
    for _ in range(100):
        costs = [rng.randint(0, 9) for _ in range(rng.randint(0, 25))]
        n = rng.randint(1, 7)
        assert assign_owners_among(costs, [tuple(range(n))] * len(costs)) == assign_owners(costs, n)


def test_lpt_among_rejects_empty_candidates():
    with pytest.raises(ValueError, match=r"candidates\[1\] is empty"):
        assign_owners_among([1, 2], [(0,), ()])


def test_ties_follow_the_candidate_order_so_work_spreads_over_replicas():
    # 4 equal matrices, 8 ranks in 2 replicas of 4 (ranks 0-3 and 4-7). Listed in rank order,
    # ties fill replica 0 first; listed replica-fastest (0, 4, 1, 5, ...), both replicas get 2.
    costs = [1.0] * 4
    assert assign_owners_among(costs, [tuple(range(8))] * 4) == [0, 1, 2, 3]
    spread = (0, 4, 1, 5, 2, 6, 3, 7)
    assert assign_owners_among(costs, [spread] * 4) == [0, 4, 1, 5]
