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
    # every rank's step check reported, and passed: equal to single-device, one host read, a trace
    lines = [json.loads(line) for line in (out / "step_checks.log").read_text().splitlines() if line.startswith("{")]
    assert len(lines) == 4 and all(r["ok"] for r in lines), lines
    assert all(r["syncs"]["host_reads"] == ["tolist"] for r in lines)
    assert all(os.path.exists(r["overlap"]["trace"]) for r in lines)
