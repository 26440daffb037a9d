"""benchmarks/scale_model.py at small worlds (FSDP 8 and 64, HSDP 2x4): files written, numbers right.

The model's numbers are checked against references that are not its own code:
- arithmetic done here from the shapes in benchmarks/model_shapes.py (FLOP and byte
  totals, which matrices the "auto" replica split takes, world traffic totals, a
  hand-worked one-matrix plan);
- bounds that hold whatever the owners (busiest >= ideal, critical path >= busiest,
  splitting over replicas never raises the busiest rank, bytes sent = received);
- the optimizer itself: its owners are exactly ``world_jobs``' on parameters built
  here, and every rank's load, bytes sent and received and largest chunk buffers
  are exactly what ``build_plan`` (the per-rank plan the optimizer runs) computes.
"""

from __future__ import annotations

import functools
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from optimizer.distributed.layout import MeshGrid, ParamLayout
from optimizer.newton_schulz.forms import newton_schulz_flops
from optimizer.parallel.planning.plan import MoveChunk, PlanParam, PlanSettings, build_plan, split_workspace, world_jobs
from optimizer.parallel.planning.cut_hardware import SplitHardware
from repo import load_benchmark

RANKS = [8, 64]
HSDP = (2, 4)
HSDP_MODELS = ["llama3-70b", "deepseek-v3"]
WIRE_BYTES = 2  # the script's default wire dtype (bf16)
AUTO = 1e4  # the script's default "auto" threshold (the optimizer's CUDA default)
NS_SPLITS = ("never", "auto")  # the script's default ns_split rows
DION2_RANKS, DION2_FRACTIONS = (512, 1024), (0.25, 0.125)  # the script's default Dion2 section


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("scale_model")


@pytest.fixture(scope="module")
def run(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("scale_model")
    bench.main(["--ranks", *map(str, RANKS), "--hsdp", f"{HSDP[0]}x{HSDP[1]}",
                "--hsdp-models", *HSDP_MODELS, "--out", str(out)])
    with open(out / "scale_model.json") as f:
        data = json.load(f)
    return out, data


@pytest.fixture(scope="module")
def models():
    return load_benchmark("model_shapes").all_models()


def _is_moe(model) -> bool:
    return any(len(s) == 3 for _, s in model.muon_params)


def _expected_rows(models):
    rows = []
    for name, m in models.items():
        dims = [1, 0] if _is_moe(m) else [None]
        rows += [(name, "fsdp", n, d, None, ns) for n in RANKS for d in dims for ns in NS_SPLITS]
        if name in HSDP_MODELS:
            rows += [(name, "hsdp", HSDP[0] * HSDP[1], d, s, ns) for d in dims for s in ("never", "auto", "always")
                     for ns in NS_SPLITS]
    return rows


def _key(r):
    return (r["model"], r["layout"], r["ranks"], r["expert_dim"], r["replica_split"], r["ns_split"])


def _flops(shape) -> float:
    """What CUDA runs by default (compute_dtype None): the classic form in bf16, or the Gram form
    in fp16 where "auto" takes it (newton_schulz.choose_ns_form)."""
    return _cuda_flops(tuple(shape))


@functools.lru_cache(maxsize=None)
def _cuda_flops(shape: tuple[int, ...]) -> float:  # cached: the plans below ask for a few shapes ~10^5 times
    return float(newton_schulz_flops(shape, 5, "auto", None, "fixed", "cuda"))


def _splits_auto(shape) -> bool:
    """The "auto" rule, from its definition: FLOPs per byte of one matrix (one expert) >= threshold."""
    one = shape if len(shape) == 2 else (1, *shape[1:])
    return _flops(one) / (math.prod(one) * WIRE_BYTES) >= AUTO


def _short(name: str) -> str:
    return re.sub(r"^layers\.\d+\.", "", name).removesuffix(".weight")


def _expected_traffic(model, row) -> tuple[float, float]:
    """(gather bytes over the world, replica all-gather payload) from the shapes and the layout."""
    R, S = row["replicas"], row["shards"]
    gather = payload = 0.0
    for _, shape in model.muon_params:
        b = math.prod(shape) * WIRE_BYTES
        held_whole = len(shape) == 3 and row["expert_dim"] == 0  # shard group of 1
        split = R > 1 and (row["replica_split"] == "always"
                           or (row["replica_split"] == "auto" and _splits_auto(shape)))
        if not held_whole:  # S - 1 of its S pieces travel to the owner, in each replica that runs it
            gather += (1 if split else R) * (S - 1) / S * b
        if split:  # its update reaches the other R - 1 replicas
            payload += (R - 1) * b
    return gather, payload


# ----------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------


def test_every_model_layout_and_plan_is_reported(run, models):
    _, data = run
    assert sorted(map(_key, data["results"]), key=str) == sorted(_expected_rows(models), key=str)


def test_markdown_has_one_table_row_per_result_and_the_verdicts(run, models):
    out, data = run
    text, dion2_section = (out / "scale_model.md").read_text().split("\n## Dion2 against Muon", 1)
    assert text.startswith("# Parallel Muon scale model")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert len(rows) == len(data["results"])
    for r in data["results"]:
        layout = "fsdp" if r["layout"] == "fsdp" else f"hsdp {r['replicas']}x{r['shards']}"
        assert any(row.startswith(f"| {r['model']} | {layout} | {r['ranks']} |") for row in rows), _key(r)
    assert "sends T - O + (S - 1) O" in text  # the traffic formula is stated
    assert "## HSDP: replicas repeat the work (never) vs split over replicas" in text
    # the Dion2 section: labelled a prediction, one row per model, rank count and optimizer
    assert dion2_section.startswith(" (a prediction")
    dion2_rows = [line for line in dion2_section.splitlines() if line.startswith("| ") and
                  not line.startswith("| model")]
    assert len(dion2_rows) == len(data["dion2"]) == len(models) * len(DION2_RANKS) * (1 + len(DION2_FRACTIONS))


def test_png_is_written_when_matplotlib_is_available(run):
    pytest.importorskip("matplotlib")
    out, _ = run
    assert (out / "scale_model.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------
# Arithmetic from the shapes
# ----------------------------------------------------------------------------


def test_totals_match_the_shapes(run, models):
    _, data = run
    for r in data["results"]:
        m = models[r["model"]]
        total = sum(_flops(s) for _, s in m.muon_params)
        assert r["muon_param_bytes"] == sum(math.prod(s) for _, s in m.muon_params) * WIRE_BYTES
        assert r["total_ns_flops"] == pytest.approx(total, rel=1e-12)
        assert r["ideal_ns_flops"] == pytest.approx(total / r["ranks"], rel=1e-12)
        # What the world runs: one copy, plus R - 1 more of every matrix kept per replica.
        kept = 0.0
        if r["replicas"] > 1 and r["replica_split"] != "always":
            kept = sum(_flops(s) for _, s in m.muon_params
                       if r["replica_split"] == "never" or not _splits_auto(s))
        if not r["cut_units"]:  # (a cut unit's members may repeat its m^3 term: checked below)
            assert r["planned_ns_flops"] == pytest.approx(total + (r["replicas"] - 1) * kept, rel=1e-9), _key(r)
            assert r["planned_load"] == r["planned_ns_flops"]
        assert r["busiest_over_ideal"] == pytest.approx(r["busiest_ns_flops"] / r["ideal_ns_flops"])


def test_auto_splits_exactly_the_matrices_worth_it(run, models):
    _, data = run
    for r in data["results"]:
        if r["replicas"] == 1:
            assert r["split_matrices"] == [], _key(r)
            continue
        names = {_short(n) for n, _ in models[r["model"]].muon_params}
        want = {"never": set(), "always": names,
                "auto": {_short(n) for n, s in models[r["model"]].muon_params if _splits_auto(s)}}[r["replica_split"]]
        assert set(r["split_matrices"]) == want, _key(r)
        assert set(r["unsplit_matrices"]) == names - want
    # DeepSeek's narrow matrices are the ones kept per replica at the CUDA threshold.
    auto = next(r for r in data["results"] if r["model"] == "deepseek-v3" and r["replica_split"] == "auto")
    assert {"mlp.router", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"} <= set(auto["unsplit_matrices"])


def test_world_traffic_against_the_sharding_arithmetic(run, models):
    _, data = run
    for r in data["results"]:
        n, R, S = r["ranks"], r["replicas"], r["shards"]
        w = r["world_bytes"]
        gather, payload = _expected_traffic(models[r["model"]], r)
        # Shards divide evenly at these sizes, so no piece is padded.
        assert w["gather"] == pytest.approx(gather, rel=1e-12), _key(r)
        assert w["scatter"] == w["gather"]
        assert w["exchange_payload"] == pytest.approx(payload, rel=1e-12), _key(r)
        assert w["exchange"] >= w["exchange_payload"]  # the all-gather pads to the longest contribution
        # Conservation: what the world sends, it receives; and the kinds add up.
        sent = r["bytes_sent_per_rank_mean"] * n
        assert sent == pytest.approx(r["bytes_received_per_rank_mean"] * n, rel=1e-12)
        assert sent == pytest.approx(w["gather"] + w["scatter"] + w["exchange"], rel=1e-12)
        assert r["bytes_sent_per_rank_max"] >= r["bytes_sent_per_rank_mean"] * (1 - 1e-12)
        if R == 1:
            assert w["exchange"] == r["exchange_sent_per_rank_max"] == 0
        assert r["gather_all"]["bytes_received_per_rank"] == pytest.approx(
            (S - 1) / S * r["muon_param_bytes"], rel=1e-12)


def test_one_matrix_by_hand(bench):
    """[8, 8] bf16 on 2 ranks: rank 0 owns it; pieces are 4 x 8 = 32 elements."""
    model = SimpleNamespace(name="one", muon_params=[("w", (8, 8))])
    params = bench.plan_params(model, bench.Layout(1, 2, None), 5, torch.bfloat16)
    plan = bench.measure(params, PlanSettings(), lookahead=1, state_bytes=4, compute_bytes=2)
    assert plan.load == [_flops((8, 8)), 0.0]
    # sent = T - O + (S - 1) O: rank 0 (T = O = 32) sends its update piece, rank 1 its gradient piece.
    assert plan.sent == [64, 64] and plan.received == [64, 64]
    assert plan.world_bytes == {"gather": 64, "scatter": 64, "exchange": 0, "exchange_payload": 0, "moves": 0}
    # buffers 2T + 3 S O: rank 0 256 elements, rank 1 64; workspace 2mn + 2m^2 = 256 elements on rank 0.
    assert plan.chunk_buffers == [[512, 128]]
    assert plan.peak == [512 + 512, 128]
    assert plan.critical_path == _flops((8, 8))


def test_one_matrix_cut_over_two_ranks_by_hand(bench, monkeypatch):
    """[8, 8] bf16 on 2 ranks, ns_split="always": two blocks [8, 4] (columns), one per rank.

    Pieces: each rank holds 4 rows; block j takes columns of every row, so each rank sends the
    other owner its 4 x 4 piece of the other block and gets the same back: 16 + 16 elements, the
    same 64 bytes as the whole matrix's gather and scatter.  The split iteration per step: the
    Gram matrix (ring all-reduce over 2 ranks: each rank sends the buffer once), the first in fp32
    with the norm, 8 x 8 x 4 + 4 = 260 bytes, then four in bf16, 4 x 128; at 1 FLOP/s computing
    B = b A + c A^2 by rows pays, so each rank computes its 4 rows (2 x 4 x 8 x 8 = 512 FLOPs)
    and all-gathers them (4 x 8 bf16 = 64 bytes): 1092 bytes.  FLOPs per rank and step:
    X_i X_i^T and B X_i, 2 x 8 x 8 x 4 each, plus 512: 5 x 1536 = 7680, half the whole matrix's
    30 n^3 = 15360."""
    monkeypatch.setattr(bench, "HARDWARE", SplitHardware("test: 1 FLOP/s, 1 B/s, no latency", 1.0, 1.0, 1.0, 0.0,
                                                         torch.bfloat16))
    model = SimpleNamespace(name="one", muon_params=[("w", (8, 8))])
    params = bench.plan_params(model, bench.Layout(1, 2, None), 5, torch.bfloat16, "always")
    plan = bench.measure(params, PlanSettings(), lookahead=1, state_bytes=4, compute_bytes=2)
    (jobs, _), = plan.patterns
    assert [(j.shape, j.owner, j.cut.j) for j in jobs] == [((8, 4), 0, 0), ((8, 4), 1, 1)]
    assert plan.sent == [64, 64] and plan.received == [64, 64]
    assert plan.split_sent == [260 + 4 * 128 + 5 * 64] * 2
    assert plan.flops == [7680.0, 7680.0]
    # busy for FLOPs / rate + bytes / bandwidth (+ no latency): in FLOP-equivalents at 1 FLOP/s
    assert plan.load == [7680.0 + 1092, 7680.0 + 1092]
    assert plan.split_units == {2: 1}


def test_the_issue_at_1024_ranks(bench, models):
    """Llama-3-70B at 1,024 FSDP ranks: its [28672, 8192] gate/up/down alone were 3.41x the ideal;
    on the calibrated CUDA figures the cost model cuts them over eight ranks, two to a group (each
    pair one call whose halves interleave), and q/o over eight ranks alone beside each pair, the
    rest paired over four (two k's in one class: ``cut_packing.pack_ways``): the busiest rank drops
    to about 1.48x, still above 1.25x (CUDA's default Gram form in fp16 makes the ideal share 20%
    smaller, the Gram all-reduces not) but at the bound no whole-or-cut plan can beat
    (split_bound.py), within 0.5%."""
    args = SimpleNamespace(ns_steps=5, wire_dtype="bf16", chunk_size=None, lookahead=1, state_bytes=4,
                           compute_bytes=2, replica_flops_per_byte=AUTO)
    never = bench.evaluate(models["llama3-70b"], bench.Layout(1, 1024, None), None, args, "never")
    auto = bench.evaluate(models["llama3-70b"], bench.Layout(1, 1024, None), None, args, "auto")
    # never: the busiest rank holds one gate/up/down whole (3.41x with the classic bf16 count; the
    # Gram form in fp16, which CUDA runs by default for these shapes, lowers the ratio to 3.24x)
    params = models["llama3-70b"].muon_params
    largest = max(_flops(s) for _, s in params) / (sum(_flops(s) for _, s in params) / 1024)
    assert never["busiest_over_ideal"] == pytest.approx(largest, rel=1e-9)
    assert auto["busiest_over_ideal"] < 1.65 and auto["critical_path_over_ideal"] < 1.65
    # 80 layers x (gate, up, down) over 8 (120 pairs), 128 of the 160 q/o over 8 alone and 32 over 4 (16 pairs)
    assert auto["cut_units"] == {"4": 32, "8": 368}
    assert 1.0 < auto["cut_lower_bound_over_ideal"] <= auto["busiest_over_ideal"]
    assert auto["busiest_over_ideal"] <= 1.005 * auto["cut_lower_bound_over_ideal"]
    assert auto["split_sent_per_rank_max"] > 0 and auto["total_sent_per_rank_max"] > never["total_sent_per_rank_max"]
    line = bench.split_line(("llama3-70b", "fsdp", 1024, None), {"never": never, "auto": auto})
    assert "misses" in line and "no whole-or-cut plan goes below" in line



def test_llama3_70b_at_512_ranks_meets_the_target(bench, models):
    """Llama-3-70B at 512 FSDP ranks (issue 29): one k per class left the busiest rank at 1.35x
    (every gate/up/down over 8 ranks, 6 on the busiest group); with each unit's way chosen as it is
    placed (``cut_packing.pack_ways``) every gate/up/down goes paired over 4 ranks (120 of the 128
    groups of 4), beside 112 of the pairs a q/o over 4 alone (0.86x + 0.35x of the ideal share),
    and on the other 32 ranks 32 q/o whole and 16 paired over 4: busiest rank and critical path
    within the 1.25x target, and no lower than the bound (split_bound.py)."""
    args = SimpleNamespace(ns_steps=5, wire_dtype="bf16", chunk_size=None, lookahead=1, state_bytes=4,
                           compute_bytes=2, replica_flops_per_byte=AUTO)
    auto = bench.evaluate(models["llama3-70b"], bench.Layout(1, 512, None), None, args, "auto")
    assert auto["busiest_over_ideal"] <= 1.25 and auto["critical_path_over_ideal"] <= 1.25
    assert 1.0 < auto["cut_lower_bound_over_ideal"] <= auto["busiest_over_ideal"]
    assert "meets" in bench.split_line(("llama3-70b", "fsdp", 512, None), {"never": auto, "auto": auto})

def test_units_held_whole_count_in_chunk_0(bench):
    """2 ranks: experts [3, 8, 8] Shard(0) are held 2 + 1; the matrices 16^2, 3 x 12^2 are one chunk.

    Square n x n costs 2 * 5 * 3 n^3 = 30 n^3 (16: 122880, 12: 51840, 8: 15360).  LPT
    (largest first, to the least-loaded rank): 16 -> rank 0; each 12 -> rank 1, whose load
    (0, 51840, 103680) stays under rank 0's.  Chunks: at most busiest total / largest
    = 155520 / 122880, so 1.
    """
    c = {n: 30 * n**3 for n in (8, 12, 16)}
    model = SimpleNamespace(name="tiny", muon_params=[("e", (3, 8, 8)), ("a", (16, 16))]
                            + [(f"b{i}", (12, 12)) for i in range(3)])
    params = bench.plan_params(model, bench.Layout(1, 2, 0), 5, torch.bfloat16)
    plan = bench.measure(params, PlanSettings(), lookahead=1, state_bytes=4, compute_bytes=2)
    assert plan.local_load == [2 * c[8], c[8]]
    assert plan.load == [2 * c[8] + c[16], c[8] + 3 * c[12]]
    assert len(plan.chunk_buffers) == 1
    # Units held whole run while chunk 0's gathers travel: max over ranks of (held + chunk 0).
    assert plan.critical_path == max(2 * c[8] + c[16], c[8] + 3 * c[12])
    assert plan.critical_path < max(2 * c[8], c[8]) + max(c[16], 3 * c[12])  # not a chunk of their own


# ----------------------------------------------------------------------------
# Bounds that hold whatever the owners
# ----------------------------------------------------------------------------


def test_balance_bounds(run):
    _, data = run
    by = {_key(r): r for r in data["results"]}
    for r in data["results"]:
        k = _key(r)
        assert r["busiest_over_lower_bound"] >= 1 - 1e-12, k
        assert r["busiest_ns_flops"] >= r["planned_ns_flops"] / r["ranks"] * (1 - 1e-12), k
        assert r["busiest_over_ideal"] >= 1 - 1e-12, k
        assert r["busiest_over_ideal"] >= r["largest_unit_over_ideal"] * (1 - 1e-12), k
        # A barrier per chunk can only add waiting: sum of per-chunk maxima >= max of sums.
        assert r["critical_path_over_ideal"] >= r["busiest_over_ideal"] * (1 - 1e-12), k
        assert r["peak_extra_memory_bytes"] >= r["peak_extra_memory_bytes_mean"] * (1 - 1e-12)
        if r["ns_split"] != "never":  # cutting is kept only where it lowers the busiest rank
            whole = by[(*k[:-1], "never")]
            assert r["busiest_ns_flops"] <= whole["busiest_ns_flops"] * (1 + 1e-12), k
        if r["replica_split"] in ("auto", "always") and r["ns_split"] == "never":
            never = by[(*k[:-2], "never", "never")]
            assert r["busiest_ns_flops"] <= never["busiest_ns_flops"] * (1 + 1e-12), k
            assert r["planned_ns_flops"] <= never["planned_ns_flops"] * (1 + 1e-12), k


def test_every_cost_goes_through_one_function(bench, models, monkeypatch):
    """Issue 15: swapping ``_ns_cost`` changes every figure (the planner's costs included)."""
    model = models["deepseek-v3"]
    args = SimpleNamespace(ns_steps=5, wire_dtype="bf16", chunk_size=None, lookahead=1, state_bytes=4,
                           compute_bytes=2, replica_flops_per_byte=AUTO)
    monkeypatch.setattr(bench, "_ns_cost", lambda shape, steps: float(math.prod(shape)))
    row = bench.evaluate(model, bench.Layout(1, 8, 1), None, args)
    numel = sum(math.prod(s) for _, s in model.muon_params)
    assert row["total_ns_flops"] == numel
    assert row["planned_ns_flops"] == numel  # the per-rank loads come from the planner's costs
    assert row["busiest_ns_flops"] >= numel / 8


# ----------------------------------------------------------------------------
# The optimizer's own plan
# ----------------------------------------------------------------------------


def _params_here(model, mesh, placements_2d, placements_3d, ranks=None, split=None):
    """PlanParams built from the shapes in this test (not by the benchmark)."""
    grid = MeshGrid(tuple(mesh), tuple(ranks or range(math.prod(mesh))))
    layouts = {tuple(s): ParamLayout(tuple(s), grid, placements_3d if len(s) == 3 else placements_2d)
               for _, s in model.muon_params}
    return [PlanParam(name=n, shape=tuple(s), layout=layouts[tuple(s)], wire_dtype=torch.bfloat16,
                      device=torch.device("cpu"), ns_key=0, cost=_flops, split=split)
            for n, s in model.muon_params]


CASES = [  # model, mesh, expert dim, replica_split[, shard-major rank order[, ns_split]]
    ("deepseek-v3", (8,), 1, "never"),
    ("llama3-70b", (2, 4), None, "always", True),  # ranks 0 4 1 5 2 6 3 7 on the (2, 4) mesh
    ("deepseek-v3", (8,), 0, "never"),
    ("deepseek-v3", (2, 4), 1, "always"),
    ("deepseek-v3", (2, 4), 0, "auto"),
    ("llama3-70b", (2, 4), None, "never"),
    ("qwen3-235b-a22b", (3, 5), 0, "auto"),  # uneven: 128 experts on 5 ranks, padded pieces
    ("qwen3-235b-a22b", (5,), 0, "never"),  # experts held whole, unevenly: 26, 26, 26, 26, 24
    # Newton–Schulz cut over k ranks: every matrix over its shard group ("always"); over aligned
    # blocks of 2-8 ranks where the cost model says so ("auto", with free communication so it cuts)
    ("llama3-70b", (8,), None, "never", False, "always"),
    ("llama3-70b", (2, 4), None, "always", True, "always"),  # cut over shard groups, split over replicas
    ("qwen3-235b-a22b", (3, 5), 1, "never", False, "always"),  # uneven shard groups of 5
    ("three-matrices", (8,), None, "never", False, "auto"),
    # experts held whole (Shard(0)), fewer than ranks: moved to ranks holding none, some cut
    ("few-experts", (8,), 0, "never", False, "auto"),
]
THREE = SimpleNamespace(name="three-matrices", muon_params=[("a", (512, 2048)), ("b", (2048, 512)), ("c", (96, 64))])
FEW = SimpleNamespace(name="few-experts", muon_params=[("e1", (3, 256, 1024)), ("e2", (5, 1024, 256)),
                                                       ("e3", (2, 128, 128)), ("d", (512, 512))])
FREE = SplitHardware("test: free communication", 1e12, 1e12, 1e18, 1e-12, torch.bfloat16)
LOOKAHEAD, STATE_BYTES, COMPUTE_BYTES = 1, 4, 2


def _workspace(shape) -> int:
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * (2 * m * m + 2 * m * n)


def _chunk_bytes(chunk) -> int:
    """A chunk's buffers on this rank, from the plan's sizes: gather send, receive and the
    assembled matrices, scatter send and receive, and the replica all-gather's output."""
    item = torch.empty((), dtype=chunk.wire_dtype).element_size()
    if isinstance(chunk, MoveChunk):  # blocks out and back: send, receive, batched copies, return both ways
        return item * (2 * chunk.send_numel + 3 * chunk.recv_numel)
    whole = chunk.segment * chunk.shard_size
    return item * (chunk.send_numel + 2 * whole + whole + max(chunk.scatter_recv_numel, chunk.exchange_length)
                   + chunk.exchange_length * chunk.replica_size)


def _expected_peak(step) -> int:
    """The pipeline docstring's rule on build_plan's chunks: lookahead + 2 chunks (+1 while a
    replica all-gather is in flight), plus the computing chunk's largest batched NS workspace;
    before chunk 0, the units held whole, same-shape ones stacked as far as a chunk's buffers
    allow, at least one (run_local)."""
    buffers = [_chunk_bytes(c) for c in step.chunks]
    groups: dict = {}
    for job in step.local:
        groups[job.shape] = groups.get(job.shape, 0) + 1
    unit = {s: math.prod(s) * STATE_BYTES + _workspace(s) * COMPUTE_BYTES for s in groups}
    cap = max([max(buffers, default=0), *unit.values()])
    local = max((min(k, max(1, cap // unit[s])) * unit[s] for s, k in groups.items()), default=0)
    peak = local + sum(buffers[: LOOKAHEAD + 1])
    for k, chunk in enumerate(step.chunks):
        batched = {i for b in chunk.batches for i in b}
        spaces = [sum(_workspace(chunk.owned[i].shape) for i in b) for b in chunk.batches]
        spaces += [_workspace(o.shape) if o.split is None
                   else split_workspace(o.shape, o.split.transpose, len(o.split.ranks))
                   for i, o in enumerate(chunk.owned) if i not in batched]
        live = list(range(max(0, k - 1), min(len(buffers), k + LOOKAHEAD + 1)))
        if k >= 2 and step.chunks[k - 2].exchange_length:
            live.append(k - 2)
        peak = max(peak, sum(buffers[c] for c in live) + max(spaces, default=0) * COMPUTE_BYTES)
    return peak


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_owners_loads_and_bytes_are_the_optimizers(bench, models, case, monkeypatch):
    name, mesh, expert_dim, split, *rest = case
    shard_major = bool(rest and rest[0])
    ns = rest[1] if len(rest) > 1 else "never"
    if ns == "auto":
        monkeypatch.setattr(bench, "HARDWARE", FREE)
    model_split = bench.split_model(ns, 5)
    models = {**models, THREE.name: THREE, FEW.name: FEW}
    model = models[name]
    ranks = [r + mesh[0] * s for r in range(mesh[0]) for s in range(mesh[-1])] if shard_major else None
    hsdp = len(mesh) == 2
    p2 = (Replicate(), Shard(0)) if hsdp else (Shard(0),)
    p3 = (Replicate(), Shard(expert_dim or 0)) if hsdp else (Shard(expert_dim or 0),)
    settings = PlanSettings(replica_split=split, replica_min_flops_per_byte=AUTO)
    layout = bench.Layout(mesh[0] if hsdp else 1, mesh[-1], expert_dim, shard_major)
    if shard_major:
        assert list(layout.ranks) == ranks
    plan = bench.measure(bench.plan_params(model, layout, 5, torch.bfloat16, ns), settings, LOOKAHEAD, STATE_BYTES,
                         COMPUTE_BYTES)
    assert bool(plan.split_units) == (ns != "never"), plan.split_units
    if name == FEW.name:  # the experts moved (some of them cut: split_units above)
        assert any(j.holder >= 0 and j.owner != j.holder for jobs, _ in plan.patterns for j in jobs)

    # The benchmark's owners and chunks are world_jobs' on parameters built here.
    mine = world_jobs(_params_here(model, mesh, p2, p3, ranks, model_split), settings)
    assert [[(j.param, j.shape, j.owner, j.split, j.cut) for j in jobs] for jobs, _ in plan.patterns] == \
        [[(j.param, j.shape, j.owner, j.split, j.cut) for j in jobs] for jobs, _ in mine]
    assert [chunks for _, chunks in plan.patterns] == [chunks for _, chunks in mine]

    # Every rank's load, traffic and largest chunk buffers are what build_plan gives that rank.
    params = _params_here(model, mesh, p2, p3, ranks, model_split)

    def unit_of(o):
        unit = list(o.shape)
        unit[-2 if o.split.transpose else -1] = sum(o.split.widths)
        return tuple(unit)

    def chunk_costs(chunk):
        """Owned FLOPs of a chunk; a block of a cut unit: its call's modelled time per unit (the
        runtime runs the cut units of a group with one block shape, short side first, as one call)."""
        calls: dict = {}
        for o in chunk.owned:
            if o.split is not None:
                block = o.shape[:-2] + (o.shape[-1:] + o.shape[-2:-1] if o.split.transpose else o.shape[-2:])
                calls.setdefault((o.split.ranks, o.split.widths, block), []).append(o)
        total = sum(_flops(o.shape) for o in chunk.owned if o.split is None)
        for blocks in calls.values():
            unit = unit_of(blocks[0])
            unit = (*unit[:-2], min(unit[-2:]), max(unit[-2:]))
            total += len(blocks) * model_split.member_cost(unit, len(blocks[0].split.ranks), len(blocks))
        return total

    per_chunk, local = [], []  # [rank][chunk] owned FLOPs, [rank] FLOPs of units held whole
    for rank in range(math.prod(mesh)):
        step = build_plan(params, rank, settings, lambda ranks, mesh, dims: tuple(ranks))
        # the moves' transfers (blocks out, updates back; one link here, FREE's) count in the model's
        # load: 2 x max(bytes out, bytes in) at the link's rate, from the all-to-alls' splits
        out = sum(c.send_numel - c.send_splits[c.member] for c in step.chunks if isinstance(c, MoveChunk))
        into = sum(c.recv_numel - c.recv_splits[c.member] for c in step.chunks if isinstance(c, MoveChunk))
        moving = 2 * max(out, into) * 2 / FREE.bandwidth * FREE.bf16_flops if model_split else 0.0
        assert plan.move_load[rank] == pytest.approx(moving, rel=1e-9, abs=1e-12), rank
        assert plan.load[rank] == pytest.approx(step.load + moving, rel=1e-12), rank
        assert plan.sent[rank] == step.bytes_sent, rank
        assert plan.received[rank] == step.bytes_received, rank
        assert max((c[rank] for c in plan.chunk_buffers), default=0) == step.peak_chunk_bytes, rank
        assert len(plan.chunk_buffers) == len(step.chunks)
        assert plan.peak[rank] == _expected_peak(step), rank
        assert plan.split_sent[rank] == step.split_bytes, rank
        per_chunk.append([chunk_costs(c) for c in step.chunks])
        local.append(sum(_flops(j.shape) for j in step.local) + plan.move_load[rank])  # transfers: in chunk 0
    # Units held whole run while chunk 0's gathers travel: they count in chunk 0.
    chunks = len(per_chunk[0])
    path = sum(max(loads[k] + (local[r] if k == 0 else 0) for r, loads in enumerate(per_chunk))
               for k in range(chunks)) if chunks else max(local)
    assert plan.critical_path == pytest.approx(path, rel=1e-12)


# ----------------------------------------------------------------------------
# Verdicts and arguments
# ----------------------------------------------------------------------------


def test_verdict_names_the_unit_that_rules_out_the_target(bench, models):
    args = SimpleNamespace(ns_steps=5, wire_dtype="bf16", chunk_size=None, lookahead=1, state_bytes=4,
                           compute_bytes=2, replica_flops_per_byte=AUTO)
    model = models["llama3-8b"]
    row = bench.evaluate(model, bench.Layout(1, 512, None), None, args)
    total = sum(_flops(s) for _, s in model.muon_params)
    largest = max(_flops(s) for _, s in model.muon_params)
    assert row["largest_unit_over_ideal"] == pytest.approx(largest / (total / 512))
    text = bench.verdict(row)
    assert text.startswith("misses 1.10x")
    assert f"is {largest / (total / 512):.2f}x the ideal" in text
    assert f"{len(model.muon_params)} units for 512 ranks" in text
    met = dict(row, busiest_over_ideal=1.05, critical_path_over_ideal=1.09)
    assert bench.verdict(met).startswith("meets 1.10x")


@pytest.mark.parametrize("argv,message", [
    (["--ranks", "0"], "--ranks"),
    (["--hsdp", "8by128"], "RxS"),
    (["--hsdp", "1x64"], "at least 2 replicas"),
    (["--models", "gpt-5"], "unknown model"),
    (["--chunk-size", "0"], "--chunk-size"),
    (["--dion2-fractions", "0"], "--dion2-fractions"),
    (["--dion2-fractions", "1.5"], "--dion2-fractions"),
    (["--dion2-ranks", "0"], "--dion2-ranks"),
])
def test_bad_arguments_are_named(bench, argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        bench.main([*argv, "--out", str(tmp_path)])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "scale_model.json").exists()


def test_llama3_8b_at_1024_ranks_reaches_its_whole_or_cut_bound(bench, models):
    """Issue 29: the bound split_bound.py gives for Llama-3-8B at 1,024 FSDP ranks is every
    14336 x 4096 cut over 8 ranks alone (96 units x 8 = 768 ranks) and q/o over 4: the planner
    reaches it (it stopped at 4 for the big ones, 3.81x, where 8 is slower paired but faster alone)."""
    args = SimpleNamespace(ns_steps=5, wire_dtype="bf16", chunk_size=None, lookahead=1, state_bytes=4,
                           compute_bytes=2, replica_flops_per_byte=AUTO)
    auto = bench.evaluate(models["llama3-8b"], bench.Layout(1, 1024, None), None, args, "auto")
    assert auto["busiest_over_ideal"] == pytest.approx(auto["cut_lower_bound_over_ideal"], rel=1e-6)
    assert auto["cut_units"]["8"] == 96


# ----------------------------------------------------------------------------
# Dion2 beside Muon (scale_dion2.py: docs/dion2.md's bytes formula, a prediction)
# ----------------------------------------------------------------------------

LLAMA3_8B_LAYER = [("wq", (4096, 4096)), ("wk", (1024, 4096)), ("wv", (1024, 4096)), ("wo", (4096, 4096)),
                   ("w1", (14336, 4096)), ("w3", (14336, 4096)), ("w2", (4096, 14336))]


def _dion2_layer_bytes(alpha, S, w=WIRE_BYTES):
    """docs/dion2.md's formula, written out for one Llama-3-8B layer on FSDP Shard(0) (rows split
    over S members, R = 1): wide/square matrices choose rows (each row on one member, c = 1), tall
    ones columns (each column on all S members, c = S); k = ceil(alpha s)."""
    chosen = selection = 0.0
    for _, (m, n) in LLAMA3_8B_LAYER:
        s, c = (m, 1) if m <= n else (n, S)
        k = math.ceil(alpha * s)
        chosen += 2 * (k / s) * m * n * w * (S - 1) / S
        selection += 9 * s * c * (S - 1) / S
    return chosen, selection


@pytest.fixture(scope="module")
def dion2():
    return load_benchmark("scale_dion2")


@pytest.mark.parametrize("S", [8, 1024])
def test_dion2_bytes_of_one_llama_layer_are_the_formula(dion2, S):
    d = dion2.price(LLAMA3_8B_LAYER, 0.25, S, 1, WIRE_BYTES, None, _flops)
    chosen, selection = _dion2_layer_bytes(0.25, S)
    assert d["chosen_bytes"] == pytest.approx(chosen, rel=1e-12)
    assert d["selection_bytes"] == pytest.approx(selection, rel=1e-12)
    assert d["replicas_bytes"] == 0 and d["total_bytes"] == pytest.approx(chosen + selection, rel=1e-12)
    muon = dion2.price(LLAMA3_8B_LAYER, None, S, 1, WIRE_BYTES, None, _flops)
    muon_bytes = sum(2 * m * n * WIRE_BYTES * (S - 1) / S for _, (m, n) in LLAMA3_8B_LAYER)
    assert muon["total_bytes"] == pytest.approx(muon_bytes, rel=1e-12) and muon["selection_bytes"] == 0
    # docs/dion2.md's table for this layer: ratio 0.251 on 8 ranks, 0.337 on 1,024
    assert d["total_bytes"] / muon["total_bytes"] == pytest.approx({8: 0.251, 1024: 0.337}[S], abs=5e-4)


def test_dion2_at_fraction_one_is_muons_bytes_plus_the_selection(dion2, models):
    for m in models.values():
        for expert_dim in ([1, 0] if _is_moe(m) else [None]):
            muon = dion2.price(m.muon_params, None, 64, 1, WIRE_BYTES, expert_dim, _flops)
            full = dion2.price(m.muon_params, 1.0, 64, 1, WIRE_BYTES, expert_dim, _flops)
            assert full["chosen_bytes"] == pytest.approx(muon["total_bytes"], rel=1e-12), (m.name, expert_dim)
            assert full["selection_bytes"] > 0 and full["ns_flops"] == pytest.approx(muon["ns_flops"], rel=1e-12)


def test_dion2_replicas_and_experts_held_whole(dion2):
    # k is dion's max(1, ceil(fraction s)) with the float product (0.07 * 100 = 7.000000000000001: k = 8),
    # and the bytes follow k, not the fraction
    d = dion2.matrix_bytes((100, 300), 0.07, 4, 1, WIRE_BYTES, -2)
    assert d["chosen"] == pytest.approx(2 * (8 / 100) * 100 * 300 * WIRE_BYTES * 3 / 4)
    assert dion2.submatrix_shape((300, 100), 0.07) == (300, 8) and dion2.submatrix_shape((100, 300), 0.07) == (8, 300)
    # HSDP R x S with the replica split: the chosen updates reach the other R - 1 replicas, and
    # every replica selects (the selection term times R)
    R, S, (m, n) = 4, 8, (4096, 4096)
    d = dion2.matrix_bytes((m, n), 0.25, S, R, WIRE_BYTES, -2)
    assert d["replicas"] == pytest.approx(0.25 * m * n * WIRE_BYTES * (R - 1))
    assert d["selection"] == pytest.approx(9 * m * 1 * R * (S - 1) / S)
    # experts on Shard(0): every member holds whole experts, nothing travels for either optimizer
    stack = [("experts.w1", (16, 2048, 7168))]
    for fraction in (None, 0.25):
        assert dion2.price(stack, fraction, 8, 1, WIRE_BYTES, 0, _flops)["total_bytes"] == 0
    # on Shard(1) each expert selects on its own: E times one expert's bytes
    one = dion2.matrix_bytes((2048, 7168), 0.25, 8, 1, WIRE_BYTES, -2)
    many = dion2.matrix_bytes((16, 2048, 7168), 0.25, 8, 1, WIRE_BYTES, -2)
    assert many["total"] == pytest.approx(16 * one["total"])


def test_dion2_flops_are_the_k_slice_submatrix(dion2, models):
    m = models["deepseek-v3"]
    expected = 0.0
    for _, shape in m.muon_params:
        *batch, rows, cols = shape
        sub = (math.ceil(0.25 * rows), cols) if rows <= cols else (rows, math.ceil(0.25 * cols))
        expected += _flops(sub) * math.prod(batch)
    d = dion2.price(m.muon_params, 0.25, 1024, 1, WIRE_BYTES, 1, _flops)
    assert d["ns_flops"] == pytest.approx(expected, rel=1e-12)
    assert d["per_rank_flops_lower_bound"] >= d["ns_flops"] / 1024


def test_dion2_section_prices_every_model_at_512_and_1024_ranks(run, models):
    _, data = run
    rows = data["dion2"]
    keys = {(r["model"], r["ranks"], r["fraction"]) for r in rows}
    assert keys == {(m, n, f) for m in models for n in DION2_RANKS for f in (None, *DION2_FRACTIONS)}
    for r in rows:
        if r["fraction"] is None:
            continue
        # below Muon's bytes, and at most the formula's slack above the chosen fraction
        assert r["fraction"] < r["bytes_over_muon"] < 1 and r["flops_over_muon"] < r["fraction"]
