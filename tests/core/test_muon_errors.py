"""Bad input to Muon gets a clear error that names the culprit and says what to do,
and nothing is changed by a step that raises."""

from __future__ import annotations

import math

import pytest
import torch

from optimizer import Muon, QKClipConfig


def _named_groups():
    g = torch.Generator().manual_seed(0)
    wq = torch.nn.Parameter(torch.randn(8, 6, generator=g))
    wk = torch.nn.Parameter(torch.randn(4, 6, generator=g))
    norm = torch.nn.Parameter(torch.ones(6))
    groups = [
        {"params": [wq, wk], "param_names": ["layers.0.attn.wq.weight", "layers.0.attn.wk.weight"], "use_muon": True},
        {"params": [norm], "param_names": ["layers.0.norm.weight"], "use_muon": False},
    ]
    return groups, (wq, wk, norm)


def _with_grads(params):
    for p in params:
        p.grad = torch.ones_like(p)


def test_groups_without_use_muon_are_split_by_shape_and_a_wrong_use_muon_is_named():
    """A plain list of tensors (torch.optim's call) or a group without ``use_muon``: matrices go to
    Muon, the rest to AdamW (issue 20; exactness against torch.optim.Muon is tested in
    test_torch_optim_renewed.py); an unnamed 3-D tensor is ambiguous (experts or a conv kernel):
    AdamW, and named as experts, Muon (issue 30, tests/core/test_roles.py).  A ``use_muon`` that is
    not a bool is still refused by name."""
    w, e = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(2, 4, 3))
    b = torch.nn.Parameter(torch.zeros(4))
    for params in ([w, b, e], [{"params": [w, b, e]}]):
        opt = Muon(params)
        assert [g["use_muon"] for g in opt.param_groups] == [True, False]
        assert opt.param_groups[0]["params"] == [w] and opt.param_groups[1]["params"] == [b, e]
    opt = Muon([("w", w), ("b", b), ("moe.experts", e)])
    assert opt.param_groups[0]["param_names"] == ["w", "moe.experts"] and opt.param_groups[1]["param_names"] == ["b"]
    with pytest.raises(ValueError, match="`use_muon` must be True or False"):
        Muon([{"params": [w], "use_muon": 1}])


def test_one_dimensional_tensor_in_a_muon_group_is_named():
    bias = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"'mlp.bias'.*use_muon=False"):
        Muon([{"params": [bias], "param_names": ["mlp.bias"], "use_muon": True}])


def test_complex_parameter_is_named():
    z = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"'rot.weight' is complex"):
        Muon([{"params": [z], "param_names": ["rot.weight"], "use_muon": True}])


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(lr=math.nan), "lr"),
        (dict(lr=-1.0), "lr"),
        (dict(weight_decay=math.inf), "weight_decay"),
        (dict(momentum=math.nan), "momentum"),
        (dict(momentum=1.5), "momentum"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(adjust_lr="bogus"), "adjust_lr"),
        (dict(adamw_betas=(0.9, math.nan)), r"betas\[1\]"),
        (dict(adamw_betas=(1.0, 0.9)), r"betas\[0\]"),
        (dict(adamw_eps=0.0), "eps"),
        (dict(eps=math.inf), "eps"),
        (dict(compute_dtype=torch.int32), "compute_dtype"),
        (dict(distributed_mode="allgather"), "distributed_mode"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(lookahead=-1), "lookahead"),
        (dict(qk_clip={"threshold": 1.0}), "qk_clip"),
    ],
)
def test_bad_hyper_parameters_name_the_key(kwargs, key):
    groups, _ = _named_groups()
    with pytest.raises(ValueError, match=key):
        Muon(groups, **kwargs)


def test_sparse_gradient_is_named_and_nothing_changes():
    groups, params = _named_groups()
    opt = Muon(groups, lr=0.1)
    _with_grads(params)
    params[0].grad = params[0].grad.to_sparse()
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"'layers.0.attn.wq.weight' has a sparse gradient"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state


@pytest.mark.parametrize(
    "qk_logits, match",
    [
        ({3: torch.ones(2)}, r"layers \[3\] that QK-clip does not know"),
        ({0: torch.ones(3)}, r"qk_logits\[0\].*2 query heads"),
        ({0: torch.ones(1, 2)}, r"qk_logits\[0\].*2 query heads"),
        ({0: [1.0, 2.0]}, r"qk_logits\[0\].*1-D tensor"),
        ({0: torch.tensor([1.0, math.nan])}, r"qk_logits\[0\].*NaN"),
        ({"0": torch.ones(2)}, "QK-clip does not know"),  # str layer keys exist (towers); "0" is not layer 0
        ([torch.ones(2)], "dict"),
    ],
)
def test_bad_qk_logits_are_explained_and_nothing_changes(qk_logits, match):
    groups, params = _named_groups()
    opt = Muon(groups, lr=0.1, qk_clip=QKClipConfig(head_dim=4, threshold=1.0))
    _with_grads(params)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=match):
        opt.step(qk_logits=qk_logits)
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state


def test_qk_logits_without_qk_clip_config_says_how_to_enable_it():
    groups, params = _named_groups()
    opt = Muon(groups, lr=0.1)
    _with_grads(params)
    with pytest.raises(ValueError, match=r"qk_clip=QKClipConfig\("):
        opt.step(qk_logits={0: torch.ones(2)})


def test_nothing_a_user_passes_is_changed():
    groups, params = _named_groups()
    opt = Muon(groups, lr=0.1, weight_decay=0.1)
    _with_grads(params)
    grads = [p.grad.clone() for p in params]
    logits = {0: torch.tensor([5.0, 0.5])}
    logits_before = logits[0].clone()
    opt2 = Muon(_named_groups()[0], lr=0.1, qk_clip=QKClipConfig(head_dim=4, threshold=1.0))
    opt.step()
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)
    _with_grads(opt2.param_groups[0]["params"])
    opt2.step(qk_logits=logits)
    assert torch.equal(logits[0], logits_before)
