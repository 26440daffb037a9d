"""Smoke tests for benchmarks/: each runs end to end on tiny sizes and writes files that parse.

The benchmarks' numbers are not checked (they are measurements); what is
checked is what they must get right whatever the machine: every variant ran
or reported its error, bytes moved match the sharding arithmetic, the
stand-in Newton–Schulz used for torch.optim.Muon is torch's own line for line,
and the symmetric prototype computes the same thing as the package.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from harness import run_ranks
from repo import BENCHMARKS, load_benchmark

_BENCH = BENCHMARKS


TINY = ["--dim", "32", "--ffn-dim", "64", "--layers", "1", "--head-dim", "8", "--warmup", "1", "--steps", "2"]


def _step_time_rank(rank, world_size, argv):
    step_time = load_benchmark("step_time")
    result = step_time.run(step_time.parse_args(argv), rank, world_size, torch.device("cpu"))
    return None if result is None else json.dumps(result)


def _numel(specs) -> int:
    return sum(s.shape[0] * s.shape[1] for s in specs)


def test_step_time_fsdp_two_ranks(tmp_path):
    step_time = load_benchmark("step_time")
    run_ranks(_step_time_rank, 2, [*TINY, "--out", str(tmp_path), "--tag", "smoke"], timeout=60)
    result = json.loads((tmp_path / "step_time_smoke.json").read_text())
    md = (tmp_path / "step_time_smoke.md").read_text()

    from optimizer.newton_schulz.forms import choose_ns_method

    # a 1-D FSDP mesh has no replicas; at these sizes auto picks the classic form for every matrix,
    # so the classic-only variant would be parallel Muon again and is left out; and nothing is cut
    # over ranks (ns_split="auto"), so neither is "whole"
    assert {choose_ns_method(s, 5, "auto", torch.float32) for s in [(32, 32), (32, 64), (64, 32)]} == {"classic"}
    no_replicas = [v for v in step_time.VARIANTS if v not in ("repeat", "classic", "whole")]
    assert result["variants"] == no_replicas
    # torchtitan's DistMuon runs on CUDA only: on this CPU its row says why it did not run
    assert "CUDA" in result["results"]["titan"]["error"] or "not installed" in result["results"]["titan"]["error"]
    for v in (v for v in no_replicas if v != "titan"):
        row = result["results"][v]
        assert "error" not in row, row  # the others run on Shard(0) DTensors in torch 2.13
        # equal to the same optimizer on one device (fp32 on CPU; torch.optim.Muon's own order of ops)
        assert row["max_deviation"] <= (1e-5 if v == "torch" else 0.0), (v, row["max_deviation"])
        assert row["time"]["n"] == 2 and 0 < row["time"]["min_s"] <= row["time"]["median_s"] <= row["time"]["max_s"]
        assert step_time.VARIANT_LABELS[v] in md
    assert result["results"]["parallel"]["ratio_to_parallel"] == pytest.approx(1.0)

    # Bytes per rank, from the sharding alone: with 2 ranks and even Shard(0) halves, parallel Muon
    # sends each matrix's off-owner half once (to the owner, or back from it), and the gather baseline
    # receives the other half of every matrix.
    kv = 32 // 8
    total = _numel(step_time.transformer_matrices(32, 1, 64, 8, kv))
    assert result["sizes"]["params"] == total
    for st in result["results"]["parallel"]["stages_per_rank"]:
        assert st["bytes_sent"] == st["bytes_received"] == total // 2 * 4
        assert set(st["seconds"]) == {*step_time.STAGES, "other"}
        assert st["seconds"]["orthogonalize"] > 0 and st["seconds"]["qk_clip"] > 0
    for st in result["results"]["gather"]["stages_per_rank"]:
        assert st["bytes_received"] == total // 2 * 4
    # NorMuon and cautious weight decay: the same collectives as Muon; NorMuon's v rides in them
    for a, b, c in zip(*(result["results"][v]["stages_per_rank"] for v in ("parallel", "normuon", "cautious"))):
        assert a["all_to_alls"] == b["all_to_alls"] == c["all_to_alls"] and a["all_gathers"] == b["all_gathers"]
        assert a["bytes_sent"] == c["bytes_sent"] < b["bytes_sent"]
    assert "parallel NorMuon (beta2 0.95) vs parallel Muon" in md and "collectives per step the same" in md
    # Dion2 in the same launch, on the same parameters: its ratio to parallel Muon is printed
    dion2 = result["results"]["dion2"]
    assert dion2["time"]["n"] == 2 and dion2["ratio_to_parallel"] > 0
    assert f"Dion2 (fraction 0.25) vs parallel Muon: **{dion2['ratio_to_parallel']:.3f}x**" in md


def test_step_time_one_matrix_split_over_two_ranks(tmp_path):
    """--shapes: one 512 x 512 matrix on two ranks, fewer matrices than ranks: "auto" cuts it
    over both (this CPU's gloo figures), and the "whole" variant (ns_split="never") is timed beside
    it; both equal single-device Muon."""
    argv = ["--shapes", "512x512", "--warmup", "1", "--steps", "1", "--variants", "parallel,whole",
            "--out", str(tmp_path), "--tag", "split"]
    run_ranks(_step_time_rank, 2, argv, timeout=120)
    result = json.loads((tmp_path / "step_time_split.json").read_text())
    assert result["variants"] == ["parallel", "whole"] and result["sizes"]["matrices"] == 1
    split, whole = result["results"]["parallel"], result["results"]["whole"]
    assert [st["split_units"] for st in split["stages_per_rank"]] == [1, 1]
    assert [st["split_units"] for st in whole["stages_per_rank"]] == [0, 0]
    assert all(st["split_bytes"] > 0 for st in split["stages_per_rank"])
    assert split["max_deviation"] <= 1e-5 and whole["max_deviation"] == 0.0
    md = (tmp_path / "step_time_split.md").read_text()
    assert "vs every matrix whole on one rank" in md and "the busiest rank's Newton–Schulz" in md


def test_step_time_2d_mesh_from_config(tmp_path):
    config = tmp_path / "mesh.toml"
    config.write_text("[mesh]\ndp_shard = 2\ntp = 2\n\n[model]\ndim = 999\n")  # only [mesh] is read
    argv = [*TINY, "--config", str(config), "--variants", "parallel,gather", "--out", str(tmp_path)]
    run_ranks(_step_time_rank, 4, argv, timeout=60)
    result = json.loads((tmp_path / "step_time_ws4_2x2_fsdp_tp.json").read_text())
    assert result["mesh"] == {"names": ["dp_shard", "tp"], "shape": [2, 2], "layout": "fsdp_tp"}
    assert len(result["results"]["parallel"]["stages_per_rank"]) == 4
    assert result["results"]["gather"]["ratio_to_parallel"] > 0


def test_step_time_hsdp_split_against_repeating_replicas(tmp_path):
    argv = [*TINY, "--mesh", "2,2", "--layout", "hsdp", "--variants", "parallel,repeat", "--out", str(tmp_path)]
    run_ranks(_step_time_rank, 4, argv, timeout=90)
    result = json.loads((tmp_path / "step_time_ws4_2x2_hsdp.json").read_text())
    assert result["mesh"] == {"names": ["dp_replicate", "dp_shard"], "shape": [2, 2], "layout": "hsdp"}
    split, repeat = result["results"]["parallel"], result["results"]["repeat"]
    assert all(st["all_gathers"] > 0 for st in split["stages_per_rank"])  # updates cross replicas
    assert all(st["all_gathers"] == 0 for st in repeat["stages_per_rank"])
    # Over the world, bytes sent equal bytes received (each path moves what it moves once).
    for row in (split, repeat):
        assert sum(st["bytes_sent"] for st in row["stages_per_rank"]) == sum(
            st["bytes_received"] for st in row["stages_per_rank"])
    assert "Split over replicas vs replicas repeating the work" in (tmp_path / "step_time_ws4_2x2_hsdp.md").read_text()


def test_host_overhead_runs_on_a_fake_world(tmp_path):
    import subprocess

    script = _BENCH / "host_overhead.py"
    subprocess.run([sys.executable, str(script), "--worlds", "8", "64", "--params", "20", "--steps", "1",
                    "--out", str(tmp_path)], check=True, timeout=120, capture_output=True)
    rows = json.loads((tmp_path / "host_overhead.json").read_text())
    assert {(r["layout"], r["world"]) for r in rows} == {(lay, w) for lay in ("fsdp", "fsdp_tp") for w in (8, 64)}
    assert all(r["ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert "target <= 1.5x" in (tmp_path / "host_overhead.md").read_text()


def test_peak_memory_stays_within_the_plans_bound(tmp_path):
    import subprocess

    script = _BENCH / "peak_memory.py"
    done = subprocess.run([sys.executable, str(script), "--ranks", "2", "--experts", "4", "--deviation-steps", "3",
                           "--out", str(tmp_path)],
                          # a hang guard, not a check: 73 s on a loaded 2-core machine, and past 120 s
                          # when it started beside the other slowest tests (tests/conftest.py)
                          timeout=300, capture_output=True, text=True)
    rows = json.loads((tmp_path / "peak_memory.json").read_text())
    assert len(rows) == 2 and all(0 < r["peak"] <= r["bound"] for r in rows), rows
    assert done.returncode == 0, done.stdout + done.stderr


def test_placements_follow_fully_shard_over_tp():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    step_time = load_benchmark("step_time")
    names, shape = ("dp_shard", "tp"), (2, 4)
    assert step_time.placements_for("col", names, shape, "fsdp_tp") == (_StridedShard(0, split_factor=4), Shard(0))
    assert step_time.placements_for("row", names, shape, "fsdp_tp") == (Shard(0), Shard(1))
    assert step_time.placements_for("col", names, shape, "s0s1") == (Shard(0), Shard(1))
    assert step_time.placements_for("row", ("dp_replicate", "dp_shard"), (2, 2), "fsdp_tp") == (Replicate(), Shard(0))


def test_bad_mesh_config_names_the_key(tmp_path):
    step_time = load_benchmark("step_time")
    config = tmp_path / "bad.toml"
    config.write_text("[mesh]\ndp_shrad = 2\n")
    with pytest.raises(ValueError, match="dp_shrad"):
        step_time.mesh_from_config(str(config))


def test_torch_muon_stand_in_is_torchs_own_in_bf16():
    """The fp32 stand-in differs from torch.optim.Muon's Newton–Schulz only in the cast."""
    import torch.optim._muon as torch_muon

    from optimizer.testing import torch_muon_zeropower

    coeffs = (3.4445, -4.7750, 2.0315)
    for shape in ((24, 40), (40, 24)):
        G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        expected = torch_muon._zeropower_via_newtonschulz(G, coeffs, 5, 1e-7)
        got = torch_muon_zeropower(torch.bfloat16)(G, coeffs, 5, 1e-7)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        before = G.clone()
        torch_muon_zeropower(torch.float32)(G, coeffs, 5, 1e-7)
        torch.testing.assert_close(G, before, rtol=0, atol=0)  # the input (momentum buffer) is untouched


def test_ns_efficiency_runs_and_symmetric_prototype_matches(tmp_path):
    from optimizer.newton_schulz.forms import choose_ns_method, newton_schulz_flops

    ns = load_benchmark("ns_efficiency")
    result = ns.main(["--shapes", "48x32,2x16x24,48x512", "--repeats", "1", "--sym-min-block", "4",
                      "--out", str(tmp_path), "--tag", "smoke"])
    saved = json.loads((tmp_path / "ns_efficiency_smoke.json").read_text())
    assert saved == json.loads(json.dumps(result))
    md = (tmp_path / "ns_efficiency_smoke.md").read_text()
    assert "| 48x32 |" in md and "| 48x512 |" in md
    for row in saved["shapes"]:
        assert row["efficiency"] > 0 and row["gflop"] > 0
        assert row["symmetric_max_abs_diff"] < 1e-4
        shape = tuple(row["shape"])
        assert row["chosen"] == choose_ns_method(shape, 5, "auto", torch.float32)
        assert set(row["median_s"]) == {"classic", "gram", "auto", "mm", "symmetric"}
        assert row["gflop_of"]["gram"] == pytest.approx(newton_schulz_flops(shape, 5, "gram") / 1e9)
        assert row["speedup"]["classic"] == pytest.approx(1.0)
        assert row["gram_rel_diff"] < 1e-4  # the two forms compute the same polynomial
    assert [r["chosen"] for r in saved["shapes"]] == ["classic", "classic", "gram"]
    # a line per target; shapes not run are reported as such, never as met
    assert len(saved["targets"]) == len(ns.SPEEDUP_TARGETS) + 1
    assert [v["status"] for v in saved["targets"][:-1]] == ["not measured"] * len(ns.SPEEDUP_TARGETS)
    assert saved["targets"][-1]["status"] in ("met", "not met")
    assert "## Targets" in md and "not measured" in md


def test_ns_efficiency_judges_targets_from_minima():
    ns = load_benchmark("ns_efficiency")

    def row(shape, auto):
        return dict(shape=list(shape), speedup_of_minima={"auto": auto}, speedup={"auto": auto})

    verdicts = ns.judge_targets([row((1024, 4096), 1.4), row((8, 512, 2048), 1.3), row((512, 4096), 1.9),
                                 row((1024, 1024), 0.96)])
    assert [v["status"] for v in verdicts] == ["met", "not met", "met", "met"]
    verdicts = ns.judge_targets([row((1024, 4096), 1.4), row((64, 64), 0.94)])
    assert [v["status"] for v in verdicts] == ["met", "not measured", "not measured", "not met"]
    assert "64x64" in verdicts[-1]["measured"]


def test_symmetric_gram_is_x_xt():
    ns = load_benchmark("ns_efficiency")
    g = torch.Generator().manual_seed(0)
    for shape in ((37, 20), (3, 64, 9)):  # odd split sizes, several recursion levels, a batch
        X = torch.randn(shape, generator=g, dtype=torch.float64)
        torch.testing.assert_close(ns.symmetric_gram(X, min_block=4), X @ X.mT)


def test_ns_restart_study_runs_and_judges_the_band(tmp_path):
    """--restart-study on tiny matrices: every (dtype, table, steps, input) row, the package's plans,
    and the verdicts that hold at any size: bf16's plan is the classic iteration (the same errors),
    fp32 stays far inside the band, no restart is outside it in 16 bits."""
    from optimizer.newton_schulz.restarts import gram_restart_plan

    ns = load_benchmark("ns_efficiency")
    result = ns.main(["--restart-study", "--study-shape", "8x24", "--study-seeds", "1", "--out", str(tmp_path),
                      "--tag", "smoke"])
    saved = json.loads((tmp_path / "ns_restarts_smoke.json").read_text())
    assert len(saved["rows"]) == len(result["rows"]) == 2 * 2 * 3 * len(ns.STUDY_INPUTS)
    md = (tmp_path / "ns_restarts_smoke.md").read_text()
    assert "## Worst error / band" in md and "## Errors per input" in md
    for r in saved["rows"]:
        dtype = getattr(torch, r["dtype"])
        assert tuple(r["plans"]["package plan"]) == gram_restart_plan(r["table"], r["ns_steps"], dtype)
        assert r["band"] == max(r["band_of"].values()) > 0
        err = r["max_sv_error"]
        if r["dtype"] == "bfloat16":
            assert err["package plan"] == err["classic"]
        if r["dtype"] == "float32":
            assert err["package plan"] < r["band"] / 4 and r["in_band"]["package plan"]
    for s in saved["summary"]:
        if s["dtype"] != "float32":
            assert not s["in_band"]["no restart"]


def test_gpu_step_runs_on_cpu_tiny(tmp_path):
    """benchmarks/gpu_step.py --device cpu --tiny end to end: every contender of ours ran (the torch
    path here: the Triton kernels' interpreter runs take minutes, and tests/kernels and
    tests/parallel/test_ns_kernels.py check them), torch.optim.Muon beside it where it takes the
    model's shapes, floors from the launch's own matmul rate, the JSON is what it returned."""
    gpu_step = load_benchmark("gpu_step")
    out = tmp_path / "gpu_step.json"
    result = gpu_step.main(["--device", "cpu", "--tiny", "--warmup", "1", "--repeats", "1",
                            "--ns-kernels", "torch", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["matmul_flops"] > 0 and result["hardware"]
    assert [r["shape"] for r in result["ns"]] == ["x".join(map(str, s)) for s in gpu_step.NS_SHAPES_TINY]
    for row in result["ns"]:
        assert row["floor_ms"] > 0
        ours = {k for k in row["ms"] if k.startswith("ours ")}
        assert ours == {f"ours torch/{f}" for f in ("auto", "classic", "gram")}
        # torch's iteration takes matrices only, in bf16 only (CPU runs fp32: absent here)
        assert ("torch.optim.Muon" in row["ms"]) == (row["shape"].count("x") == 1 and result["compute_dtype"] == "torch.bfloat16")
        assert all(ms > 0 for ms in row["ms"].values())
    assert [r["model"] for r in result["steps"]] == list(gpu_step.MODELS_TINY)
    for row in result["steps"]:
        names = set(row["runs"])
        assert {f"ours {v} [torch]" for v in ("Muon", "NorMuon", "Muon bf16 momentum")} <= names
        assert ("torch.optim.Muon" in names) == ("experts" not in row["model"])
        for name, run in row["runs"].items():
            assert "error" not in run, (row["model"], name, run)
            assert run["ms"] > 0 and run["state_gib"] > 0 and run["host_syncs"] is None  # counted on CUDA only


def test_gpu_step_reports_the_kernels_first_use_check():
    """gpu_step.py's header reports the kernels' first-use check on the GPU it ran on, per kind and
    dtype (where it failed, "auto" rows ran torch). Here on CPU under the interpreter (no check
    runs there; the kernels are available): every entry reads "passed"; without the interpreter
    every entry gives the reason."""
    pytest.importorskip("triton")
    gpu_step = load_benchmark("gpu_step")
    report = gpu_step.kernels_check(torch.device("cpu"))
    assert report == {"products bfloat16": "passed", "products float16": "passed", "products float32": "passed",
                      "elementwise": "passed"}
    assert all(reason != "passed" for reason in gpu_step.kernels_check(torch.device("meta")).values())
