"""``benchmarks/split_bound.py``: its bounds against brute force on small worlds (issue 29).

References, none of them the code under test: every plan of a small world enumerated here (each
unit whole on any rank, or cut over any aligned group alone or paired with a unit of its shape;
experts held whole also moved whole to any rank), each plan's busiest rank computed from formulas
written in this file (the transfers as ``2 x max(bytes over NVLink / its rate, bytes over the NIC /
its rate)`` per rank, sent or received, out and back).  A bound must never exceed the best plan,
and where the best plan is known in closed form (experts that cannot pay for their transfers
stay home; five equal units on two ranks) it must equal it: a bound that ignores the transfers,
or that drops the dual feasible functions, fails there.
"""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Shard

from optimizer.distributed.layout import MeshGrid, ParamLayout
from optimizer.newton_schulz.forms import newton_schulz_flops
from optimizer.parallel.planning.plan_data import PlanParam
from optimizer.parallel.planning.cut_hardware import SplitHardware
from optimizer.parallel.planning.cut_model import SplitModel
from repo import load_benchmark


@pytest.fixture(scope="module")
def sb():
    return load_benchmark("split_bound")


# ----------------------------------------------------------------------------- whole-or-cut units


class _Table:
    """A split model given as a table: per k, a unit's member cost alone and in a pair (per unit)."""

    def __init__(self, alone: dict, paired: dict):
        self.alone, self.paired, self.max_ranks = alone, paired, max(alone)

    def member_cost(self, shape, k, units=1):
        return (self.alone if units == 1 else self.paired)[k]


def _unit(shape, cost, table=None):
    return SimpleNamespace(shape=shape, cost=lambda s, c=cost: c, split=table)


def _best_whole_or_cut(units, world: int) -> float:
    """The least busiest rank over every plan: each unit whole on a rank, or cut over an aligned
    group of k ranks alone, or paired (an even number of same-shape units on one group at one k,
    each member charged the per-unit paired cost for each)."""
    choices = []
    for u in units:
        opts = [("whole", r) for r in range(world)]
        if u.split is not None:
            for k in u.split.alone:
                if k <= world:
                    for g in range(world // k):
                        opts += [("alone", k, g), ("pair", k, g)]
        choices.append(opts)
    best = math.inf
    for plan in itertools.product(*choices):
        load = [0.0] * world
        pairs: dict[tuple, int] = {}
        for u, way in zip(units, plan):
            if way[0] == "whole":
                load[way[1]] += u.cost(u.shape)
                continue
            _, k, g = way
            cost = u.split.member_cost(u.shape, k, 1 if way[0] == "alone" else 2)
            for r in range(g * k, g * k + k):
                load[r] += cost
            if way[0] == "pair":
                pairs[(u.shape, k, g)] = pairs.get((u.shape, k, g), 0) + 1
        if all(n % 2 == 0 for n in pairs.values()):
            best = min(best, max(load))
    return best


def test_five_equal_units_on_two_ranks_need_three_on_one(sb):
    """Five whole units of 0.4 on two ranks: the best plan puts three on one rank (1.2).  The
    total (1.0 per rank) and the slots of (3) (no unit above half of any T below 1.2) say 1.0;
    u^(2) refutes every T below 1.2 (each unit counts 1/2, five of them 2.5 > 2 ranks)."""
    units = [_unit((4, 4), 0.4) for _ in range(5)]
    assert _best_whole_or_cut(units, 2) == pytest.approx(1.2)
    assert sb.lower_bound(units, 2) == pytest.approx(1.2, rel=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_the_whole_or_cut_bound_never_exceeds_the_best_plan(sb, seed):
    """Random costs on 4 ranks, two shapes: the bound is at most the best plan enumerated here."""
    rng = random.Random(seed)
    units = []
    for shape, n in (((8, 16), 2), ((8, 8), 2)):
        whole = rng.uniform(1, 4)
        alone = {2: whole * rng.uniform(0.5, 0.9), 4: whole * rng.uniform(0.3, 0.8)}
        paired = {k: v * rng.uniform(0.6, 1.0) for k, v in alone.items()}
        table = _Table(alone, paired)
        units += [_unit(shape, whole, table) for _ in range(n)]
    best = _best_whole_or_cut(units, 4)
    bound = sb.lower_bound(units, 4)
    assert bound <= best * (1 + 1e-9)
    assert bound >= sum(u.cost(u.shape) for u in units) / 4 * (1 - 1e-9)  # and at least the average


# ----------------------------------------------------------------------------- experts held whole

WORLD, NODE = 8, 4
SPECS = [("e1", (2, 32, 64)), ("e2", (1, 64, 32))]  # Shard(0) on 8 ranks: e1 on ranks 0 and 1, e2 on rank 0


def _hardware(nvlink: float, nic: float, node_size: int = NODE, latency: float = 1e-6) -> SplitHardware:
    return SplitHardware(f"test: NVLink {nvlink:g} B/s, NIC {nic:g} B/s", 1e9, 1e9, nvlink, latency, torch.float32,
                         node_size=node_size, inter_bandwidth=nic, device="cpu")


def _cost(shape):
    return float(newton_schulz_flops(shape, 5, "classic"))


def _expert_params(hw):
    grid = MeshGrid((WORLD,), tuple(range(WORLD)))
    model = SplitModel.of("auto", hw, 5, "classic", "fixed", torch.float32)
    return [PlanParam(n, s, ParamLayout(s, grid, (Shard(0),)), torch.float32, torch.device("cpu"), 0, _cost,
                      split=model) for n, s in SPECS]


def _experts():
    """(holder, one expert's shape) of every expert: torch.chunk of E experts over 8 ranks puts
    expert e on rank e (E <= 8)."""
    return [(e, (1, *s[1:])) for _, s in SPECS for e in range(s[0])]


def _best_expert_plan(hw, model) -> float:
    """The least step over every plan of the three experts: home, whole to any other rank, or cut
    over any aligned group of 2, 4 or 8 ranks alone or paired (same short-side-first shape, same
    group and k); each rank's step = its products + 2 x max(sent over NVLink, sent over the NIC,
    received over NVLink, received over the NIC) at their rates, in FLOP-equivalents."""
    rate = hw.fp32_flops
    item = 4
    experts = _experts()
    choices = []
    for h, shape in experts:
        opts = [("home",)] + [("whole", o) for o in range(WORLD) if o != h]
        for k in (2, 4, 8):
            for g in range(WORLD // k):
                opts += [("alone", k, g), ("pair", k, g)]
        choices.append(opts)
    best = math.inf
    for plan in itertools.product(*choices):
        load = [0.0] * WORLD
        link = {}  # (rank, "send"/"recv", same node) -> bytes
        pairs: dict[tuple, int] = {}

        def ship(src, dst, nbytes):
            same = src // NODE == dst // NODE
            link[(src, "send", same)] = link.get((src, "send", same), 0) + nbytes
            link[(dst, "recv", same)] = link.get((dst, "recv", same), 0) + nbytes

        for (h, shape), way in zip(experts, plan):
            m, n = shape[-2:]
            if way[0] == "home":
                load[h] += _cost(shape)
            elif way[0] == "whole":
                load[way[1]] += _cost(shape)
                ship(h, way[1], m * n * item)
            else:
                _, k, g = way
                units = 1 if way[0] == "alone" else 2
                member = model.member_cost(shape, k, units)
                long, short = max(m, n), min(m, n)
                widths = [long // k + (1 if j < long % k else 0) for j in range(k)]
                for j, r in enumerate(range(g * k, g * k + k)):
                    load[r] += member
                    if r != h:
                        ship(h, r, short * widths[j] * item)
                if units == 2:
                    key = (short, long, k, g)
                    pairs[key] = pairs.get(key, 0) + 1
        if any(c % 2 for c in pairs.values()):
            continue
        step = 0.0
        for r in range(WORLD):
            t = max([nbytes / (hw.bandwidth if same else hw.inter_bandwidth)
                     for (rr, _, same), nbytes in link.items() if rr == r], default=0.0)
            step = max(step, load[r] + 2 * t * rate)
        best = min(best, step)
    return best


def _bound(sb, params):
    eb = sb.expert_bound(params, WORLD)
    return max(eb.value, sb.lower_bound(params, WORLD))


def test_experts_that_cannot_pay_for_their_transfers_bound_at_home(sb):
    """Links so slow that every move costs more than the expert's products: the best plan keeps
    every expert home, rank 0 running its two (the brute force finds it), and the bound equals it.
    A bound that left the transfers out would be the products alone, spread: far below."""
    hw = _hardware(1e3, 1e2)
    params = _expert_params(hw)
    home = _cost((1, 32, 64)) + _cost((1, 64, 32))
    best = _best_expert_plan(hw, params[0].split)
    assert best == pytest.approx(home, rel=1e-12)
    assert _bound(sb, params) == pytest.approx(home, rel=1e-9)
    assert sb.lower_bound(params, WORLD) < home / 2  # the transfer-free bound alone says far less


@pytest.mark.parametrize("nvlink, nic", [(1e3, 1e2), (4e6, 4e5), (1e7, 1e5), (1e8, 1e8), (1e12, 1e12), (3e6, 3e4)])
def test_the_expert_bound_never_exceeds_the_best_plan(sb, nvlink, nic):
    """Slow, middling, fast-inside-slow-between and free links (nodes of 4 in 8 ranks): the bound
    is at most the best plan's step, and at least the transfer-free bound."""
    hw = _hardware(nvlink, nic)
    params = _expert_params(hw)
    best = _best_expert_plan(hw, params[0].split)
    bound = _bound(sb, params)
    assert bound <= best * (1 + 1e-9), (bound, best)
    assert bound >= sb.lower_bound(params, WORLD) * (1 - 1e-12)


def test_a_node_whose_ranks_all_hold_experts_keeps_them_when_its_nic_is_slow(sb):
    """Nodes of 2: ranks 0 and 1 (every rank of node 0) hold the experts, NVLink free, NIC slow.
    Moving inside the node only trades work between holders; leaving it costs the NIC: the node
    bound is the node's experts over its 2 ranks, and the brute force's best plan cannot go lower."""
    hw = _hardware(1e15, 1e2, node_size=2)
    params = _expert_params(hw)
    eb = sb.expert_bound(params, WORLD)
    total = 2 * _cost((1, 32, 64)) + _cost((1, 64, 32))
    assert eb.node == pytest.approx(total / 2, rel=1e-12)
    assert eb.holder < eb.node  # the holder alone could shed its work inside the node
