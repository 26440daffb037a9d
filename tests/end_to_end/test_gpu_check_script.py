"""scripts/gpu_check.sh runs its checks on CPU/gloo too (``--device cpu``): CI runs that form,
so the script's code is exercised where no GPU exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from repo import REPO

ROOT = str(REPO)


@pytest.mark.torchrun
def test_gpu_check_script_passes_on_cpu(tmp_path):
    out = tmp_path / "gpu_check"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--device", "cpu", "--quick",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, log
    summary = (out / "summary.txt").read_text()
    for check in ("config_fsdp_tp_fp32", "config_fsdp_tp_bf16", "step_checks", "step_time", "ns_efficiency"):
        assert f"{check}: ok" in summary, summary
    # both config cases ran in one launch (examples/train_cases.py), each to its own exit status 0
    results = json.loads((out / "config_cases_ws4_results.json").read_text())
    assert results == {"config_fsdp_tp_fp32": 0, "config_fsdp_tp_bf16": 0}, results
    # every rank's step check reported, and passed: equal to single-device, one host read, a trace
    lines = [json.loads(line) for line in (out / "step_checks.log").read_text().splitlines() if line.startswith("{")]
    assert len(lines) == 4 and all(r["ok"] for r in lines), lines
    assert all(r["syncs"]["host_reads"] == ["tolist"] for r in lines)
    assert all(os.path.exists(r["overlap"]["trace"]) for r in lines)


def test_outcomes_name_every_case_and_why_it_failed():
    """What gpu_check.sh prints per config case from a shared launch's results (the launch's exit
    statuses so far): a failed check, a case the launch died in and one it never reached."""
    from examples.train_cases import outcomes

    cases = {"config_a_fp32": [], "config_a_bf16": [], "config_b_fp32": [], "config_b_bf16": []}
    assert outcomes(cases, {"config_a_fp32": 0, "config_a_bf16": 1}) == [
        "config_a_fp32 ok",
        "config_a_bf16 FAILED (exit status 1)",
        "config_b_fp32 FAILED (not finished: the launch stopped in it or before it)",
        "config_b_bf16 FAILED (not finished: the launch stopped in it or before it)",
    ]
    assert outcomes(cases, dict.fromkeys(cases, 0)) == [f"{name} ok" for name in cases]
