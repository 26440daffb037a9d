"""Packaging as a Hugging Face `kernels` kernel.

build.toml must be accepted by the parser that ships with `kernels`, the variant laid out by
scripts/build_kernel_variant.py must be what the `kernels` loader resolves and imports, and
the imported kernel must be the package itself (relative imports, declared dependencies).
Tests that need `kernels` skip only when it is not installed (CI installs it via `.[test]`).
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.build_kernel_variant import build_variants, python_name, read_build_config
from repo import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = REPO
BUILD_SCRIPT = ROOT / "scripts" / "build_kernel_variant.py"
GENERAL = tomllib.loads((ROOT / "build.toml").read_text())["general"]
PACKAGE_DIR = ROOT / "torch-ext" / python_name(GENERAL["name"])


def package_files(root: Path) -> dict[str, bytes]:
    """Relative path -> content of every file under root, without bytecode."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.suffix != ".pyc" and "__pycache__" not in p.parts
    }


def test_build_toml_is_accepted_by_kernels_parser():
    pytest.importorskip("kernels")
    from kernels._rust import Backend, Build, KernelName

    build = Build.open(ROOT)  # raises ValueError on anything kernel-builder would reject

    assert set(build.general.backends) == {Backend.from_str(b) for b in GENERAL["backends"]}
    assert build.all_kernel_depends(Backend.CPU) == []
    # kernel-builder takes the Python sources from torch-ext/<python name>/.
    assert KernelName(GENERAL["name"]).python_name == PACKAGE_DIR.name
    assert (PACKAGE_DIR / "__init__.py").is_file()


def test_build_toml_agrees_with_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert GENERAL["license"] == pyproject["project"]["license"]["text"]
    assert GENERAL["edition"] == 5


def test_variant_layout_mirrors_source(tmp_path):
    variant_dirs = build_variants(ROOT, tmp_path)

    source = package_files(PACKAGE_DIR)
    assert [d.name for d in variant_dirs] == [f"torch-{b}" for b in GENERAL["backends"]]
    for backend, variant_dir in zip(GENERAL["backends"], variant_dirs):
        built = package_files(variant_dir)
        metadata = json.loads(built.pop("metadata.json"))
        assert built == source
        assert metadata["name"] == GENERAL["name"]
        assert metadata["version"] == GENERAL["version"]
        assert metadata["license"] == GENERAL["license"]
        assert metadata["python-depends"] == GENERAL.get("python-depends", [])
        assert metadata["backend"] == {"type": backend}
        assert metadata["id"].startswith(f"_{PACKAGE_DIR.name}_{backend}_")


def test_variant_layout_matches_kernels_own_parsers(tmp_path):
    pytest.importorskip("kernels")
    from kernels._rust import Backend, Metadata
    from kernels.variants import NoarchVariant, parse_variant

    for backend, variant_dir in zip(GENERAL["backends"], build_variants(ROOT, tmp_path)):
        variant = parse_variant(variant_dir.name)
        assert isinstance(variant, NoarchVariant)
        assert variant.arch.backend_name == backend

        metadata = Metadata.read_from_file(variant_dir / "metadata.json")
        raw = json.loads((variant_dir / "metadata.json").read_text())
        assert metadata.id == raw["id"]
        assert str(metadata.name) == GENERAL["name"]
        assert metadata.backend.backend_type == Backend.from_str(backend)
        assert metadata.python_depends == GENERAL.get("python-depends", [])


def test_module_id_follows_source_content(tmp_path):
    # The id names the module in sys.modules: equal sources must give equal ids
    # (reproducible builds), any source change a new one (side-by-side loading).
    checkout = tmp_path / "checkout"
    shutil.copytree(PACKAGE_DIR, checkout / "torch-ext" / PACKAGE_DIR.name)
    shutil.copy2(ROOT / "build.toml", checkout / "build.toml")

    def build_id(out_name: str) -> str:
        (variant_dir,) = build_variants(checkout, tmp_path / out_name, ["cpu"])
        return json.loads((variant_dir / "metadata.json").read_text())["id"]

    first = build_id("a")
    assert build_id("b") == first
    init = checkout / "torch-ext" / PACKAGE_DIR.name / "__init__.py"
    init.write_text(init.read_text() + "\n# edited\n")
    assert build_id("c") != first


def test_rebuild_refuses_to_clobber_foreign_directory(tmp_path):
    (tmp_path / "torch-cpu").mkdir()
    (tmp_path / "torch-cpu" / "keep.txt").write_text("not a build")
    with pytest.raises(FileExistsError, match="not a build variant"):
        build_variants(ROOT, tmp_path, ["cpu"])
    with pytest.raises(ValueError, match="not in build.toml"):
        build_variants(ROOT, tmp_path / "other", ["metal"])


def _one_muon_step(muon_cls) -> torch.Tensor:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 4))
    weight.grad = torch.randn(8, 4)
    opt = muon_cls([{"params": [weight], "use_muon": True}], lr=0.02)
    opt.step()
    return weight.detach().clone()


def test_get_local_kernel_loads_built_variant(tmp_path):
    kernels = pytest.importorskip("kernels")

    # The documented command, run as a user would.
    proc = subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), "--out", str(tmp_path / "build")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr

    module = kernels.get_local_kernel(tmp_path)

    assert isinstance(module.Muon, type) and issubclass(module.Muon, torch.optim.Optimizer)
    # The loader imports the variant under its metadata id; every submodule must come from
    # the variant directory. An absolute `import optimizer...` inside the package would pull
    # the source tree copy from sys.path instead (and fail outside this repository).
    assert module.Muon.__module__.split(".")[0] == module.__name__
    variant_modules = {n: m for n, m in sys.modules.items() if n.split(".")[0] == module.__name__}
    for name, mod in variant_modules.items():
        origin = Path(getattr(mod, "__file__", None) or "")
        assert origin.is_relative_to(tmp_path / "build"), f"{name} was imported from {origin}"

    # The packaged optimizer behaves exactly like the source package.
    import optimizer

    assert torch.equal(_one_muon_step(module.Muon), _one_muon_step(optimizer.Muon))


def _guarded_by_import_error(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """True if node sits in a `try:` body whose handlers catch ImportError (an optional import)."""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.Try) and node in parent.body:
            caught = {ast.unparse(h.type) for h in parent.handlers if h.type is not None}
            if caught & {"ImportError", "ModuleNotFoundError", "(ImportError, ModuleNotFoundError)"}:
                return True
        node = parent
    return False


def required_top_level_imports(package_dir: Path) -> dict[str, set[str]]:
    """Top-level module name -> files importing it unconditionally (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            if _guarded_by_import_error(node, parents):
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(path.relative_to(package_dir).as_posix())
    return found


def test_package_imports_match_declared_python_depends():
    # A Hub user gets torch and the build.toml `python-depends`, nothing else; the
    # loader refuses to import the kernel if a declared dependency is missing.
    kernels = pytest.importorskip("kernels")
    depends_table = json.loads((Path(kernels.__file__).parent / "python_depends.json").read_text())["general"]
    declared = {
        pkg["import"]
        for dep in GENERAL.get("python-depends", [])
        for pkg in depends_table[dep]["python"]
        if "import" in pkg
    }

    imports = required_top_level_imports(PACKAGE_DIR)
    self_imports = imports.pop(PACKAGE_DIR.name, set())
    assert not self_imports, f"use relative imports inside the package: {sorted(self_imports)}"
    undeclared = {m: f for m, f in imports.items() if m not in sys.stdlib_module_names | {"torch"} | declared}
    assert not undeclared, (
        f"the package imports {undeclared} but build.toml's python-depends only allows {sorted(declared)} "
        f"(names from kernels' python_depends.json); drop the import or guard it with try/except ImportError"
    )
    unused = declared - imports.keys()
    assert not unused, f"build.toml declares {sorted(unused)} in python-depends but the package never imports it"


def test_read_build_config_rejects_other_editions(tmp_path):
    (tmp_path / "build.toml").write_text((ROOT / "build.toml").read_text().replace("edition = 5", "edition = 4"))
    with pytest.raises(ValueError, match="edition"):
        read_build_config(tmp_path)
