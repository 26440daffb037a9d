"""The ``ns_kernels`` option: Muon with Newton–Schulz on the Triton kernels (run on CPU tensors
under Triton's interpreter; ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before anything
imports Triton) against the torch path.

* Single device, odd shapes (no dimension a multiple of a tile; wide, tall, an expert stack): the
  kernels really run (their launches are counted), and after several steps every parameter is as
  close to an fp64 run of the same optimizer as the torch path is (within twice the torch path's
  own distance, plus a few fp32 ulps of the weights): the two differ only in fp32 rounding.
* Parallel layouts (FSDP, FSDP+TP ``_StridedShard``, HSDP with the replica split, expert
  sharding, ``ns_split``, NorMuon): parallel Muon on the kernels equals single-device Muon on the
  kernels to float32 rounding (the tolerance of ``test_parallel_muon.py``), the owners running the
  same kernels on the same assembled matrices. With ``ns_split`` the matrices cut over ranks run
  their products on the kernels too: every cut call on every rank launches them (counted inside
  the calls); no other run cuts anything. (tests/parallel/test_split_ns_kernels.py checks the cut
  iteration on the kernels itself.)
* The option itself: refused where it cannot run before anything changes, agreed across ranks,
  optional in checkpoints.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from dist_cases import run_distributed, run_reference
from harness import run_ranks

pytest.importorskip("triton")

ATOL, RTOL = 2e-6, 1e-5  # as test_parallel_muon.py: same fp32 math, elementwise order aside
STEPS = 3
U32 = torch.finfo(torch.float32).eps / 2


@pytest.fixture
def kernel_launches(monkeypatch):
    """Counts the Triton kernel launches of Newton–Schulz's products (symmetric and general)."""
    from optimizer.kernels import matmul_add_kernel, symmetric_kernel

    counts = {"symmetric": 0, "general": 0}

    def counting(fn, key):
        def wrapped(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(symmetric_kernel, "symmetric_matmul_triton",
                        counting(symmetric_kernel.symmetric_matmul_triton, "symmetric"))
    monkeypatch.setattr(matmul_add_kernel, "matmul_add_triton", counting(matmul_add_kernel.matmul_add_triton, "general"))
    return counts


SHAPES = {"wide": (37, 53), "tall": (65, 30), "square": (33, 33), "experts": (3, 17, 29)}


def _steps(dtype, ns_kernels, seed=0, **kw):
    from optimizer import Muon

    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for n, s in SHAPES.items()}
             for _ in range(STEPS)]
    opt = Muon([{"params": list(params.values()), "param_names": list(params), "use_muon": True}], lr=0.02,
               weight_decay=0.1, compute_dtype=dtype, ns_kernels=ns_kernels, **kw)
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].clone()
        opt.step()
    return {n: p.detach().double() for n, p in params.items()}


@pytest.mark.parametrize("method", ["classic", "gram"])
def test_kernels_are_as_close_to_fp64_as_torch_is(method, kernel_launches):
    """Odd shapes, both Newton–Schulz forms: triton vs torch vs the same optimizer in fp64."""
    exact = _steps(torch.float64, "torch", ns_method=method)
    on_torch = _steps(torch.float32, "torch", ns_method=method)
    assert kernel_launches["symmetric"] == 0
    on_kernels = _steps(torch.float32, "triton", ns_method=method)
    # every product on the kernels: X X^T and b A + c A A each step (classic), or the Gram
    # recursion's symmetric products; 4 parameters, one call per shape
    assert kernel_launches["symmetric"] >= 2 * STEPS * len(SHAPES)
    for n in SHAPES:
        err_torch = (on_torch[n] - exact[n]).abs().max().item()
        err_kernels = (on_kernels[n] - exact[n]).abs().max().item()
        floor = 8 * U32 * exact[n].abs().max().item()  # a few fp32 ulps of the weights
        assert err_kernels <= 2 * err_torch + floor, (n, method, err_kernels, err_torch)
        # and the paths really differ: the kernels round each product once, in their own order
        assert not torch.equal(on_kernels[n], on_torch[n]) or n == "square", n


def test_auto_is_torch_on_cpu(kernel_launches):
    _steps(torch.float32, "auto")
    assert kernel_launches == {"symmetric": 0, "general": 0}


# ---------------------------------------------------------------------------- parallel layouts

Q, K = (16, 12), (8, 12)
CASES = {
    "fsdp": ((2,), [("layers.0.attention.wq.weight", Q, ["S0"]), ("layers.0.attention.wk.weight", K, ["S0"]),
                    ("w1", (10, 13), ["S0"]), ("w2", (13, 10), ["S1"]), ("norm", (12,), ["S0"])]),
    "fsdp_tp": ((2, 2), [("layers.0.attention.wq.weight", Q, ["SS0/2", "S0"]),
                         ("layers.0.attention.wk.weight", K, ["SS0/2", "S0"]),
                         ("w1", (9, 6), ["SS0/2", "S0"]), ("w2", (6, 9), ["S0", "S1"])]),
    "hsdp": ((2, 2), [("layers.0.attention.wq.weight", Q, ["R", "S0"]), ("layers.0.attention.wk.weight", K, ["R", "S0"]),
                      ("w1", (7, 5), ["R", "S0"]),
                      ("w2", (12, 20), ["R", "S1"])]),
    "experts": ((2, 2), [("moe.w1", (4, 8, 12), ["S0", "S1"]), ("moe.w2", (4, 12, 8), ["S0", "R"]),
                         ("moe.w3", (3, 9, 6), ["S0", "S2"])]),
}
# (case, extra optimizer options): the replica split forced on HSDP, ns_split cutting every matrix
# it can, NorMuon with cautious weight decay
RUNS = [
    ("fsdp", {}), ("fsdp_tp", {}), ("hsdp", {"replica_split": "always"}), ("experts", {}),
    ("fsdp", {"muon_group": {"ns_split": "always"}}), ("fsdp_tp", {"muon_group": {"normuon_beta2": 0.9, "cautious_wd": True}}),
]


def _kw(extra, kernels):
    kw = copy.deepcopy(extra)
    kw.setdefault("muon_group", {})["ns_kernels"] = kernels
    return kw


@contextlib.contextmanager
def launches_in_cut_units():
    """In this process: the kernel launches made inside each call of the cut iteration (the
    ``ns_split`` units, what ``NewtonSchulz.split`` calls), one count per call."""
    from optimizer.kernels import matmul_add_kernel, symmetric_kernel
    from optimizer.newton_schulz import group

    per_call: list[int] = []
    inside = [False]
    patched = [(group, "split_zeropower_via_newtonschulz"), (symmetric_kernel, "symmetric_matmul_triton"),
               (matmul_add_kernel, "matmul_add_triton")]
    saved = [getattr(*where) for where in patched]
    split, symmetric, general = saved

    def launching(fn):
        def wrapped(*args, **kwargs):
            if inside[0]:
                per_call[-1] += 1
            return fn(*args, **kwargs)
        return wrapped

    def cut(*args, **kwargs):
        per_call.append(0)
        inside[0] = True
        try:
            return split(*args, **kwargs)
        finally:
            inside[0] = False

    for (module, name), fn in zip(patched, (cut, launching(symmetric), launching(general))):
        setattr(module, name, fn)
    try:
        yield per_call
    finally:
        for (module, name), fn in zip(patched, saved):
            setattr(module, name, fn)


def _run(rank, world_size, runs):
    out = []
    for name, extra in runs:
        mesh_shape, specs = CASES[name]
        with launches_in_cut_units() as cut_calls:
            result = run_distributed(rank, world_size, mesh_shape, specs, STEPS, True, **_kw(extra, "triton"))
        out.append((result, cut_calls))
    return out


@pytest.mark.parametrize("world_size", [4, 2])
def test_parallel_muon_on_the_kernels_equals_single_device(world_size):
    runs = [(n, e) for n, e in RUNS if _world(CASES[n][0]) == world_size]
    results = run_ranks(_run, world_size, runs, timeout=300)
    for i, (name, extra) in enumerate(runs):
        want = run_reference(CASES[name][1], STEPS, True, **_kw(extra, "triton"))
        for rank_result in results:
            got, cut_calls = rank_result[i]
            for pname, ref in want.items():
                torch.testing.assert_close(got[pname], ref, atol=ATOL, rtol=RTOL,
                                           msg=lambda m: f"{name} {extra} {pname}: {m}")
            if "ns_split" in extra.get("muon_group", {}):
                # every matrix cut over ranks ran its products on the kernels, on every rank
                assert len(cut_calls) >= STEPS and min(cut_calls) > 0, (name, cut_calls)
            else:
                assert cut_calls == [], (name, cut_calls)


def _world(shape):
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------- the option


def test_triton_where_it_cannot_run_is_refused_before_anything_changes(monkeypatch):
    from optimizer import Muon
    from optimizer.kernels import environment

    w = torch.nn.Parameter(torch.randn(8, 12))
    monkeypatch.setattr(environment, "triton_import_error", lambda: "the triton package does not import (test)")
    with pytest.raises(ValueError, match=r"ns_kernels='triton' cannot run .*triton package does not import.*"
                                         r"use ns_kernels='auto'.*param_groups\[0\] ns_kernels"):
        Muon([w], lr=0.1, ns_kernels="triton")
    # added with an option that runs, then switched: the step refuses before the momentum moves
    opt = Muon([w], lr=0.1, ns_kernels="torch")
    opt.param_groups[0]["ns_kernels"] = "triton"
    w.grad = torch.randn(8, 12)
    before = w.detach().clone()
    with pytest.raises(ValueError, match="ns_kernels='triton' cannot run"):
        opt.step()
    assert torch.equal(w.detach(), before) and not opt.state.get(w)


def test_a_bad_value_names_the_option():
    from optimizer import Muon

    w = torch.nn.Parameter(torch.randn(8, 12))
    with pytest.raises(ValueError, match=r"`ns_kernels`: ns_kernels must be one of 'auto', 'torch', 'triton'"):
        Muon([w], ns_kernels="cuda")
    with pytest.raises(ValueError, match=r"param_groups\[0\] ns_kernels"):
        Muon([{"params": [w], "use_muon": True, "ns_kernels": 1}])


def test_the_option_is_optional_in_checkpoints_and_survives_pickling():
    import pickle

    from optimizer import Muon

    w = torch.nn.Parameter(torch.randn(8, 12))
    assert "ns_kernels" not in Muon([w], lr=0.1).state_dict()["param_groups"][0]  # default: not held
    opt = Muon([w], lr=0.1, ns_kernels="torch")
    assert opt.state_dict()["param_groups"][0]["ns_kernels"] == "torch"
    assert pickle.loads(pickle.dumps(opt)).param_groups[0]["ns_kernels"] == "torch"


@pytest.mark.parametrize("method", ["classic", "gram"])
def test_auto_where_the_kernels_run_keeps_cublas_for_the_general_products(monkeypatch, kernel_launches, method):
    """``"auto"`` where the kernels run (a CUDA GPU; pretended here, tests/pretend_gpu.py): the
    symmetric products on the kernels from two tile rows up (130 rows: three 64-row fp32 tiles),
    ``a X + B X`` and ``Q X`` on torch (cuBLAS on a GPU: nothing symmetric to save, and its
    epilogue fuses ``a X``), a matrix of one tile row (40) all on torch; ``"triton"`` runs every
    product on the kernels. What docs/kernels.md and the GPU predictions assume."""
    from pretend_gpu import pretend_auto_takes_the_kernels

    from optimizer.newton_schulz import zeropower_via_newtonschulz
    from optimizer.newton_schulz.coefficients import resolve_ns_coefficients
    from optimizer.newton_schulz.forms import choose_ns_form
    from optimizer.newton_schulz.restarts import gram_restart_plan

    pretend_auto_takes_the_kernels(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    large, small = torch.randn(130, 200, generator=gen), torch.randn(40, 100, generator=gen)
    steps = resolve_ns_coefficients("fixed", 5)
    form, dtype = choose_ns_form(large.shape, 5, method, torch.float32, steps)
    plan = gram_restart_plan(steps, 5, dtype) if form == "gram" else (1,) * 5
    # per segment of L steps: classic (L = 1) X X^T, b A + c A^2 and a X + B X; Gram: X X^T, the
    # recursion's 4L - 3 symmetric products, Q X
    symmetric = sum(2 if n == 1 else 1 + 4 * n - 3 for n in plan)
    general = len(plan)
    seen = {}
    for name, G in (("large", large), ("small", small)):
        for mode in ("auto", "triton"):
            before = dict(kernel_launches)
            zeropower_via_newtonschulz(G, 5, compute_dtype=torch.float32, method=method, ns_kernels=mode)
            seen[name, mode] = {k: kernel_launches[k] - before[k] for k in before}
    assert seen == {("large", "auto"): {"symmetric": symmetric, "general": 0},
                    ("large", "triton"): {"symmetric": symmetric, "general": general},
                    ("small", "auto"): {"symmetric": 0, "general": 0},
                    ("small", "triton"): {"symmetric": symmetric, "general": general}}
