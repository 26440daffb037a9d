"""scripts/gpu_first_run.sh, the one command for a lent GPU, as a dry run on CPU (``--device cpu``:
gloo ranks, the interpreter, small sizes), so CI runs the script's code where no GPU exists: its
folder holds the environment, every part's log and tables and a summary, and it fails when a part
does."""

from __future__ import annotations

import json
import subprocess

import pytest
from first_run_script import DRY_RUN_TIMEOUT_S, run
from repo import REPO


@pytest.mark.torchrun
@pytest.mark.xdist_group("gpu_first_run")
@pytest.mark.timeout(DRY_RUN_TIMEOUT_S + 100)
def test_dry_run_on_cpu_writes_every_table_and_the_environment(gpu_first_run_dry_run):
    """The dry run (conftest.py's fixture: one launch, shared with test_gpu_check_script.py)."""
    proc, folder = gpu_first_run_dry_run
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, log
    summary = (folder / "summary.txt").read_text()
    for part in ("gpu_check", "gpu_step", "ns_kernels"):
        assert f"{part}: ok" in summary, summary
    assert "every part passed on cpu" in summary
    environment = (folder / "environment.txt").read_text()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    for line in (f"commit: {commit}", "torch: ", "triton: ", "python: ", "nvidia-smi", "dion: "):
        assert line in environment, environment
    # the parts' own results: gpu_check's summary, gpu_step's tables and JSON, ns_kernels' tables
    assert "gpu_check: all checks passed on cpu" in (folder / "gpu_check.log").read_text()
    assert "step_checks: ok" in (folder / "gpu_check" / "summary.txt").read_text()
    step = json.loads((folder / "gpu_step.json").read_text())
    assert step["ns"] and step["steps"]
    assert "## Newton–Schulz" in (folder / "gpu_step.log").read_text()
    assert (folder / "ns_kernels_cpu.md").exists() and (folder / "ns_kernels_cpu.json").exists()


def test_a_failed_part_fails_the_run_and_the_folder_defaults_to_OUT(tmp_path):
    """A part that fails, or runs out of its time, is named and makes the exit status non-zero
    (here each part is given a second); with no folder given, the device tool's $OUT holds it all."""
    proc = run(["--device", "cpu"], {"OUT": str(tmp_path), "GPU_CHECK_LIMIT_S": "1", "GPU_STEP_LIMIT_S": "1",
                                     "NS_KERNELS_LIMIT_S": "1"}, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "gpu_check: FAILED (out of time after 1 s)" in summary, summary
    assert "gpu_first_run: FAILED: gpu_check gpu_step ns_kernels" in summary
    assert (tmp_path / "environment.txt").exists() and (tmp_path / "gpu_check.log").exists()


def test_gpu_step_strict_names_the_kernels_that_failed_their_first_use_check():
    """What --strict (the first run's correctness gate) reads from gpu_step's hardware record."""
    from repo import load_benchmark

    gpu_step = load_benchmark("gpu_step")
    passed = {"products bfloat16": "passed", "elementwise": "passed"}
    assert gpu_step.kernel_check_failures({"device": "cpu"}) == {}
    assert gpu_step.kernel_check_failures({"kernels_check": passed}) == {}
    failed = {**passed, "products float16": "syrk (tiles 64x64x64, k=71): 3 of 90 entries outside the rounding bound"}
    assert gpu_step.kernel_check_failures({"kernels_check": failed}) == {"products float16": failed["products float16"]}
    assert gpu_step.kernel_check_failures({"kernels_check": "no optimizer.kernels in this build"}) == {
        "check": "no optimizer.kernels in this build"}
