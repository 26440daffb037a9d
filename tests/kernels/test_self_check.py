"""The kernels' first-use check on a GPU (optimizer/kernels/self_check.py), run here on CPU tensors
under the interpreter: it passes on the kernels as they are, in every tile configuration the rule can
pick; it names the kernel when one is broken (a triangle not mirrored, a wrong epilogue
coefficient, an off-by-one edge, a kernel that raises); and on a (pretended) CUDA GPU a failure makes
"auto" run torch, with one warning, and "triton" refuse with the reason."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

pytest.importorskip("triton")

from optimizer.kernels import backend as kernel_backend  # noqa: E402
from optimizer.kernels import environment  # noqa: E402
from optimizer.newton_schulz.implementation import Implementations, resolve_implementation  # noqa: E402
from optimizer.kernels import elementwise_kernel, matmul_add_kernel, self_check, symmetric_kernel  # noqa: E402
from optimizer.kernels.tiles import CUDA_CANDIDATES, INTERPRETER_TILES, choose_tiles  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernels_pass_their_check(dtype):
    assert self_check.check("products", CPU, dtype, [INTERPRETER_TILES]) is None


def test_the_elementwise_kernels_pass_their_check():
    assert self_check.check("elementwise", CPU, None, []) is None


def test_the_gpu_tile_configurations_pass_their_check_under_the_interpreter():
    """The CUDA tiles' block sizes (warps and stages mean nothing to the interpreter): the same
    edges, mirroring and K loop at 64 and 128."""
    for tiles in self_check.candidates(torch.float16, (9, 0)) + self_check.candidates(torch.float32, (9, 0)):
        dtype = torch.float32 if tiles == CUDA_CANDIDATES["fp32"] else torch.float16
        assert self_check.check("products", CPU, dtype, [tiles]) is None, tiles


def test_the_candidates_are_every_tile_the_rule_can_pick():
    """A tile the rule picks that the check does not compile would run unchecked."""
    for capability, sms in (((8, 0), 108), ((8, 6), 84), ((9, 0), 132), ((10, 0), 148), ((12, 0), 84)):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            picked = {choose_tiles(kind, batch, m, m if kind == "symmetric" else n, k, dtype, capability, sms)
                      for kind, batch, m, n, k in itertools.product(("symmetric", "general"), (1, 4, 64),
                                                                     (64, 1024, 4096), (512, 14336), (64, 4096))}
            assert picked <= set(self_check.candidates(dtype, capability)), (capability, dtype, picked)
    assert self_check.candidates(torch.bfloat16, None) == [INTERPRETER_TILES]


# ------------------------------------------------------------------ broken kernels are named


def _broken_symmetric(how):
    real = symmetric_kernel.symmetric_matmul_triton

    def broken(L, R, C=None, *, alpha=1.0, beta=0.0, out=None, out_dtype=None, tiles=None):
        if how == "epilogue":
            beta = beta * 1.01
        result = real(L, R, C, alpha=alpha, beta=beta, out=out, out_dtype=out_dtype, tiles=tiles)
        if how == "not mirrored":
            result = result.tril()
        elif how == "edge":  # the last row and column not written
            result[..., -1, :] = 0
            result[..., :, -1] = 0
        return result

    return broken


@pytest.mark.parametrize("how, named", [("not mirrored", "syrk"), ("edge", "syrk"), ("epilogue", "symmetric_matmul")])
def test_a_broken_symmetric_kernel_is_named(monkeypatch, how, named):
    monkeypatch.setattr(symmetric_kernel, "symmetric_matmul_triton", _broken_symmetric(how))
    reason = self_check.check("products", CPU, torch.float32, [INTERPRETER_TILES])
    assert reason is not None and reason.startswith(named), reason


def test_a_broken_general_kernel_is_named(monkeypatch):
    real = matmul_add_kernel.matmul_add_triton
    monkeypatch.setattr(matmul_add_kernel, "matmul_add_triton",
                        lambda L, R, C=None, *, alpha, beta, **kw: real(L, R, C, alpha=alpha, beta=beta + 2**-10, **kw))
    reason = self_check.check("products", CPU, torch.float32, [INTERPRETER_TILES])
    assert reason is not None and reason.startswith("matmul_add"), reason


def test_a_kernel_that_raises_is_reported_not_raised(monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")  # how a Triton compile error reads

    monkeypatch.setattr(symmetric_kernel, "symmetric_matmul_triton", fails)
    assert self_check.check("products", CPU, torch.bfloat16, [INTERPRETER_TILES]) == "RuntimeError: PassManager::run failed"


@pytest.mark.parametrize("stage", ["momentum", "update"])
def test_broken_elementwise_kernels_are_named(monkeypatch, stage):
    if stage == "momentum":
        real = elementwise_kernel.momentum_nesterov_triton
        monkeypatch.setattr(elementwise_kernel, "momentum_nesterov_triton",
                            lambda buf, grad, out, momentum, *a, **k: real(buf, grad, out, momentum - 0.01, *a, **k))
        expected = "momentum"
    else:
        real = elementwise_kernel.apply_update_triton
        monkeypatch.setattr(elementwise_kernel, "apply_update_triton",
                            lambda p, u, factor, lr, cautious: real(p, u, factor, lr * 1.001, cautious))
        expected = "weight decay and update"
    reason = self_check.check("elementwise", CPU, None, [])
    assert reason is not None and reason.startswith(expected), reason


# ------------------------------------------------------------------ what a failure does on a GPU


@pytest.fixture
def pretend_gpu(monkeypatch):
    """backend.py (through environment.py) believes cuda:0 is an H100 with Triton compiled for it; the self-check's answer is
    what the test sets in ``outcome`` (nothing here touches a GPU)."""
    outcome = {"reason": None, "asked": []}
    monkeypatch.setattr(environment, "triton_import_error", lambda: None)
    monkeypatch.setattr(environment, "interpreting", lambda: False)
    monkeypatch.setattr(environment, "cuda_properties", lambda index: ((9, 0), 132, False))
    monkeypatch.setattr(environment, "device_index", lambda device: 0)

    def failure(kind, device, dtype=None):
        outcome["asked"].append((kind, dtype))
        return outcome["reason"]

    monkeypatch.setattr(self_check, "failure", failure)
    return outcome


def test_on_a_gpu_auto_takes_the_kernels_only_where_they_passed(pretend_gpu):
    assert kernel_backend.resolve("auto", "cuda:0", torch.bfloat16) == "triton"
    assert ("products", torch.bfloat16) in pretend_gpu["asked"]
    pretend_gpu["reason"] = "syrk (tiles 128x128x64, k=71): 3 of 100 entries outside the rounding bound"
    assert kernel_backend.resolve("auto", "cuda:0", torch.bfloat16) == "torch"
    assert kernel_backend.resolve("auto", "cuda:0", kind="elementwise") == "torch"
    with pytest.raises(RuntimeError, match="outside the rounding bound"):
        kernel_backend.resolve("triton", "cuda:0", torch.bfloat16)


def kernels_problem(mode, device, dtype):
    """What resolving ``ns_kernels=mode`` for products in ``dtype`` (and the stages) finds wrong."""
    return resolve_implementation(mode, device, (dtype,)).problem


def test_the_optimizer_option_refuses_triton_and_lets_auto_fall_back(pretend_gpu):
    assert kernels_problem("auto", "cuda:0", torch.float16) is None
    assert ("products", torch.float16) in pretend_gpu["asked"] and ("elementwise", None) in pretend_gpu["asked"]
    assert kernels_problem("triton", "cuda:0", torch.float16) is None
    pretend_gpu["reason"] = "RuntimeError: PassManager::run failed"
    assert kernels_problem("auto", "cuda:0", torch.float16) is None
    problem = kernels_problem("triton", "cuda:0", torch.float16)
    assert "PassManager::run failed" in problem and "ns_kernels='auto'" in problem, problem
    assert torch.float16 not in resolve_implementation("auto", torch.device("cuda:0"), (torch.float16,)).kernel_dtypes
    asked = len(pretend_gpu["asked"])
    assert kernels_problem("torch", "cuda:0", torch.float16) is None  # torch: nothing to check
    assert len(pretend_gpu["asked"]) == asked


def test_a_failure_is_checked_once_and_warned_once(monkeypatch):
    """``failure`` runs the check once per kind, device and dtype, and warns when it fails."""
    runs = []

    def check(kind, device, dtype, tiles):
        runs.append((kind, device, dtype, tuple(tiles)))
        return "matmul_add (tiles 64x64x64, k=71): 1 of 100 entries outside the rounding bound"

    monkeypatch.setattr(self_check, "check", check)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    self_check._cached_failure.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="products in torch.bfloat16 kernels failed their first-use check on cuda:0"):
            first = self_check.failure("products", "cuda:0", torch.bfloat16)
        assert first.startswith("matmul_add")
        assert runs == [("products", torch.device("cuda", 0), torch.bfloat16,
                         tuple(self_check.candidates(torch.bfloat16, (9, 0))))]
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert self_check.failure("products", "cuda:0", torch.bfloat16) == first  # cached: no second run or warning
        assert len(runs) == 1
    finally:
        self_check._cached_failure.cache_clear()


def test_adding_a_group_on_a_gpu_runs_the_check_for_each_forms_dtype_and_a_step_does_not(pretend_gpu):
    """Muon resolves a group's ``ns_kernels`` when the group is added (``Implementations``): on a
    GPU with ``"auto"`` that runs the first-use check in the classic form's bf16 and the Gram
    form's fp16, and for the elementwise stages; a step's own check asks nothing again (the
    resolution is kept), for "auto" as for "triton"."""
    from types import SimpleNamespace

    on_gpu = SimpleNamespace(device=torch.device("cuda", 0), shape=(8, 12))  # what local_view(param) reads
    auto, triton = {"use_muon": True, "ns_kernels": "auto"}, {"use_muon": True, "ns_kernels": "triton"}
    implementations = Implementations()
    assert implementations.param_problem("w", on_gpu, auto, None) is None  # the group added
    assert set(pretend_gpu["asked"]) == {("products", torch.bfloat16), ("products", torch.float16), ("elementwise", None)}
    pretend_gpu["asked"].clear()
    assert implementations.param_problem("w", on_gpu, auto, None) is None  # a step
    assert pretend_gpu["asked"] == []
    pretend_gpu["reason"] = "RuntimeError: out of resource: shared memory"
    assert Implementations().param_problem("w", on_gpu, auto, None) is None
    problem = implementations.param_problem("layers.0.wq", on_gpu, triton, None)
    assert problem.startswith("Muon: parameter 'layers.0.wq'") and "shared memory" in problem, problem
    assert implementations.param_problem("w", on_gpu, {"use_muon": False, "ns_kernels": "triton"}, None) is None
