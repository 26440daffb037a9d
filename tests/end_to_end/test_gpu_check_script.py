"""scripts/gpu_check.sh runs its checks on CPU/gloo too (``--device cpu``): CI runs that form,
so the script's code is exercised where no GPU exists. The run checked is the one
scripts/gpu_first_run.sh --device cpu makes (its first part, ``gpu_check.sh --device cpu --quick``):
one launch of the dry run (conftest.py's fixture) serves this file and test_gpu_first_run.py."""

from __future__ import annotations

import json
import os

import pytest
from first_run_script import DRY_RUN_TIMEOUT_S


@pytest.mark.torchrun
@pytest.mark.xdist_group("gpu_first_run")
@pytest.mark.timeout(DRY_RUN_TIMEOUT_S + 100)
def test_gpu_check_script_passes_on_cpu(gpu_first_run_dry_run):
    _, folder = gpu_first_run_dry_run
    out = folder / "gpu_check"
    # the part's exit status 0 (gpu_first_run.sh's summary), its output on failure
    assert "gpu_check: ok" in (folder / "summary.txt").read_text(), (folder / "gpu_check.log").read_text()[-6000:]
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
