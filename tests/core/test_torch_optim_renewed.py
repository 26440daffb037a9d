"""Code written for ``torch.optim.Muon`` runs unchanged on ``optimizer.Muon``, and its checkpoints
carry over (issue 20).

Part 1 ports PyTorch's ``TestOptimRenewed`` (``test/test_optim.py``; read at two recent versions,
the one whose tests special-case ``optim_cls.__name__ == "Muon"`` included) and runs it against
``optimizer.Muon`` the way torch runs it against ``torch.optim.Muon``: plain lists of parameters,
torch's keywords, torch's own optimizer inputs (``optim_inputs_func_muon`` and
``optim_error_inputs_func_muon`` from ``torch.testing._internal.common_optimizers``: importing it
costs ~2 s and needs ``expecttest``) and torch's LR schedulers for Muon.  The inputs are the
installed release's (issue 32, ``tests/torch_muon_inputs.py``): an input a new release adds is run,
one ours cannot run is listed there with its reason and checked to be refused, and
``test_port_runs_every_torch_input`` fails if one goes missing; ``python tests/torch_muon_inputs.py``
reports what changed between releases.  torch 2.8 has no ``torch.optim.Muon``: the module is skipped
there, saying so.
Where torch's version drops the bias because ``torch.optim.Muon`` refuses 1-D parameters, the
test runs both torch's Muon form and TestOptimRenewed's original ``[weight, bias]`` form
(``with_bias``): ours sends the bias to AdamW.  Where torch only checks that something runs, the
port also checks the numbers when that is cheap (the same continuation, a formula).

Part 2 is the migration promised by the issue, against ``torch.optim.Muon`` itself (one device,
fp32, several steps): plain lists / ``model.parameters()`` / groups without ``use_muon`` / named
parameters; non-matrices routed to AdamW; torch's keywords, positional order and per-group values
with torch's meaning; the default ``adjust_lr`` for torch-style input; a ``torch.optim.Muon``
state dict loaded mid-run, plainly and through ``torch.distributed.checkpoint`` into a sharded
Muon (2 forked gloo ranks); ``load_state_dict``'s hooks and non-parameter state entries.

References are independent of the code under test: ``torch.optim.Muon`` (its Newton–Schulz patched
to fp32 by the ``torch_muon_in_fp32`` fixture, so the comparison is like for like: float32
rounding, atol 1e-6 after a few steps), formulas written here, or a second ``optimizer.Muon``
built with explicit ``use_muon`` groups where torch has nothing to compare with (3-D expert
stacks).  Every comparison with torch also checks that the option changes torch's own result, so
that matching it is not vacuous.

Runtime: ~480 tests in ~7 s of one core, ~12 s with the imports (the lazy torch.testing import is
~2 s; the DCP test forks 2 ranks, ~1 s).

TestOptimRenewed tests that do not apply, and why:

- ``test_optim_infos_do_not_specify_global_cliquey_kwargs``: checks torch's OptimizerInfo
  database, not an optimizer.
- ``test_forloop_goes_right_direction_multigpu``: CUDA with two GPUs, a weight and a bias on
  different devices (multi-device; no GPU on this project's machines).
- ``test_rosenbrock_sparse``: sparse gradients (torch.optim.Muon has ``supports_sparse=False``;
  ours refuses sparse gradients too).
- ``test_complex``, ``test_complex_2d``: complex parameters (``supports_complex=False``; that
  ours refuses them is ported from ``test_errors``).
- ``test_adamw_serialization``: Adam/AdamW's ``decoupled_weight_decay`` flag.
- ``test_foreach_matches_forloop``, ``test_set_default_dtype_works_with_foreach``,
  ``test_foreach_large_tensor``, ``test_peak_memory_foreach``, ``test_defaults_changed_to_foreach``
  (and their helpers ``_test_derived_optimizers`` / ``_compare_between``): the ``foreach``
  implementation flag, which neither Muon has (``supported_impls=()``); the last three are also
  CUDA-only.
- ``test_fused_matches_forloop``, ``test_fused_error_on_params_on_meta``,
  ``test_fused_large_tensor``, ``test_fused_does_not_step_if_foundinf``,
  ``test_fused_cpu_matches_cuda``: the ``fused`` flag (neither Muon has one).
- ``test_mixed_device_dtype``: foreach/fused on two GPUs.
- ``test_cpu_load_state_dict``: ``fused``/``capturable`` flags, on a non-CPU device.
- ``test_state_dict_with_cuda_params``: CUDA-only (a CPU checkpoint loaded onto CUDA params).
- ``test_second_order_optims_return_consistent_types``: LBFGS only (``step_requires_closure``).
- ``TestDifferentiableOptimizer`` (imported by test_optim.py): the ``differentiable`` flag.
"""

from __future__ import annotations

import copy
import functools
import io
import logging

import pytest
import torch
from torch import nn
from torch.nn import Parameter
from torch.optim import SGD
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import torch_muon_inputs
from harness import run_ranks
from optimizer import Muon

if not torch_muon_inputs.has_torch_muon():
    pytest.skip(torch_muon_inputs.NO_TORCH_MUON, allow_module_level=True)

# torch.optim.Muon compared like for like: its own iteration in fp32 (conftest.py)
pytestmark = pytest.mark.usefixtures("torch_muon_in_fp32")

ATOL = 1e-6  # ours vs torch.optim.Muon (fp32 both) after a few steps: float32 rounding

# ``optim_inputs_func_muon``'s inputs by their ``desc``, as the installed torch defines them, but for
# those ours cannot run (``torch_muon_inputs.CANNOT_RUN``, each refused in test_inputs_we_cannot_run_are_refused);
# test_port_runs_every_torch_input fails if an input goes missing between torch's list and this one.
INPUT_DESCS = torch_muon_inputs.runnable_descs()
by_input = pytest.mark.parametrize("desc", INPUT_DESCS, ids=lambda d: d.replace(" ", "_"))
with_bias = pytest.mark.parametrize("with_bias", [False, True], ids=["muon_form", "with_bias"])


# ----------------------------------------------------------------------------- helpers


@functools.cache
def muon_info():
    """torch's OptimizerInfo for torch.optim.Muon (its scheduler inputs and error inputs)."""
    from torch.testing._internal.common_optimizers import optim_db

    return next(o for o in optim_db if o.optim_cls is torch.optim.Muon)


def torch_inputs():
    """torch's optim inputs for Muon, fresh (a Tensor lr is mutated in place by schedulers)."""
    return torch_muon_inputs.torch_inputs()


def kwargs_of(desc: str) -> dict:
    return next(i for i in torch_inputs() if i.desc == desc).kwargs


def clone_kwargs(kw: dict) -> dict:
    """The same keywords with a Tensor lr copied (each optimizer gets its own)."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()}


def weight_bias_input(contiguous=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        weight = Parameter(torch.randn((10, 5), generator=g))
        bias = Parameter(torch.randn((10,), generator=g))
    else:
        weight = Parameter(torch.randn((10, 5, 2), generator=g)[..., 0])
        bias = Parameter(torch.randn((10, 2), generator=g)[..., 0])
    return weight, bias, torch.randn(5, generator=g)


def matrices(seed=0, shapes=((24, 16), (16, 24))):
    """A tall and a wide matrix (adjust_lr "original" and "match_rms_adamw" differ on both)."""
    g = torch.Generator().manual_seed(seed)
    return [Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]


def copies(params):
    return [Parameter(p.detach().clone()) for p in params]


def grad_for(p, step, index, scale=1.0):
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(p.shape, generator=g) * scale


def run_steps(opt, params, steps, start=0, scale=1.0, sign=1.0):
    for t in range(start, start + steps):
        for i, p in enumerate(params):
            p.grad = sign * grad_for(p, t, i, scale)
        opt.step()


def assert_params_close(ours, ref, atol=ATOL, what=""):
    for i, (p, r) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(p.detach(), r.detach(), atol=atol, rtol=0, msg=lambda m: f"{what}[{i}]: {m}")


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def assert_same(a, b, path="state_dict"):
    """Nested state dicts equal: tensors bit for bit, everything else with ==."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), f"{path}: {a!r} vs {b!r}"
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{path}: {m}")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def without_param_names(state_dict):
    out = copy.deepcopy(state_dict)
    for group in out["param_groups"]:
        group.pop("param_names", None)
    return out


def make_named(params, named):
    return [(f"name{i}", p) for i, p in enumerate(params)] if named else list(params)


MUON_STATE = {"momentum_buffer"}
ADAMW_STATE = {"step", "exp_avg", "exp_avg_sq"}


# =============================================================================================
# Part 1: TestOptimRenewed, ported
# =============================================================================================


def test_errors(caplog):
    """torch's error inputs for Muon: the same error type (and torch's message, or ours naming the
    culprit). Adapted: torch refuses a 3-D parameter ("Muon only supports 2D parameters"); ours
    sends an unnamed 3-D tensor (an expert stack or a conv kernel: ambiguous) to AdamW with a
    warning naming it (issue 30), so that input must construct and step. torch raises
    RuntimeError at step() for a complex parameter; ours refuses it at construction with a
    ValueError naming it (either is accepted: both refuse before anything changes)."""
    from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_error_inputs_func_muon

    ours_instead = {
        "Tensor lr must be 1-element": r"`lr`.*one-element",
        "only support `original` and `match_rms_adamw`": r"adjust_lr",  # torch < 2.15
        "unsupported adjust_lr_fn": r"adjust_lr",  # torch 2.15
    }
    seen = set()
    for error_input in optim_error_inputs_func_muon(device="cpu", dtype=torch.float32):
        inp = error_input.optimizer_error_input
        seen.add(inp.desc)
        if inp.desc == "only support 2D parameters":  # ours: ambiguous 3-D, AdamW and a warning
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="optimizer.muon"):
                opt = Muon(inp.params, **inp.kwargs)
            opt.step()
            assert set(opt.state[inp.params[0]]) == ADAMW_STATE
            shape = str(tuple(inp.params[0].shape))
            assert [r for r in caplog.records if r.levelno == logging.WARNING and shape in r.getMessage()
                    and "went to AdamW" in r.getMessage()]
            continue
        if inp.desc == "does not support complex parameters":
            with pytest.raises((ValueError, RuntimeError), match="complex"):
                Muon(inp.params, **inp.kwargs).step()
            continue
        pattern = error_input.error_regex
        if inp.desc in ours_instead:
            pattern = f"({pattern})|({ours_instead[inp.desc]})"
        if issubclass(error_input.error_type, Warning):
            assert error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR
            with pytest.warns(error_input.error_type, match=pattern):
                Muon(inp.params, **inp.kwargs)
        elif error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
            with pytest.raises(error_input.error_type, match=pattern):
                Muon(inp.params, **inp.kwargs)
        else:
            opt = Muon(inp.params, **inp.kwargs)
            with pytest.raises(error_input.error_type, match=pattern):
                opt.step()
    assert {"only support 2D parameters", "does not support complex parameters",
            "Tensor lr must be 1-element", "invalid param type"} <= seen


def test_port_runs_every_torch_input():
    """Every Muon input the installed torch defines is run by the parametrized tests below, or is
    listed in ``CANNOT_RUN`` with its reason; nothing else is left out, and every listed one is
    refused by ours (test_inputs_we_cannot_run_are_refused).  Fails if the port silently drops one
    of torch's inputs (a filter, a hard-coded list that fell behind the release)."""
    descs = tuple(i.desc for i in torch_inputs())  # torch's list, read afresh
    assert descs, "torch defines no Muon inputs: the port would test nothing"
    assert len(set(descs)) == len(descs), f"torch's descs are not unique: {descs}"
    assert INPUT_DESCS == tuple(d for d in descs if d not in torch_muon_inputs.CANNOT_RUN)
    assert set(INPUT_DESCS) | (set(descs) & set(torch_muon_inputs.CANNOT_RUN)) == set(descs)
    assert all(entry.reason.strip() for entry in torch_muon_inputs.CANNOT_RUN.values())
    assert tuple(by_input.args[1]) == INPUT_DESCS


@pytest.mark.parametrize("desc", list(torch_muon_inputs.CANNOT_RUN), ids=lambda d: d.replace(" ", "_"))
def test_inputs_we_cannot_run_are_refused(desc):
    """An input listed as one ours cannot run is refused at construction with an error naming the
    option, before anything changes (so the listing is true; supporting it one day fails this test,
    and the input is then taken off the list and run).  Where the installed torch defines the input,
    its keywords are torch's (and equal the list's)."""
    entry = torch_muon_inputs.CANNOT_RUN[desc]
    kwargs = {i.desc: i.kwargs for i in torch_inputs()}.get(desc, entry.kwargs)
    assert kwargs == entry.kwargs, f"torch's keywords for {desc!r} changed: {kwargs}"
    weight = Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    before = weight.detach().clone()
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([weight], **kwargs)
    assert torch.equal(weight.detach(), before)


@by_input
@with_bias
@pytest.mark.parametrize("with_lrsched", [False, True], ids=["no_sched", "sched"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "noncontiguous"])
def test_forloop_goes_right_direction(desc, with_bias, with_lrsched, contiguous):
    for schedulers_c in (muon_info().scheduler_inputs if with_lrsched else [None]):
        kwargs = kwargs_of(desc)  # fresh per scheduler set (a Tensor lr is mutated)
        weight, bias, inp = weight_bias_input(contiguous)
        optimizer = Muon([weight, bias] if with_bias else [weight], **kwargs)
        schedulers = [s(optimizer) for s in (schedulers_c or [])]

        def closure():
            optimizer.zero_grad()
            out = weight.mv(inp) + bias if with_bias else weight.mv(inp)
            loss = out.pow(2).sum()
            loss.backward()
            return loss

        initial = closure().item()
        for _ in range(20):
            loss = closure()
            optimizer.step()
            for s in schedulers:
                s.step(loss.detach()) if isinstance(s, ReduceLROnPlateau) else s.step()
        assert closure().item() < initial


@with_bias
def test_maximize_goes_the_other_way_and_equals_negated_gradients(with_bias):
    """``maximize`` (not a torch.optim.Muon option; TestOptimRenewed checks that the loss goes up):
    the loss rises, and the matrices equal torch.optim.Muon fed the negated gradients."""
    weight, bias, inp = weight_bias_input()
    optimizer = Muon([weight, bias] if with_bias else [weight], lr=0.01, maximize=True)

    def closure():
        optimizer.zero_grad()
        loss = (weight.mv(inp) + bias if with_bias else weight.mv(inp)).pow(2).sum()
        loss.backward()
        return loss

    initial = closure().item()
    for _ in range(20):
        closure()
        optimizer.step()
    assert closure().item() > initial

    ours, ref = matrices(), matrices()
    run_steps(Muon(ours, lr=0.02, maximize=True), ours, 4)
    run_steps(torch.optim.Muon(ref, lr=0.02), ref, 4, sign=-1.0)
    assert_params_close(ours, ref, what="maximize")


@with_bias
def test_param_group_with_lrscheduler_goes_right_direction(with_bias):
    for schedulers_c in muon_info().scheduler_inputs:
        weight, bias, inp = weight_bias_input()
        other = bias if with_bias else Parameter(torch.randn((10, 5), generator=torch.Generator().manual_seed(9)))
        optimizer = Muon([{"params": [weight]}, {"params": [other], "lr": 0.01}])
        schedulers = [s(optimizer) for s in schedulers_c]

        def closure():
            optimizer.zero_grad()
            out = weight.mv(inp) + (bias if with_bias else other.mv(inp))
            loss = out.pow(2).sum()
            loss.backward()
            return loss

        initial = closure().item()
        for _ in range(20):
            loss = optimizer.step(closure)
            for s in schedulers:
                s.step(loss.detach()) if isinstance(s, ReduceLROnPlateau) else s.step()
        assert closure().item() < initial


@by_input
@with_bias
@pytest.mark.parametrize("num_dim", [0, 1, 2])
def test_tensor_lr(desc, with_bias, num_dim):
    """A float lr and the same lr as a 1-element tensor of 0, 1 or 2 dims give the same steps."""
    weight, bias, inp = weight_bias_input()
    weight_c, bias_c = (p.detach().clone().requires_grad_(True) for p in (weight, bias))
    kwargs = kwargs_of(desc)
    kwargs.pop("lr", None)
    kwargs["lr"] = 1e-3
    optimizer_r = Muon([weight, bias] if with_bias else [weight], **kwargs)
    kwargs["lr"] = torch.tensor(1e-3).reshape([1] * num_dim)
    optimizer = Muon([weight_c, bias_c] if with_bias else [weight_c], **kwargs)

    def closure(optim, w, b):
        optim.zero_grad()
        loss = (w.mv(inp) + b if with_bias else w.mv(inp)).pow(2).sum()
        loss.backward()
        return loss

    for _ in range(5):
        closure(optimizer_r, weight, bias)
        optimizer_r.step()
        closure(optimizer, weight_c, bias_c)
        optimizer.step()
        torch.testing.assert_close(weight, weight_c)
        if with_bias:
            torch.testing.assert_close(bias, bias_c)


@by_input
def test_param_groups_weight_decay(desc):
    """torch's Muon form: two matrices, the second group without weight decay."""
    weight_kwargs = kwargs_of(desc)
    other_kwargs = dict(kwargs_of(desc), weight_decay=0.0)
    weight, _, inp = weight_bias_input()
    weight2 = Parameter(torch.randn((10, 5), generator=torch.Generator().manual_seed(9)))
    optimizer = Muon([dict(params=[weight], **weight_kwargs), dict(params=[weight2], **other_kwargs)])

    def loss_fn():
        return (weight.mv(inp) + weight2.mv(inp)).pow(2).sum()

    initial = loss_fn().item()
    for _ in range(20):
        optimizer.zero_grad()
        loss = loss_fn()
        loss.backward()
        optimizer.step()
    assert loss.item() < initial
    assert optimizer.param_groups[1]["weight_decay"] == 0.0


@by_input
def test_param_groups_lr(desc):
    """A group at the input's lr moves the loss; a group at the outer lr=1e-28 does not move."""
    kwargs = kwargs_of(desc)
    if "lr" not in kwargs or kwargs["lr"] == 0:
        kwargs["lr"] = 1e-3
    weight, _, inp = weight_bias_input()
    irrelevant = Parameter(torch.randn((2, 2), generator=torch.Generator().manual_seed(5)))
    irrelevant_clone = irrelevant.detach().clone()
    optimizer = Muon([dict(params=[weight], **kwargs), dict(params=[irrelevant])], lr=1e-28)

    initial = weight.mv(inp).pow(2).sum().item()
    for _ in range(20):
        optimizer.zero_grad()
        loss = weight.mv(inp).pow(2).sum()
        loss.backward()
        irrelevant.grad = torch.rand_like(irrelevant)
        optimizer.step()
    assert loss.item() < initial
    assert torch.equal(irrelevant.detach(), irrelevant_clone)


@by_input
def test_step_is_noop_when_params_have_no_grad(desc):
    """Parameters without gradients are not stepped (not even weight decay) and get no state."""
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g), torch.randn(3, generator=g)]
    old = [p.clone() for p in params]
    optimizer = Muon(params, **kwargs_of(desc))
    loss = optimizer.step(lambda: torch.tensor([1.0]))
    assert loss.item() == 1.0
    assert all(torch.equal(p, o) for p, o in zip(params, old))
    assert not any(p in optimizer.state for p in params)


@pytest.mark.parametrize("desc", [d for d in INPUT_DESCS if "weight_decay" not in kwargs_of(d)],
                         ids=lambda d: d.replace(" ", "_"))
@with_bias
def test_step_is_noop_for_zero_grads(desc, with_bias):
    """torch's check (lr 1e-5, default tolerance), and sharper: a zero gradient moves a matrix by
    weight decay alone, ``p * (1 - lr * weight_decay)``, and by nothing without weight decay.
    (torch leaves out the inputs that set weight_decay, as this does.)"""
    kwargs = kwargs_of(desc)
    assert kwargs.get("weight_decay", 0) == 0
    kwargs["lr"] = torch.tensor(1e-5) if torch.is_tensor(kwargs.get("lr", 1e-5)) else 1e-5
    g = torch.Generator().manual_seed(2)
    param = torch.randn((5, 1), generator=g, requires_grad=True)
    bias = torch.randn((5,), generator=g, requires_grad=True)
    params = [param, bias] if with_bias else [param]
    old = [p.detach().clone() for p in params]
    optimizer = Muon(params, **clone_kwargs(kwargs))
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step(lambda: torch.tensor([1.0]))
    for p, o in zip(params, old):
        torch.testing.assert_close(p.detach(), o)  # torch's check
        torch.testing.assert_close(p.detach(), o * (1 - 1e-5 * 0.1), rtol=1e-6, atol=1e-9)  # default weight_decay 0.1

    params = [p.detach().clone().requires_grad_(True) for p in old]
    optimizer = Muon(params, **dict(clone_kwargs(kwargs), weight_decay=0.0))
    for _ in range(3):
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    assert all(torch.equal(p.detach(), o) for p, o in zip(params, old))


@by_input
def test_optimizer_can_be_printed(desc):
    g = torch.Generator().manual_seed(3)
    params = [Parameter(torch.randn(2, 3, generator=g)) for _ in range(2)]
    text = repr(Muon(params, **kwargs_of(desc)))
    assert text.startswith("Muon (") and "Parameter Group 0" in text
    if desc == "non-default lr":
        assert "lr: 0.01" in text


@by_input
@with_bias
@pytest.mark.parametrize("named0", [False, True], ids=["unnamed0", "named0"])
@pytest.mark.parametrize("named1", [False, True], ids=["unnamed1", "named1"])
def test_state_dict_deterministic(desc, with_bias, named0, named1):
    """Load a primed optimizer's state dict into a fresh one on equal (not identical) parameters:
    both then step bit-identically and have equal state dicts (param names aside); repeated
    parameter groups have one representation."""
    g = torch.Generator().manual_seed(4)
    weight = Parameter(torch.randn(2, 3, generator=g))
    bias = Parameter(torch.randn(2, generator=g))
    inp = torch.randn(3, generator=g)
    params = [weight, bias] if with_bias else [weight]

    def fwd_bwd(optim, w, b):
        optim.zero_grad()
        loss = (w.mv(inp) + b if with_bias else w.mv(inp)).pow(2).sum()
        loss.backward()
        return loss

    kwargs = kwargs_of(desc)
    optimizer = Muon(make_named(params, named0), **clone_kwargs(kwargs))
    for _ in range(10):
        fwd_bwd(optimizer, weight, bias)
        optimizer.step()
    with torch.no_grad():
        weight_c, bias_c = Parameter(weight.clone()), Parameter(bias.clone())
    optimizer_c = Muon(make_named([weight_c, bias_c] if with_bias else [weight_c], named1), **clone_kwargs(kwargs))
    optimizer_c.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for _ in range(10):
        fwd_bwd(optimizer, weight, bias)
        fwd_bwd(optimizer_c, weight_c, bias_c)
        optimizer.step()
        optimizer_c.step()
        assert torch.equal(weight, weight_c)
        if with_bias:
            assert torch.equal(bias, bias_c)
    assert_same(without_param_names(optimizer.state_dict()), without_param_names(optimizer_c.state_dict()))
    optimizer_c.param_groups.extend(optimizer_c.param_groups)
    assert_same(without_param_names(optimizer.state_dict())["param_groups"][-1],
                without_param_names(optimizer_c.state_dict())["param_groups"][-1])


@by_input
@with_bias
def test_state_dict_round_trip_leaves_stepping_identical(desc, with_bias):
    """``opt.load_state_dict(opt.state_dict())`` mid-run changes nothing: it steps bit-identically
    to a twin that never saw its own state dict."""
    weight, bias, _ = weight_bias_input()
    twin = copies([weight, bias])
    params, twin_params = ([weight, bias], twin) if with_bias else ([weight], twin[:1])
    kwargs = kwargs_of(desc)
    opt, twin_opt = Muon(params, **clone_kwargs(kwargs)), Muon(twin_params, **clone_kwargs(kwargs))
    run_steps(opt, params, 3)
    run_steps(twin_opt, twin_params, 3)
    opt.load_state_dict(opt.state_dict())
    run_steps(opt, params, 3, start=3)
    run_steps(twin_opt, twin_params, 3, start=3)
    assert all(torch.equal(p, q) for p, q in zip(params, twin_params))


def _older(state_dict):
    """A state dict from before the flags torch lists as added after release (OptimizerInfo's
    default ``not_og_supported_flags``, plus torch.optim.Muon's own, which is empty)."""
    old = copy.deepcopy(state_dict)
    flags = set(muon_info().not_og_supported_flags) | {"foreach", "differentiable", "maximize", "capturable"}
    for group in old["param_groups"]:
        for flag in flags:
            group.pop(flag, None)
    return old


@by_input
@with_bias
def test_can_load_older_state_dict(desc, with_bias):
    """torch's Muon form (``Linear(10, 4, bias=False)``) and the bias form. Loaded without the newer
    flags (``maximize`` here), the optimizer steps, exactly as with them (their defaults)."""
    results = []
    for make_old in (False, True):
        torch.manual_seed(1)
        model = nn.Linear(10, 4, bias=with_bias)
        inp = torch.rand(10)
        optimizer = Muon(model.parameters(), **kwargs_of(desc))

        def fwd_bwd():
            optimizer.zero_grad()
            model(inp).sum().backward()

        for _ in range(3):
            fwd_bwd()
            optimizer.step()
        state_dict = copy.deepcopy(optimizer.state_dict())
        if make_old:
            state_dict = _older(state_dict)
            assert all("maximize" not in g for g in state_dict["param_groups"])
        optimizer.load_state_dict(state_dict)
        fwd_bwd()
        optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@by_input
@with_bias
@pytest.mark.parametrize("named0", [False, True], ids=["unnamed0", "named0"])
@pytest.mark.parametrize("named1", [False, True], ids=["unnamed1", "named1"])
def test_can_load_from_to_named_state_dict(desc, with_bias, named0, named1):
    torch.manual_seed(1)
    model = nn.Linear(10, 4, bias=with_bias)
    inp = torch.rand(10)

    def fwd_bwd(optim):
        optim.zero_grad()
        model(inp).sum().backward()

    optimizer = Muon(model.named_parameters() if named0 else model.parameters(), **kwargs_of(desc))
    for _ in range(3):
        fwd_bwd(optimizer)
        optimizer.step()
    old_state_dict = copy.deepcopy(optimizer.state_dict())
    optimizer2 = Muon(model.named_parameters() if named1 else model.parameters(), **kwargs_of(desc))
    optimizer2.load_state_dict(old_state_dict)
    fwd_bwd(optimizer2)
    optimizer2.step()
    if named0 or named1:
        names = [n for g in optimizer2.state_dict()["param_groups"] for n in g["param_names"]]
        assert sorted(names) == (["bias", "weight"] if with_bias else ["weight"])


@by_input
@with_bias
@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
def test_save_load_equality_with_weights_only(desc, with_bias, named):
    g = torch.Generator().manual_seed(6)
    weight = Parameter(torch.randn(2, 3, generator=g))
    bias = Parameter(torch.randn(2, generator=g))
    inp = torch.randn(3, generator=g)
    optimizer = Muon(make_named([weight, bias] if with_bias else [weight], named), **kwargs_of(desc))

    def closure():
        optimizer.zero_grad()
        loss = (weight.mv(inp) + bias if with_bias else weight.mv(inp)).pow(2).sum()
        loss.backward()
        return loss

    for _ in range(3):
        optimizer.step(closure)
    sd = optimizer.state_dict()
    f = io.BytesIO()
    torch.save(sd, f)
    f.seek(0)
    assert_same(torch.load(f), sd)
    f.seek(0)
    assert_same(torch.load(f, weights_only=True), sd)


@by_input
@with_bias
def test_load_nontensor_step(desc, with_bias):
    """A state dict whose ``step`` entries are Python numbers (older checkpoints) loads and steps as
    the tensor ones do (AdamW parameters have a ``step``; Muon's have none)."""
    g = torch.Generator().manual_seed(7)
    init = [torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)]
    init += [torch.randn(3, generator=g)] if with_bias else []
    grads = [torch.rand(p.shape, generator=g) for p in init]
    results = []
    for as_number in (False, True):
        params = [Parameter(p.clone()) for p in init]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        optimizer = Muon(params, **kwargs_of(desc))
        for _ in range(3):
            optimizer.step()
        state_dict = copy.deepcopy(optimizer.state_dict())
        if as_number:
            converted = 0
            for p_state in state_dict["state"].values():
                if "step" in p_state and torch.is_tensor(p_state["step"]):
                    p_state["step"] = p_state["step"].item()
                    converted += 1
            assert converted == (1 if with_bias else 0)
        optimizer.load_state_dict(state_dict)
        optimizer.step()
        results.append(params)
    assert_params_close(results[1], results[0], what="nontensor step")


# ---------------------------------------------------------------------- state-dict hooks


def _state_dict_pre_hook(optimizer):
    optimizer.state["test"] = 1


def _state_dict_post_hook(optimizer, state_dict):
    if "test" in state_dict["state"]:
        state_dict["state"].pop("test")
        state_dict["ran_state_dict_pre_hook"] = True
    else:
        state_dict["ran_state_dict_pre_hook"] = False
    return state_dict


def _load_state_dict_pre_hook1(optimizer, state_dict):
    state_dict["param_groups"][0]["lr"] = 0.002


def _load_state_dict_pre_hook2(optimizer, state_dict):
    # torch: "the typical use case for returning a state dict is to drastically modify it"
    my_state_dict = copy.deepcopy(state_dict)
    my_state_dict["param_groups"][0]["lr"] = 0.003
    return my_state_dict


def _load_state_dict_post_hook(optimizer):
    optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
    optimizer.state["ran_load_state_dict_post_hook"] = True


def _one_param_optimizer(desc):
    return Muon([torch.rand(2, 3, requires_grad=True)], **kwargs_of(desc))


@by_input
def test_state_dict_pre_hook(desc):
    optim = _one_param_optimizer(desc)
    optim.register_state_dict_pre_hook(_state_dict_pre_hook)
    assert optim.state_dict()["state"]["test"] == 1


@by_input
def test_state_dict_post_hook(desc):
    optim = _one_param_optimizer(desc)
    optim.register_state_dict_post_hook(_state_dict_post_hook)
    assert optim.state_dict()["ran_state_dict_pre_hook"] is False


@by_input
def test_state_dict_pre_post_hook(desc):
    optim = _one_param_optimizer(desc)
    optim.register_state_dict_pre_hook(_state_dict_pre_hook)
    optim.register_state_dict_post_hook(_state_dict_post_hook)
    state_dict = optim.state_dict()
    assert "test" not in state_dict["state"]
    assert state_dict["ran_state_dict_pre_hook"] is True


@by_input
def test_load_state_dict_pre_hook_and_prepend(desc):
    optim = _one_param_optimizer(desc)
    state_dict = optim.state_dict()
    optim.register_load_state_dict_pre_hook(_load_state_dict_pre_hook1)
    optim.load_state_dict(state_dict)
    assert optim.param_groups[0]["lr"] == 0.002
    optim.register_load_state_dict_pre_hook(_load_state_dict_pre_hook2, prepend=True)
    optim.load_state_dict(state_dict)
    # if prepend were False this would be 0.003; hook 1 runs last and overrides
    assert optim.param_groups[0]["lr"] == 0.002


@by_input
def test_load_state_dict_post_hook(desc):
    optim = _one_param_optimizer(desc)
    optim.register_load_state_dict_post_hook(_load_state_dict_post_hook)
    optim.load_state_dict(optim.state_dict())
    assert not optim.state["ran_load_state_dict_pre_hook2"]  # (a tensor with a Tensor lr, as in torch)
    assert optim.state["ran_load_state_dict_post_hook"] is True


@by_input
def test_load_state_dict_pre_post_hook(desc):
    optim = _one_param_optimizer(desc)
    optim.register_load_state_dict_pre_hook(_load_state_dict_pre_hook2)
    optim.register_load_state_dict_post_hook(_load_state_dict_post_hook)
    optim.load_state_dict(optim.state_dict())
    assert optim.state["ran_load_state_dict_pre_hook2"] is True
    assert optim.state["ran_load_state_dict_post_hook"] is True


# ----------------------------------------------------------------------------- step hooks


def _hook_params():
    return [torch.tensor([[1.0, 1.0]])]  # torch uses tensor([1, 1]); a matrix for torch's Muon form


@by_input
def test_step_post_hook(desc):
    data = 2

    def post_hook(opt, args, kwargs):
        nonlocal data
        data += 2

    optim = Muon(_hook_params(), **kwargs_of(desc))
    handle = optim.register_step_post_hook(post_hook)
    optim.step()
    optim.step()
    assert data == 6
    handle.remove()
    optim.step()
    assert data == 6


@by_input
def test_step_pre_hook(desc):
    data = 5

    def pre_hook(opt, args, kwargs):
        nonlocal data
        data += 2

    optim = Muon(_hook_params(), **kwargs_of(desc))
    handle = optim.register_step_pre_hook(pre_hook)
    optim.step()
    optim.step()
    assert data == 9
    handle.remove()
    optim.step()
    assert data == 9


@by_input
def test_step_all_hooks(desc):
    data = []
    params = _hook_params()
    optim = Muon(params, **kwargs_of(desc))
    optim2 = SGD(params)
    handles = [
        register_optimizer_step_pre_hook(lambda *a: data.append(0)),
        register_optimizer_step_post_hook(lambda *a: data.append(5)),
    ]
    try:
        for o in (optim, optim2):
            handles.append(o.register_step_pre_hook(lambda *a: data.append(1)))
            handles.append(o.register_step_post_hook(lambda *a: data.append(2)))
        optim.step()
        assert data == [0, 1, 2, 5]
        optim2.step()
        assert data == [0, 1, 2, 5] * 2
        optim.step()
        assert data == [0, 1, 2, 5] * 3
    finally:
        for h in handles:
            h.remove()
    optim.step()
    optim2.step()
    assert data == [0, 1, 2, 5] * 3


# -------------------------------------------------------------------------- deepcopy, state


@by_input
@with_bias
def test_deepcopy_copies_all_public_attrs(desc, with_bias):
    """torch's check, and the copy goes on stepping like the original (its own parameters)."""
    g = torch.Generator().manual_seed(8)
    params = [Parameter(torch.randn(2, 3, generator=g)) for _ in range(2)]
    if with_bias:
        params.append(Parameter(torch.randn(3, generator=g)))
    for p in params:
        p.grad = torch.rand(p.shape, generator=g)
    optimizer = Muon(params, **kwargs_of(desc))
    for _ in range(3):
        optimizer.step()

    def public(obj):
        return {k for k in obj.__dict__ if not k.startswith("_")}

    clone = copy.deepcopy(optimizer)
    assert public(optimizer) == public(clone)
    own = [p for group in optimizer.param_groups for p in group["params"]]
    theirs = [p for group in clone.param_groups for p in group["params"]]
    assert not {id(p) for p in own} & {id(p) for p in theirs}  # the copy has its own parameters
    run_steps(optimizer, own, 2)
    run_steps(clone, theirs, 2)
    assert_params_close(theirs, own, atol=0, what="deepcopy")


@by_input
@with_bias
def test_non_empty_state(desc, with_bias):
    model = nn.Linear(5, 5, bias=with_bias)
    inp = torch.rand(2, 5)
    optim = Muon(model.parameters(), **kwargs_of(desc))
    optim.zero_grad()
    model(inp).sum().backward()
    optim.step()
    assert len(optim.state) == (2 if with_bias else 1)
    for state in optim.state.values():
        assert len(state) > 0


# ------------------------------------------------------- add_param_group, zero_grad (torch API)


def test_add_param_group_like_torch():
    """``add_param_group`` with a torch-style group (no ``use_muon``): the same steps as
    torch.optim.Muon's; a 1-D parameter added that way goes to AdamW."""
    ours, ref = matrices(), matrices()
    opt = Muon(ours[:1], lr=0.02)
    opt.add_param_group({"params": ours[1:], "lr": 0.01})
    torch_opt = torch.optim.Muon(ref[:1], lr=0.02)
    torch_opt.add_param_group({"params": ref[1:], "lr": 0.01})
    run_steps(opt, ours, 4)
    run_steps(torch_opt, ref, 4)
    assert_params_close(ours, ref, what="add_param_group")
    assert [g["lr"] for g in opt.param_groups] == [0.02, 0.01]

    bias = Parameter(torch.zeros(16))
    opt.add_param_group({"params": [bias]})
    run_steps(opt, ours + [bias], 1, start=4)
    assert set(opt.state[bias]) == ADAMW_STATE


def test_zero_grad_sets_to_none_or_zero():
    params = matrices() + [Parameter(torch.ones(3))]
    opt = Muon(params, lr=0.02)
    run_steps(opt, params, 1)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


# ------------------------------------------------ correctness against torch.optim.Muon itself


@by_input
def test_matches_torch_muon_for_each_optim_input(desc):
    """Each of torch's Muon inputs, ours and torch.optim.Muon on the same gradients, 5 steps: a tall,
    a wide and a non-contiguous matrix."""
    def params():
        g = torch.Generator().manual_seed(11)
        return matrices() + [Parameter((torch.randn((10, 5, 2), generator=g) * 0.1)[..., 0])]

    ours, ref, init = params(), params(), params()
    assert not ours[2].is_contiguous()
    kwargs = kwargs_of(desc)
    run_steps(Muon(ours, **clone_kwargs(kwargs)), ours, 5)
    run_steps(torch.optim.Muon(ref, **clone_kwargs(kwargs)), ref, 5)
    assert_params_close(ours, ref, what=desc)
    assert max_diff(ref, init) > 1e-3  # they moved


# =============================================================================================
# Part 2: migration from torch.optim.Muon
# =============================================================================================


def _seq():
    model = nn.Sequential(nn.Linear(16, 24, bias=False), nn.Linear(24, 16, bias=False))
    for p, m in zip(model.parameters(), matrices()):
        p.data.copy_(m.detach())
    return model


PARAM_FORMS = {
    "list": lambda ps: list(ps),
    "generator": lambda ps: (p for p in ps),
    "groups": lambda ps: [{"params": [ps[0]]}, {"params": [ps[1]], "lr": 0.01}],
    "named": lambda ps: [(f"w{i}", p) for i, p in enumerate(ps)],
    "named_groups": lambda ps: [{"params": [("w0", ps[0])]}, {"params": [("w1", ps[1])], "lr": 0.01}],
}


@pytest.mark.parametrize("form", list(PARAM_FORMS))
def test_torch_style_params_equal_torch_muon(form):
    """``Muon(params, lr=0.02)`` for a plain list, a generator (``model.parameters()``), groups
    without ``use_muon`` and torch's named parameters equals ``torch.optim.Muon(params, lr=0.02)``."""
    ours, ref = matrices(), matrices()
    opt = Muon(PARAM_FORMS[form](ours), lr=0.02)
    torch_opt = torch.optim.Muon(PARAM_FORMS[form](ref), lr=0.02)
    run_steps(opt, ours, 5)
    run_steps(torch_opt, ref, 5)
    assert_params_close(ours, ref, what=form)
    assert all(set(opt.state[p]) == MUON_STATE for p in ours)


@pytest.mark.parametrize("form", ["list", "group"])
def test_named_and_unnamed_params_mixed_are_refused_like_torch(form):
    """torch: "all optimizer params should be with/without names" (a ValueError), whatever the form
    (explicit ``use_muon`` groups get it from torch's ``add_param_group``)."""
    named, unnamed = matrices()
    params = [("w0", named), unnamed]
    for make in (torch.optim.Muon, Muon):
        with pytest.raises(ValueError, match="all optimizer params should be with/without names"):
            make(params if form == "list" else [{"params": params}])


def test_model_parameters_equal_torch_muon():
    model, ref = _seq(), _seq()
    opt = Muon(model.parameters(), lr=0.02)
    torch_opt = torch.optim.Muon(ref.parameters(), lr=0.02)
    run_steps(opt, list(model.parameters()), 5)
    run_steps(torch_opt, list(ref.parameters()), 5)
    assert_params_close(list(model.parameters()), list(ref.parameters()), what="model.parameters()")


class Mixed(nn.Module):
    """Matrices (2-D weights, a 3-D expert stack) and non-matrices (biases, a norm, a 0-D scale, a
    4-D conv kernel)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(12)
        self.up = nn.Linear(16, 24)
        self.experts = nn.Parameter(torch.randn(4, 8, 24, generator=g) * 0.1)
        self.norm = nn.LayerNorm(24)
        self.down = nn.Linear(24, 16, bias=False)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.kernel = nn.Parameter(torch.randn(2, 3, 1, 1, generator=g) * 0.1)
        with torch.no_grad():
            for p in (self.up.weight, self.up.bias, self.norm.weight, self.norm.bias, self.down.weight):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def matrices(self):
        return [self.up.weight, self.experts, self.down.weight]

    def others(self):
        return [self.up.bias, self.norm.weight, self.norm.bias, self.scale, self.kernel]


MIXED_FORMS = {
    "list": lambda m: list(m.parameters()),
    "generator": lambda m: m.parameters(),
    "named": lambda m: m.named_parameters(),
    "group": lambda m: [{"params": list(m.parameters())}],
}


@pytest.mark.parametrize("form", list(MIXED_FORMS))
def test_non_matrices_go_to_adamw_as_with_explicit_groups(form):
    """Each parameter goes to Muon if it is a matrix (2-D, or a 3-D expert stack where its name
    says so: ``named_parameters()``) and to AdamW otherwise (an unnamed 3-D tensor is ambiguous:
    AdamW, issue 30); the result equals explicit ``use_muon`` groups (with torch's default
    ``adjust_lr="original"``, which torch-style input gets), and the 2-D weights equal
    torch.optim.Muon's."""
    model, explicit, ref = Mixed(), Mixed(), Mixed()
    opt = Muon(MIXED_FORMS[form](model), lr=0.02)
    named = form == "named"
    muon_of = (lambda m: m.matrices()) if named else (lambda m: [m.up.weight, m.down.weight])
    adamw_of = (lambda m: m.others()) if named else (lambda m: [m.experts, *m.others()])
    explicit_opt = Muon([{"params": muon_of(explicit), "use_muon": True, "adjust_lr": "original"},
                         {"params": adamw_of(explicit), "use_muon": False}], lr=0.02)
    torch_opt = torch.optim.Muon([ref.up.weight, ref.down.weight], lr=0.02)
    for t in range(4):
        for m in (model, explicit, ref):
            for i, p in enumerate(m.parameters()):
                p.grad = grad_for(p, t, i)
        opt.step()
        explicit_opt.step()
        torch_opt.step()
    for p in muon_of(model):
        assert set(opt.state[p]) == MUON_STATE, tuple(p.shape)
    for p in adamw_of(model):
        assert set(opt.state[p]) == ADAMW_STATE, tuple(p.shape)
    assert_params_close(list(model.parameters()), list(explicit.parameters()), what="vs explicit groups")
    assert_params_close([model.up.weight, model.down.weight], [ref.up.weight, ref.down.weight], what="vs torch")


def test_torch_style_input_recommends_default_groups_once(caplog, monkeypatch):
    """An info log recommends ``get_default_muon_param_groups(model)`` once for torch-style input
    (not again at every step); explicit ``use_muon`` groups get none. The note is logged once per
    process: the test makes the process forget earlier tests' note (``optimizer.muon._SPLIT_LOGGED``)."""
    import optimizer.muon

    monkeypatch.setattr(optimizer.muon, "_SPLIT_LOGGED", [])
    caplog.set_level(logging.INFO, logger="optimizer.muon")  # whatever level earlier tests left it at

    def notes():
        return [r for r in caplog.records if "get_default_muon_param_groups" in r.getMessage()
                and r.levelno == logging.INFO]  # not the warning about ambiguous 3-D tensors (test_roles.py)

    model = Mixed()
    Muon([{"params": model.matrices(), "use_muon": True}, {"params": model.others(), "use_muon": False}], lr=0.02)
    assert not notes()
    opt = Muon(model.parameters(), lr=0.02)
    for t in range(3):
        for i, p in enumerate(model.parameters()):
            p.grad = grad_for(p, t, i)
        opt.step()
    assert len(notes()) == 1, [r.getMessage() for r in caplog.records]
    assert notes()[0].levelno == logging.INFO


# ------------------------------------------------------------------------- torch's keywords

SMALL = 0.01  # gradient scale: ||G||_F ~ 0.2, so eps=1.0 (not 1e-7) changes the normalisation
KW_CASES = {
    "lr": dict(lr=0.05),
    "tensor_lr": dict(lr=torch.tensor(0.05)),
    "weight_decay": dict(weight_decay=0.3),
    "no_weight_decay": dict(weight_decay=0.0),
    "momentum": dict(momentum=0.8),
    "nesterov": dict(nesterov=False),
    "ns_coefficients": dict(ns_coefficients=(3.4, -4.7, 2.0)),
    "eps": dict(eps=1.0),
    "ns_steps": dict(ns_steps=3),
    "adjust_lr_fn_None": dict(adjust_lr_fn=None),
    "adjust_lr_fn_original": dict(adjust_lr_fn="original"),
    "adjust_lr_fn_match_rms_adamw": dict(adjust_lr_fn="match_rms_adamw"),
    "all": dict(lr=0.05, weight_decay=0.3, momentum=0.8, nesterov=False, ns_coefficients=(3.4, -4.7, 2.0),
                eps=1.0, ns_steps=3, adjust_lr_fn="match_rms_adamw"),
}
DEFAULT_EQUIVALENT = {"adjust_lr_fn_None", "adjust_lr_fn_original"}


def _torch_run(params_fn, kwargs, steps=4, args=()):
    ref = matrices()
    run_steps(torch.optim.Muon(params_fn(ref), *args, **clone_kwargs(kwargs)), ref, steps, scale=SMALL)
    return ref


@pytest.mark.parametrize("case", list(KW_CASES))
def test_torch_keywords_have_torch_meaning(case):
    """``Muon(params, **kw)`` equals ``torch.optim.Muon(params, **kw)`` for each of torch's keywords."""
    kw = KW_CASES[case]
    ours = matrices()
    run_steps(Muon(ours, **clone_kwargs(kw)), ours, 4, scale=SMALL)
    ref = _torch_run(list, kw)
    assert_params_close(ours, ref, what=case)
    if case not in DEFAULT_EQUIVALENT:  # the keyword changes torch's own result: matching it means something
        assert max_diff(ref, _torch_run(list, {})) > 1e-5, case


POSITIONAL = (0.05, 0.3, 0.8, False, (3.4, -4.7, 2.0), 1.0, 3, "match_rms_adamw")


@pytest.mark.parametrize("count", [1, 4, len(POSITIONAL)])
def test_positional_arguments_in_torch_order(count):
    """``Muon(params, lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
    adjust_lr_fn)``, as torch.optim.Muon takes them."""
    args = POSITIONAL[:count]
    ours = matrices()
    run_steps(Muon(ours, *args), ours, 4, scale=SMALL)
    ref = _torch_run(list, {}, args=args)
    assert_params_close(ours, ref, what=f"{count} positional")
    assert max_diff(ref, _torch_run(list, {})) > 1e-5


def _per_group(ps):
    return [{"params": [ps[0]], "lr": 0.05, "weight_decay": 0.0, "momentum": 0.8, "nesterov": False,
             "ns_coefficients": (3.4, -4.7, 2.0), "eps": 1.0, "ns_steps": 3, "adjust_lr_fn": "match_rms_adamw"},
            {"params": [ps[1]]}]


def test_per_group_values_have_torch_meaning():
    """Every torch keyword set per group (a Muon group's ``eps`` is the Newton–Schulz eps, as in torch)."""
    ours = matrices()
    run_steps(Muon(_per_group(ours), lr=0.02), ours, 4, scale=SMALL)
    ref = _torch_run(_per_group, dict(lr=0.02))
    assert_params_close(ours, ref, what="per-group")
    # the group's eps alone changes torch's result
    no_eps = _torch_run(lambda ps: [{k: v for k, v in g.items() if k != "eps"} for g in _per_group(ps)], dict(lr=0.02))
    assert (ref[0] - no_eps[0]).abs().max() > 1e-5


def test_adjust_lr_and_adjust_lr_fn_together_are_refused():
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon(matrices(), adjust_lr="original", adjust_lr_fn="original")


def test_default_adjust_lr_is_torchs_for_torch_style_input_and_ours_for_use_muon_groups():
    """Neither ``adjust_lr`` nor ``adjust_lr_fn`` given: torch-style input (a plain list, groups
    without ``use_muon``) steps as torch's default (``adjust_lr_fn=None`` = "original");
    explicit ``use_muon`` groups keep ours ("match_rms_adamw")."""
    original = _torch_run(list, dict(lr=0.02))
    match_rms = _torch_run(list, dict(lr=0.02, adjust_lr_fn="match_rms_adamw"))
    assert max_diff(original, match_rms) > 1e-3
    for form in ("list", "groups_without_use_muon", "use_muon_groups"):
        ours = matrices()
        params = {"list": list(ours), "groups_without_use_muon": [{"params": list(ours)}],
                  "use_muon_groups": [{"params": list(ours), "use_muon": True}]}[form]
        run_steps(Muon(params, lr=0.02), ours, 4, scale=SMALL)
        assert_params_close(ours, match_rms if form == "use_muon_groups" else original, what=form)
    # and an explicit choice wins in explicit groups too
    ours = matrices()
    run_steps(Muon([{"params": list(ours), "use_muon": True}], lr=0.02, adjust_lr_fn="original"), ours, 4, scale=SMALL)
    assert_params_close(ours, original, what="use_muon groups, adjust_lr_fn='original'")


# ----------------------------------------------------------- torch.optim.Muon checkpoints load

K_STEPS, N_STEPS = 3, 3
TORCH_RUNS = {
    "default": (lambda ps: list(ps), dict(lr=0.02)),
    "options": (lambda ps: list(ps), dict(lr=0.02, weight_decay=0.0, momentum=0.8, nesterov=False,
                                          adjust_lr_fn="match_rms_adamw", ns_steps=4)),
    "tensor_lr": (lambda ps: list(ps), dict(lr=torch.tensor(0.02))),
    "named": (PARAM_FORMS["named"], dict(lr=0.02)),
    "groups": (PARAM_FORMS["groups"], dict(lr=0.02, momentum=0.9)),
}


def _as_use_muon_groups(form):
    """The same groups, said explicitly to be Muon groups (names stay names)."""
    def build(ps):
        groups = form(ps)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        return [dict(g, use_muon=True) for g in groups]
    return build


@pytest.mark.parametrize("built_with", ["same_keywords", "defaults", "use_muon_groups"])
@pytest.mark.parametrize("run", list(TORCH_RUNS))
def test_torch_muon_state_dict_continues_in_ours(run, built_with):
    """k steps of torch.optim.Muon, its ``state_dict()`` loaded into ours built on the same
    parameters: the momentum carries over and the next n steps equal torch's own continuation.
    Built with torch's keywords, with none (the checkpoint's group options are restored, as
    torch's ``load_state_dict`` restores them), or as explicit ``use_muon`` groups with no
    keywords (the checkpoint's ``adjust_lr_fn=None`` is torch's, "original", not our default)."""
    form, kw = TORCH_RUNS[run]
    ref = matrices()
    torch_opt = torch.optim.Muon(form(ref), **clone_kwargs(kw))
    run_steps(torch_opt, ref, K_STEPS)
    state_dict = copy.deepcopy(torch_opt.state_dict())
    at_k = [p.detach().clone() for p in ref]
    ours = copies(ref)
    if built_with == "use_muon_groups":
        opt = Muon(_as_use_muon_groups(form)(ours))
    else:
        opt = Muon(form(ours), **(clone_kwargs(kw) if built_with == "same_keywords" else {}))
    opt.load_state_dict(state_dict)
    for p, r in zip(ours, ref):
        assert torch.equal(opt.state[p]["momentum_buffer"], torch_opt.state[r]["momentum_buffer"])
    run_steps(opt, ours, N_STEPS, start=K_STEPS)
    run_steps(torch_opt, ref, N_STEPS, start=K_STEPS)
    assert_params_close(ours, ref, what=f"{run} continued")
    # control: the same parameters at step k without the momentum continue visibly differently
    cold = copies(at_k)
    run_steps(torch.optim.Muon(form(cold), **clone_kwargs(kw)), cold, N_STEPS, start=K_STEPS)
    assert max_diff(cold, ref) > 1e-4


def _dcp_rank(rank, world, root, start, grads):
    """Ours over DTensor shards (row- and column-sharded) built torch-style, loading a
    torch.optim.Muon checkpoint through DCP, then N_STEPS steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    placements = [[Shard(0)], [Shard(1)]]
    model = _seq()
    for mod, full, pl in zip(model, start, placements):
        mod.weight = Parameter(distribute_tensor(full.clone(), mesh, pl))
    opt = Muon(model.parameters(), lr=0.02)
    target = {"optim": get_optimizer_state_dict(model, opt)}
    # The checkpoint has torch's group keys only; ours adds its own (use_muon, its layout
    # version, ...), which a strict DCP load reports missing: load what the checkpoint has.
    dcp.load(target, checkpoint_id=root, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_optimizer_state_dict(model, opt, target["optim"])
    loaded = [opt.state[p]["momentum_buffer"].full_tensor() for p in model.parameters()]
    for step_grads in grads:
        for p, g, pl in zip(model.parameters(), step_grads, placements):
            p.grad = distribute_tensor(g.clone(), mesh, pl)
        opt.step()
    return loaded, [p.full_tensor().detach() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_muon_checkpoint_through_dcp_continues_in_sharded_ours(tmp_path):
    """torch.optim.Muon saved with ``get_optimizer_state_dict`` + ``dcp.save`` (one process), loaded
    by ours over 2 ranks of DTensor shards (``dcp.load`` with ``allow_partial_load=True``,
    ``set_optimizer_state_dict``): the momentum carries over and the continuation equals torch's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _seq()
    params = list(model.parameters())
    torch_opt = torch.optim.Muon(model.parameters(), lr=0.02)
    run_steps(torch_opt, params, K_STEPS)
    dcp.save({"optim": get_optimizer_state_dict(model, torch_opt)}, checkpoint_id=str(tmp_path))
    start = [p.detach().clone() for p in params]
    momentum = [torch_opt.state[p]["momentum_buffer"].clone() for p in params]
    grads = [[grad_for(p, t, i) for i, p in enumerate(params)] for t in range(K_STEPS, K_STEPS + N_STEPS)]
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        torch_opt.step()
    loaded, final = run_ranks(_dcp_rank, 2, str(tmp_path), start, grads, timeout=90)[0]
    assert_params_close(loaded, momentum, atol=0, what="momentum loaded")
    assert_params_close(final, params, what="sharded continuation")


# ------------------------------------------------------------------ load_state_dict and hooks


def _explicit(ps):
    return [{"params": list(ps), "use_muon": True}]


def _primed(steps=2):
    ps = matrices()
    opt = Muon(_explicit(ps), lr=0.02)
    run_steps(opt, ps, steps)
    return ps, opt


def _transposed(state_dict):
    """A copy whose first momentum buffer is transposed (a shape the parameter does not have)."""
    out = copy.deepcopy(state_dict)
    first = out["param_groups"][0]["params"][0]
    out["state"][first]["momentum_buffer"] = out["state"][first]["momentum_buffer"].T.contiguous()
    return out


def test_pre_hook_repairs_a_broken_state_dict_then_it_loads():
    """``load_state_dict`` runs torch's pre-hooks first and validates what they return: a broken
    state dict is refused with our error, and loads once a pre-hook repairs it; post-hooks run
    after loading and see the loaded state. The repaired load continues exactly."""
    ps, opt = _primed()
    good = copy.deepcopy(opt.state_dict())
    broken = _transposed(good)
    fresh = copies(ps)
    with pytest.raises(ValueError, match=r"Muon\.load_state_dict.*momentum_buffer"):
        Muon(_explicit(fresh), lr=0.02).load_state_dict(broken)

    calls = []

    def repair(optimizer, state_dict):
        calls.append("pre")
        return _transposed(state_dict)  # transposing again restores it

    def post(optimizer):
        p0 = optimizer.param_groups[0]["params"][0]
        calls.append(("post", tuple(optimizer.state[p0]["momentum_buffer"].shape)))

    loaded = Muon(_explicit(fresh), lr=0.02)
    loaded.register_load_state_dict_pre_hook(repair)
    loaded.register_load_state_dict_post_hook(post)
    loaded.load_state_dict(broken)
    assert calls == ["pre", ("post", tuple(fresh[0].shape))]
    run_steps(loaded, fresh, 3, start=2)
    run_steps(opt, ps, 3, start=2)
    assert all(torch.equal(p, q) for p, q in zip(fresh, ps))


def test_pre_hook_that_breaks_a_good_state_dict_is_refused():
    """What a pre-hook returns is checked like any state dict: a hook that breaks a good one gets
    our clear error, and the optimizer is left as it was."""
    ps, opt = _primed()
    good = copy.deepcopy(opt.state_dict())
    target_params = copies(ps)
    target = Muon(_explicit(target_params), lr=0.05)
    run_steps(target, target_params, 1)
    before = copy.deepcopy(target.state_dict())
    target.register_load_state_dict_pre_hook(lambda optimizer, sd: _transposed(sd))
    with pytest.raises(ValueError, match=r"Muon\.load_state_dict.*momentum_buffer.*shape"):
        target.load_state_dict(good)
    assert_same(target.state_dict(), before)


@pytest.mark.parametrize("style", ["use_muon_groups", "torch_style"])
@pytest.mark.parametrize("how", ["set_directly", "state_dict_pre_hook"])
def test_non_parameter_state_entries_round_trip(style, how):
    """Entries of ``opt.state`` that are not a parameter's (``opt.state["test"] = 1``, as torch's
    own tests write, directly or from a state-dict pre-hook) are saved and loaded "as is, for
    backward compatibility" (torch's ``load_state_dict``), and change no step."""
    ps = matrices()
    def build(ps):
        return Muon(_explicit(ps) if style == "use_muon_groups" else list(ps), lr=0.02)

    opt = build(ps)
    run_steps(opt, ps, 2)
    if how == "set_directly":
        opt.state["test"] = 1
    else:
        opt.register_state_dict_pre_hook(_state_dict_pre_hook)
    state_dict = opt.state_dict()
    assert state_dict["state"]["test"] == 1
    fresh = copies(ps)
    loaded = build(fresh)
    loaded.load_state_dict(copy.deepcopy(state_dict))
    assert loaded.state["test"] == 1
    assert_same(without_param_names(loaded.state_dict()), without_param_names(state_dict))
    run_steps(loaded, fresh, 2, start=2)
    run_steps(opt, ps, 2, start=2)
    assert all(torch.equal(p, q) for p, q in zip(fresh, ps))
