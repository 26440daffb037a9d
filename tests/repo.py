"""Where things are in the repository, for tests in any folder under tests/."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
BENCHMARKS = REPO / "benchmarks"
