"""The kernels' dispatcher (optimizer/kernels/__init__.py, backend.py, environment.py, operands.py,
tiles.py, reference.py): which implementation a call gets, bad input refused by name before anything is
written, the package without Triton, the tile rule, and the torch references against fp64."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kernel_bounds import assert_within_rounding

from optimizer import kernels
from optimizer.kernels import environment
from optimizer.kernels.tiles import CUDA_CANDIDATES, INTERPRETER_TILES, choose_tiles
from repo import REPO


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ------------------------------------------------------------------ the torch references


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_against_fp64(dtype):
    L, R, C = randn(2, 37, 53, dtype=dtype, seed=1), randn(2, 53, 37, dtype=dtype, seed=2), randn(2, 37, 37, dtype=dtype, seed=3)
    sym = kernels.symmetric_matmul(L, R, C, alpha=1.3, beta=-0.7, backend="torch")
    assert_within_rounding(sym, L, R, C, alpha=1.3, beta=-0.7, symmetric=True)
    general = kernels.matmul_add(L, R, C, alpha=1.3, beta=-0.7, backend="torch")
    assert_within_rounding(general, L, R, C, alpha=1.3, beta=-0.7)
    gram = kernels.syrk(L, out_dtype=torch.float32, backend="torch")  # mixed dtypes: fp32 path
    assert_within_rounding(gram, L, L.mT, symmetric=True, out_dtype=torch.float32)


def test_references_do_not_read_C_when_beta_is_zero():
    X = randn(37, 53, seed=4)
    nan = torch.full((37, 37), float("nan"))
    assert torch.isfinite(kernels.symmetric_matmul(X, X.mT, nan, beta=0.0, backend="torch")).all()
    assert torch.isfinite(kernels.matmul_add(X, X.mT, nan, beta=0.0, backend="torch")).all()


# ------------------------------------------------------------------ which implementation runs


def _forbid(monkeypatch, module_name, function_name):
    pytest.importorskip("triton")
    module = __import__(f"optimizer.kernels.{module_name}", fromlist=[function_name])

    def refuse(*args, **kwargs):
        raise AssertionError(f"{function_name} ran")

    monkeypatch.setattr(module, function_name, refuse)


def test_auto_is_torch_on_cpu_even_under_the_interpreter(monkeypatch):
    """The interpreter is for tests: "auto" never picks it."""
    _forbid(monkeypatch, "symmetric_kernel", "symmetric_matmul_triton")
    _forbid(monkeypatch, "matmul_add_kernel", "matmul_add_triton")
    X = randn(37, 53, seed=5)
    assert torch.equal(kernels.syrk(X), kernels.syrk(X, backend="torch"))
    assert torch.equal(kernels.matmul_add(X.mT, X), kernels.matmul_add(X.mT, X, backend="torch"))


def test_triton_backend_runs_the_kernels(monkeypatch):
    _forbid(monkeypatch, "symmetric_kernel", "symmetric_matmul_triton")
    with pytest.raises(AssertionError, match="symmetric_matmul_triton ran"):
        kernels.syrk(randn(4, 4), backend="triton")


def test_auto_uses_torch_for_general_products_on_cuda(monkeypatch):
    """On a (pretended) supported GPU, "auto" sends symmetric products that span two tile rows to
    the kernel and general products, and one-tile-row symmetric ones, to torch. Decided before any
    launch, so the CPU tensors below never reach one."""
    from pretend_gpu import pretend_auto_takes_the_kernels

    calls = []
    pytest.importorskip("triton")
    pretend_auto_takes_the_kernels(monkeypatch)
    from optimizer.kernels import matmul_add_kernel, symmetric_kernel

    monkeypatch.setattr(symmetric_kernel, "symmetric_matmul_triton", lambda *a, **k: calls.append("sym"))
    monkeypatch.setattr(matmul_add_kernel, "matmul_add_triton", lambda *a, **k: calls.append("general"))
    wide, small = randn(200, 8, dtype=torch.bfloat16), randn(64, 8, dtype=torch.bfloat16)
    kernels.syrk(wide)  # 200 rows: 4 tile rows of 64 (few tiles, see tiles.py) -> kernel
    assert calls == ["sym"]
    kernels.syrk(small)  # 64 rows: one tile row (of 64 or 128) -> torch
    kernels.matmul_add(wide, wide.mT)  # general -> torch under "auto"
    assert calls == ["sym"]
    kernels.matmul_add(wide, wide.mT, backend="triton")
    assert calls == ["sym", "general"]


def test_available_and_reasons():
    pytest.importorskip("triton")
    assert kernels.available("cpu")  # TRITON_INTERPRET=1 (tests/conftest.py)
    assert not kernels.available("meta")
    assert "float64" in kernels.unavailable_reason("cpu", torch.float64)
    with pytest.raises(RuntimeError, match="backend='triton' cannot run on cpu: the kernels take float16"):
        kernels.syrk(randn(4, 4, dtype=torch.float64), backend="triton")
    assert kernels.syrk(randn(4, 4, dtype=torch.float64)).dtype == torch.float64  # auto: torch


def test_cpu_without_the_interpreter_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(environment, "interpreting", lambda: False)
    reason = kernels.unavailable_reason("cpu")
    assert reason is None or "TRITON_INTERPRET=1" in reason
    if environment.triton_import_error() is None:
        with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
            kernels.syrk(randn(4, 4), backend="triton")


def test_package_without_triton():
    """With triton unimportable: `import optimizer` and the kernels package import, "auto" and
    "torch" compute, "triton" is refused with the reason, and nothing imported triton."""
    code = """
import sys
sys.modules["triton"] = None  # import triton raises ImportError
import torch, optimizer
from optimizer import kernels
X = torch.randn(5, 7)
assert torch.equal(kernels.syrk(X), kernels.syrk(X, backend="torch"))
assert not kernels.available("cpu") and not kernels.available("cuda")
assert "triton package does not import" in kernels.unavailable_reason("cpu")
try:
    kernels.syrk(X, backend="triton")
except RuntimeError as error:
    assert "backend='triton' cannot run on cpu: the triton package does not import" in str(error), error
else:
    raise AssertionError("no error")
assert sys.modules["triton"] is None
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO / "torch-ext")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ------------------------------------------------------------------ bad input


def _bad_calls():
    L, R = randn(2, 5, 7), randn(2, 7, 5)
    return [
        (lambda o: kernels.symmetric_matmul(L, R, out=o, backend="bogus"), ValueError, "backend must be one of"),
        (lambda o: kernels.symmetric_matmul(L, randn(2, 7, 6), out=o), ValueError, "symmetric result is square"),
        (lambda o: kernels.symmetric_matmul(L, randn(2, 6, 5), out=o), ValueError, "do not multiply"),
        (lambda o: kernels.symmetric_matmul(L, R[0], out=o), ValueError, "must both be 2-D or both 3-D"),
        (lambda o: kernels.symmetric_matmul(L, R.double(), out=o), ValueError, "one dtype"),
        (lambda o: kernels.symmetric_matmul(L[None], R[None], out=o), ValueError, r"L must be \[m, k\]"),
        (lambda o: kernels.symmetric_matmul(L, R, alpha=float("nan"), out=o), ValueError, "alpha must be a finite"),
        (lambda o: kernels.symmetric_matmul(L, R, beta=True, out=o), ValueError, "beta must be a finite"),
        (lambda o: kernels.symmetric_matmul(L, R, randn(2, 5, 4), out=o), ValueError, "C must have the result's shape"),
        (lambda o: kernels.symmetric_matmul(L, R, out=o, out_dtype=torch.float16), ValueError, "out_dtype"),
        (lambda o: kernels.symmetric_matmul(L, R, out=o, backend="triton", alpha=torch.tensor(1.0)), ValueError, "alpha"),
        (lambda o: kernels.matmul_add(L, R, L.new_zeros(2, 5, 4), out=o), ValueError, "C must have the result's shape"),
        (lambda o: kernels.syrk([[1.0]], out=o), TypeError, "X must be a tensor"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_is_refused_by_name_and_writes_nothing(case):
    call, error, message = _bad_calls()[case]
    out = torch.full((2, 5, 5), 7.0)
    with pytest.raises(error, match=message):
        call(out)
    assert (out == 7.0).all()


def test_out_may_be_C_but_not_an_operand():
    X = randn(5, 7, seed=6)
    with pytest.raises(ValueError, match="out shares memory with L"):
        kernels.symmetric_matmul(X, X.mT, out=X[:, 2:])
    with pytest.raises(ValueError, match="out shares memory with R"):
        kernels.matmul_add(X.mT @ X, X.mT, out=X.mT)
    C = randn(6, 6, seed=7)
    with pytest.raises(ValueError, match="overlaps C without being C"):
        kernels.symmetric_matmul(X[:, :5].mT @ X[:, :5], torch.eye(5), C[1:, 1:], beta=1.0, out=C[:5, :5])
    kernels.symmetric_matmul(X, X.mT, C[:5, :5], beta=1.0, out=C[:5, :5])  # in place on C is fine


# ------------------------------------------------------------------ tiles


def test_tile_rule():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert choose_tiles("symmetric", 1, 37, 37, 53, bf16, None, 1) == INTERPRETER_TILES
    h100 = ((9, 0), 132)
    large, small = CUDA_CANDIDATES["large16"], CUDA_CANDIDATES["small16"]
    # 4096 rows: 32 tile rows of 128, 528 triangle tiles >= 132 SMs
    assert choose_tiles("symmetric", 1, 4096, 4096, 14336, bf16, *h100) == large
    # 1024 rows: 36 triangle tiles of 128 would leave most SMs idle
    assert choose_tiles("symmetric", 1, 1024, 1024, 4096, bf16, *h100) == small
    # ... unless a batch fills them: 16 x 36 tiles
    assert choose_tiles("symmetric", 16, 1024, 1024, 4096, bf16, *h100) == large
    assert choose_tiles("general", 1, 1024, 4096, 1024, bf16, *h100) == large  # 8 x 32 tiles
    assert choose_tiles("symmetric", 1, 4096, 4096, 14336, fp32, *h100) == CUDA_CANDIDATES["fp32"]
    a100 = choose_tiles("symmetric", 1, 4096, 4096, 14336, bf16, (8, 0), 108)
    assert (a100.block_m, a100.block_k, a100.num_stages) == (128, 64, 4)  # 98,304 of A100's 166,912 B
    # the 99 KiB parts (RTX 30/40/50) and a capability the table lacks: 3 stages (65,536 B; 4 would take 98,304)
    for capability in ((8, 6), (8, 9), (12, 0), (12, 1), (11, 0)):
        assert choose_tiles("symmetric", 1, 4096, 4096, 14336, bf16, capability, 84).num_stages == 3, capability
    for capability in ((8, 0), (8, 7), (9, 0), (10, 0), (10, 3)):
        assert choose_tiles("symmetric", 1, 1024, 1024, 4096, bf16, capability, 132).num_stages == 4, capability
    for tiles in CUDA_CANDIDATES.values():
        assert tiles.block_m == tiles.block_n and min(tiles.block_m, tiles.block_k) >= 16
