"""Parallel Muon on DTensor parameters equals single-device Muon.

Every case builds the same global parameters and per-step global gradients on
every rank, shards them with the case's placements (FSDP, HSDP, TP, FSDP+TP,
HSDP+TP, expert-sharded 3-D weights, solver-style mixes, uneven and empty
shards), runs several steps with and without QK-clip, and compares every
parameter's ``full_tensor()`` with the single-device run on the same inputs.
"""

from __future__ import annotations

import pytest
import torch

from dist_cases import HEAD_DIM, run_distributed, run_reference
from harness import run_ranks

# Same inputs, same fp32 math: the only differences are the order of a few
# elementwise ops, so the results agree to float32 rounding.
ATOL, RTOL = 2e-6, 1e-5
STEPS = 3

# (name, global shape, placements per mesh dim); q/k weights have rows = heads * HEAD_DIM
# (4 query heads, 2 kv heads: grouped-query attention).
Q, K = (16, 12), (8, 12)

CASES = {
    "fsdp": ((2,), [
        ("layers.0.attention.wq.weight", Q, ["S0"]),
        ("layers.0.attention.wk.weight", K, ["S0"]),
        ("layers.0.attention.wo.weight", (12, 16), ["S0"]),
        ("layers.0.ffn.w1.weight", (10, 12), ["S0"]),
        ("layers.0.norm.weight", (12,), ["S0"]),
    ]),
    "tp": ((2,), [
        ("layers.0.attention.wq.weight", Q, ["S0"]),
        ("layers.0.attention.wk.weight", K, ["S0"]),
        ("layers.0.attention.wo.weight", (12, 16), ["S1"]),
        ("layers.0.moe.w1", (3, 8, 12), ["S1"]),
        ("layers.0.moe.w2", (3, 12, 8), ["S2"]),
    ]),
    "uneven_2": ((2,), [
        ("a", (9, 7), ["S0"]),
        ("b", (5, 3), ["S1"]),
        ("c", (1, 5), ["S0"]),  # rank 1 holds an empty shard
        ("e", (3, 9, 5), ["S1"]),
    ]),
    "strided_2": ((2,), [
        # rows interleaved across heads: rank 0 holds rows 0-3 and 8-11 of wq
        ("layers.0.attention.wq.weight", Q, ["SS0/2"]),
        ("layers.0.attention.wk.weight", K, ["SS0/2"]),
        ("f", (7, 5), ["SS0/2"]),
        ("g", (6, 9), ["SS1/3"]),
    ]),
    "fsdp_4_uneven": ((4,), [
        ("a", (9, 7), ["S0"]),  # chunks of 3,3,3,0
        ("b", (6, 5), ["S1"]),
        ("layers.1.attention.wq.weight", Q, ["S0"]),
        ("layers.1.attention.wk.weight", K, ["S1"]),
    ]),
    "experts_split": ((4,), [
        # a few dominant expert weights: world.expert_units splits them into expert ranges
        ("layers.0.moe.w1", (8, 12, 16), ["S1"]),
        ("layers.0.moe.w2", (8, 16, 12), ["S2"]),
        ("a", (6, 5), ["S0"]),
    ]),
    "experts_split_2d_mesh": ((2, 2), [
        ("layers.0.moe.w1", (8, 12, 16), ["S0", "S1"]),  # experts over one dim, rows over the other
        ("layers.0.moe.w2", (9, 16, 12), ["SS0/2", "S1"]),  # interleaved experts (index tensors)
        ("layers.0.moe.w3", (7, 12, 16), ["S1", "S0"]),
    ]),
    "fsdp_tp": ((2, 2), [
        ("layers.0.attention.wq.weight", Q, ["SS0/2", "S0"]),
        ("layers.0.attention.wk.weight", K, ["SS0/2", "S0"]),
        ("layers.0.attention.wo.weight", (12, 16), ["S0", "S1"]),
        ("layers.0.ffn.w1.weight", (9, 6), ["SS0/2", "S0"]),  # uneven strided
        ("layers.0.ffn.w2.weight", (6, 9), ["S0", "S1"]),
    ]),
    "hsdp": ((2, 2), [
        ("layers.0.attention.wq.weight", Q, ["R", "S0"]),
        ("layers.0.attention.wk.weight", K, ["R", "S0"]),
        ("layers.0.ffn.w1.weight", (7, 5), ["R", "S0"]),
        ("layers.0.norm.weight", (5,), ["R", "S0"]),
    ]),
    "solver": ((2, 2), [
        ("layers.0.attention.wq.weight", Q, ["S1", "S0"]),
        ("layers.0.attention.wk.weight", K, ["S1", "S0"]),
        ("layers.0.attention.wv.weight", K, ["S1", "S0"]),
        ("layers.0.attention.wo.weight", (12, 16), ["S0", "S1"]),
        ("tok_embeddings.weight", (11, 12), ["S1", "S1"]),
        ("layers.0.ffn.w1.weight", (10, 12), ["S0", "S0"]),
        ("layers.0.ffn.w3.weight", (10, 12), ["SS0/2", "S0"]),
        ("layers.0.ffn.w2.weight", (12, 10), ["R", "S0"]),
        ("layers.1.attention.wq.weight", Q, ["SS0/2", "S0"]),
        ("layers.1.attention.wk.weight", K, ["S0", "S0"]),
        ("layers.2.attention.wq.weight", Q, ["S0", "SS0/2"]),
        ("layers.2.attention.wk.weight", K, ["R", "SS0/2"]),
    ]),
    "ep": ((2, 2), [
        ("layers.0.moe.w1", (4, 8, 12), ["S0", "S1"]),  # experts over ep, rows over dp
        ("layers.0.moe.w2", (4, 12, 8), ["S0", "R"]),  # experts only: whole matrices stay local
        ("layers.0.moe.w3", (3, 9, 6), ["S0", "S2"]),  # uneven experts and columns
    ]),
    "hsdp_tp": ((2, 2, 2), [
        ("layers.0.attention.wq.weight", Q, ["R", "SS0/2", "S0"]),
        ("layers.0.attention.wk.weight", K, ["R", "SS0/2", "S0"]),
        ("layers.0.attention.wo.weight", (12, 16), ["R", "S0", "S1"]),
        ("layers.0.ffn.w1.weight", (9, 6), ["R", "SS0/2", "S0"]),
    ]),
}


def _world(mesh_shape):
    n = 1
    for s in mesh_shape:
        n *= s
    return n


def _run_cases(rank, world_size, names, qk):
    out = {}
    for name in names:
        mesh_shape, specs = CASES[name]
        out[name] = run_distributed(rank, world_size, mesh_shape, specs, STEPS, qk)
    return out


def _assert_close(case, got, want):
    for pname, ref in want.items():
        torch.testing.assert_close(got[pname], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{case} {pname}: {m}")


@pytest.mark.parametrize("qk", [False, True], ids=["qk_off", "qk_on"])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_parallel_muon_matches_single_device(world_size, qk):
    names = [n for n, (shape, _) in CASES.items() if _world(shape) == world_size]
    results = run_ranks(_run_cases, world_size, names, qk, timeout=240)
    for name in names:
        want = run_reference(CASES[name][1], STEPS, qk)
        for rank_result in results:
            _assert_close(name, rank_result[name], want)


def _gather_mode(rank, world_size):
    mesh_shape, specs = CASES["fsdp_tp"]
    return run_distributed(rank, world_size, mesh_shape, specs, STEPS, True, distributed_mode="gather")


def test_gather_everything_baseline_matches_single_device():
    results = run_ranks(_gather_mode, 4, timeout=120)
    want = run_reference(CASES["fsdp_tp"][1], STEPS, True)
    for r in results:
        _assert_close("fsdp_tp/gather", r, want)


def _expert_split_counts(rank, world_size):
    mesh_shape, specs = CASES["experts_split"]
    from dist_cases import build_groups, make_case_tensors, parse_placement, to_dtensor
    from optimizer import Muon
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    params, grads = make_case_tensors(specs, 1)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl]))) for n, _, pl in specs]
    opt = Muon(build_groups(named), lr=0.02)
    for n, p in named:
        p.grad = to_dtensor(grads[0][n], mesh, p.placements)
    opt.step()
    return opt.last_step_stats.matrices


def test_dominant_expert_weights_are_split_across_owners():
    """The experts_split case above checks the values; this checks the split happened."""
    for matrices in run_ranks(_expert_split_counts, 4, timeout=60):
        assert matrices > len(CASES["experts_split"][1])


def test_qk_clip_changes_the_result():
    """Guard against a vacuous QK-clip: the thresholds used above do clip heads."""
    specs = CASES["fsdp_tp"][1]
    on, off = run_reference(specs, STEPS, True), run_reference(specs, STEPS, False)
    wq = "layers.0.attention.wq.weight"
    assert not torch.allclose(on[wq], off[wq])
    assert HEAD_DIM == 4


# ---------------------------------------------------------------- collectives


def _count_collectives(rank, world_size, mode):
    from torch.distributed.tensor.debug import CommDebugMode

    from dist_cases import build_groups, make_case_tensors, to_dtensor, parse_placement
    from optimizer import Muon
    from torch.distributed.device_mesh import init_device_mesh

    mesh_shape, specs = CASES["fsdp_tp"]
    specs = specs + [(f"extra.{i}.weight", (16, 12), ["SS0/2", "S0"]) for i in range(12)]  # 2+ chunks
    mesh = init_device_mesh("cpu", mesh_shape)
    params, grads = make_case_tensors(specs, 2)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl]))) for n, _, pl in specs]
    opt = Muon(build_groups(named), lr=0.02, distributed_mode=mode)
    counts = []
    for s in range(2):
        for n, p in named:
            p.grad = to_dtensor(grads[s][n], mesh, p.placements)
        with CommDebugMode() as comm:
            opt.step()
        counts.append({str(k): v for k, v in comm.get_comm_counts().items()})
    return counts, opt.last_step_stats.chunks, opt.last_step_stats.all_to_alls


def test_each_chunk_costs_two_all_to_alls_and_nothing_else():
    results = run_ranks(_count_collectives, 4, "parallel", timeout=120)
    for counts, chunks, a2a in results:
        # 17 matrices, one shard group of 4 ranks, default chunk = 4 matrices: cut by load,
        # at least 2 chunks (the largest matrix is far below a rank's share)
        expected_chunks = chunks
        assert chunks >= 2 and a2a == 2 * chunks
        for step_counts in counts:
            a2a_ops = {k: v for k, v in step_counts.items() if "alltoall" in k}
            others = {k: v for k, v in step_counts.items() if "alltoall" not in k and "allreduce" not in k}
            assert sum(a2a_ops.values()) == 2 * expected_chunks, step_counts
            # the only other collective is the single agreement all-reduce
            assert sum(v for k, v in step_counts.items() if "allreduce" in k) == 1, step_counts
            assert not others, step_counts


def test_gather_baseline_all_gathers_every_matrix():
    """The counter above can see all-gathers: the baseline does one per matrix."""
    results = run_ranks(_count_collectives, 4, "gather", timeout=120)
    for counts, _, _ in results:
        for step_counts in counts:
            gathers = sum(v for k, v in step_counts.items() if "all_gather" in k or "allgather" in k)
            assert gathers >= len(CASES["fsdp_tp"][1]) + 12, step_counts


# ------------------------------------------------------------- overlap schedule


def _record_schedule(rank, world_size, lookahead):
    import optimizer.parallel.execution.pipeline as pipeline
    from dist_cases import build_groups, make_case_tensors, parse_placement, to_dtensor
    from optimizer import Muon
    from torch.distributed.device_mesh import init_device_mesh

    events = []

    def wrap(name, fn, chunk_of):
        def wrapped(*args, **kwargs):
            events.append((name, chunk_of(*args)))
            return fn(*args, **kwargs)
        return wrapped

    ids = {}
    chunk_id = lambda chunk: ids.setdefault(id(chunk), len(ids))  # noqa: E731 - chunks in launch order
    pipeline.start_gather = wrap("gather_start", pipeline.start_gather, lambda c, *_: chunk_id(c))
    pipeline.finish_gather = wrap("gather_wait", pipeline.finish_gather, lambda f, *_: chunk_id(f.chunk))
    pipeline.orthogonalize_owned = wrap("orthogonalize", pipeline.orthogonalize_owned,
                                        lambda f, *_: chunk_id(f.chunk))
    pipeline.start_scatter = wrap("scatter_start", pipeline.start_scatter, lambda c, *_: chunk_id(c))
    pipeline.finish_update = wrap("update", pipeline.finish_update, lambda f, *_: chunk_id(f.chunk))

    specs = [(f"w{i}", (8, 6), ["S0"]) for i in range(8)]  # 4 chunks of 2 on 2 ranks
    mesh = init_device_mesh("cpu", (world_size,))
    params, grads = make_case_tensors(specs, 1)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl]))) for n, _, pl in specs]
    opt = Muon(build_groups(named), lr=0.02, lookahead=lookahead)
    for n, p in named:
        p.grad = to_dtensor(grads[0][n], mesh, p.placements)
    opt.step()
    return events


@pytest.mark.parametrize("lookahead", [1, 2])
def test_communication_is_in_flight_while_the_owner_computes(lookahead):
    """While chunk i is orthogonalised, the gathers of chunks i+1..i+lookahead and the
    scatter of chunk i-1 have been launched and not yet waited on."""
    for events in run_ranks(_record_schedule, 2, lookahead, timeout=60):
        pos = {e: k for k, e in enumerate(events)}
        chunks = sorted({c for _, c in events})
        assert len(chunks) == 4
        for i in chunks:
            t = pos[("orthogonalize", i)]
            for j in range(i + 1, min(i + lookahead, chunks[-1]) + 1):
                assert pos[("gather_start", j)] < t < pos[("gather_wait", j)], (i, j, events)
            if i > 0:
                assert pos[("scatter_start", i - 1)] < t < pos[("update", i - 1)], (i, events)
            assert pos[("gather_wait", i)] < t < pos[("scatter_start", i)]


# ------------------------------------------------- narrower wire dtype (bf16 on CUDA)


def _bf16_compute(rank, world_size):
    mesh_shape, specs = CASES["fsdp_tp"]
    sent = {}
    for dtype in (torch.float32, torch.bfloat16):
        full, stats = run_distributed(rank, world_size, mesh_shape, specs, STEPS, True, with_stats=True,
                                      compute_dtype=dtype)
        sent[str(dtype)] = stats.bytes_sent
    return full, sent


def test_bf16_compute_sends_bf16_and_matches_single_device_bf16():
    """With a bf16 Newton–Schulz (the CUDA default) shards travel as bf16: half the bytes,
    and the same result as single-device Muon computing in bf16."""
    want = run_reference(CASES["fsdp_tp"][1], STEPS, True, compute_dtype=torch.bfloat16)
    for full, sent in run_ranks(_bf16_compute, 4, timeout=120):
        _assert_close("fsdp_tp/bf16", full, want)
        assert sent["torch.bfloat16"] * 2 == sent["torch.float32"] > 0, sent
