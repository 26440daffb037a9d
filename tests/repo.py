"""Where things are in the repository, for tests in any folder under tests/."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
BENCHMARKS = REPO / "benchmarks"


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` (a script directory, not a package), once per process."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[key]
