"""Muon with its elementwise stages on the fused kernels (``ns_kernels="triton"``, run under
Triton's interpreter) against the same optimizer on the torch formulas (``ns_kernels="torch"``).

Newton–Schulz's products run on torch's matmuls in both runs here (``products_on_torch``: the
products' own kernels are tested in test_symmetric_kernel.py and tests/parallel/test_ns_kernels.py),
so the two runs differ only in the elementwise stages: momentum, Nesterov input, weight decay
(cautious or not) and the update.

* Single device, step by step (:func:`_side_by_side`): before every step the fused optimizer is
  given the torch one's weights and momentum, and its Newton–Schulz calls return what the torch
  run's returned for the same inputs' places (the iteration is the same code in both runs; fp32
  Newton–Schulz turns a last-bit difference in its input into differences no derivable bound
  separates from a wrong step). Then each run's momentum, Newton–Schulz input and new weights are
  held per element to the step's formulas in fp64 from the shared state, within the counted
  roundings (kernel_bounds.py), and the fused run to the torch run within the sum of their
  bounds: several steps, with maximize, cautious decay, nesterov False, bf16 momentum and a 0-d
  tensor lr. Not bit for bit: torch's CPU formulas round ``a * b + c`` once or twice depending on
  the CPU (test_elementwise_kernel.py).
* One parallel layout (FSDP+TP with ``_StridedShard``, forked gloo ranks, NorMuon, cautious decay,
  maximize, bf16 momentum): parallel Muon on the fused stages equals single-device Muon on the
  fused stages to the tolerance of test_parallel_muon.py (the layout is all that differs).
"""

from __future__ import annotations

import math

import pytest
import torch

from dist_cases import run_distributed, run_reference
from harness import run_ranks
from kernel_bounds import apply_update_fp64, assert_within, momentum_fp64, nesterov_input_fp64

pytest.importorskip("triton")

STEPS = 3
ATOL, RTOL = 2e-6, 1e-5  # as test_parallel_muon.py


LAUNCHES: dict[str, int] = {}  # the fused kernels' launches (module-level: forked ranks return their copy)


@pytest.fixture
def products_on_torch(monkeypatch):
    """Newton–Schulz's products on torch's matmuls whatever ``ns_kernels`` says; counts the fused
    elementwise kernels' launches."""
    from optimizer.newton_schulz import group
    from optimizer.kernels import elementwise_kernel

    real = group.zeropower_via_newtonschulz

    def on_torch(*args, **kwargs):
        kwargs["ns_kernels"] = "torch"
        return real(*args, **kwargs)

    monkeypatch.setattr(group, "zeropower_via_newtonschulz", on_torch)
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


class NewtonSchulzCalls:
    """Newton–Schulz's inputs and outputs, call by call; while :attr:`replay` holds outputs, each
    call returns the next of them (its shape and dtype checked) instead of running."""

    def __init__(self):
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self.replay: list[torch.Tensor] | None = None

    def take(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        calls = self.inputs, self.outputs
        self.inputs, self.outputs = [], []
        return calls


@pytest.fixture
def newton_schulz_calls(products_on_torch, monkeypatch):
    from optimizer.newton_schulz import group

    calls = NewtonSchulzCalls()
    inner = group.zeropower_via_newtonschulz  # products_on_torch's

    def recorded(x, *args, **kwargs):
        if calls.replay is None:
            out = inner(x, *args, **kwargs)
        else:
            assert calls.replay, "the fused run called Newton–Schulz more often than the torch run"
            out = calls.replay.pop(0).clone()
            assert (out.shape, out.dtype) == (x.shape, x.dtype), (out.shape, out.dtype, x.shape, x.dtype)
        calls.inputs.append(x.detach().clone())
        calls.outputs.append(out.detach().clone())
        return out

    monkeypatch.setattr(group, "zeropower_via_newtonschulz", recorded)
    return calls


SHAPES = {"wide": (32, 96), "tall": (96, 32), "experts": (2, 32, 64)}
VARIANTS = {
    "plain": {},
    "maximize_cautious": {"maximize": True, "cautious_wd": True},
    "no_nesterov_bf16_momentum": {"nesterov": False, "momentum_dtype": torch.bfloat16},
    "tensor_lr_cautious": {"lr": "tensor", "cautious_wd": True},
}
LR, WD, MU = 0.02, 0.1, 0.95


def _muon(ns_kernels, variant, **extra):
    from optimizer import Muon

    kw = {**VARIANTS[variant], **extra}
    lr = torch.tensor(LR) if kw.pop("lr", None) == "tensor" else LR
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in SHAPES.items()}
    opt = Muon([{"params": list(params.values()), "param_names": list(params), "use_muon": True}], lr=lr,
               momentum=MU, weight_decay=WD, adjust_lr="match_rms_adamw", compute_dtype=torch.float32,
               ns_kernels=ns_kernels, **kw)
    return params, opt


def _gradients(steps, nan_at=None):
    gen = torch.Generator().manual_seed(1)
    out = [{n: torch.randn(s, generator=gen) for n, s in SHAPES.items()} for _ in range(steps)]
    if nan_at is not None:
        out[nan_at]["wide"][3, 5] = float("nan")
    return out


def _buffer(opt, p):
    state = opt.state.get(p, {})
    return state["momentum_buffer"] if "momentum_buffer" in state else None


def _side_by_side(variant, calls, launches, gradients, **extra):
    """Both optimizers through ``gradients``, step by step from the same state (the module
    docstring); returns one record per step: the shared state before it, and each run's momentum,
    Newton–Schulz inputs and outputs, weights and ``last_step_skipped`` after it."""
    torch_params, torch_opt = _muon("torch", variant, **extra)
    fused_params, fused_opt = _muon("triton", variant, **extra)
    records = []
    for grads in gradients:
        with torch.no_grad():
            for n, p in fused_params.items():  # the fused run starts from the torch run's state
                p.copy_(torch_params[n])
                buf, fused_buf = _buffer(torch_opt, torch_params[n]), _buffer(fused_opt, p)
                assert (buf is None) == (fused_buf is None), n
                if buf is not None:
                    fused_buf.copy_(buf)
        before = {n: (p.detach().clone(), None if _buffer(torch_opt, p) is None else _buffer(torch_opt, p).clone())
                  for n, p in torch_params.items()}
        record = {"before": before, "grads": grads}
        for name, params, opt in (("torch", torch_params, torch_opt), ("fused", fused_params, fused_opt)):
            counted = dict(launches)
            for n, p in params.items():
                p.grad = grads[n].clone()
            opt.step()
            assert not calls.replay, "the fused run called Newton–Schulz less often than the torch run"
            inputs, outputs = calls.take()
            record[name] = {
                "launches": {k: launches[k] - counted[k] for k in counted},
                "skipped": opt.last_step_skipped,
                "inputs": inputs, "outputs": outputs,
                "params": {n: p.detach().clone() for n, p in params.items()},
                "bufs": {n: None if _buffer(opt, p) is None else _buffer(opt, p).clone() for n, p in params.items()},
            }
            calls.replay = list(outputs) if name == "torch" else None
        records.append(record)
    return records


def _check_step(record, variant):
    """A step that ran: both runs' momentum, Newton–Schulz inputs and weights against the fp64
    formulas from the shared state, each within its bound (the kernels' scalars fp32, torch's
    the tensors' dtypes: fp32 here), and the fused run against the torch run."""
    kw = VARIANTS[variant]
    maximize, nesterov, cautious = kw.get("maximize", False), kw.get("nesterov", True), kw.get("cautious_wd", False)
    buf_dtype = kw.get("momentum_dtype", torch.float32)
    lr = float(torch.tensor(LR)) if kw.get("lr") == "tensor" else LR  # a tensor lr is its fp32 value
    runs = record["torch"], record["fused"]
    for run in runs:
        assert [x.numel() for x in run["inputs"]] == [math.prod(s) for s in SHAPES.values()], \
            [tuple(x.shape) for x in run["inputs"]]  # one call per weight, in order: its input is the weight's
    for i, (n, shape) in enumerate(SHAPES.items()):
        p0, b0 = record["before"][n]
        b0 = torch.zeros(shape, dtype=buf_dtype) if b0 is None else b0
        g = record["grads"][n].double() * (-1 if maximize else 1)
        want_buf, buf_bound = momentum_fp64(b0, g, MU, buf_dtype)
        update = runs[0]["outputs"][i].reshape(shape)  # what both runs applied (replayed)
        alr = lr * 0.2 * math.sqrt(max(shape[-2:]))
        want_p, p_bound = apply_update_fp64(p0, update, lr, alr, WD, cautious)
        input_bounds = []
        for who, run in zip(("torch", "fused"), runs):
            buf, x, p = run["bufs"][n], run["inputs"][i].reshape(shape), run["params"][n]
            assert buf.dtype == buf_dtype and p.dtype == p0.dtype
            assert_within(buf, want_buf, buf_bound, f"{variant}: {who} momentum of {n}")
            want_x, x_bound = nesterov_input_fp64(g, buf, MU, nesterov, torch.float32, x.dtype)
            assert_within(x, want_x, x_bound, f"{variant}: {who} Newton–Schulz input of {n}")
            assert_within(p, want_p, p_bound, f"{variant}: {who} weights of {n}")
            input_bounds.append(x_bound)
        (tb, tx, tp), (fb, fx, fp) = ((r["bufs"][n], r["inputs"][i], r["params"][n]) for r in runs)
        assert_within(fb, tb.double(), 2 * buf_bound, f"{variant}: fused against torch momentum of {n}")
        spread = (MU if nesterov else 1.0) * (fb.double() - tb.double()).abs()
        assert_within(fx.reshape(shape), tx.reshape(shape).double(), sum(input_bounds) + spread,
                      f"{variant}: fused against torch Newton–Schulz input of {n}")
        assert_within(fp, tp.double(), 2 * p_bound, f"{variant}: fused against torch weights of {n}")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_stages_agree_with_the_torch_formulas_step_by_step(variant, newton_schulz_calls, products_on_torch):
    records = _side_by_side(variant, newton_schulz_calls, products_on_torch, _gradients(STEPS))
    per_step = len(SHAPES)  # per step and weight: one pass of the momentum with the input, one of decay with the update
    for step, record in enumerate(records):
        assert record["torch"]["launches"] == {"momentum_nesterov": 0, "apply_update": 0}
        assert record["fused"]["launches"] == {"momentum_nesterov": per_step, "apply_update": per_step}, step
        assert not record["torch"]["skipped"] and not record["fused"]["skipped"]
        _check_step(record, variant)


def test_a_skipped_step_leaves_the_fused_state_untouched(newton_schulz_calls, products_on_torch):
    """skip_nonfinite: a step with a NaN gradient changes neither weights nor momentum on either
    path (the skip is decided before any stage runs: the state is compared with itself, bit for
    bit), and the next step goes on from the state before it, as the formulas say."""
    records = _side_by_side("plain", newton_schulz_calls, products_on_torch, _gradients(3, nan_at=1),
                            skip_nonfinite=True)
    assert [r["fused"]["skipped"] for r in records] == [False, True, False]
    assert [r["torch"]["skipped"] for r in records] == [False, True, False]
    assert [r["fused"]["launches"]["apply_update"] for r in records] == [len(SHAPES), 0, len(SHAPES)]
    skipped = records[1]
    for who in ("torch", "fused"):
        assert skipped[who]["inputs"] == []  # Newton–Schulz did not run
        for n, (p0, b0) in skipped["before"].items():
            assert torch.equal(skipped[who]["params"][n], p0), (who, n)
            assert torch.equal(skipped[who]["bufs"][n], b0), (who, n)
    _check_step(records[0], "plain")
    _check_step(records[2], "plain")


def test_auto_keeps_the_torch_formulas_on_cpu(products_on_torch):
    params, opt = _muon("auto", "plain")
    for grads in _gradients(STEPS):
        for n, p in params.items():
            p.grad = grads[n]
        opt.step()
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


def test_parallel_fused_stages_equal_single_device_fused_stages(products_on_torch):
    """The fused stages on DTensor local pieces (regions of ``_StridedShard`` and ``Shard`` pieces,
    NorMuon's rows) against the same stages on whole tensors on one device: what the layout
    changes, to test_parallel_muon.py's tolerance for it. Against the torch formulas, the fused
    stages are held step by step above (through fp32 Newton–Schulz for several steps, a
    last-bit difference in an input has no derivable bound)."""
    results = run_ranks(_run, 4, timeout=300)
    want = run_reference(SPECS, STEPS, True, muon_group=_group("triton"))
    assert products_on_torch["momentum_nesterov"] > 0 and products_on_torch["apply_update"] > 0  # the reference ran them
    for rank_result, launches in results:
        assert launches["momentum_nesterov"] > 0 and launches["apply_update"] > 0, launches  # the ranks ran them
        for name, ref in want.items():
            torch.testing.assert_close(rank_result[name], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")
