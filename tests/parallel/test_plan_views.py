"""Every rank builds the same plan from its own view of the parameters (issue 29).

Planning runs on every rank without communication (``parallel/plan.py``), so each rank of a
pattern must work out the same jobs, owners, cuts and chunks from what it holds.  What it holds
is not what the others hold: a parameter sharded over a slice of a larger mesh has another slice
on other ranks.  FSDP over TP shards the MoE experts over the ``dp_shard`` slice
(``examples/parallelize.py``; torchtitan without EP): on a (dp_shard=2, tp=2) mesh they are on
ranks (0, 2) as ranks 0 and 2 see them, on (1, 3) as ranks 1 and 3 do.  Counting each slice's
held experts as the load of "the" experts' holders made ranks 0/2 and 1/3 own the dense
matrices differently, and the gather's sizes disagreed (a gloo size mismatch in
``tests/core/test_checkpoint.py``'s fsdp_tp resume test, which reverted d5ab8e3).

References, none of them the code under test: the slices are built here from the mesh's
row-major rank order (as torch's ``DeviceMesh`` slices it); the all-to-all's own contract (what
rank r sends member j is what j receives from r, both ways); and the plan of one view compared
with every other view's, job for job.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from optimizer.distributed.layout import MeshGrid, ParamLayout
from optimizer.newton_schulz.forms import newton_schulz_flops
from optimizer.parallel.planning.plan import Chunk, MoveChunk, PlanParam, PlanSettings, build_plan, world_jobs
from optimizer.parallel.planning.cut_hardware import CPU_GLOO, SplitHardware
from optimizer.parallel.planning.cut_model import SplitModel

FREE = SplitHardware("test: free communication", 1e12, 1e12, 1e18, 1e-12, torch.float32)
# Links so slow that nothing moves or is cut: the whole matrices are only owned around held loads.
SLOW = SplitHardware("test: slow links", CPU_GLOO.bf16_flops, CPU_GLOO.fp32_flops, 1e3, 1.0, torch.float32,
                     device="cpu")
HARDWARE = [SLOW, CPU_GLOO, FREE]
MESHES = [(2, 2), (2, 4), (4, 2)]  # (dp_shard, tp)


def _cost(shape):
    return float(newton_schulz_flops(shape, 5, "classic"))


def _dense(dp: int, tp: int):
    """Matrices on the whole (dp_shard, tp) mesh, placed as FSDP over TP places them, and one
    replicated over dp_shard: as many as there are ranks, each costing what one expert costs."""
    placements = [(Shard(0), Shard(0)), (Shard(0), Shard(1)), (Replicate(), Shard(0))]
    return [(f"dense{i}", (64, 64), placements[i % len(placements)]) for i in range(dp * tp)]


def _view(rank: int, dp: int, tp: int, hardware, dense=None, experts=(("w1", (2, 64, 64)), ("w2", (2, 64, 64))),
          experts_split=True):
    """The plan's inputs as ``rank`` sees them: the dense matrices on the whole mesh, the experts
    (``Shard(0)``, the given number per dp_shard rank) on this rank's dp_shard slice; experts that
    may move or be cut (``experts_split``) or not (a param group with ``ns_split="never"``)."""
    grid = MeshGrid((dp, tp), tuple(range(dp * tp)))
    column = grid.coordinate(rank)[1]
    dp_slice = MeshGrid((dp,), tuple(column + tp * a for a in range(dp)))  # row-major: rank = a * tp + b
    assert rank in dp_slice.ranks
    model = SplitModel.of("auto", hardware, 5, "classic", "fixed", torch.float32)
    params = [PlanParam(n, s, ParamLayout(s, grid, pl), torch.float32, torch.device("cpu"), 0, _cost, split=model)
              for n, s, pl in (_dense(dp, tp) if dense is None else dense)]
    for name, (e, *matrix) in experts:
        shape = (e * dp, *matrix)
        params.append(PlanParam(name, shape, ParamLayout(shape, dp_slice, (Shard(0),)), torch.float32,
                                torch.device("cpu"), 0, _cost, split=model if experts_split else None))
    return params


def _whole_mesh_patterns(params, settings):
    """The world plan's entries whose jobs are all the whole mesh's matrices (the dense ones)."""
    whole = {i for i, p in enumerate(params) if len(p.layout.grid.ranks) == len(params[0].layout.grid.ranks)}
    return [(jobs, chunks) for jobs, chunks in world_jobs(params, settings) if {j.param for j in jobs} <= whole]


@pytest.mark.parametrize("dp,tp", MESHES)
@pytest.mark.parametrize("hardware", HARDWARE, ids=["slow_links", "cpu_gloo", "free_link"])
def test_every_rank_of_a_pattern_plans_it_alike_though_the_experts_sit_on_other_slices(dp, tp, hardware):
    settings = PlanSettings()
    views = [_view(r, dp, tp, hardware) for r in range(dp * tp)]
    mine = [_whole_mesh_patterns(v, settings) for v in views]
    assert mine[0] and all(m == mine[0] for m in mine), [sorted((j.param, j.owner) for j in m[0][0]) for m in mine]
    # A slice's moves (if any) are planned alike by the ranks of that slice.
    for r, v in enumerate(views):
        for s in v[-1].layout.grid.ranks:
            assert world_jobs(views[s], settings) == world_jobs(v, settings)


@pytest.mark.parametrize("dp,tp", MESHES)
@pytest.mark.parametrize("hardware", HARDWARE, ids=["slow_links", "cpu_gloo", "free_link"])
def test_the_all_to_alls_sizes_mirror_between_ranks_planning_from_their_own_views(dp, tp, hardware):
    """The condition gloo enforced: every chunk's gather sends member j what j expects from this
    rank (its segment), and the scatter returns what this rank expects from j."""
    world = dp * tp
    by_ranks = lambda ranks, mesh, dims: tuple(ranks)  # noqa: E731 - a chunk's group: its ranks, in group order
    plans = [build_plan(_view(r, dp, tp, hardware), r, PlanSettings(), by_ranks) for r in range(world)]
    chunks = [[c for c in plan.chunks if isinstance(c, Chunk)] for plan in plans]
    assert chunks[0] and len({len(c) for c in chunks}) == 1
    for c in range(len(chunks[0])):
        for r in range(world):
            group = chunks[r][c].shard_group
            assert len(group) == chunks[r][c].shard_size and group[chunks[r][c].member] == r
            for j in group:
                theirs = chunks[j][c]
                assert theirs.shard_group == group, (c, r, j)
                assert chunks[r][c].send_splits[group.index(j)] == theirs.segment, (c, r, j)
                assert theirs.scatter_recv_splits[group.index(r)] == chunks[r][c].segment, (c, r, j)
    # moved experts: their all-to-all runs over their slice, and mirrors there
    for r in range(world):
        for m, mine in enumerate(c for c in plans[r].chunks if isinstance(c, MoveChunk)):
            for j in mine.ranks:
                theirs = [c for c in plans[j].chunks if isinstance(c, MoveChunk)][m]
                assert theirs.ranks == mine.ranks
                assert mine.send_splits[mine.ranks.index(j)] == theirs.recv_splits[theirs.ranks.index(r)]


def test_cut_groups_are_placed_alike_from_every_view():
    """Cuts, too, were placed around the held load (``choose_ks``/``assign_paired`` see ``held()``)
    before d5ab8e3: three 512 x 512 matrices on a (2, 4) mesh, cut in two on this CPU's link, beside
    one expert per dp_shard rank that may not move.  Counting each view's slice, rank 0 (slice 0, 4)
    put the first matrix's halves on ranks 2 and 3, rank 2 (slice 2, 6) on ranks 0 and 1: the
    same disagreement, on main since cuts consult held loads, whatever d5ab8e3 did."""
    dense = [(f"d{i}", (512, 512), (Shard(0), Shard(1))) for i in range(3)]
    views = [_view(r, 2, 4, CPU_GLOO, dense, (("ex", (1, 256, 256)),), experts_split=False) for r in range(8)]
    mine = [_whole_mesh_patterns(v, PlanSettings()) for v in views]
    assert any(j.cut is not None for j in mine[0][0][0])  # the case cuts
    assert all(m == mine[0] for m in mine), [sorted((j.param, j.owner) for j in m[0][0]) for m in mine]


def test_experts_on_the_whole_mesh_still_count_where_they_are_held():
    """The fix drops only slices: experts sharded over the whole mesh are held by ranks every rank
    of the pattern knows, so the matrices are still owned around them (the plan d5ab8e3 made,
    test_expert_moves.test_whole_matrices_are_owned_around_experts_that_stay_home, here on a
    2-D mesh): four experts over (dp_shard, tp) = (2, 4) by ``Shard(0)`` twice are held one each by
    ranks 0, 1, 4 and 5 (torch.chunk over dp_shard, then over tp), and the four matrices, each
    costing what an expert costs, go one each to the other four ranks."""
    grid = MeshGrid((2, 4), tuple(range(8)))
    model = SplitModel.of("auto", SLOW, 5, "classic", "fixed", torch.float32)
    experts = (4, 64, 64)
    specs = [("ex", experts, (Shard(0), Shard(0)))] + [(f"d{i}", (64, 64), (Shard(0), Shard(1))) for i in range(4)]
    params = [PlanParam(n, s, ParamLayout(s, grid, pl), torch.float32, torch.device("cpu"), 0, _cost, split=model)
              for n, s, pl in specs]
    holders = {r for r in range(8) if params[0].layout.local_shape(grid.coordinate(r))[0] > 0}
    assert holders == {0, 1, 4, 5}  # the placement's index math (torch.chunk twice) says so
    jobs = [j for js, _ in world_jobs(params, PlanSettings()) for j in js]
    assert all(j.holder < 0 and j.cut is None for j in jobs)
    assert sorted(j.owner for j in jobs) == [2, 3, 6, 7]  # none on an expert's holder
    assert _cost((1, 64, 64)) == _cost((64, 64))  # so one unit per rank is the best any plan does


# ------------------------------------------------------------------ on gloo: the case that failed

SLICED = {
    # the example model's fsdp_tp shapes: dense matrices on (dp_shard, tp), 2 experts per dp_shard rank
    "2x2": ((2, 2), [("wq", (64, 64), ["S0", "S0"]), ("wk", (32, 64), ["S0", "S0"]), ("wo", (64, 64), ["S0", "S1"]),
                     ("w1", (128, 64), ["S0", "S0"]), ("w2", (64, 128), ["S0", "S1"]), ("norm", (64, 64), ["R", "S0"])],
             [("experts.w1", (4, 32, 64)), ("experts.w2", (4, 64, 32))]),
    # test_cut_groups_are_placed_alike_from_every_view's case: cuts beside one expert per dp_shard rank
    "2x4": ((2, 4), [(f"d{i}", (512, 512), ["S0", "S1"]) for i in range(3)], [("experts.w1", (2, 256, 256))]),
}
GLOO_STEPS = 3


def _sliced_run(rank, world_size, case):
    from torch.distributed.device_mesh import init_device_mesh

    from dist_cases import OPT_KW, build_groups, make_case_tensors, parse_placement, to_dtensor
    from optimizer import Muon
    from strided_layouts import full_of

    mesh_shape, dense, experts = SLICED[case]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp_shard", "tp"))
    specs = [(n, s, [parse_placement(x) for x in pl]) for n, s, pl in dense]
    specs += [(n, s, [Shard(0)]) for n, s in experts]
    params, grads = make_case_tensors(specs, GLOO_STEPS)
    meshes = {n: mesh if len(pl) == 2 else mesh["dp_shard"] for n, _, pl in specs}  # experts: this rank's slice
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], meshes[n], pl))) for n, _, pl in specs]
    opt = Muon(build_groups(named), **OPT_KW)
    for s in range(GLOO_STEPS):
        for (n, p), (_, _, pl) in zip(named, specs):
            p.grad = to_dtensor(grads[s][n], meshes[n], pl)
        opt.step()
    cut = sum(1 for c in opt._cached_context.plan.chunks for o in c.owned if o.split is not None)
    return {n: full_of(p).detach() for n, p in named}, meshes["experts.w1"].mesh.tolist(), cut


@pytest.mark.parametrize("case", sorted(SLICED))
def test_experts_on_dp_shard_slices_beside_dense_matrices_equal_single_device_on_gloo(case):
    """The fsdp_tp layout (experts on each rank's dp_shard slice) stepped on gloo: no size
    mismatch, and every parameter equals single-device Muon within fp32 rounding (moved whole:
    exact; cut: a differently ordered Gram sum, 1e-5)."""
    from dist_cases import run_reference
    from harness import run_ranks

    mesh_shape, dense, experts = SLICED[case]
    specs = [(n, s, pl) for n, s, pl in dense] + [(n, s, ["S0"]) for n, s in experts]
    want = run_reference(specs, GLOO_STEPS, False)
    results = run_ranks(_sliced_run, mesh_shape[0] * mesh_shape[1], case, timeout=240)
    assert len({tuple(sl) for _, sl, _ in results}) == mesh_shape[1]  # one slice per tp coordinate
    for got, _, _ in results:
        for n, ref in want.items():
            torch.testing.assert_close(got[n], ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{case} {n}: {m}")
    if case == "2x4":
        assert sum(cut for _, _, cut in results) > 0  # the matrices were cut
