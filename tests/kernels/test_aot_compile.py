"""Every Triton kernel compiled ahead of time for the GPUs the kernels run on, with the installed
Triton (aot_compile.py says how): sm80 (A100), sm90 (H100/H200) and sm100 (B200) get every
specialisation the launchers produce; sm86, sm89 and sm120 (the 99 KiB RTX parts) the products'
largest layouts. A compile error, shared memory past the target's, a launch without
``enable_fp_fusion=False`` (or an epilogue contracted into FMAs) or a tf32 instruction in an fp32
product fails it; the controls below show each check failing on a break.

Runs in the main suite (Triton 3.9, every target) and in the compatibility runs of ``.ci/run``
(sm80, sm90 and the controls: torch 2.10's CUDA wheel brings Triton 3.6, the GPU machines' release,
and those machines are A100s and H100/H200s). The compiles run in a process of their own without
``TRITON_INTERPRET`` (tests/conftest.py sets it for every other test, and Triton decides when a
kernel is defined). Compiled binaries go to Triton's cache (``~/.triton/cache`` unless
``TRITON_CACHE_DIR`` says otherwise), so a second run only looks them up. Its key holds the
kernel's source and the jit functions it calls, the constexprs, signature, alignment hints and
options, and the Triton build, so a changed kernel or tile is compiled afresh, never answered from
the cache; docs/kernels.md has the counts and times, cold and warm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optimizer.kernels.self_check import candidates
from optimizer.kernels.tiles import SHARED_MEMORY

AOT = Path(__file__).with_name("aot_compile.py")
FULL_TARGETS = (80, 90, 100)
EXTRA_TARGETS = (86, 89, 120)
PRODUCTS = {"_symmetric_matmul_kernel", "_matmul_add_kernel"}
ELEMENTWISE = {"_momentum_nesterov_kernel", "_apply_update_kernel"}
# A cold compile of one full target costs ~160 s of CPU (2026-11-28); a loaded 2-core machine
# stretches that several times over.
TIMEOUT_S = 1800


def run_aot(tmp_path, *args) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jobs = "1" if os.environ.get("PYTEST_XDIST_WORKER") else str(min(2, os.cpu_count() or 1))
    out = tmp_path / "aot.json"
    # --no-resources: registers and spills are reported by the script, not checked here
    command = [sys.executable, str(AOT), "--jobs", jobs, "--no-resources", "--json", str(out), *args]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.exists(), (f"aot_compile.py wrote no results (exit {proc.returncode}):\n"
                          f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc, json.loads(out.read_text())


def _dtype_name(dtype):
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


def _tiles_name(t):
    return f"{t.block_m}x{t.block_n}x{t.block_k}/{t.num_warps}w/{t.num_stages}s"


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("capability,scope",
                         [(c, "full") for c in FULL_TARGETS] + [(c, "products") for c in EXTRA_TARGETS])
def test_every_kernel_compiles_within_the_targets_limits(tmp_path, capability, scope):
    proc, results = run_aot(tmp_path, "--scope", scope, str(capability))
    bad = [f"{r['name']}: {'; '.join(r['problems'])}" for r in results if r["problems"]]
    assert not bad, f"sm{capability}: {len(bad)} of {len(results)} specialisations:\n" + "\n".join(bad[:20])
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    # what was compiled is what the rule can pick: every kernel, and each dtype in each of its tiles
    assert {r["kernel"] for r in results} == (PRODUCTS | ELEMENTWISE if scope == "full" else PRODUCTS)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for tiles in candidates(dtype, divmod(capability, 10)):
            tag = f" {_dtype_name(dtype)} {_tiles_name(tiles)} "
            assert {r["kernel"] for r in results if tag in r["name"]} == PRODUCTS, tag
    limit = SHARED_MEMORY[divmod(capability, 10)]
    assert 0 < max(r["shared"] for r in results) <= limit
    if scope == "full":  # the elementwise kernels' 64-bit specialisation: 2^31 entries and more
        huge = [r for r in results if "2^31 entries" in r["name"]]
        assert {r["kernel"] for r in huge} == ELEMENTWISE
        # flat: N (the entries) is int64; strided: the batch strides are
        assert all(("N" if "flat" in r["name"] else "stride_bb" if "momentum" in r["name"] else "stride_pb")
                   in r["int64_args"] for r in huge), [(r["name"], r["int64_args"]) for r in huge][:3]
        assert not any(r["int64_args"] for r in results if "2^31" not in r["name"])


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("control,expected", [
    ("tile 256x256x128", "B of shared memory; a block gets 166,912 B on sm80"),
    ("BLOCK 48", "does not compile"),
    ("fp32 on tf32", "an fp32 product compiled to tf32 instructions"),
    ("fp fusion on", "launched without enable_fp_fusion=False"),
])
def test_the_checks_catch_a_break(tmp_path, control, expected):
    """Each break (aot_compile.CONTROLS: a launcher given it, on sm80) fails every specialisation
    it touches, for the reason expected."""
    proc, results = run_aot(tmp_path, "--scope", control, "80")
    assert proc.returncode == 1 and results
    assert all(any(expected in p for p in r["problems"]) for r in results), [r["problems"] for r in results]
    if control == "fp fusion on":  # and in the compiled code: the epilogues with C contract into FMAs
        assert any("epilogue contracted into FMAs" in p for r in results for p in r["problems"])
