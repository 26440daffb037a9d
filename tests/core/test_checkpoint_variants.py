"""Checkpoints with NorMuon, cautious weight decay and bf16 momentum.

* DCP resharding: a run with NorMuon on 4 ranks (``_StridedShard`` rows, last-dim sharding, 3-D
  experts, uneven shards) saved after K steps continues on 2 ranks with other placements, and on
  one device, as the uninterrupted run: NorMuon's ``v`` comes back bit-identical (its
  ``full_tensor()``), and the parameters match single-device Muon fed the same gradients.  Two
  controls: continuing with ``v`` reset misses, and so does a run whose ``v`` was saved under
  the wrong placements (``_StridedShard`` rows labelled as contiguous): v's layout matters.
* Plain ``state_dict()``: bit-identical resume; ``torch.load(weights_only=True)``; a bf16 buffer
  stays bf16 and fp32 ``v`` of a bf16 parameter stays fp32 (torch's loader would cast both to the
  parameter's dtype); another ``momentum_dtype`` converts with a note; ``normuon_v`` present
  exactly when the group has NorMuon on.
* Checkpoints written before these options (``data/pre_variants``, by commit 49fa963: see
  ``data/make_pre_variants_checkpoint.py``), plain and through DCP, load into the optimizer that
  run had (the same tensors put into today's Muon by hand, ``state_by_hand.py``) and continue as
  it bit for bit.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import logging
import os

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

from dist_cases import build_groups, make_case_tensors, parse_placement, run_reference, to_dtensor
from harness import run_ranks
from optimizer import Muon
from state_by_hand import assert_same_optimizer, set_state_by_hand

K, N = 2, 4
OPTIONS = dict(lr=0.02, weight_decay=0.3, normuon_beta2=0.9, cautious_wd=True, momentum_dtype=torch.bfloat16)
ATOL, RTOL = 2e-6, 1e-5  # parallel vs single device: fp32 rounding of batched matmuls
# (name, shape, placements on the 4-rank (2, 2) mesh, placements on the 2-rank (2,) mesh)
# (torch 2.13's DCP places a standalone _StridedShard of a 1-D mesh, and uneven _StridedShard
# splits, at the wrong global rows for every tensor, parameters included: not used as targets.)
LAYOUTS = [
    ("layers.0.attention.wq.weight", (16, 12), ["SS0/2", "S0"], ["S1"]),  # strided rows -> columns
    ("layers.0.attention.wo.weight", (12, 16), ["S0", "S1"], ["S0"]),  # last dim -> rows
    ("layers.0.ffn.w1.weight", (9, 6), ["S1", "S0"], ["S0"]),  # uneven rows, columns -> uneven rows
    ("layers.0.moe.w1", (3, 8, 12), ["S0", "S2"], ["S1"]),  # experts and columns -> rows
    ("layers.0.norm.weight", (12,), ["S0", "R"], ["S0"]),
]
SPECS = [(n, s, p4) for n, s, p4, _ in LAYOUTS]


def _quiet():
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _net(mesh, placements, seed=0):
    params, _ = make_case_tensors(SPECS, N, seed)
    net = torch.nn.Module()
    for (name, _, _, _), pl in zip(LAYOUTS, placements):
        t = params[name] if mesh is None else to_dtensor(params[name], mesh, [parse_placement(x) for x in pl])
        net.register_parameter(name.replace(".", "_"), torch.nn.Parameter(t))
    named = [(n, p) for (n, _, _, _), p in zip(LAYOUTS, net.parameters())]
    return net, named, Muon(build_groups(named), **OPTIONS)


def _train(named, opt, steps, mesh):
    _, grads = make_case_tensors(SPECS, N, 0)
    for s in steps:
        for n, p in named:
            g = grads[s][n]
            p.grad = to_dtensor(g, mesh, p.placements) if isinstance(p, DTensor) else g.clone()
        opt.step()


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _state(opt, named, key):
    return {n: _full(opt.state[p][key]) for n, p in named if key in opt.state[p]}


def _save(rank, world_size, path, broken):
    _quiet()
    if broken:  # v saved under placements that put its strided rows in the wrong global places
        import optimizer.matrix_view as matrix_view  # where v's layout is derived (row_state_layout)
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        right = matrix_view.row_placements
        matrix_view.row_placements = lambda pl, ndim: tuple(
            Shard(p.dim) if isinstance(p, _StridedShard) else p for p in right(pl, ndim))
    mesh = init_device_mesh("cpu", (2, 2))
    net, named, opt = _net(mesh, [p4 for _, _, p4, _ in LAYOUTS])
    _train(named, opt, range(K), mesh)
    dcp.save({"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}, checkpoint_id=path)
    return _state(opt, named, "normuon_v"), _state(opt, named, "momentum_buffer")


def _resume(rank, world_size, path, reset_v):
    _quiet()
    mesh = init_device_mesh("cpu", (world_size,)) if world_size > 1 else None
    net, named, opt = _net(mesh, [p2 for _, _, _, p2 in LAYOUTS], seed=1)  # other weights: all must load
    sd = {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(net, sd["model"])
    set_optimizer_state_dict(net, opt, sd["optim"])
    loaded = _state(opt, named, "normuon_v"), _state(opt, named, "momentum_buffer")
    if reset_v:
        for _, p in named:
            if "normuon_v" in opt.state[p]:
                opt.state[p]["normuon_v"].zero_()
    _train(named, opt, range(K, N), mesh)
    return loaded, {n: _full(p) for n, p in named}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for broken in (False, True):
        path = str(tmp_path_factory.mktemp("normuon") / "ckpt")
        out[broken] = path, run_ranks(_save, 4, path, broken, timeout=120)[0]
    return out


def _deviation(got, want):
    return max((got[n] - want[n]).abs().max().item() for n in want)


@pytest.mark.parametrize("world_size", [2, 1])
def test_normuon_checkpoint_reshards_and_continues(saved, world_size):
    path, (v_saved, buf_saved) = saved[False]
    (v_loaded, buf_loaded), params = run_ranks(_resume, world_size, path, False, timeout=120)[0]
    assert set(v_loaded) == {n for n, s, _ in SPECS if len(s) >= 2} == set(v_saved)
    for n in v_saved:  # the state comes back exactly, in its dtypes
        assert torch.equal(v_loaded[n], v_saved[n]) and v_loaded[n].dtype == torch.float32, n
        assert torch.equal(buf_loaded[n], buf_saved[n]) and buf_loaded[n].dtype == torch.bfloat16, n
    want = run_reference(SPECS, N, False, **OPTIONS)
    for n, ref in want.items():
        torch.testing.assert_close(params[n], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{n}: {m}")


def test_controls_v_reset_or_saved_under_the_wrong_placements_miss(saved):
    want = run_reference(SPECS, N, False, **OPTIONS)
    path, (v_saved, _) = saved[False]
    _, reset = run_ranks(_resume, 2, path, True, timeout=120)[0]
    assert _deviation(reset, want) > 50 * ATOL
    path, _ = saved[True]
    (v_wrong, _), wrong = run_ranks(_resume, 2, path, False, timeout=120)[0]
    assert any(not torch.equal(v_wrong[n], v_saved[n]) for n in v_saved)
    assert _deviation(wrong, want) > 5 * ATOL


def _flat_round_trip(rank, world_size, path):
    """Flattened optimizer state dicts (one key per parameter and setting) with NorMuon on."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    _quiet()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    mesh = init_device_mesh("cpu", (2, 2))
    net, named, opt = _net(mesh, [p4 for _, _, p4, _ in LAYOUTS])
    _train(named, opt, range(K), mesh)
    dcp.save({"optim": get_optimizer_state_dict(net, opt, options=flat)}, checkpoint_id=path)
    net2, named2, opt2 = _net(mesh, [p4 for _, _, p4, _ in LAYOUTS], seed=1)
    sd = {"optim": get_optimizer_state_dict(net2, opt2, options=flat)}
    dcp.load(sd, checkpoint_id=path)
    set_optimizer_state_dict(net2, opt2, sd["optim"], options=flat)
    return all(torch.equal(a, b) for key in ("normuon_v", "momentum_buffer")
               for a, b in zip(_state(opt, named, key).values(), _state(opt2, named2, key).values()))


def test_flattened_dcp_state_dicts_with_normuon(tmp_path):
    assert all(run_ranks(_flat_round_trip, 4, str(tmp_path / "flat"), timeout=120))


# ------------------------------------------------------------------ plain state_dict


def _single(seed=0, **options):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(8, 6, generator=g))
    e = torch.nn.Parameter(torch.randn(2, 6, 4, generator=g))
    b = torch.nn.Parameter(torch.randn(6, generator=g))
    opt = Muon([{"params": [w, e], "use_muon": True}, {"params": [b], "use_muon": False}], **{**OPTIONS, **options})
    return [w, e, b], opt


def _steps(params, opt, steps):
    for s in steps:
        g = torch.Generator().manual_seed(100 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def _round_trip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # what Hugging Face's Trainer does with optimizer.pt


def test_plain_state_dict_resumes_bit_identically_and_loads_weights_only():
    params, opt = _single()
    _steps(params, opt, range(N))
    want = [p.detach().clone() for p in params]
    params, opt = _single()
    _steps(params, opt, range(K))
    sd = _round_trip(opt.state_dict())
    assert sd["param_groups"][0]["normuon_beta2"] == 0.9 and sd["param_groups"][1]["cautious_wd"] is True
    params2, opt2 = _single(seed=1, normuon_beta2=0.5, cautious_wd=False, lr=0.1)  # all restored from sd
    for p, q in zip(params2, params):
        p.data.copy_(q.data)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["normuon_beta2"] == 0.9 and opt2.param_groups[0]["lr"] == 0.02
    _steps(params2, opt2, range(K, N))
    assert all(torch.equal(p, q) for p, q in zip(params2, want))


def test_state_dtypes_survive_load_state_dict():
    """torch's loader casts floating state to the parameter's dtype: a bf16 buffer would come
    back fp32 and an fp32 v of a bf16 parameter bf16 (rounded).  Both keep their dtype."""
    params, opt = _single()
    _steps(params, opt, range(K))
    params2, opt2 = _single()
    opt2.load_state_dict(_round_trip(opt.state_dict()))
    for p, q in zip(params[:2], params2[:2]):
        assert opt2.state[q]["momentum_buffer"].dtype == torch.bfloat16
        assert torch.equal(opt2.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])
    bf = torch.nn.Parameter(torch.randn(8, 6).bfloat16())
    opt3 = Muon([{"params": [bf], "use_muon": True}], normuon_beta2=0.9, momentum_dtype=torch.float32)
    bf.grad = torch.randn(8, 6).bfloat16()
    opt3.step()
    opt4 = Muon([{"params": [bf], "use_muon": True}], normuon_beta2=0.9, momentum_dtype=torch.float32)
    opt4.load_state_dict(_round_trip(opt3.state_dict()))
    for key in ("normuon_v", "momentum_buffer"):
        assert opt4.state[bf][key].dtype == torch.float32 and torch.equal(opt4.state[bf][key], opt3.state[bf][key])


def test_load_post_hooks_run_once_and_see_the_state_as_loaded():
    """torch runs load-state-dict post-hooks after loading; ours run after the state whose dtype
    is the optimizer's own is restored, so a hook sees the bf16 momentum and v, once."""
    params, opt = _single()
    _steps(params, opt, range(K))
    params2, opt2 = _single()
    seen = []
    opt2.register_load_state_dict_post_hook(
        lambda o: seen.append({k: o.state[params2[0]][k].dtype for k in ("momentum_buffer", "normuon_v")}))
    opt2.load_state_dict(_round_trip(opt.state_dict()))
    assert seen == [{"momentum_buffer": torch.bfloat16, "normuon_v": torch.float32}]


def test_another_momentum_dtype_converts_with_a_note(caplog):
    params, opt = _single()  # bf16 momentum
    _steps(params, opt, range(K))
    sd = _round_trip(opt.state_dict())
    assert sd["param_groups"][0]["momentum_dtype"] == torch.bfloat16  # recorded (and read weights_only)
    params2, opt2 = _single(momentum_dtype=None)
    with caplog.at_level(logging.WARNING, logger="optimizer.muon"):
        opt2.load_state_dict(sd)
    assert "momentum_dtype" not in opt2.param_groups[0]  # the loading optimizer's choice (None) stays
    assert opt2.state[params2[0]]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(opt2.state[params2[0]]["momentum_buffer"], opt.state[params[0]]["momentum_buffer"].float())
    assert "2 'momentum_buffer' tensors were saved as bfloat16 and are converted to float32" in caplog.text


def test_normuon_state_is_there_exactly_when_normuon_is_on():
    params, opt = _single()
    _steps(params, opt, range(1))
    sd = opt.state_dict()
    without_v = {**sd, "state": {k: {kk: vv for kk, vv in v.items() if kk != "normuon_v"} for k, v in sd["state"].items()}}
    with pytest.raises(ValueError, match="normuon_v.*exactly when NorMuon is on"):
        _single()[1].load_state_dict(without_v)
    muon_groups = [{**g, "normuon_beta2": None} if g["use_muon"] else g for g in sd["param_groups"]]
    with pytest.raises(ValueError, match="normuon_beta2=None"):
        _single()[1].load_state_dict({**sd, "param_groups": muon_groups})
    bad_shape = {**sd, "state": {**sd["state"], 0: {**sd["state"][0], "normuon_v": torch.zeros(8, 6)}}}
    with pytest.raises(ValueError, match=r"'normuon_v'.*shape \(8, 6\).*\(8, 1\)"):
        _single()[1].load_state_dict(bad_shape)
    # turning NorMuon off drops v at the next step; on again starts it from zero
    opt.param_groups[0]["normuon_beta2"] = None
    _steps(params, opt, range(1, 2))
    assert "normuon_v" not in opt.state[params[0]] and "normuon_v" not in opt.state_dict()["state"][0]
    opt.param_groups[0]["normuon_beta2"] = 0.9
    _steps(params, opt, range(2, 3))
    assert opt.state[params[0]]["normuon_v"].shape == (8, 1)


def test_options_at_off_are_not_written_and_absent_ones_read_as_off():
    params, opt = _single(normuon_beta2=None, cautious_wd=False, momentum_dtype=None)
    _steps(params, opt, range(1))
    sd = opt.state_dict()
    for g in sd["param_groups"] + opt.param_groups:  # a group holds them only when they are on
        assert not {"normuon_beta2", "cautious_wd", "momentum_dtype"} & set(g), g.keys()
    params2, opt2 = _single()  # built with everything on: the checkpoint's groups win, like lr
    opt2.load_state_dict(sd)
    assert "normuon_beta2" not in opt2.param_groups[0] and "cautious_wd" not in opt2.param_groups[1]
    assert "normuon_v" not in opt2.state[params2[0]]


# ------------------------------------------------------------------ checkpoints from before the variants

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pre_variants")


def _generator():
    spec = importlib.util.spec_from_file_location(
        "make_pre_variants_checkpoint", os.path.join(os.path.dirname(DATA), "make_pre_variants_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_plain_checkpoint_from_before_the_variants_continues_as_it_did():
    """Loaded into today's Muon it is the optimizer that run had (the reference built here,
    tests/state_by_hand.py: the generator's options, the checkpoint's tensors assigned by hand),
    and the two continue bit for bit.  (``saved["continued"]``, what that Muon computed next on the
    machine that wrote it, is not an oracle: another CPU rounds fp32 matmuls differently.)"""
    gen = _generator()
    saved = torch.load(os.path.join(DATA, "plain.pt"), weights_only=True)
    assert all("normuon_beta2" not in g for g in saved["optimizer"]["param_groups"])  # really from before
    _, grads = gen.tensors()
    net = gen.Net.build({n: t.clone() for n, t in saved["params"].items()})
    opt = gen.muon(net)
    opt.load_state_dict(copy.deepcopy(saved["optimizer"]))  # a copy: the reference is built from the file's own tensors
    assert not {"normuon_beta2", "cautious_wd", "momentum_dtype"} & set(opt.param_groups[0])  # all off
    ref_net = gen.Net.build({n: t.clone() for n, t in saved["params"].items()})
    ref = gen.muon(ref_net)
    set_state_by_hand(ref, saved["optimizer"]["state"])
    assert_same_optimizer(opt, ref)
    assert all(torch.equal(p, r) for p, r in zip(net.parameters(), ref_net.parameters()))
    gen.train(net, opt, grads, range(gen.K, gen.N))
    gen.train(ref_net, ref, grads, range(gen.K, gen.N))
    for (n, p), (_, r) in zip(net.named_parameters(), ref_net.named_parameters()):
        assert torch.equal(p.detach(), r.detach()), n
    assert_same_optimizer(opt, ref)


def _old_dcp(rank, world_size, full):
    """The DCP checkpoint loaded on 2 ranks, and beside it the reference: the same tensors
    (``full``: read by torch's own ``dcp_to_torch_save``) sharded by DTensor and assigned by hand.
    Both continue on these ranks; returns whether they agree bit for bit, per parameter."""
    from state_by_hand import params_in_order

    gen = _generator()
    mesh = init_device_mesh("cpu", (world_size,))
    params, grads = gen.tensors(seed=5)  # other weights: the checkpoint must bring them
    net = gen.Net.build({n: to_dtensor(t, mesh, [parse_placement(gen.PLACEMENTS[n])]) for n, t in params.items()})
    opt = gen.muon(net)
    sd = {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}
    dcp.load(sd, checkpoint_id=os.path.join(DATA, "dcp"))  # the default planner: strict about keys
    set_model_state_dict(net, sd["model"])
    set_optimizer_state_dict(net, opt, sd["optim"])

    ref_net = gen.Net.build({n: to_dtensor(full["model"][n], mesh, [parse_placement(gen.PLACEMENTS[n])])
                             for n in gen.SHAPES})
    ref = gen.muon(ref_net)
    names = [n for g in ref.param_groups for n in g["param_names"]]
    set_state_by_hand(ref, {i: full["optim"]["state"][n] for i, n in enumerate(names)},
                      lambda t, p: to_dtensor(t, mesh, p.placements))
    assert [p.placements for p in params_in_order(ref)] == [p.placements for p in params_in_order(opt)]
    assert_same_optimizer(opt, ref)
    assert all(torch.equal(p.to_local(), r.to_local()) for p, r in zip(net.parameters(), ref_net.parameters()))
    _, grads = gen.tensors()
    as_dtensor = lambda n, g, p: to_dtensor(g, mesh, p.placements)  # noqa: E731
    gen.train(net, opt, grads, range(gen.K, gen.N), as_dtensor)
    gen.train(ref_net, ref, grads, range(gen.K, gen.N), as_dtensor)
    assert_same_optimizer(opt, ref)
    return {n: torch.equal(p.full_tensor(), r.full_tensor())
            for (n, p), (_, r) in zip(net.named_parameters(), ref_net.named_parameters())}


def test_a_dcp_checkpoint_from_before_the_variants_continues_as_it_did(tmp_path):
    """As the plain one, through DCP on 2 ranks.  (``dcp_continued.pt`` is not an oracle, as above.)"""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(os.path.join(DATA, "dcp"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert all("normuon_beta2" not in g for g in full["optim"]["param_groups"])  # really from before
    for same in run_ranks(_old_dcp, 2, full, timeout=120):
        assert same == {n: True for n in _generator().SHAPES}, same
