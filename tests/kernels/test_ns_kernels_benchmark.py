"""benchmarks/ns_kernels.py end to end on a tiny shape under the interpreter: every product and
tile is reported, the kernels' results equal cuBLAS's (here torch's CPU matmul) within bf16
rounding, and the files parse. The timings are not checked (they are measurements)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from repo import BENCHMARKS

pytest.importorskip("triton")


def test_tiny_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_ns_kernels", BENCHMARKS / "ns_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
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
