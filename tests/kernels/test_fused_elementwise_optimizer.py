"""Muon with its elementwise stages on the fused kernels (``ns_kernels="triton"``, run under
Triton's interpreter) against the same optimizer on the torch formulas (``ns_kernels="torch"``).

Newton–Schulz's products run on torch's matmuls in both runs here (``products_on_torch``: the
products' own kernels are tested in test_symmetric_kernel.py and tests/parallel/test_ns_kernels.py),
so the two runs differ only in the elementwise stages: momentum, Nesterov input, weight decay
(cautious or not) and the update.

* Single device, fp32 weights whose sizes are multiples of 64 (torch's CPU kernels vectorised on
  every entry: test_elementwise_kernel.py says why that matters): equal bit for bit after several
  steps, with maximize, cautious decay, nesterov False, bf16 momentum and a 0-d tensor lr.
* One parallel layout (FSDP+TP with ``_StridedShard``, forked gloo ranks, NorMuon, cautious decay,
  maximize, bf16 momentum): parallel Muon on the fused stages equals single-device Muon on the
  torch formulas to the tolerance of test_parallel_muon.py.
"""

from __future__ import annotations

import pytest
import torch

from dist_cases import run_distributed, run_reference
from harness import run_ranks

pytest.importorskip("triton")

STEPS = 3
ATOL, RTOL = 2e-6, 1e-5  # as test_parallel_muon.py


LAUNCHES: dict[str, int] = {}  # the fused kernels' launches (module-level: forked ranks return their copy)


@pytest.fixture
def products_on_torch(monkeypatch):
    """Newton–Schulz's products on torch's matmuls whatever ``ns_kernels`` says; counts the fused
    elementwise kernels' launches."""
    from optimizer import rule
    from optimizer.kernels import elementwise_kernel

    real = rule.zeropower_via_newtonschulz

    def on_torch(*args, **kwargs):
        kwargs["kernels"] = "torch"
        return real(*args, **kwargs)

    monkeypatch.setattr(rule, "zeropower_via_newtonschulz", on_torch)
    counts = LAUNCHES
    counts.update(momentum_nesterov=0, apply_update=0)

    def counting(fn, key):
        def wrapped(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(elementwise_kernel, "momentum_nesterov_triton",
                        counting(elementwise_kernel.momentum_nesterov_triton, "momentum_nesterov"))
    monkeypatch.setattr(elementwise_kernel, "apply_update_triton",
                        counting(elementwise_kernel.apply_update_triton, "apply_update"))
    return counts


SHAPES = {"wide": (32, 96), "tall": (96, 32), "experts": (2, 32, 64)}
VARIANTS = {
    "plain": {},
    "maximize_cautious": {"maximize": True, "cautious_wd": True},
    "no_nesterov_bf16_momentum": {"nesterov": False, "momentum_dtype": torch.bfloat16},
    "tensor_lr_cautious": {"lr": "tensor", "cautious_wd": True},
}


def _steps(ns_kernels, variant):
    from optimizer import Muon

    kw = dict(VARIANTS[variant])
    lr = torch.tensor(0.02) if kw.pop("lr", None) == "tensor" else 0.02
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in SHAPES.items()}
    opt = Muon([{"params": list(params.values()), "param_names": list(params), "use_muon": True}], lr=lr,
               weight_decay=0.1, compute_dtype=torch.float32, ns_kernels=ns_kernels, **kw)
    for _ in range(STEPS):
        for n, p in params.items():
            p.grad = torch.randn(SHAPES[n], generator=gen)
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}, opt


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_stages_equal_the_torch_formulas_bitwise(variant, products_on_torch):
    on_torch, _ = _steps("torch", variant)
    assert products_on_torch == {"momentum_nesterov": 0, "apply_update": 0}
    fused, opt = _steps("triton", variant)
    # per step and parameter: the momentum kernel, one input call, one update call
    per_step = len(SHAPES)
    assert products_on_torch == {"momentum_nesterov": 2 * per_step * STEPS, "apply_update": per_step * STEPS}
    for n in SHAPES:
        assert torch.equal(fused[n], on_torch[n]), (variant, n, (fused[n] - on_torch[n]).abs().max())


def test_a_skipped_step_leaves_the_fused_state_untouched(products_on_torch):
    """skip_nonfinite: a step with a NaN gradient changes neither weights nor momentum on the
    fused path (the skip is decided before any stage runs), and the run goes on as torch's."""
    from optimizer import Muon

    def run(ns_kernels):
        gen = torch.Generator().manual_seed(1)
        p = torch.nn.Parameter(torch.randn(32, 64, generator=gen))
        opt = Muon([{"params": [p], "param_names": ["w"], "use_muon": True}], lr=0.02, weight_decay=0.1,
                   compute_dtype=torch.float32, ns_kernels=ns_kernels, skip_nonfinite=True)
        snapshots = []
        for step in range(3):
            g = torch.randn(32, 64, generator=gen)
            if step == 1:
                g[3, 5] = float("nan")
            p.grad = g
            opt.step()
            snapshots.append((p.detach().clone(), opt.state[p]["momentum_buffer"].clone(), opt.last_step_skipped))
        return snapshots

    on_torch, fused = run("torch"), run("triton")
    assert products_on_torch["apply_update"] == 2  # two steps ran on the kernels, one was skipped
    assert [s[2] for s in fused] == [False, True, False]
    assert torch.equal(fused[1][0], fused[0][0]) and torch.equal(fused[1][1], fused[0][1])
    for (pt, bt, _), (pf, bf, _) in zip(on_torch, fused):
        assert torch.equal(pt, pf) and torch.equal(bt, bf)


def test_auto_keeps_the_torch_formulas_on_cpu(products_on_torch):
    _steps("auto", "plain")
    assert products_on_torch == {"momentum_nesterov": 0, "apply_update": 0}


# ---------------------------------------------------------------------------- a parallel layout

SPECS = [("layers.0.attention.wq.weight", (16, 12), ["SS0/2", "S0"]),
         ("layers.0.attention.wk.weight", (8, 12), ["SS0/2", "S0"]),
         ("w1", (9, 6), ["SS0/2", "S0"]), ("w2", (6, 9), ["S0", "S1"])]
EXTRA = {"normuon_beta2": 0.9, "cautious_wd": True, "maximize": True, "momentum_dtype": torch.bfloat16}


def _group(ns_kernels):
    return {**EXTRA, "ns_kernels": ns_kernels}


def _run(rank, world_size):
    return run_distributed(rank, world_size, (2, 2), SPECS, STEPS, True, muon_group=_group("triton")), dict(LAUNCHES)


def test_parallel_fused_stages_equal_single_device_torch(products_on_torch):
    results = run_ranks(_run, 4, timeout=300)
    want = run_reference(SPECS, STEPS, True, muon_group=_group("torch"))
    assert products_on_torch == {"momentum_nesterov": 0, "apply_update": 0}  # the reference: torch formulas
    for rank_result, launches in results:
        assert launches["momentum_nesterov"] > 0 and launches["apply_update"] > 0, launches  # the ranks ran them
        for name, ref in want.items():
            torch.testing.assert_close(rank_result[name], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")
