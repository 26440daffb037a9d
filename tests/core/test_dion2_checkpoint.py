"""Checkpoints of Dion2 and NorDion2 groups through ``torch.distributed.checkpoint`` (issue 40).

A run of DTensor parameters (4 ranks, a (2, 2) mesh: ``_StridedShard`` rows, last-dim sharding,
uneven rows, 3-D experts sharded on the expert dim and columns, a vector on AdamW) with a Dion2
or a NorDion2 group is saved after K steps with DCP, loaded into a fresh optimizer (other
weights, other Dion2 options, another lr: everything must come from the checkpoint) and continued
to N steps:

* on the same 4-rank layout: every parameter equals the uninterrupted 4-rank run bit for bit
  (``torch.equal``), as Muon's resume does (``test_checkpoint.py``);
* resharded, on 2 ranks with other placements and on one device: the loaded ``momentum_buffer``
  and NorDion2's ``normuon_v`` equal the saved ones bit for bit (their ``full_tensor()``), the
  group options come back, and the parameters match single-device Dion2 fed the same gradients
  for N steps (within the fp32 rounding of batched matmuls, as Muon's resharded resume);
* controls: continuing with the momentum (or ``v``) reset misses by far more.

The config-level runs (the example model on its configs' meshes, ``dion2_hsdp`` and
``nordion2_fsdp_tp``, saved and resumed, also resharded) are in ``test_checkpoint.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dist_cases import OPT_KW, build_groups, make_case_tensors, parse_placement, run_reference, to_dtensor
from harness import run_ranks
from optimizer import Muon

K, N = 2, 4
LR = 0.02
ATOL, RTOL = 2e-6, 1e-5  # parallel vs single device: fp32 rounding of batched matmuls (as test_checkpoint_variants)
VARIANTS = {
    "dion2": dict(dion2_fraction=0.25, dion2_ef_decay=0.9, weight_decay=0.1),
    "nordion2": dict(dion2_fraction=0.5, dion2_ef_decay=0.8, normuon_beta2=0.9, cautious_wd=True, weight_decay=0.2),
}
# The options a fresh optimizer is built with before loading: other values of the variant's
# numbers (DCP loads the keys the loading groups hold, so the same keys, other values; a boolean
# option off is a key the group does not hold, so cautious_wd stays as the variant has it).
WRONG = {"dion2_fraction": 1.0, "dion2_ef_decay": 0.5, "normuon_beta2": 0.5, "weight_decay": 0.0}
# (name, shape, placements on the 4-rank (2, 2) mesh, placements on the 2-rank (2,) mesh), as
# test_checkpoint_variants.py (torch 2.13's DCP misplaces a standalone _StridedShard of a 1-D
# mesh and uneven _StridedShard splits: not used as targets).
LAYOUTS = [
    ("layers.0.attention.wq.weight", (16, 12), ["SS0/2", "S0"], ["S1"]),  # strided rows -> columns
    ("layers.0.attention.wo.weight", (12, 16), ["S0", "S1"], ["S0"]),  # last dim -> rows
    ("layers.0.ffn.w1.weight", (9, 6), ["S1", "S0"], ["S0"]),  # uneven rows, columns -> uneven rows
    ("layers.0.moe.w1", (3, 8, 12), ["S0", "S2"], ["S1"]),  # experts and columns -> rows
    ("layers.0.norm.weight", (12,), ["S0", "R"], ["S0"]),
]
SPECS = [(n, s, p4) for n, s, p4, _ in LAYOUTS]
MATRICES = [n for n, s, _ in SPECS if len(s) >= 2]
STATE_KEYS = ("momentum_buffer", "normuon_v")


def _quiet():
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _net(mesh, placements, group_options, seed=0):
    params, _ = make_case_tensors(SPECS, N, seed)
    net = torch.nn.Module()
    for (name, _, _, _), pl in zip(LAYOUTS, placements):
        t = params[name] if mesh is None else to_dtensor(params[name], mesh, [parse_placement(x) for x in pl])
        net.register_parameter(name.replace(".", "_"), torch.nn.Parameter(t))
    named = [(n, p) for (n, _, _, _), p in zip(LAYOUTS, net.parameters())]
    return net, named, Muon(build_groups(named, group_options), **{**OPT_KW, "lr": LR})


def _train(named, opt, steps, mesh):
    _, grads = make_case_tensors(SPECS, N, 0)
    for s in steps:
        for n, p in named:
            g = grads[s][n]
            p.grad = to_dtensor(g, mesh, p.placements) if isinstance(p, DTensor) else g.clone()
        opt.step()


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _state(opt, named):
    """{key: {name: full tensor}} of the matrices' Dion2 state."""
    return {key: {n: _full(opt.state[p][key]) for n, p in named if key in opt.state.get(p, {})} for key in STATE_KEYS}


def _save(rank, world_size, path, variant):
    """The uninterrupted 4-rank run of N steps, and a run saved after K (state and groups returned)."""
    _quiet()
    mesh = init_device_mesh("cpu", (2, 2))
    placements = [p4 for _, _, p4, _ in LAYOUTS]
    net, named, opt = _net(mesh, placements, VARIANTS[variant])
    _train(named, opt, range(N), mesh)
    uninterrupted = {n: _full(p) for n, p in named}
    net, named, opt = _net(mesh, placements, VARIANTS[variant])
    _train(named, opt, range(K), mesh)
    dcp.save({"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}, checkpoint_id=path)
    return uninterrupted, _state(opt, named)


def _resume(rank, world_size, path, variant, reset=None):
    """A fresh optimizer (other weights, other Dion2 options) loads the checkpoint and runs K..N-1.
    ``reset``: a state key zeroed after loading (the controls)."""
    _quiet()
    if world_size == 4:
        mesh, placements = init_device_mesh("cpu", (2, 2)), [p4 for _, _, p4, _ in LAYOUTS]
    else:
        mesh = init_device_mesh("cpu", (world_size,)) if world_size > 1 else None
        placements = [p2 for _, _, _, p2 in LAYOUTS]
    wrong = {k: WRONG.get(k, v) for k, v in VARIANTS[variant].items()}
    net, named, opt = _net(mesh, placements, wrong, seed=1)
    sd = {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(net, sd["model"])
    set_optimizer_state_dict(net, opt, sd["optim"])
    loaded = _state(opt, named)
    options = {k: opt.param_groups[0][k] for k in VARIANTS[variant]}
    if reset is not None:
        for _, p in named:
            if reset in opt.state.get(p, {}):
                opt.state[p][reset].zero_()
    _train(named, opt, range(K, N), mesh)
    return loaded, options, {n: _full(p) for n, p in named}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(variant):
        if variant not in cache:
            path = str(tmp_path_factory.mktemp(variant) / "ckpt")
            cache[variant] = path, run_ranks(_save, 4, path, variant, timeout=180)[0]
        return cache[variant]

    return get


def _deviation(got, want):
    return max((got[n] - want[n]).abs().max().item() for n in want)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_on_the_same_layout_is_bit_identical(saved, variant):
    path, (uninterrupted, saved_state) = saved(variant)
    loaded, options, params = run_ranks(_resume, 4, path, variant, timeout=180)[0]
    assert options == {k: VARIANTS[variant][k] for k in options}, options
    assert {key: set(v) for key, v in loaded.items()} == {key: set(v) for key, v in saved_state.items()}
    different = [n for n in uninterrupted if not torch.equal(params[n], uninterrupted[n])]
    assert not different, f"{variant}: {different} differ from the uninterrupted run (max {_deviation(params, uninterrupted):.3g})"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("world_size", [2, 1])
def test_resharded_resume_restores_the_state_and_continues_as_single_device(saved, variant, world_size):
    path, (_, saved_state) = saved(variant)
    loaded, options, params = run_ranks(_resume, world_size, path, variant, timeout=180)[0]
    assert options == {k: VARIANTS[variant][k] for k in options}, options
    # the state the Dion2 step keeps: momentum for every matrix, v for NorDion2's only
    assert set(saved_state["momentum_buffer"]) == set(MATRICES)
    assert set(saved_state["normuon_v"]) == (set(MATRICES) if "normuon_beta2" in VARIANTS[variant] else set())
    for key in STATE_KEYS:
        assert set(loaded[key]) == set(saved_state[key]), key
        for n, want in saved_state[key].items():
            assert torch.equal(loaded[key][n], want) and loaded[key][n].dtype == want.dtype, f"{key} of {n}"
    want = run_reference(SPECS, N, False, muon_group=VARIANTS[variant], lr=LR)
    for n, ref in want.items():
        torch.testing.assert_close(params[n], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{variant}, {n}: {m}")


@pytest.mark.parametrize("variant,reset", [("dion2", "momentum_buffer"), ("nordion2", "normuon_v")])
def test_controls_continuing_without_the_state_misses(saved, variant, reset):
    path, _ = saved(variant)
    _, _, params = run_ranks(_resume, 2, path, variant, reset, timeout=180)[0]
    want = run_reference(SPECS, N, False, muon_group=VARIANTS[variant], lr=LR)
    assert _deviation(params, want) > 50 * ATOL, f"{variant} with {reset} reset: {_deviation(params, want):.3g}"
