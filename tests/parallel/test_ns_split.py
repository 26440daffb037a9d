"""Newton–Schulz of one unit split over k ranks inside the optimizer (``ns_split``; issue 21).

References, none of them the code under test:

- single-device Muon on the full tensors (``dist_cases.run_reference``): with the split forced on
  (``ns_split="always"``) or chosen by the cost model, every parameter equals it within fp32
  rounding after several steps, on 2, 4 and 8 gloo ranks, for wide, tall, square and 3-D units,
  uneven blocks, FSDP ``Shard(0)``/``Shard(1)``, FSDP+TP ``_StridedShard``, HSDP with and
  without the replica split, QK-clip on, both coefficient tables, both Newton–Schulz forms;
- the gradient itself: every block an owner assembles is, column for column, a set of columns
  of the global momentum update (found by exact match, not by the plan's index math), and the
  blocks of a unit together hold every column exactly once;
- a misassigned block (one block's slice handed to another) makes the comparison fail;
- stats: the split really ran (``last_step_stats.split_units``) and only where meant to.
"""

from __future__ import annotations

import pytest
import torch

from dist_cases import (build_groups, make_case_tensors, owned_matrices_of_one_step, parse_placement, run_distributed,
                        run_reference, to_dtensor)
from harness import run_ranks
from tolerances import normuon_rtol

ATOL, RTOL = 1e-5, 1e-5  # fp32 rounding of a differently ordered Gram sum (measured <= 5e-7 here)
STEPS = 5
Q, K = (16, 12), (8, 12)

# (mesh, specs, extra options).  "always" cuts every unit whose short side >= the shard group.
CASES = {
    "fsdp_2": ((2,), [
        ("wide", (24, 96), ["S0"]),
        ("tall", (96, 24), ["S0"]),  # cut along its sharded rows
        ("square", (40, 40), ["S0"]),
        ("experts", (3, 16, 50), ["S1"]),
        ("uneven", (13, 37), ["S0"]),  # 7 + 6 rows, 19 + 18 columns
        ("layers.0.attention.wq.weight", Q, ["S0"]),
        ("layers.0.attention.wk.weight", K, ["S0"]),
    ], {}),
    "fsdp_4_shard1": ((4,), [
        ("wide", (24, 96), ["S1"]),  # cut along its sharded columns
        ("tall", (90, 20), ["S1"]),  # 23, 23, 22, 22 rows
        ("tall_s0", (50, 12), ["S0"]),  # shards of 13, 13, 13, 11 rows, cut across them
        ("experts", (4, 20, 12), ["S2"]),
        ("layers.0.attention.wq.weight", Q, ["S0"]),
        ("layers.0.attention.wk.weight", K, ["S0"]),
    ], {"ns_coefficients": "polar_express"}),
    "fsdp_tp_4": ((2, 2), [
        ("layers.0.attention.wq.weight", Q, ["SS0/2", "S0"]),  # interleaved rows
        ("layers.0.attention.wk.weight", K, ["SS0/2", "S0"]),
        ("layers.0.attention.wo.weight", (12, 40), ["S0", "S1"]),
        ("layers.0.ffn.w1.weight", (36, 12), ["SS0/2", "S0"]),
        ("layers.0.ffn.w2.weight", (12, 30), ["S0", "S1"]),
        ("layers.0.moe.w1", (3, 12, 20), ["S0", "S1"]),
    ], {}),
    "hsdp_4_split": ((2, 2), [
        ("layers.0.attention.wq.weight", Q, ["R", "S0"]),
        ("layers.0.attention.wk.weight", K, ["R", "S0"]),
        ("wide", (12, 40), ["R", "S1"]),
        ("tall", (30, 6), ["R", "S0"]),
        ("experts", (4, 8, 12), ["R", "S1"]),
    ], {"replica_split": "always"}),
    "hsdp_4_per_replica": ((2, 2), [
        ("layers.0.attention.wq.weight", Q, ["R", "S0"]),
        ("layers.0.attention.wk.weight", K, ["R", "S0"]),
        ("wide", (12, 40), ["R", "S1"]),
        ("tall", (30, 6), ["R", "S0"]),
    ], {"replica_split": "never"}),
    "fsdp_8": ((8,), [
        ("wide", (16, 64), ["S0"]),
        ("tall", (72, 16), ["S0"]),  # 9 rows per shard, cut across all 8
        ("experts", (2, 8, 40), ["S1"]),
        ("layers.0.attention.wq.weight", Q, ["S0"]),
        ("layers.0.attention.wk.weight", (8, 12), ["S0"]),
    ], {}),
    "fsdp_3": ((3,), [  # a shard group of 3: "always" cuts over all 3 (k need not be a power of two)
        ("wide", (12, 50), ["S0"]),
        ("tall", (50, 12), ["S0"]),  # shards of 17, 17, 16 rows
        ("experts", (2, 9, 31), ["S2"]),
    ], {}),
    # same-shape units cut over one group: one call each pair (their halves interleaved)
    "twins_4": ((4,), [
        ("a", (24, 96), ["S0"]), ("b", (24, 96), ["S0"]),
        ("c", (96, 24), ["S1"]), ("d", (96, 24), ["S1"]),
        ("layers.0.moe.w1", (2, 16, 50), ["S1"]), ("layers.0.moe.w2", (2, 16, 50), ["S1"]),
    ], {}),
    "gram_form_2": ((2,), [  # fp32, more than 1.5x wide: the Gram-space form, split alike
        ("wide", (64, 256), ["S0"]),
        ("tall", (256, 64), ["S1"]),
    ], {}),
}


def _world(mesh_shape):
    n = 1
    for s in mesh_shape:
        n *= s
    return n


def _run(rank, world_size, name, qk, ns_split, extra):
    mesh_shape, specs, kw = CASES[name]
    full, stats = run_distributed(rank, world_size, mesh_shape, specs, STEPS, qk, with_stats=True,
                                  ns_split=ns_split, **{**kw, **extra})
    return full, stats.split_units


def _check(name, qk, ns_split="always", extra=None, expect_split=True):
    mesh_shape, specs, kw = CASES[name]
    extra = extra or {}
    want = run_reference(specs, STEPS, qk, **{k: v for k, v in {**kw, **extra}.items() if k != "replica_split"})
    results = run_ranks(_run, _world(mesh_shape), name, qk, ns_split, extra, timeout=240)
    for got, split_units in results:
        for n, ref in want.items():
            torch.testing.assert_close(got[n], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} qk={qk} {n}: {m}")
        assert (split_units > 0) == expect_split, (name, split_units)
    return results


@pytest.mark.parametrize("name", ["fsdp_2", "fsdp_4_shard1", "fsdp_tp_4", "hsdp_4_split", "hsdp_4_per_replica",
                                  "fsdp_8", "fsdp_3", "gram_form_2", "twins_4"])
def test_forced_split_equals_single_device(name):
    _check(name, qk=name in ("fsdp_2", "fsdp_tp_4", "hsdp_4_split"))


def _batched_calls(rank, world_size):
    from optimizer import rule

    sizes = []
    real = rule.MatrixStep.orthogonalize_split

    def recording(self, x, *args, **kwargs):
        sizes.append(tuple(x.shape))
        return real(self, x, *args, **kwargs)

    rule.MatrixStep.orthogonalize_split = recording
    try:
        full, _ = _run(rank, world_size, "twins_4", False, "always", {})
    finally:
        rule.MatrixStep.orthogonalize_split = real
    return full, sizes


def test_cut_units_sharing_a_group_run_as_one_call():
    """Pairs of same-shape units cut over the same shard group run as one split call (a batch of
    their matrices, whose halves interleave): the wide pair, the tall pair and the expert pair;
    every parameter equals single-device Muon."""
    mesh_shape, specs, _ = CASES["twins_4"]
    want = run_reference(specs, STEPS, False)
    for full, sizes in run_ranks(_batched_calls, 4, timeout=240):
        for n, ref in want.items():
            torch.testing.assert_close(full[n], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"twins {n}: {m}")
        # per step: the wide pair, the tall pair (transposed: the same blocks), two pairs of expert units
        assert len(sizes) == 4 * STEPS and all(s[0] == 2 for s in sizes), sizes
        assert sorted(len(s) for s in sizes[-4:]) == [3, 3, 4, 4], sizes


def test_the_gram_case_runs_the_gram_form():
    from optimizer.newton_schulz.forms import choose_ns_method

    for _, shape, _ in CASES["gram_form_2"][1]:
        assert choose_ns_method(shape, 5, "auto", torch.float32) == "gram"


NORMUON = {"normuon_beta2": 0.9, "cautious_wd": True}


def _run_with_state(rank, world_size, name, extra):
    mesh_shape, specs, kw = CASES[name]
    full, stats, state = run_distributed(rank, world_size, mesh_shape, specs, STEPS, False, with_stats=True,
                                         with_state=True, ns_split="always", **{**kw, **extra})
    return full, stats.split_units, {n: s["normuon_v"] for n, s in state.items()}


def _check_normuon_state(name):
    """NorMuon's v after STEPS steps, every rank against single-device's."""
    mesh_shape, specs, kw = CASES[name]
    _, want = run_reference(specs, STEPS, False, with_state=True,
                            **{k: v for k, v in {**kw, **NORMUON}.items() if k != "replica_split"})
    for got, split_units, v in run_ranks(_run_with_state, _world(mesh_shape), name, NORMUON, timeout=240):
        assert split_units > 0
        for n, ref in want.items():
            torch.testing.assert_close(v[n], ref["normuon_v"], atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} v {n}: {m}")


@pytest.mark.parametrize("name", ["fsdp_2", "fsdp_4_shard1", "fsdp_tp_4", "hsdp_4_split"])
def test_normuon_units_are_cut_and_equal_single_device(name):
    """NorMuon (with cautious WD) on cut units: a column-cut wide unit's row statistics come from
    one all-reduce of its row sums, a row-cut tall unit's norms from one of two numbers per
    matrix, v travels in the blocks' row slots: the weights and v equal single-device NorMuon's."""
    _check(name, qk=name in ("fsdp_2", "fsdp_tp_4", "hsdp_4_split"), extra=NORMUON, expect_split=True)
    _check_normuon_state(name)


def _local_row_sums(block, group, rows_whole):
    """row_sums_of_squares without its all-reduce: this block's own row sums."""
    from optimizer.newton_schulz.cut_rows import squares_per_row

    sums = squares_per_row(block)
    return sums, sums.sum(-1)


@pytest.mark.parametrize("broken", ["row_sums", "norms"])
def test_normuon_without_the_whole_matrix_statistics_is_caught(monkeypatch, broken):
    """Skip the all-reduce of a cut unit's statistics (the row sums of a column-cut wide unit, or
    the two norms of a row-cut tall one): each block is normalised with its own statistics, and
    the comparison with single-device NorMuon fails."""
    from optimizer.rule import normuon

    if broken == "row_sums":
        monkeypatch.setattr(normuon, "row_sums_of_squares", _local_row_sums)  # the forked ranks inherit it
    else:
        monkeypatch.setattr(normuon, "sum_over_group", lambda t, group: t)
    with pytest.raises(AssertionError):
        _check("fsdp_2", qk=False, extra=NORMUON)


def test_never_runs_no_split_and_gather_mode_has_none():
    _check("fsdp_2", qk=False, ns_split="never", expect_split=False)
    _check("fsdp_2", qk=False, ns_split="always", extra={"distributed_mode": "gather"}, expect_split=False)


# ----------------------------------------------------------------- the misassigned block


def test_a_misassigned_block_is_caught(monkeypatch):
    """Hand block 1 the slices of block 0 (block 0's columns twice, block 1's never): the
    comparison above must fail.  (Moving whole slices between blocks would not be an error:
    Newton–Schulz does not care which columns form a block, as long as gather and scatter
    agree.)"""
    from optimizer.parallel.planning import cut_geometry, rank_view

    real = cut_geometry.cut_blocks

    def wrong(lengths, k):
        rows = list(real(lengths, k))
        if k > 1 and all(a.stop - a.start == b.stop - b.start for a, b in zip(rows[0], rows[1])):
            rows[1] = rows[0]
        return rows

    monkeypatch.setattr(rank_view, "cut_blocks", wrong)  # the forked ranks inherit it
    with pytest.raises(AssertionError):
        _check("fsdp_2", qk=False)


# -------------------------------------------------------- the blocks owners assemble


def _assembled(rank, world_size, name):
    """Every block an owner assembles, with its parameter's name."""
    mesh_shape, specs, kw = CASES[name]
    return [(n, o.experts, o.split.transpose, o.split.unit, full)
            for n, o, full in owned_matrices_of_one_step(mesh_shape, specs, ns_split="always", **kw)
            if o.split is not None]


@pytest.mark.parametrize("name", ["fsdp_2", "fsdp_4_shard1", "fsdp_tp_4", "hsdp_4_split"])
def test_owners_assemble_column_blocks_of_the_global_update(name):
    mesh_shape, specs, _ = CASES[name]
    _, grads = make_case_tensors(specs, 1)
    blocks: dict[tuple, list] = {}
    for per_rank in run_ranks(_assembled, _world(mesh_shape), name, timeout=120):
        for pname, experts, transposed, unit, full in per_rank:
            blocks.setdefault((pname, unit, str(experts)), []).append((experts, transposed, full))
    assert blocks
    for (pname, _, _), parts in blocks.items():
        g = grads[0][pname]
        want = g.lerp(g * 0.1, 0.9)  # first step, Nesterov: buf = 0.1 g, update = g.lerp(buf, 0.9)
        experts = parts[0][0]
        if experts is not None:
            want = want[experts]
        transposed = parts[0][1]
        whole = want.mT if transposed else want  # cut along the last dim of this view
        found = []
        for _, _, full in parts:
            block = full.mT if transposed else full
            assert block.shape[:-1] == whole.shape[:-1], (pname, block.shape, whole.shape)
            for c in range(block.shape[-1]):  # which global column is this? (Gaussian: unique)
                match = [i for i in range(whole.shape[-1]) if torch.equal(block[..., c], whole[..., i])]
                assert len(match) == 1, (pname, c, match)
                found.append(match[0])
        assert sorted(found) == list(range(whole.shape[-1])), (pname, sorted(found))  # every column once


# ------------------------------------------------------------- the cost model's choice

BIG = [("a", (256, 1024), ["S0"]), ("b", (1024, 256), ["S1"])]  # two big matrices, four ranks


def _fast_link():
    """A link so fast that only FLOPs count: "auto" cuts as far as it may."""
    from optimizer.parallel.planning.cut_hardware import SplitHardware

    return SplitHardware("test: free communication", 1e12, 1e12, 1e18, 1e-12, torch.float32)


def _auto(rank, world_size, specs, fast):
    from optimizer.parallel.planning import plan_inputs

    if fast:
        plan_inputs.split_hardware = lambda device: _fast_link()
    full, stats = run_distributed(rank, world_size, (world_size,), specs, 3, False, with_stats=True)
    return full, stats.split_units


@pytest.mark.parametrize("fast, specs", [(False, BIG), (True, BIG[:1])], ids=["cpu_gloo", "free_link"])
def test_auto_splits_when_there_are_fewer_matrices_than_ranks_and_equals_single_device(fast, specs):
    """Fewer matrices than ranks: "auto" cuts them.  With this CPU's measured gloo figures two
    big matrices on four ranks go over two ranks each; with free communication one goes over all
    four (test_cuts.py checks the k).  Every parameter equals single-device Muon."""
    want = run_reference(specs, 3, False)
    results = run_ranks(_auto, 4, specs, fast, timeout=240)
    for got, split_units in results:
        assert split_units == 1  # every rank orthogonalised one block in the last step
        for n, ref in want.items():
            torch.testing.assert_close(got[n], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{n}: {m}")



QUAD = [(f"w{i}", (64, 160), ["S0"]) for i in range(4)]  # one class of four same-shape units


def _mixed_ways(rank, world_size):
    """A plan with three ways in one class (issue 29, ``cut_choice.choose_cuts``), forced the same
    on every rank: w0 and w1 paired over ranks 0-1, w2 over all four, w3 whole on rank 3."""
    from optimizer.parallel.planning import plan_inputs
    from optimizer.parallel.planning import world as world_part

    plan_inputs.split_hardware = lambda device: _fast_link()
    real = world_part.choose_cuts

    def forced(units, world, held=dict, keys=None):
        plan = real(units, world, held, keys)
        if len(units) != 4:
            return plan
        assert len(set(keys)) == 1 and all(u.ks == (2, 4) for u in units)  # one class, may go over 2 or 4
        return [2, 2, 4, 1], [0, 0, 0, 3]

    world_part.choose_cuts = forced
    full, stats = run_distributed(rank, world_size, (world_size,), QUAD, 3, False, with_stats=True)
    return full, stats.split_units


def test_one_class_over_two_ks_paired_and_whole_equals_single_device():
    """The runtime runs whatever ways the planner gives one class's units: two paired over 2 ranks,
    one over 4 alone, one whole.  Every parameter equals single-device Muon; the blocks each rank
    ran in the last step (3, 3, 1, 1) show the forced plan was the one run."""
    want = run_reference(QUAD, 3, False)
    results = run_ranks(_mixed_ways, 4, timeout=240)
    assert [split_units for _, split_units in results] == [3, 3, 1, 1]
    for got, _ in results:
        for n, ref in want.items():
            torch.testing.assert_close(got[n], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{n}: {m}")

def _auto_hsdp(rank, world_size):
    from optimizer.parallel.planning import plan_inputs

    plan_inputs.split_hardware = lambda device: _fast_link()
    full, stats = run_distributed(rank, world_size, (2, 2), [("w", (256, 1024), ["R", "S0"])], 3, False,
                                  with_stats=True, replica_split="always")
    return full, stats.split_units, stats.all_gathers


def test_auto_cut_across_replicas_equals_single_device():
    """HSDP 2 x 2, the matrix split over replicas and cut over all four holders: two blocks are
    owned in each replica, gathered from that replica's shards, and the other replica's blocks
    arrive in the replica all-gather."""
    want = run_reference([("w", (256, 1024), None)], 3, False)
    for got, split_units, all_gathers in run_ranks(_auto_hsdp, 4, timeout=120):
        assert split_units == 1 and all_gathers > 0
        torch.testing.assert_close(got["w"], want["w"], atol=ATOL, rtol=RTOL)


def test_auto_keeps_small_matrices_whole():
    specs = [(f"w{i}", (16, 24), ["S0"]) for i in range(2)]
    for _, split_units in run_ranks(_auto, 4, specs, False, timeout=120):
        assert split_units == 0


# ----------------------------------------------------------------------------- bf16


def _bf16(rank, world_size, ns_split):
    mesh_shape, specs, _ = CASES["fsdp_2"]
    return run_distributed(rank, world_size, mesh_shape, specs, 1, False, ns_split=ns_split,
                           compute_dtype=torch.bfloat16)


def test_bf16_split_is_within_bf16_newton_schulz_noise():
    """bf16: the partial Gram matrices are rounded on each rank (another rounding path; the
    primitive's tests bound |split - unsplit| of O by 5e-2).  One step: every parameter moves by
    lr * adjust_lr * O, so split and unsplit differ by at most lr * adjust_lr * 5e-2."""
    from optimizer.rule import adjust_lr

    _, specs, _ = CASES["fsdp_2"]
    split = run_ranks(_bf16, 2, "always", timeout=120)[0]
    whole = run_ranks(_bf16, 2, "never", timeout=120)[0]
    moved = 0.0
    for n, shape, _ in specs:
        bound = 0.02 * adjust_lr(1.0, shape, "match_rms_adamw") * 5e-2
        diff = (split[n] - whole[n]).abs().max().item()
        assert diff <= bound, (n, diff, bound)
        moved = max(moved, diff)
    assert moved > 0  # the split did run in bf16 (another rounding path)


# ------------------------------------------------------------- NorMuon's hook


def _row_sums(rank, world_size):
    from optimizer.newton_schulz.cut_rows import row_sums_of_squares

    g = torch.Generator().manual_seed(3)
    wide, tall = torch.randn(2, 6, 20, generator=g), torch.randn(2, 20, 6, generator=g)
    cols, rows = slice(10 * rank, 10 * rank + 10), slice(10 * rank, 10 * rank + 10)
    a, na = row_sums_of_squares(wide[..., cols], None if world_size == 1 else torch.distributed.group.WORLD, False)
    b, nb = row_sums_of_squares(tall[..., rows, :], torch.distributed.group.WORLD, True)
    return a, na, b, nb, (wide * wide).sum(-1), (wide * wide).sum((-2, -1)), (tall * tall).sum(-1)[..., rows], \
        (tall * tall).sum((-2, -1))


def test_row_sums_of_squares_for_normuon():
    for a, na, b, nb, ra, fa, rb, fb in run_ranks(_row_sums, 2, timeout=60):
        torch.testing.assert_close(a, ra), torch.testing.assert_close(na, fa)
        torch.testing.assert_close(b, rb), torch.testing.assert_close(nb, fb)


NORMUON_SPLIT_SHAPES = ((2, 6, 20), (2, 20, 6), (9, 31))  # wide (columns cut), tall (rows cut), odd
NORMUON_SPLIT_BETA2 = 0.9


def _normuon_split(rank, world_size, dtype):
    from optimizer.rule import normuon_normalize, normuon_normalize_split

    group = torch.distributed.group.WORLD
    g = torch.Generator().manual_seed(5)
    out = []
    for shape, rows_whole in zip(NORMUON_SPLIT_SHAPES, (False, True, False)):
        o = torch.randn(shape, generator=g)
        v = torch.rand((*shape[:-1], 1), generator=g, dtype=dtype)
        want, want_v = normuon_normalize(o, v, NORMUON_SPLIT_BETA2)
        n = shape[-2] if rows_whole else shape[-1]
        cut = slice(0, n // 2) if rank == 0 else slice(n // 2, n)  # uneven where n is odd
        block = o[..., cut, :] if rows_whole else o[..., cut]
        got, got_v = normuon_normalize_split(block, v[..., cut, :] if rows_whole else v, NORMUON_SPLIT_BETA2,
                                             group, rows_whole, shape[-1])
        out.append((got, want[..., cut, :] if rows_whole else want[..., cut],
                    got_v, want_v[..., cut, :] if rows_whole else want_v))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normuon_of_a_cut_matrix_is_normuon_of_the_whole(dtype):
    """The split normalisation's blocks (and v) are the whole matrix's, for a column cut (wide,
    batched and single), a row cut (tall), in v's dtype."""
    for per_rank in run_ranks(_normuon_split, 2, dtype, timeout=60):
        for (got, want, got_v, want_v), shape in zip(per_rank, NORMUON_SPLIT_SHAPES):
            assert got.dtype == got_v.dtype == dtype
            rtol, rtol_v = normuon_rtol(*shape[-2:], dtype, NORMUON_SPLIT_BETA2)  # from the rounding, not a run
            torch.testing.assert_close(got, want, atol=0, rtol=rtol)
            torch.testing.assert_close(got_v, want_v, atol=0, rtol=rtol_v)


# ------------------------------------------------------------- row blocks, checkpoints

ROW_BLOCKS = [("fused", (24, 40), ["S0"]), ("plain", (24, 40), ["S0"])]


def _groups(named):
    return [{"params": [named[0][1]], "param_names": [named[0][0]], "use_muon": True, "muon_row_blocks": "heads:8"},
            {"params": [named[1][1]], "param_names": [named[1][0]], "use_muon": True}]


def _row_blocks_run(rank, world_size):
    from optimizer import Muon
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    params, grads = make_case_tensors(ROW_BLOCKS, STEPS)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
             for n, _, pl in ROW_BLOCKS]
    opt = Muon(_groups(named), lr=0.02, ns_split="always")
    for s in range(STEPS):
        for n, p in named:
            p.grad = to_dtensor(grads[s][n], mesh, p.placements)
        opt.step()
    cut = {o.param for c in opt._cached_context.plan.chunks for o in c.owned if o.split is not None}
    return {n: p.full_tensor() for n, p in named}, cut, opt.state_dict()


def test_weights_with_row_blocks_stay_whole_and_the_option_is_checkpointed():
    """A fused weight's row blocks are orthogonalised apart, each with its own lr factor: such a
    weight is never cut (the plain one beside it is), and the result is single-device Muon's."""
    from optimizer import Muon

    params, grads = make_case_tensors(ROW_BLOCKS, STEPS)
    named = [(n, torch.nn.Parameter(params[n].clone())) for n, _, _ in ROW_BLOCKS]
    ref = Muon(_groups(named), lr=0.02)
    for s in range(STEPS):
        for n, p in named:
            p.grad = grads[s][n].clone()
        ref.step()
    for got, cut, state in run_ranks(_row_blocks_run, 2, timeout=120):
        assert cut == {1}  # the plain weight only
        for n, p in named:
            torch.testing.assert_close(got[n], p.detach(), atol=ATOL, rtol=RTOL)
        assert [g["ns_split"] for g in state["param_groups"]] == ["always", "always"]
    # at its default ("auto") a group does not hold the option, so a checkpoint from before it
    # (no "ns_split" in its groups) has the keys of today's and loads, plainly and through DCP
    old = ref.state_dict()
    assert all("ns_split" not in g for g in old["param_groups"])
    ref.load_state_dict(old)
    ref.step()


def test_the_option_is_checked():
    from optimizer import Muon

    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="ns_split"):
        Muon([{"params": [p], "use_muon": True}], ns_split="sometimes")
    with pytest.raises(ValueError, match="ns_split"):
        Muon([{"params": [p], "use_muon": True, "ns_split": True}])
    # the default ("auto") is not held by the group (an optional option: checkpoints from before it
    # have the same keys, so DCP loads them); another value is
    assert "ns_split" not in Muon([{"params": [p], "use_muon": True}]).param_groups[0]
    assert Muon([{"params": [p], "use_muon": True}], ns_split="never").param_groups[0]["ns_split"] == "never"


def _switch(rank, world_size):
    from optimizer import Muon
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    specs = [("w", (24, 96), ["S0"])]
    params, grads = make_case_tensors(specs, 2)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
             for n, _, pl in specs]
    opt = Muon(build_groups(named), lr=0.02, ns_split="never")
    seen = []
    for s, mode in enumerate(("never", "always")):
        opt.param_groups[0]["ns_split"] = mode  # the plan depends on it: changing it re-plans
        for n, p in named:
            p.grad = to_dtensor(grads[s][n], mesh, p.placements)
        opt.step()
        seen.append(opt.last_step_stats.split_units)
    return seen


def test_changing_the_option_between_steps_replans():
    for seen in run_ranks(_switch, 2, timeout=60):
        assert seen == [0, 1]


def _late_auto(rank, world_size):
    from dist_cases import OPT_KW
    from optimizer import Muon
    from optimizer.parallel.planning import plan_inputs
    from torch.distributed.device_mesh import init_device_mesh

    plan_inputs.split_hardware = lambda device: _fast_link()
    mesh = init_device_mesh("cpu", (world_size,))
    params, grads = make_case_tensors(LATE_SPECS, 2)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
             for n, _, pl in LATE_SPECS]
    opt = Muon(build_groups(named), **{**OPT_KW, "ns_split": "never"})  # no split groups made
    opt.step()  # a step with no gradients: nothing to do
    opt.param_groups[0]["ns_split"] = "auto"  # would cut each over two ranks: groups {0, 1}, {2, 3}
    for s in range(2):
        for n, p in named:
            p.grad = to_dtensor(grads[s][n], mesh, p.placements)
        opt.step()
    return {n: p.full_tensor() for n, p in named}, opt.last_step_stats.split_units


LATE_SPECS = [("a", (256, 1024), ["S0"]), ("b", (1024, 256), ["S0"])]


def test_a_split_whose_group_was_not_made_at_construction_is_made_at_step_on_every_rank():
    """Switching ``ns_split`` on after construction needs process groups nobody made: the step
    agrees on the missing rank sets (the same on every rank, or one error everywhere) and makes
    them collectively, in one order, then cuts; the result is still single-device Muon's."""
    want = run_reference(LATE_SPECS, 2, False)
    results = run_ranks(_late_auto, 4, timeout=120)
    assert len(results) == 4
    for got, split_units in results:
        assert split_units == 1  # each rank orthogonalised one block of one cut unit
        for n, ref in want.items():
            torch.testing.assert_close(got[n], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{n}: {m}")
