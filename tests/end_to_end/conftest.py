from __future__ import annotations

import pytest
from first_run_script import run


@pytest.fixture(scope="session")
def gpu_first_run_dry_run(tmp_path_factory):
    """``scripts/gpu_first_run.sh --device cpu FOLDER``, run once for the tests that read it:
    test_gpu_first_run.py (the folder) and test_gpu_check_script.py (its gpu_check part, which is
    ``gpu_check.sh --device cpu --quick``). Those tests share the xdist group ``gpu_first_run``, so
    under ``-n 2 --dist loadgroup`` (.ci/run) one worker runs them and launches it once.
    Returns the finished process and the folder."""
    folder = tmp_path_factory.mktemp("gpu_first_run") / "first_run"
    return run(["--device", "cpu", str(folder)]), folder
