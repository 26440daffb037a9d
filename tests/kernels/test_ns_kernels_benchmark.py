"""benchmarks/ns_kernels.py end to end on a tiny shape under the interpreter: every product and
tile is reported, the kernels' results equal cuBLAS's (here torch's CPU matmul) within bf16
rounding, the elementwise stages are reported, and the files parse. The timings are not checked (they are measurements)."""

from __future__ import annotations

import json

import pytest

from repo import load_benchmark

pytest.importorskip("triton")


def test_tiny_run(tmp_path):
    bench = load_benchmark("ns_kernels")
    result = bench.main(["--device", "cpu", "--tiny", "--shapes", "37x53", "--out", str(tmp_path), "--tag", "smoke"])
    assert json.loads((tmp_path / "ns_kernels_smoke.json").read_text()) == json.loads(json.dumps(result))
    (row,) = result["rows"]
    assert set(row["products"]) == {"X X^T", "bA + cAA", "aX + BX"}
    for entry in row["products"].values():
        (tile,) = entry["tiles"].values()
        # each side rounds an fp32 sum of the same products once to bf16: at most one bf16 ulp
        # apart, and an ulp is at most 2^-7 of the entry, so of the largest entry
        assert 0 <= tile["max_rel_diff"] <= 2**-7
        assert tile["ms"] > 0 and entry["cublas_ms"] > 0
    assert all(row[key] > 0 for key in ("ns_torch_ms", "ns_kernels_auto_ms", "ns_kernels_triton_ms", "floor_ms"))
    assert "| 37x53 | X X^T |" in (tmp_path / "ns_kernels_smoke.md").read_text()
    # the elementwise stages: torch's and the fused kernels', each timed, bytes by the model
    stages = row["elementwise"]
    assert set(stages) == {"momentum", "nesterov input", "momentum + nesterov input", "decay + update",
                           "cautious decay + update"}
    for e in stages.values():
        assert e["torch"]["ms"] > 0 and e["fused"]["ms"] > 0 and e["ratio"] > 0
        assert e["fused"]["bytes"] <= e["torch"]["bytes"] and e["fused"]["bytes"] % (37 * 53) == 0
    assert "| 37x53 | decay + update | 18," in (tmp_path / "ns_kernels_smoke.md").read_text()
    assert "| 37x53 | momentum + nesterov input | 22," in (tmp_path / "ns_kernels_smoke.md").read_text()
    assert stages["momentum + nesterov input"]["fused"]["bytes"] == 14 * 37 * 53
