"""The house rules of torch-ext/optimizer, read from the source (scripts/house.py): docs/architecture.md's
module map names every module and only modules; no import cycles, function-level imports included;
no module over 500 lines, no function over 60, no class over 250."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import house  # noqa: E402

ARCHITECTURE = ROOT / "docs" / "architecture.md"


def committed_map() -> str:
    text = ARCHITECTURE.read_text()
    match = re.search(r"<!-- module-map -->\n(.*?)<!-- /module-map -->", text, re.S)
    assert match, "docs/architecture.md has no <!-- module-map --> block"
    return match.group(1)


def test_the_map_names_every_module_and_only_modules():
    assert house.map_problems(committed_map()) == []
    named = house.mapped_paths(committed_map())
    files = [p for p in house.PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    assert len(named) == len(set(named)) == len(files)


def test_a_stale_or_missing_entry_fails_the_map(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for rel, doc in {"__init__.py": "The package.", "a.py": "Module a.", "sub/__init__.py": "Sub.",
                     "sub/b.py": "Module b."}.items():
        (package / rel).write_text(f'"""{doc}"""\n')
    good = house.module_map(package)
    assert house.map_problems(good, package) == []
    stale = good + "\n| `gone.py` | A module that was removed. |"
    assert house.map_problems(stale, package) == ["module-map names `gone.py`, which is no module of the package"]
    missing = "\n".join(line for line in good.splitlines() if "`sub/b.py`" not in line)
    assert house.map_problems(missing, package) == ["module-map lacks `sub/b.py`"]
    (package / "c.py").write_text("x = 1\n")
    assert "module `c.py` has no docstring" in house.map_problems(house.module_map(package), package)


def test_no_import_cycles():
    assert house.import_cycles(house.import_graph()) == []


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""P."""\n')
    (package / "a.py").write_text('"""A."""\nfrom . import b\n')
    (package / "b.py").write_text('"""B."""\ndef f():\n    from .a import g\n')
    (package / "c.py").write_text('"""C."""\nfrom .b import f\n')
    assert house.import_cycles(house.import_graph(package)) == [["pkg.a", "pkg.b"]]


@pytest.mark.parametrize("limit", ["module", "function", "class"])
def test_sizes_within_the_limits(limit):
    assert [p for p in house.size_problems() if p.startswith(limit)] == []


def test_a_long_function_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(house.MAX_FUNCTION_LINES))
    (package / "__init__.py").write_text(f'"""P."""\ndef long():\n{body}\n')
    assert house.size_problems(package) == [f"function pkg.long: {house.MAX_FUNCTION_LINES + 1} lines "
                                            f"(limit {house.MAX_FUNCTION_LINES})"]
