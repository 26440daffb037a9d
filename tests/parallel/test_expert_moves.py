"""Experts held whole (``Shard(0)``) moved to, or cut over, ranks that hold none of them
(``parallel/planning/expert_moves.py``, ``parallel/execution/move_stages.py``; issue 29).

References, none of them the code under test:

- single-device Muon on the full tensors (``dist_cases.run_reference``): with units moved whole
  (a free link with slow collectives) or cut over groups (a free link, so that "auto" cuts), every parameter
  equals it within fp32 rounding after several steps, on 2, 4 and 8 gloo ranks, wide, tall and
  square experts, uneven expert counts, with dense matrices, QK-clip and NorMuon beside them;
- the momentum update itself: every block an owner receives is, column for column, columns of
  one expert of the global update, and a unit's blocks hold each column once;
- arithmetic on the placements: every unit is orthogonalised exactly once, by its holder or by
  the ranks it moved to, each rank's all-to-all splits are its peers' mirror, bytes sent = received;
- a misassigned block (block 1 handed block 0's columns) fails the comparison; no process group
  is made in a step; nothing moves where the experts already balance, or cannot move.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from dist_cases import (build_groups, make_case_tensors, owned_matrices_of_one_step, parse_placement, run_distributed,
                        run_reference, to_dtensor)
from harness import run_ranks
from optimizer.distributed.layout import MeshGrid, ParamLayout
from optimizer.newton_schulz.forms import newton_schulz_flops
from optimizer.parallel.planning.plan import MoveChunk, PlanParam, PlanSettings, build_plan, world_jobs
from optimizer.parallel.planning.expert_moves import move_seconds
from optimizer.parallel.planning.cut_hardware import CPU_GLOO, SplitHardware
from optimizer.parallel.planning.cut_model import SplitModel

ATOL, RTOL = 1e-5, 1e-5  # fp32 rounding of a differently ordered Gram sum (cut units); moved whole: exact
STEPS = 4
FREE = SplitHardware("test: free communication", 1e12, 1e12, 1e18, 1e-12, torch.float32)
# Moves cost nothing, collectives a second each: units move whole, nothing is cut (this CPU's own link
# prices moving experts this small above what it saves, so they would stay home).
MOVES = SplitHardware("test: moves free, collectives slow", CPU_GLOO.bf16_flops, CPU_GLOO.fp32_flops, 1e18, 1.0,
                      torch.float32, device="cpu")


def _cost(shape):
    return float(newton_schulz_flops(shape, 5, "classic"))


def _params(world, specs, hardware=CPU_GLOO, mode="auto"):
    grid = MeshGrid((world,), tuple(range(world)))
    model = SplitModel.of(mode, hardware, 5, "classic", "fixed", torch.float32) if mode != "never" else None
    return [PlanParam(n, s, ParamLayout(s, grid, (pl,)), torch.float32, torch.device("cpu"), 0, _cost, split=model)
            for n, s, pl in specs]


def _holder_units(params, world):
    """(param, global expert) -> holder rank, from the placement index math (torch.chunk)."""
    out = {}
    for i, p in enumerate(params):
        if len(p.shape) < 3 or not isinstance(p.layout.placements[0], Shard) or p.layout.placements[0].dim != 0:
            continue
        for r in range(world):
            held = p.layout.indices(p.layout.grid.coordinate(r))[0]
            for e in range(held.start, held.stop):
                out[(i, e)] = r
    return out


# ----------------------------------------------------------------------------- the plan (pure)

MOVING = [("w1", (3, 64, 256), Shard(0)), ("w2", (5, 256, 64), Shard(0)), ("sq", (3, 96, 96), Shard(0)),
          ("dense", (64, 96), Shard(0))]


@pytest.mark.parametrize("world", [8, 16])
@pytest.mark.parametrize("hardware", [CPU_GLOO, FREE], ids=["cpu_gloo", "free_link"])
def test_every_expert_is_orthogonalised_once_by_its_holder_or_where_it_moved(world, hardware):
    params = _params(world, MOVING, hardware)
    holders = _holder_units(params, world)
    plans = [build_plan(params, r, PlanSettings()) for r in range(world)]
    moved = [j for jobs, _ in world_jobs(params, PlanSettings()) for j in jobs if j.holder >= 0]
    assert moved and any(j.owner != j.holder for j in moved)
    # Every expert: orthogonalised where it is, or sent by its holder in blocks covering its long side once.
    covered: dict[tuple, int] = {}

    def count(i, r, region, length):
        held = params[i].layout.indices((r,))[0]
        lead = region[0] if region else slice(None)
        for e in range(held.start, held.stop)[lead]:
            covered[(i, e)] = covered.get((i, e), 0) + length

    for r, plan in enumerate(plans):
        for job in plan.local:
            if len(params[job.param].shape) == 3:
                count(job.param, r, job.region, max(params[job.param].shape[-2:]))
        for chunk in plan.chunks:
            for pack in (chunk.packs if isinstance(chunk, MoveChunk) else ()):
                shape = params[pack.param].shape
                count(pack.param, r, pack.region, pack.mine[-1 if shape[-1] >= shape[-2] else -2])
    for (i, e), holder in holders.items():
        assert covered.get((i, e)) == max(params[i].shape[-2:]), (params[i].name, e, holder, covered.get((i, e)))
    # The all-to-all: what rank r sends to j is what j receives from r, chunk by chunk.
    move_chunks = [[c for c in plan.chunks if isinstance(c, MoveChunk)] for plan in plans]
    assert len({len(c) for c in move_chunks}) == 1
    for c in range(len(move_chunks[0])):
        for r in range(world):
            for j in range(world):
                assert move_chunks[r][c].send_splits[j] == move_chunks[j][c].recv_splits[r]
    assert sum(p.bytes_sent for p in plans) == sum(p.bytes_received for p in plans) > 0
    # The busiest rank drops (Newton-Schulz FLOPs, and a cut block's modelled time); on this CPU's
    # link less far, since the planner weighs each move's transfer time against what it saves
    # (the step with the transfers: test_moves_that_pay_are_kept_and_the_step_with_their_transfers_is_shorter).
    still = [build_plan(_params(world, MOVING, hardware, "never"), r, PlanSettings()) for r in range(world)]
    assert max(p.load for p in plans) < (0.7 if hardware is FREE else 0.8) * max(p.load for p in still)


def test_nothing_moves_where_the_experts_already_balance_or_cannot_move():
    balanced = _params(8, [("w", (8, 64, 256), Shard(0)), ("v", (16, 64, 64), Shard(0))])
    assert all(j.holder < 0 for jobs, _ in world_jobs(balanced, PlanSettings()) for j in jobs)
    assert all(not isinstance(c, MoveChunk) for c in build_plan(balanced, 0, PlanSettings()).chunks)
    # the same experts, not movable: rows sharded (Shard(1): gathered as expert ranges), replicated
    # (HSDP: split over replicas instead), "always" (cuts over shard groups only) or "never"
    grid = MeshGrid((2, 4), tuple(range(8)))
    model = SplitModel.of("auto", FREE, 5, "classic", "fixed", torch.float32)
    others = [PlanParam("rows", (3, 64, 256), ParamLayout((3, 64, 256), MeshGrid((8,), tuple(range(8))), (Shard(1),)),
                        torch.float32, torch.device("cpu"), 0, _cost, split=model),
              PlanParam("hsdp", (3, 64, 256), ParamLayout((3, 64, 256), grid, (Replicate(), Shard(0))),
                        torch.float32, torch.device("cpu"), 0, _cost, split=model)]
    for params in (others, _params(8, MOVING[:2], FREE, "always"), _params(8, MOVING[:2], FREE, "never")):
        for settings in (PlanSettings(), PlanSettings(replica_split="never")):
            assert all(j.holder < 0 for jobs, _ in world_jobs(params, settings) for j in jobs)


def _links(bandwidth, node_size=0, inter_bandwidth=0.0):
    """CPU_GLOO's compute (fp32 70 GFLOP/s) with other links: bytes/s inside a node and, with
    ``node_size``, out of a rank's node."""
    return SplitHardware("test: links", CPU_GLOO.bf16_flops, CPU_GLOO.fp32_flops, bandwidth, 1e-12, torch.float32,
                         node_size=node_size, inter_bandwidth=inter_bandwidth, device="cpu")


def _moved(params):
    return [j for jobs, _ in world_jobs(params, PlanSettings()) for j in jobs if j.holder >= 0 and j.owner != j.holder]


def test_experts_stay_home_where_moving_them_does_not_pay():
    """A link so slow that sending one expert and taking its update back outlasts its
    Newton-Schulz: no plan moves anything, and every rank's load is the no-move plan's."""
    smallest = min(math.prod(s[1:]) for _, s, _ in MOVING if len(s) == 3) * 4  # fp32 bytes of one expert
    largest_ns = max(_cost(s[1:]) for _, s, _ in MOVING if len(s) == 3) / CPU_GLOO.fp32_flops
    bandwidth = 2 * smallest / (4 * largest_ns)  # out and back: 4x the longest expert's Newton-Schulz
    for world in (8, 16):
        params = _params(world, MOVING, _links(bandwidth))
        assert _moved(params) == []
        assert all(not isinstance(c, MoveChunk) for r in range(world) for c in build_plan(params, r, PlanSettings()).chunks)
        home = [build_plan(_params(world, MOVING, _links(bandwidth), "never"), r, PlanSettings()).load for r in range(world)]
        moved_experts = [j for jobs, _ in world_jobs(params, PlanSettings()) for j in jobs
                         if len(params[j.param].shape) == 3]
        assert moved_experts == []  # the experts are all run by their holders (units held whole)
        assert max(build_plan(params, r, PlanSettings()).load for r in range(world)) <= max(home) * (1 + 1e-12)


@pytest.mark.parametrize("world", [8, 16])
def test_moves_that_pay_are_kept_and_the_step_with_their_transfers_is_shorter(world):
    """This CPU's gloo figures: moving pays. The step each rank is modelled to take, its load plus
    its transfers (bytes of every block it sends or receives, out and back, at the link's rate,
    written out here), is below the busiest rank that keeps its experts home."""
    params = _params(world, MOVING, CPU_GLOO)
    moved = _moved(params)
    assert moved
    out, into = [0] * world, [0] * world
    for j in moved:
        nbytes = math.prod(j.shape) * 4
        out[j.holder] += nbytes
        into[j.owner] += nbytes
    seconds = [2 * max(out[r], into[r]) / CPU_GLOO.bandwidth for r in range(world)]
    step = [build_plan(params, r, PlanSettings()).load + seconds[r] * CPU_GLOO.fp32_flops for r in range(world)]
    home = max(build_plan(_params(world, MOVING, CPU_GLOO, "never"), r, PlanSettings()).load for r in range(world))
    assert max(step) < home
    jobs = [j for js, _ in world_jobs(params, PlanSettings()) for j in js]
    assert move_seconds(params, jobs, CPU_GLOO) == pytest.approx({r: t for r, t in enumerate(seconds) if t > 0})


def test_moves_between_nodes_are_priced_at_the_nic():
    """16 ranks in nodes of 8, a fast link inside a node and a slow one between nodes: ranks 0-2
    hold three experts each, 3-4 one, 5-7 none (torch.chunk), so moves inside node 0 pay and
    whatever moves stays there; with the fast link everywhere, moves also leave the node."""
    smallest = min(math.prod(s[1:]) for _, s, _ in MOVING if len(s) == 3) * 4
    largest_ns = max(_cost(s[1:]) for _, s, _ in MOVING if len(s) == 3) / CPU_GLOO.fp32_flops
    slow = 2 * smallest / (4 * largest_ns)
    params = _params(16, MOVING, _links(1e18, node_size=8, inter_bandwidth=slow))
    moved = _moved(params)
    assert moved and all(j.owner // 8 == j.holder // 8 for j in moved), [(j.holder, j.owner) for j in moved]
    assert any(j.owner in (5, 6, 7) for j in moved)
    assert any(j.owner // 8 != j.holder // 8 for j in _moved(_params(16, MOVING, _links(1e18))))


# ----------------------------------------------------------------------------- on gloo

Q, K = (16, 12), (8, 12)
CASES = {
    # 3 experts on 4 ranks (one idle), a tall stack of 5 (1-2 per rank), a square one; dense beside
    "fsdp_4": ((4,), [
        ("layers.0.moe.w1", (3, 24, 40), ["S0"]),
        ("layers.0.moe.w2", (5, 40, 24), ["S0"]),
        ("layers.0.moe.sq", (2, 20, 20), ["S0"]),
        ("layers.0.moe.w3", (1, 32, 192), ["S0"]),  # dominant: cut over a group on a free link
        ("layers.0.attention.wq.weight", Q, ["S0"]),
        ("layers.0.attention.wk.weight", K, ["S0"]),
        ("dense", (32, 48), ["S1"]),
    ]),
    # one expert dominant (cut over both ranks on a free link), a tall stack of 3 (2 + 1)
    "fsdp_2": ((2,), [("layers.0.moe.w1", (1, 32, 128), ["S0"]), ("layers.0.moe.w2", (3, 48, 16), ["S0"]),
                      ("layers.0.attention.wq.weight", Q, ["S0"]), ("layers.0.attention.wk.weight", K, ["S0"])]),
    "fsdp_8": ((8,), [("layers.0.moe.w1", (3, 16, 48), ["S0"]), ("layers.0.moe.w2", (5, 48, 16), ["S0"]),
                      ("layers.0.moe.w3", (2, 32, 32), ["S0"]), ("dense", (24, 40), ["S0"])]),
}
NORMUON = {"normuon_beta2": 0.9, "cautious_wd": True}


def _run(rank, world_size, name, free, extra):
    from optimizer.parallel.planning import plan_inputs

    plan_inputs.split_hardware = lambda device: FREE if free else MOVES
    mesh_shape, specs = CASES[name]
    full, stats, cut = run_distributed(rank, world_size, mesh_shape, specs, STEPS, True, with_stats=True,
                                       inspect=_cut_expert_blocks, **extra)
    return full, stats.moved_units, cut


def _cut_expert_blocks(opt, named, mesh):
    """Blocks of cut expert units this rank orthogonalises (not dense matrices cut by ns_split)."""
    return sum(1 for c in opt._cached_context.plan.chunks if isinstance(c, MoveChunk)
               for o in c.owned if o.split is not None)


def _check(name, free, extra=None):
    mesh_shape, specs = CASES[name]
    extra = extra or {}
    want = run_reference(specs, STEPS, True, **extra)
    results = run_ranks(_run, math.prod(mesh_shape), name, free, extra, timeout=240)
    for got, _, _ in results:
        for n, ref in want.items():
            torch.testing.assert_close(got[n], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} free={free} {n}: {m}")
    assert sum(moved for _, moved, _ in results) > 0  # some rank orthogonalised experts it does not hold
    return results


@pytest.mark.parametrize("name", ["fsdp_2", "fsdp_4", "fsdp_8"])
@pytest.mark.parametrize("free", [False, True], ids=["moved_whole", "cut"])
def test_moved_experts_equal_single_device(name, free):
    results = _check(name, free)
    cut = sum(blocks for _, _, blocks in results)
    if free:
        assert cut > 0  # a free link: "auto" cuts the dominant experts over groups
    else:
        assert cut == 0  # free moves, slow collectives: these experts move whole


@pytest.mark.parametrize("free", [False, True], ids=["moved_whole", "cut"])
def test_moved_normuon_experts_and_their_v_equal_single_device(free):
    _check("fsdp_4", free, NORMUON)


def _run_state(rank, world_size, free):
    from optimizer.parallel.planning import plan_inputs

    plan_inputs.split_hardware = lambda device: FREE if free else MOVES
    mesh_shape, specs = CASES["fsdp_4"]
    _, state = run_distributed(rank, world_size, mesh_shape, specs, STEPS, False, with_state=True, **NORMUON)
    return {n: s["normuon_v"] for n, s in state.items()}


@pytest.mark.parametrize("free", [False, True], ids=["moved_whole", "cut"])
def test_normuon_v_of_moved_experts_equals_single_device(free):
    _, specs = CASES["fsdp_4"]
    _, want = run_reference(specs, STEPS, False, with_state=True, **NORMUON)
    for v in run_ranks(_run_state, 4, free, timeout=240):
        for n, ref in want.items():
            torch.testing.assert_close(v[n], ref["normuon_v"], atol=ATOL, rtol=RTOL, msg=lambda m: f"v {n}: {m}")


def test_a_misassigned_expert_block_is_caught(monkeypatch):
    """Hand block 1 of every cut expert block 0's columns (block 0's twice, block 1's never)."""
    from optimizer.parallel.planning import expert_moves

    real = expert_moves.cut_blocks

    def wrong(lengths, k):
        rows = list(real(lengths, k))
        if k > 1 and rows[0][0].stop - rows[0][0].start == rows[1][0].stop - rows[1][0].start:
            rows[1] = rows[0]
        return rows

    monkeypatch.setattr(expert_moves, "cut_blocks", wrong)  # the forked ranks inherit it
    with pytest.raises(AssertionError):
        _check("fsdp_2", True)


def _assembled(rank, world_size):
    from optimizer.parallel.planning import plan_inputs

    plan_inputs.split_hardware = lambda device: FREE
    mesh_shape, specs = CASES["fsdp_4"]
    return [(n, o.experts, o.split.transpose if o.split is not None else None, full)
            for n, o, full in owned_matrices_of_one_step(mesh_shape, specs) if len(full.shape) == 3]


def test_owners_receive_columns_of_the_experts_global_update():
    """Whatever an owner orthogonalises of an expert stack (a moved unit or a block of a cut one)
    is, column for column, columns of those experts' momentum update (found by exact match), and
    together the blocks of each expert hold every column once."""
    _, specs = CASES["fsdp_4"]
    _, grads = make_case_tensors(specs, 1)
    found: dict[tuple, list] = {}
    for per_rank in run_ranks(_assembled, 4, timeout=120):
        for name, experts, transposed, full in per_rank:
            g = grads[0][name]
            want = g.lerp(g * 0.1, 0.9)[experts]  # first step, Nesterov: buf = 0.1 g, update = g.lerp(buf, 0.9)
            whole = want.mT if transposed else want
            block = full.mT if transposed else full
            cols = found.setdefault((name, str(experts)), [whole.shape[-1]])
            for c in range(block.shape[-1]):
                match = [i for i in range(whole.shape[-1]) if torch.equal(block[..., c], whole[..., i])]
                assert len(match) == 1, (name, c, match)
                cols.append(match[0])
    expert_names = {n for n, shape, _ in specs if len(shape) == 3}
    assert {name for name, _ in found} == expert_names
    for (name, experts), (width, *cols) in found.items():
        assert sorted(cols) == list(range(width)), (name, experts, sorted(cols))


def _groups_made_in_steps(rank, world_size):
    from optimizer import Muon
    from optimizer.parallel.planning import plan_inputs
    from torch.distributed.device_mesh import init_device_mesh

    plan_inputs.split_hardware = lambda device: FREE
    mesh_shape, specs = CASES["fsdp_4"]
    mesh = init_device_mesh("cpu", mesh_shape)
    params, grads = make_case_tensors(specs, 2)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
             for n, _, pl in specs]
    opt = Muon(build_groups(named), lr=0.02)
    calls, real = [], dist.new_group
    dist.new_group = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        for s in range(2):
            for n, p in named:
                p.grad = to_dtensor(grads[s][n], mesh, p.placements)
            opt.step()
    finally:
        dist.new_group = real
    return calls, opt.last_step_stats.moved_units + opt.last_step_stats.split_units


def test_no_process_group_is_made_in_a_step_with_moves():
    results = run_ranks(_groups_made_in_steps, 4, timeout=120)
    assert all(calls == [] for calls, _ in results)
    assert sum(n for _, n in results) > 0


def test_whole_matrices_are_owned_around_experts_that_stay_home():
    """Links so slow that no expert moves and no matrix is cut: ranks 0 and 1 each run an expert
    where it is, so the six 64 x 64 matrices (each costing what an expert costs) go to ranks 2-7,
    one each, and every rank runs one unit (issue 29: DeepSeek-V3 Shard(0) at 512 ranks had a dense
    gate_proj on an expert holder, 2.04x the ideal where 1.89x was the bound).  Reference: the
    holders from the placement (torch.chunk: expert e on rank e) and the costs written here."""
    slow = SplitHardware("test: slow links", CPU_GLOO.bf16_flops, CPU_GLOO.fp32_flops, 1e3, 1.0, torch.float32,
                         device="cpu")
    specs = [("ex", (2, 64, 64), Shard(0))] + [(f"d{i}", (64, 64), Shard(0)) for i in range(6)]
    params = _params(8, specs, slow)
    patterns = world_jobs(params, PlanSettings())
    jobs = [j for js, _ in patterns for j in js]
    assert all(j.holder < 0 and j.cut is None for j in jobs)  # nothing moved, nothing cut
    assert sorted(j.owner for j in jobs) == [2, 3, 4, 5, 6, 7]
    assert _cost((1, 64, 64)) == _cost((64, 64))  # so one unit per rank is the best any plan does
