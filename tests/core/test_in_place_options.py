"""Options set in place on a live group (schedulers set ``lr`` and ``momentum``; users switch
``ns_split`` on, edit ``param_names``) are checked at the start of every ``step()``, before
anything changes, by the same declarations that check them at construction (issue 38):

* one process: every refused value leaves parameters, state and ``param_groups`` as they were,
  in Muon and AdamW groups, also an AdamW group following a momentum schedule;
* the check costs per group: the options a cached plan was built with are not checked again until
  they change (counted: the number of checks per step does not grow with the parameters);
* two forked ranks: an option changed in place on one rank only is refused on both, before
  anything changes, never a hang; then the value is put back and both ranks step.

The refusal matrix over every refusal point (construction, ``add_param_group``,
``load_state_dict``, ``step``): tests/core/test_refusals.py.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dist_cases import outcome
from harness import run_ranks
from optimizer import Muon, settings
from optimizer.tensors import local_view

BAD = [  # (group index: 0 Muon, 1 AdamW; option; value set in place)
    (0, "momentum", 1.5), (0, "nesterov", "no"), (0, "weight_decay", math.nan), (0, "lr", -0.1),
    (0, "ns_steps", 0), (0, "adjust_lr", "bogus"), (0, "eps", 0.0), (0, "maximize", 1),
    (1, "lr", -0.1), (1, "betas", (0.9, 1.0)), (1, "weight_decay", math.inf), (1, "eps", -1.0),
    (1, "cautious_wd", "yes"),
]


def _named(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(8, 6, generator=g), "w2": torch.randn(6, 10, generator=g),
            "norm": torch.randn(6, generator=g)}


def _optimizer(params):
    return Muon([{"params": [params["w1"], params["w2"]], "param_names": ["w1", "w2"], "use_muon": True},
                 {"params": [params["norm"]], "param_names": ["norm"], "use_muon": False}],
                lr=0.02, ns_method="classic", compute_dtype=torch.float64)


def _grads(params, seed):
    g = torch.Generator().manual_seed(50 + seed)
    for p in params.values():
        full = torch.randn(p.shape, generator=g)
        p.grad = DTensor.from_local(full.tensor_split(2)[p.device_mesh.get_local_rank()], p.device_mesh,
                                    p.placements, shape=p.shape, stride=p.stride()) if isinstance(p, DTensor) else full


def _everything(opt):
    """Local values of every parameter and state tensor, and every group's options."""
    tensors = [local_view(p).clone() for g in opt.param_groups for p in g["params"]]
    tensors += [local_view(v).clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    options = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return tensors, repr(options)


def _unchanged(opt, before) -> bool:
    tensors, options = _everything(opt)
    return options == before[1] and len(tensors) == len(before[0]) and all(
        a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(tensors, before[0]))


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("group, key, bad", BAD, ids=[f"{'muon' if g == 0 else 'adamw'}-{k}={v!r}" for g, k, v in BAD])
def test_an_option_set_in_place_is_refused_at_the_step_before_anything_changes(group, key, bad):
    params = {n: torch.nn.Parameter(t) for n, t in _named().items()}
    opt = _optimizer(params)
    _grads(params, 0)
    opt.step()
    kept = dict(opt.param_groups[group])
    opt.param_groups[group][key] = bad
    before = _everything(opt)
    _grads(params, 1)
    with pytest.raises(ValueError, match=rf"`param_groups\[{group}\] {key}"):
        opt.step()
    assert _unchanged(opt, before)
    opt.param_groups[group].clear()
    opt.param_groups[group].update(kept)
    opt.step()
    assert not _unchanged(opt, before)


@pytest.mark.parametrize("key, bad", [("momentum", 1.5), ("ns_steps", 0)])
def test_a_first_step_refused_leaves_nothing_behind_for_the_next(key, bad):
    """Refused at the very first step (no plan cached yet), then corrected: the next step is the step
    an optimizer that never held the bad value takes, bit for bit (the refused step's context,
    which planned nothing, is not kept)."""
    runs = []
    for refuse_first in (True, False):
        params = {n: torch.nn.Parameter(t) for n, t in _named().items()}
        opt = _optimizer(params)
        _grads(params, 0)
        if refuse_first:
            good = opt.param_groups[0][key]
            opt.param_groups[0][key] = bad
            with pytest.raises(ValueError, match=key):
                opt.step()
            opt.param_groups[0][key] = good
        opt.step()
        runs.append([p.detach().clone() for p in params.values()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not torch.equal(runs[0][0], _named()["w1"])  # the Muon weight moved


def test_an_adamw_group_following_a_momentum_schedule_is_checked_with_the_betas_it_takes():
    """OneCycleLR with cycle_momentum writes ``momentum`` into every group; an AdamW group takes it
    as betas[0] (muon.follow_momentum_schedule), so a momentum of 1.5 is refused before it does."""
    params = {n: torch.nn.Parameter(t) for n, t in _named().items()}
    opt = _optimizer(params)
    _grads(params, 0)
    opt.step()
    opt.param_groups[1].update(momentum=1.5, max_momentum=1.5, base_momentum=0.85)
    before = _everything(opt)
    with pytest.raises(ValueError, match=r"param_groups\[1\] betas\[0\]"):
        opt.step()
    assert _unchanged(opt, before) and opt.param_groups[1]["betas"] == (0.9, 0.95)
    opt.param_groups[1]["momentum"] = 0.85
    opt.step()
    assert opt.param_groups[1]["betas"] == (0.85, 0.95)


@pytest.fixture
def counted_checks(monkeypatch):
    """Every declared option's check, counted by option name."""
    counts: dict[str, int] = {}

    def counting(option):
        def check(value, where, context):
            counts[option.name] = counts.get(option.name, 0) + 1
            return option.check(value, where, context)
        return dataclasses.replace(option, check=check)

    counted = tuple(counting(o) for o in settings.GROUP_OPTIONS)
    monkeypatch.setattr(settings.declarations, "GROUP_OPTIONS", counted)  # where it is declared
    monkeypatch.setattr(settings, "GROUP_OPTIONS", counted)  # and where the package re-exports it
    return counts


def _checks_per_step(counts, n_params, change=None):
    g = torch.Generator().manual_seed(0)
    muon = [torch.nn.Parameter(torch.randn(4, 4, generator=g)) for _ in range(n_params)]
    norms = [torch.nn.Parameter(torch.randn(4, generator=g)) for _ in range(n_params)]
    names = [f"w{i}" for i in range(n_params)]
    opt = Muon([{"params": muon, "param_names": names, "use_muon": True,
                 "muon_row_blocks": {n: "blocks:2,2" for n in names}},  # a plan option that grows with the group
                {"params": norms, "param_names": [f"n{i}" for i in range(n_params)], "use_muon": False}])
    for p in muon + norms:
        p.grad = torch.ones_like(p)
    opt.step()  # builds the plan
    counts.clear()
    for _ in range(3):
        opt.step()
    steady = dict(counts)
    if change is not None:
        counts.clear()
        change(opt.param_groups)
        opt.step()
    return steady, dict(counts)


def test_the_per_step_check_costs_per_group_not_per_parameter(counted_checks):
    small, _ = _checks_per_step(counted_checks, 2)
    large, changed = _checks_per_step(counted_checks, 64, lambda gs: gs[0].__setitem__("ns_steps", 4))
    assert small == large and small, (small, large)  # the same checks, however many parameters
    plan_options = {o.name for o in settings.GROUP_OPTIONS if o.shapes_plan}
    assert not plan_options & set(small), small  # the cached plan's options are not checked again
    assert set(small) >= {"lr", "momentum", "nesterov", "weight_decay", "betas"}
    assert small["lr"] == 3 * 2  # three steps, two groups
    # a plan option changed: every option is checked once more at the next step
    assert changed["ns_steps"] == 1 and changed["muon_row_blocks"] == 1


# --------------------------------------------------------------------------- two ranks


def _raising_blocks(name, shape):
    raise KeyError("bug")


ONE_RANK = [  # changed in place on rank 1 only: (case id, group, key, value); None value: see _change
    ("momentum=0.9 (valid, different)", 0, "momentum", 0.9),
    *[(f"{'muon' if g == 0 else 'adamw'}-{k}={v!r}", g, k, v) for g, k, v in BAD],
    ("ns_steps='5'", 0, "ns_steps", "5"),
    ("lr=2-element tensor", 0, "lr", torch.tensor([0.1, 0.2])),
    ("ns_kernels='triton' (cannot run in float64)", 0, "ns_kernels", "triton"),
    ("muon_row_blocks raising", 0, "muon_row_blocks", _raising_blocks),
    ("muon_row_blocks not fitting", 0, "muon_row_blocks", {"w1": "blocks:3,3"}),
    ("param_names short", 0, "param_names", ["w1"]),
    ("param_names=5", 0, "param_names", 5),
    ("use_muon='yes'", 0, "use_muon", "yes"),
]


def _one_rank_changes(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    params = {n: torch.nn.Parameter(DTensor.from_local(t.tensor_split(world_size)[rank], mesh, [Shard(0)],
                                                       shape=t.shape, stride=t.stride()))
              for n, t in _named().items()}
    opt = _optimizer(params)
    _grads(params, 0)
    opt.step()
    out = {}
    for case, group, key, value in ONE_RANK:
        kept = dict(opt.param_groups[group])
        if rank == 1:
            opt.param_groups[group][key] = value
        before = _everything(opt)
        _grads(params, 1)
        result = outcome(opt.step)
        unchanged = _unchanged(opt, before)
        opt.param_groups[group].clear()
        opt.param_groups[group].update(kept)
        after = outcome(opt.step)  # both ranks step again, together
        out[case] = (result, unchanged, after)
    return out


def test_an_option_changed_in_place_on_one_rank_is_refused_on_both_before_anything_changes():
    results = run_ranks(_one_rank_changes, 2, timeout=180)
    for case, group, key, _ in ONE_RANK:
        (exc0, msg0), unchanged0, after0 = results[0][case]
        (exc1, msg1), unchanged1, after1 = results[1][case]
        assert exc0 != "ok" and exc1 != "ok", (case, msg0, msg1)
        assert unchanged0 and unchanged1, case
        assert after0 == ("ok", "") and after1 == ("ok", ""), (case, after0, after1)
        named = key if key != "param_names" else "param_names"
        assert named in msg1 or "muon_row_blocks spec" in msg1, (case, msg1)  # the rank that changed it
        # the other rank: the same "settings differ" error naming the option, or "rejected their inputs"
        assert (exc0 == "RuntimeError" and (f"{key}" in msg0 or "rejected their inputs" in msg0)), (case, msg0)
