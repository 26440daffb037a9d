"""Running scripts/gpu_first_run.sh from a test: stopped with everything it started if it overruns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from repo import REPO

SCRIPT = str(REPO / "scripts" / "gpu_first_run.sh")
# gpu_check.sh's quick checks, then the benchmarks: ~5 min on 2 idle cores, more loaded
DRY_RUN_TIMEOUT_S = 2300


def run(args, env_extra=None, timeout=DRY_RUN_TIMEOUT_S):
    """The script's exit status and output; stopped (SIGTERM: it stops its running part) if it
    overruns ``timeout`` or the test is stopped, so that nothing it started is left running."""
    # as on a GPU machine: no TRITON_INTERPRET (tests/conftest.py sets it for the suite; under it
    # gpu_step.py would also time our kernels in the interpreter, minutes on CPU)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    env.update(PYTHON=sys.executable, **(env_extra or {}))
    proc = subprocess.Popen(["bash", SCRIPT, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
