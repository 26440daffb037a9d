"""Every option is declared once (``optimizer.settings``) and everything else follows from the
declarations: the constructor, validation, the cross-rank agreement, pickling and the step
plan's cache key.

The agreement test enumerates the declarations themselves, so an option added later is covered
(or this test fails until it has an alternative value below); the dummy-option test adds an
option to the declarations inside the test only and shows that it is agreed, pickled and part of
the cache key with no other change.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import pickle

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from dist_cases import build_groups, make_case_tensors, outcome, parse_placement, to_dtensor
from harness import run_ranks
from optimizer import Muon, MuonSettings, QKClipConfig, settings
from optimizer.settings import GROUP_OPTIONS, MUON, GroupOption


def declare(monkeypatch, name, value):
    """A declaration changed for this test only: in the module that declares it, and in the package
    that re-exports it (what editing the declaration changes)."""
    monkeypatch.setattr(settings.declarations, name, value)
    monkeypatch.setattr(settings, name, value)

SPECS = [
    ("layers.0.attention.wq.weight", (8, 12), ["S0"]),
    ("layers.0.attention.wk.weight", (8, 12), ["S0"]),
    ("layers.0.ffn.w1.weight", (10, 12), ["S1"]),
    ("layers.0.norm.weight", (12,), ["S0"]),
]

# A valid value other than the default, for every declared option (constructor keywords and
# per-group options).  A new option without an entry fails test_every_option_has_an_alternative.
CONSTRUCTOR_ALTERNATIVES = {
    "lr": 0.03, "weight_decay": 0.2, "momentum": 0.9, "nesterov": False, "ns_steps": 4,
    "ns_coefficients": "polar_express", "ns_method": "classic", "ns_split": "never", "adjust_lr": "original",
    "adamw_eps": 1e-6, "adamw_betas": (0.8, 0.9), "maximize": True, "eps": 1e-6, "adjust_lr_fn": "original",
    "compute_dtype": torch.float64,
    "qk_clip": QKClipConfig(head_dim=4, threshold=1e9), "distributed_mode": "gather", "chunk_size": 1,
    "lookahead": 2, "replica_split": "never", "replica_split_flops_per_byte": 7.0, "skip_nonfinite": True,
    "normuon_beta2": 0.9, "cautious_wd": True, "momentum_dtype": torch.bfloat16, "ns_kernels": "torch",
    "dion2_fraction": 0.25, "dion2_ef_decay": 0.9, "lion_betas": (0.8, 0.9),
}
GROUP_ALTERNATIVES = {
    "lr": 0.03, "weight_decay": 0.2, "momentum": 0.9, "nesterov": False, "ns_steps": 4,
    "ns_coefficients": "polar_express", "ns_method": "classic", "ns_split": "always", "adjust_lr": "original",
    "eps": 1e-6, "betas": (0.8, 0.9), "maximize": True, "muon_row_blocks": "heads:2", "muon_transposed": True,
    "normuon_beta2": 0.9, "cautious_wd": True, "momentum_dtype": torch.bfloat16, "ns_kernels": "torch",
    "dion2_fraction": 0.25, "dion2_ef_decay": 0.9, "algorithm": "lion",
}
# Dion2 steps DTensor parameters (parallel/execution/dion2_step.py): dion2_fraction is agreed on
# a mesh like every other option.  dion2_ef_decay set without dion2_fraction is refused at
# construction on the rank that sets it (it applies to Dion2 groups only; tests/core/test_dion2_api.py),
# before any agreement, so it has no case here.
NOT_YET_ON_A_MESH = {"dion2_ef_decay"}


def test_every_option_has_an_alternative():
    assert set(CONSTRUCTOR_ALTERNATIVES) == set(settings.constructor_keywords())
    assert set(GROUP_ALTERNATIVES) == {o.name for o in GROUP_OPTIONS}
    for key, value in CONSTRUCTOR_ALTERNATIVES.items():
        assert value != settings.constructor_keywords()[key], key


def test_the_signature_and_docstring_come_from_the_declarations():
    sig = inspect.signature(Muon)
    keywords = {k: p.default for k, p in sig.parameters.items() if k != "params"}
    assert keywords == settings.constructor_keywords()
    for field in dataclasses.fields(MuonSettings):
        assert field.name in Muon.__init__.__doc__
    with pytest.raises(TypeError, match="unexpected keyword argument 'lookahed'"):
        Muon([{"params": [torch.nn.Parameter(torch.ones(2, 2))], "use_muon": True}], lookahed=2)


def _every_option_differing(rank, world_size, cases):
    mesh = init_device_mesh("cpu", (world_size,))
    params, grads = make_case_tensors(SPECS, 1)
    out = {}
    for kind, key, value in cases:
        named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
                 for n, _, pl in SPECS]
        groups = build_groups(named)
        if key == "lion_betas":  # Lion's betas are read by Lion groups only: one on every rank
            groups[1]["algorithm"] = "lion"
        kwargs = dict(lr=0.02)
        if rank == world_size - 1:
            if kind == "constructor":
                kwargs[key] = value
            else:
                kinds = next(o.kinds for o in GROUP_OPTIONS if o.name == key)
                groups[0 if MUON in kinds else 1][key] = value
        opt = Muon(groups, **kwargs)
        for n, p in named:
            p.grad = to_dtensor(grads[0][n], mesh, p.placements)
        before = [p.to_local().clone() for _, p in named]
        result = outcome(opt.step)
        unchanged = all(torch.equal(p.to_local(), b) for (_, p), b in zip(named, before)) and not opt.state
        out[(kind, key)] = (result, unchanged)
    return out


def test_every_declared_option_set_differently_on_one_rank_is_refused_on_every_rank_by_name():
    cases = [("constructor", k, v) for k, v in CONSTRUCTOR_ALTERNATIVES.items() if k not in NOT_YET_ON_A_MESH]
    cases += [("group", k, v) for k, v in GROUP_ALTERNATIVES.items() if k not in NOT_YET_ON_A_MESH]
    results = run_ranks(_every_option_differing, 2, cases, timeout=120)
    for kind, key, _ in cases:
        seen = [r[(kind, key)] for r in results]
        messages = {msg for (_, msg), _ in seen}
        assert len(messages) == 1, (key, messages)  # the same error on both ranks
        (exc, msg), _ = seen[0]
        # the constructor keyword sets the group option of its declared name (adamw_eps -> eps;
        # torch's adjust_lr_fn -> adjust_lr)
        names = {**{o.ctor_keyword: o.name for o in GROUP_OPTIONS}, "adjust_lr_fn": "adjust_lr"}
        name = names.get(key, key) if kind == "constructor" else key
        assert exc == "RuntimeError" and "settings differ" in msg and name in msg, (key, msg)
        assert "rank 0" in msg and "rank 1" in msg, msg
        assert all(unchanged for _, unchanged in seen), key


# ------------------------------------------------------------------ a dummy option, in this test only


def _option_field(default):
    return dataclasses.field(default=default, metadata={"declared": settings.Declared(
        "a dummy option", lambda value, where, context: settings.check_number(where, value, low=0.0), shapes_plan=True)})


@pytest.fixture
def dummy_options(monkeypatch):
    """``dummy`` (optimizer-wide) and ``dummy_beta`` (per Muon group), declared and nothing else."""
    with_dummy = dataclasses.make_dataclass(
        "MuonSettings", [("dummy", float, _option_field(0.5))], bases=(MuonSettings,), frozen=True)
    with_dummy.__module__ = settings.declarations.__name__  # pickle finds it where it finds MuonSettings
    declare(monkeypatch, "MuonSettings", with_dummy)
    dummy_beta = GroupOption("dummy_beta", (MUON,), 0.25, "a dummy group option",
                             lambda value, where, context: settings.check_number(where, value, low=0.0), shapes_plan=True)
    declare(monkeypatch, "GROUP_OPTIONS", (*GROUP_OPTIONS, dummy_beta))


def _net():
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 4, generator=g))
    b = torch.nn.Parameter(torch.randn(4, generator=g))
    return w, b


def test_a_dummy_option_is_validated_defaulted_pickled_and_in_the_cache_key(dummy_options):
    w, b = _net()
    opt = Muon([{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}], dummy=0.75, dummy_beta=0.5)
    assert opt.settings.dummy == 0.75
    assert opt.param_groups[0]["dummy_beta"] == 0.5
    with pytest.raises(ValueError, match="dummy"):
        Muon([{"params": [_net()[0]], "use_muon": True}], dummy=-1.0)
    with pytest.raises(ValueError, match=r"param_groups\[0\] dummy_beta"):
        Muon([{"params": [_net()[0]], "use_muon": True, "dummy_beta": math.nan}])
    # part of what the ranks compare
    record = settings.record(opt.settings, opt.param_groups)
    assert record["dummy"] == "0.75" and record["param_groups[0].dummy_beta"] == "0.5"
    # pickled with the optimizer
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert clone.settings.dummy == 0.75 and clone.param_groups[0]["dummy_beta"] == 0.5
    # part of the step plan's cache key: changing either rebuilds the step context
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.step()
    first = opt._cached_context
    opt.step()
    assert opt._cached_context is first
    opt.settings = dataclasses.replace(opt.settings, dummy=0.1)
    opt.step()
    second = opt._cached_context
    assert second is not first
    opt.param_groups[0]["dummy_beta"] = 0.1
    opt.step()
    assert opt._cached_context is not second


def _dummy_differs(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    params, grads = make_case_tensors(SPECS[:1], 1)
    name = SPECS[0][0]
    results = []
    for key in ("dummy", "dummy_beta"):
        p = torch.nn.Parameter(to_dtensor(params[name], mesh, [parse_placement("S0")]))
        opt = Muon([{"params": [p], "param_names": [name], "use_muon": True}], **({key: 0.9} if rank else {}))
        p.grad = to_dtensor(grads[0][name], mesh, p.placements)
        results.append(outcome(opt.step))
    return results


def test_a_dummy_option_is_agreed_across_ranks(dummy_options):
    for key, (kind, msg) in zip(("dummy", "dummy_beta"), run_ranks(_dummy_differs, 2, timeout=60)[0]):
        assert kind == "RuntimeError" and "settings differ" in msg and key in msg, msg


# ------------------------------------------------------------------ settings on a live optimizer


def test_settings_are_attributes_validated_on_assignment():
    w, _ = _net()
    opt = Muon([{"params": [w], "use_muon": True}], lookahead=2)
    assert opt.lookahead == 2 and opt.settings.lookahead == 2
    opt.lookahead = 3
    assert opt.settings.lookahead == 3
    with pytest.raises(ValueError, match="lookahead"):
        opt.lookahead = -1
    assert opt.lookahead == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.settings.lookahead = 4


def test_a_refused_param_group_leaves_the_optimizer_as_it_was():
    w, b = _net()
    opt = Muon([{"params": [w], "use_muon": True}])
    before = [dict(g) for g in opt.param_groups]
    matrix = torch.nn.Parameter(torch.ones(3, 3))
    for bad, option in (({"params": [b], "use_muon": False, "betas": (0.9, 2.0)}, "betas"),
                        ({"params": [matrix], "use_muon": True, "momentum": 2.0}, "momentum"),
                        ({"params": [matrix], "use_muon": True, "muon_row_blocks": "heads:2"}, "muon_row_blocks"),
                        ({"params": [matrix], "use_muon": True, "normuon_beta2": 1.0}, "normuon_beta2"),
                        ({"params": [matrix], "use_muon": True, "normuon_beta2": math.nan}, "normuon_beta2"),
                        ({"params": [b], "use_muon": False, "cautious_wd": 1}, "cautious_wd"),
                        ({"params": [matrix], "use_muon": True, "momentum_dtype": torch.int8}, "momentum_dtype")):
        with pytest.raises(ValueError, match=option):
            opt.add_param_group(bad)
        assert len(opt.param_groups) == 1 and opt.param_groups[0].keys() == before[0].keys()
    opt.add_param_group({"params": [b], "use_muon": False})  # the parameter of a refused group can be added
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("option, bad", [
    ("normuon_beta2", 1.0), ("normuon_beta2", -0.1), ("normuon_beta2", math.nan), ("normuon_beta2", "0.9"),
    ("normuon_beta2", True), ("cautious_wd", 1), ("cautious_wd", "yes"), ("cautious_wd", None),
    ("momentum_dtype", torch.int32), ("momentum_dtype", "int8"), ("momentum_dtype", "bfloat"),
    ("momentum_dtype", torch.complex64),
])
def test_bad_variant_values_are_refused_naming_the_option(option, bad):
    with pytest.raises(ValueError, match=f"`{option}`"):
        Muon([{"params": [_net()[0]], "use_muon": True}], **{option: bad})
    with pytest.raises(ValueError, match=rf"param_groups\[0\] {option}`"):
        Muon([{"params": [_net()[0]], "use_muon": True, option: bad}])


def test_variant_values_accepted_and_normalised():
    w, b = _net()
    opt = Muon([{"params": [w], "use_muon": True, "momentum_dtype": "torch.bfloat16"},
                {"params": [b], "use_muon": False}], normuon_beta2=0.0, cautious_wd=True, momentum_dtype="float32")
    assert opt.param_groups[0]["momentum_dtype"] == torch.bfloat16 and opt.group_defaults["muon"]["momentum_dtype"] == torch.float32
    assert opt.param_groups[0]["normuon_beta2"] == 0.0 and opt.param_groups[1]["cautious_wd"] is True
    # the same option given as a dtype or by name is the same setting for the ranks' agreement
    other = Muon([{"params": [_net()[0]], "use_muon": True, "momentum_dtype": torch.bfloat16},
                  {"params": [_net()[1]], "use_muon": False}], normuon_beta2=0.0, cautious_wd=True,
                 momentum_dtype=torch.float32)
    assert settings.digest(opt.settings, opt.param_groups) == settings.digest(other.settings, other.param_groups)


def test_an_optimizer_pickled_before_the_settings_record_still_loads():
    """Before this record, settings were attributes of the optimizer (``ns_eps``, the Newton–Schulz
    eps, now each Muon group's ``eps``) and the AdamW betas an attribute too; such a pickle
    unpickles into working settings."""
    w, b = _net()
    opt = Muon([{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}], lookahead=2, eps=1e-6)
    state = opt.__getstate__()
    old = {k: v for k, v in state.items() if k not in ("settings", "group_defaults")}
    old["param_groups"] = [dict(g, eps=1e-8) if g["use_muon"] else g for g in old["param_groups"]]  # v1: AdamW's
    old.update(ns_eps=1e-6, compute_dtype=None, qk_clip=None, distributed_mode="parallel", chunk_size=None,
               lookahead=2, skip_nonfinite=False, replica_split="auto", replica_split_flops_per_byte=None,
               adamw_betas=(0.8, 0.9))
    revived = Muon.__new__(Muon)
    revived.__setstate__(old)
    assert revived.settings == dataclasses.replace(MuonSettings(), lookahead=2)
    assert revived.group_defaults["adamw"]["betas"] == (0.8, 0.9)
    assert revived.param_groups[0]["eps"] == 1e-6 and revived.group_defaults["muon"]["eps"] == 1e-6
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    revived.step()
