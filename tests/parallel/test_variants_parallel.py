"""NorMuon, cautious weight decay and bf16 momentum on every placement equal single-device Muon
with the same options (itself checked against the formulas in tests/rule/test_variants.py).

Every layout of ``test_parallel_muon.CASES`` (FSDP, TP with last-dim sharding, uneven and empty
shards, ``_StridedShard``, HSDP, HSDP+TP, 3-D experts split into ranges, solver mixes), plus row
blocks of sharded weights, replicas split and not, the gather baseline and units a rank holds
whole.  NorMuon's ``v`` is compared too: its ``full_tensor()`` against the single-device state,
and its local rows against the parameter's, through DTensor's own redistribution of row ids.
Then: the same collectives as plain Muon (v rides in them), and tests that break the v transport
on purpose and show the comparison catches it.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate

from dist_cases import run_distributed, run_reference, to_dtensor
from harness import run_ranks
from test_parallel_muon import ATOL, CASES, RTOL, STEPS, _world

VARIANT = dict(normuon_beta2=0.9, cautious_wd=True, weight_decay=0.3)
BF16_MOMENTUM = dict(normuon_beta2=0.9, momentum_dtype=torch.bfloat16)
Q, K = (16, 12), (8, 12)

# Layouts that need options of their own: row blocks of sharded weights, replicas split or not,
# units held whole (run_local: replicated and expert-sharded DTensors).
EXTRA = {
    "row_blocks": ((2, 2), [
        ("layers.0.attention.wqkv.weight", (24, 12), ["SS0/2", "S0"]),  # q, k, v blocks of 8 rows
        ("layers.0.attention.wo.weight", (12, 16), ["S0", "S1"]),
        ("layers.0.moe.w1", (3, 12, 10), ["S0", "S1"]),  # heads of 4 rows per expert, columns sharded
    ], {"muon_row_blocks": {"layers.0.attention.wqkv.weight": "blocks:8,8,8", "layers.0.moe.w1": "heads:4"}}),
    "replicated": ((4,), [
        ("a", (8, 6), ["R"]),
        ("b", (6, 10), ["R"]),
        ("layers.0.moe.w1", (4, 8, 6), ["R"]),
    ], {}),
    "experts_whole": ((2, 2), [
        ("layers.0.moe.w1", (4, 8, 12), ["S0", "R"]),  # whole matrices on every rank: run_local
        ("layers.0.moe.w2", (5, 12, 8), ["R", "S0"]),
        ("c", (7, 9), ["R", "R"]),
    ], {}),
}


def _expected_row_placements(placements, ndim):
    """The parameter's placements with every shard of the last dim replaced by Replicate."""
    out = []
    for pl in placements:
        dim = getattr(pl, "dim", None)
        out.append(Replicate() if dim is not None and dim % ndim == ndim - 1 else pl)
    return tuple(out)


def _v_layout(opt, named, mesh):
    """Per NorMuon parameter: its v's placements are the expected ones, and its local rows are the
    parameter's (row ids distributed by DTensor itself with either placements)."""
    problems = []
    for name, p in named:
        if p.dim() < 2:
            continue
        v = opt.state[p]["normuon_v"]
        want = _expected_row_placements(p.placements, p.dim())
        if tuple(v.placements) != want:
            problems.append(f"{name}: v placements {v.placements}, want {want}")
        rows = p.shape[-2]
        lead = torch.arange(p.numel() // (rows * p.shape[-1])).view(*p.shape[:-2], 1, 1) if p.dim() > 2 else 0
        ids = (lead * rows + torch.arange(rows).view(-1, 1)).expand(*p.shape).contiguous().double()
        param_ids = to_dtensor(ids, mesh, p.placements).to_local()
        v_ids = to_dtensor(ids[..., :1].contiguous(), mesh, v.placements).to_local()
        if tuple(v.to_local().shape) != tuple(v_ids.shape):
            problems.append(f"{name}: local v {tuple(v.to_local().shape)}, DTensor says {tuple(v_ids.shape)}")
        elif param_ids.shape[-1] and not torch.equal(param_ids[..., :1], v_ids):
            problems.append(f"{name}: local rows of v are not the parameter's")
        elif v_ids.shape[:-1] != param_ids.shape[:-1]:
            problems.append(f"{name}: v holds {tuple(v_ids.shape[:-1])} rows, the parameter {tuple(param_ids.shape[:-1])}")
    return problems


def _case(name):
    if name in EXTRA:
        return EXTRA[name]
    mesh, specs = CASES[name]
    return mesh, specs, {}


def _run(rank, world_size, names, options, kw):
    out = {}
    for name in names:
        mesh_shape, specs, group = _case(name)
        out[name] = run_distributed(rank, world_size, mesh_shape, specs, STEPS, True, muon_group=group,
                                    with_state=True, inspect=_v_layout, **options, **kw)
    return out


def _compare(name, got, options, kw=()):
    fulls, state, layout = got
    _, specs, group = _case(name)
    want, want_state = run_reference(specs, STEPS, True, muon_group=group, with_state=True, **options, **dict(kw))
    assert layout == [], (name, layout)
    for pname, ref in want.items():
        torch.testing.assert_close(fulls[pname], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} {pname}: {m}")
        if ref.dim() < 2:
            continue
        for key in ("normuon_v", "momentum_buffer"):
            if key in want_state[pname]:
                torch.testing.assert_close(state[pname][key], want_state[pname][key], atol=ATOL, rtol=RTOL,
                                           msg=lambda m: f"{name} {pname} {key}: {m}")


def _names(world_size):
    base = [n for n, (shape, _) in CASES.items() if _world(shape) == world_size]
    return base + [n for n, (shape, _, _) in EXTRA.items() if _world(shape) == world_size]


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_normuon_and_cautious_wd_match_single_device_on_every_layout(world_size):
    names = _names(world_size)
    results = run_ranks(_run, world_size, names, VARIANT, {}, timeout=300)
    for name in names:
        for rank_result in results:
            _compare(name, rank_result[name], VARIANT)


@pytest.mark.parametrize("case, kw", [
    ("fsdp_tp", dict(distributed_mode="gather")),
    ("hsdp", dict(replica_split="always")),
    ("hsdp", dict(replica_split="never")),
    ("hsdp_tp", dict(replica_split="always")),
    ("replicated", dict(replica_split="always")),  # every rank a replica: the all-gather carries v
    ("experts_split", dict(chunk_size=1)),
])
def test_normuon_in_gather_mode_and_over_replicas(case, kw):
    world_size = _world(_case(case)[0])
    for got in run_ranks(_run, world_size, [case], VARIANT, kw, timeout=240):
        _compare(case, got[case], VARIANT, kw.items())


def test_bf16_momentum_and_normuon_match_single_device():
    names = ["fsdp_tp", "experts_split_2d_mesh", "row_blocks"]
    for got in run_ranks(_run, 4, names, BF16_MOMENTUM, {}, timeout=240):
        for name in names:
            _compare(name, got[name], BF16_MOMENTUM)


# ---------------------------------------------------------------- collectives and wire


def _count(rank, world_size, options):
    from torch.distributed.tensor.debug import CommDebugMode

    mesh_shape, specs = CASES["fsdp_tp"]
    specs = specs + [(f"extra.{i}.weight", (16, 12), ["SS0/2", "S0"]) for i in range(6)]
    out = {}
    for mode in ("parallel", "gather"):
        counts = []

        def inspect(opt, named, mesh):
            return opt

        fulls, stats, opt = run_distributed(rank, world_size, mesh_shape, specs, 1, False, with_stats=True,
                                            inspect=inspect, distributed_mode=mode, **options)
        with CommDebugMode() as comm:  # one more step, counted
            named = [(n, p) for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])]
            for n, p in named:
                p.grad = torch.ones_like(p)
            opt.step()
        counts = {str(k): v for k, v in comm.get_comm_counts().items()}
        s = opt.last_step_stats
        out[mode] = (counts, s.all_to_alls, s.all_gathers, s.chunks, s.bytes_sent)
    return out


def test_normuon_adds_no_collective():
    plain = run_ranks(_count, 4, {}, timeout=120)
    variant = run_ranks(_count, 4, VARIANT, timeout=120)
    for a, b in zip(plain, variant):
        for mode in ("parallel", "gather"):
            assert a[mode][:4] == b[mode][:4], (mode, a[mode], b[mode])
            # v travels inside them: a few more bytes, one value per row per job
            assert a[mode][4] < b[mode][4] < 1.2 * a[mode][4], (mode, a[mode][4], b[mode][4])


def _bf16_wire(rank, world_size):
    mesh_shape, specs = CASES["fsdp_tp"]
    full, state = run_distributed(rank, world_size, mesh_shape, specs, STEPS, True, with_state=True,
                                  compute_dtype=torch.bfloat16, **VARIANT)
    return full, state


def test_a_bf16_wire_carries_fp32_v_exactly():
    """With a bf16 Newton–Schulz the pieces travel as bf16; v travels as the bytes of its fp32
    values (two bf16 slots per row), so the owner's statistics and the state stay fp32-exact."""
    specs = CASES["fsdp_tp"][1]
    want, want_state = run_reference(specs, STEPS, True, with_state=True, compute_dtype=torch.bfloat16, **VARIANT)
    for full, state in run_ranks(_bf16_wire, 4, timeout=120):
        for n, ref in want.items():
            torch.testing.assert_close(full[n], ref, atol=ATOL, rtol=RTOL)
            if ref.dim() >= 2:
                assert state[n]["normuon_v"].dtype == torch.float32
                torch.testing.assert_close(state[n]["normuon_v"], want_state[n]["normuon_v"], atol=1e-7, rtol=1e-6)


# ---------------------------------------------------------------- broken on purpose


def _broken(rank, world_size, breakage, name):
    import optimizer.parallel.execution.chunk_stages as stages

    if breakage == "wrong rows of v":  # the owner assembles v with the rows reversed
        original = stages.assemble_rows
        stages.assemble_rows = lambda blocks, o: original(blocks, o).flip(-2)
    elif breakage == "v not returned":  # the scatter sends zeros in v's columns
        original_cut = stages.cut_rows
        stages.cut_rows = lambda rows, o: torch.zeros_like(original_cut(rows, o))
    elif breakage == "v stays local":  # every rank keeps its v as it was (never written back)
        import optimizer.rule as rule

        original_apply = rule.MatrixStep.apply_update
        rule.MatrixStep.apply_update = lambda self, region, update, rows=None: original_apply(self, region, update)
    mesh_shape, specs, group = _case(name)
    return run_distributed(rank, world_size, mesh_shape, specs, STEPS, True, muon_group=group, with_state=True,
                           inspect=_v_layout, **VARIANT)


@pytest.mark.parametrize("breakage", ["wrong rows of v", "v not returned", "v stays local"])
def test_the_comparison_catches_a_broken_v_transport(breakage):
    name = "fsdp_tp"
    for got in run_ranks(_broken, 4, breakage, name, timeout=120):
        with pytest.raises(AssertionError):
            _compare(name, got, VARIANT)
