"""dion's constructors (``optimizer.Dion2``, ``NorDion2``, ``Dion3``), Dion2 groups' refusals, and Lion.

* Every dion keyword and group key lands on the Muon option the table in ``docs/from_dion.md``
  says (the expected groups are written here), and a Dion2 built with dion's keywords steps bit
  for bit as the Muon built with the mapped options; the constructors' keywords are dion 0a059a4's.
* Wrong keywords are refused naming dion's keyword.
* A refused Dion2 group or keyword (fraction outside (0, 1], a negative ef_decay, momentum or
  nesterov in a Dion2 group, a vector in a Dion2 group, row blocks that do not fit the weight,
  ``ns_split='always'``) leaves the optimizer as it was (``test_refusals.Snapshot``), at construction,
  ``add_param_group`` and ``step()`` (options written in place).
* Lion groups (``algorithm="lion"``) against the formula written here, as dion's
  ``scalar_opts.lion_update`` defines it.
* A DTensor in a Dion2 group is taken (its steps: ``tests/parallel/test_dion2_dtensor.py``).
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import warnings

import pytest
import torch
from torch.nn import Parameter

import optimizer
from harness import run_ranks
from optimizer import Dion2, Dion3, Muon, NorDion2
from test_refusals import Snapshot

# dion 0a059a4's constructor keywords (dion/dion2.py, dion/nordion2.py), in order
DION2_KEYWORDS = ["params", "distributed_mesh", "lr", "fraction", "ef_decay", "betas", "weight_decay", "epsilon",
                  "adjust_lr", "flatten", "use_triton", "use_polar_express", "use_gram_newton_schulz",
                  "newton_schulz_func", "verbose", "triton_post_ortho", "selection_scope"]
NORDION2_KEYWORDS = ["params", "distributed_mesh", "lr", "fraction", "mu", "muon_beta2", "betas", "weight_decay",
                     "epsilon", "adjust_lr", "flatten", "use_triton", "use_polar_express", "use_gram_newton_schulz",
                     "newton_schulz_func", "triton_post_ortho", "selection_scope"]
IGNORED = {"muon_state_version", "qk_clip_settings", "params"}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (Parameter(torch.randn(8, 12, generator=g, dtype=torch.float64)),
            Parameter(torch.randn(12, dtype=torch.float64, generator=g)),
            Parameter(torch.randn(5, dtype=torch.float64, generator=g)))


def _options(group) -> dict:
    return {k: v for k, v in group.items() if k not in IGNORED}


def _grads(opt, seed):
    g = torch.Generator().manual_seed(100 + seed)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


# --------------------------------------------------------------------------- the keyword mapping


def test_the_constructors_take_dions_keywords():
    assert list(inspect.signature(Dion2).parameters) == DION2_KEYWORDS
    assert list(inspect.signature(NorDion2).parameters) == NORDION2_KEYWORDS
    assert Dion3 is NorDion2 and optimizer.Dion3 is optimizer.NorDion2
    assert issubclass(Dion2, Muon) and issubclass(NorDion2, Muon)


def test_dions_defaults_map_onto_muons_options():
    w, b, c = _params()
    opt = Dion2([dict(params=[w]), dict(params=[b], algorithm="adamw"), dict(params=[c], algorithm="lion")])
    dion2, adamw, lion = (_options(g) for g in opt.param_groups)
    assert dion2["use_muon"] and dion2["dion2_fraction"] == 0.25 and dion2.get("dion2_ef_decay", 0.95) == 0.95
    assert (dion2["lr"], dion2["weight_decay"], dion2["eps"]) == (0.01, 0.01, 1e-8)
    assert (dion2["adjust_lr"], dion2["ns_coefficients"], dion2["ns_method"]) == ("spectral_norm", "polar_express",
                                                                                 "auto")
    assert dion2.get("ns_kernels", "auto") == "auto"  # use_triton=None: Muon's choice (decision 6)
    assert "momentum" not in dion2 and "nesterov" not in dion2
    assert not adamw["use_muon"] and adamw["betas"] == (0.9, 0.95) and adamw["eps"] == 1e-8
    assert adamw.get("algorithm", "adamw") == "adamw"
    assert lion["algorithm"] == "lion" and lion["betas"] == (0.9, 0.95)


def test_every_keyword_and_group_key_is_mapped():
    w, b, c = _params()
    opt = Dion2([dict(params=[w], fraction=0.5, ef_decay=0.7, epsilon=1e-6, adjust_lr=None, lr=0.02),
                 dict(params=[b], algorithm="adamw", beta1=0.7, epsilon=1e-5),
                 dict(params=[c], algorithm="lion", beta2=0.8)],
                lr=0.03, fraction=0.3, ef_decay=0.8, betas=(0.85, 0.9), weight_decay=0.2, epsilon=1e-7,
                adjust_lr="rms_norm", use_triton=False, use_polar_express=False, use_gram_newton_schulz=False,
                selection_scope="global", flatten=False, verbose=False, triton_post_ortho=False)
    dion2, adamw, lion = (_options(g) for g in opt.param_groups)
    assert (dion2["dion2_fraction"], dion2["dion2_ef_decay"], dion2["eps"], dion2["adjust_lr"], dion2["lr"]) == \
        (0.5, 0.7, 1e-6, None, 0.02)  # the group's own keys win
    assert (dion2["ns_kernels"], dion2["ns_method"], dion2["ns_coefficients"]) == ("torch", "classic", "fixed")
    assert dion2["weight_decay"] == 0.2
    assert (adamw["betas"], adamw["eps"], adamw["lr"]) == ((0.7, 0.9), 1e-5, 0.03)
    assert (lion["betas"], lion["algorithm"]) == ((0.85, 0.8), "lion")
    defaults = _options(Dion2([w], fraction=0.3, adjust_lr="rms_norm", epsilon=1e-7).param_groups[0])
    assert (defaults["dion2_fraction"], defaults["adjust_lr"], defaults["eps"]) == (0.3, "match_rms_adamw", 1e-7)


@pytest.mark.parametrize("use_triton,kernels", [(None, "auto"), (False, "torch"), (True, "auto")])
@pytest.mark.parametrize("use_gram,method,coefficients", [(None, "auto", "polar_express"),
                                                          (False, "classic", "polar_express"),
                                                          (True, "gram", "polar_express")])
def test_use_triton_and_use_gram_newton_schulz(use_triton, kernels, use_gram, method, coefficients):
    w, _, _ = _params()
    group = Dion2([w], use_triton=use_triton, use_gram_newton_schulz=use_gram).param_groups[0]
    assert (group.get("ns_kernels", "auto"), group["ns_method"], group["ns_coefficients"]) == \
        (kernels, method, coefficients)
    # dion runs Gram Newton–Schulz with Polar Express's coefficients whatever use_polar_express says
    fixed = Dion2([w], use_polar_express=False, use_gram_newton_schulz=use_gram).param_groups[0]
    assert fixed["ns_coefficients"] == ("polar_express" if use_gram else "fixed")


def test_nordion2_keywords():
    w, b, _ = _params()
    opt = NorDion2([dict(params=[w], mu=0.6), dict(params=[b], algorithm="adamw")], mu=0.8, muon_beta2=0.9,
                   fraction=0.5)
    g = _options(opt.param_groups[0])
    assert (g["dion2_fraction"], g["dion2_ef_decay"], g["normuon_beta2"]) == (0.5, 0.6, 0.9)
    assert _options(NorDion2([w]).param_groups[0])["normuon_beta2"] == 0.95
    with pytest.raises(ValueError, match="algorithm='dion2'"):
        NorDion2([dict(params=[w], algorithm="dion2")])


def test_dion2_steps_as_the_muon_it_maps_to():
    """A Dion2 built from dion's keywords and the Muon built from the mapped options by hand step
    the same bits (weights and state) for three steps."""
    a, b, c = _params()
    x, y, z = (Parameter(t.detach().clone()) for t in (a, b, c))
    dion = Dion2([dict(params=[a]), dict(params=[b], algorithm="adamw"), dict(params=[c], algorithm="lion")],
                 lr=0.02, fraction=0.5, ef_decay=0.9, betas=(0.8, 0.9), weight_decay=0.1, use_triton=False)
    muon = Muon([{"params": [x], "use_muon": True}, {"params": [y], "use_muon": False},
                 {"params": [z], "use_muon": False, "algorithm": "lion"}],
                lr=0.02, weight_decay=0.1, dion2_fraction=0.5, dion2_ef_decay=0.9, adamw_betas=(0.8, 0.9),
                lion_betas=(0.8, 0.9), adamw_eps=1e-8, eps=1e-8, adjust_lr="spectral_norm", ns_kernels="torch",
                ns_coefficients="polar_express")
    for step in range(3):
        _grads(dion, step)
        _grads(muon, step)
        dion.step()
        muon.step()
        for p, q in ((a, x), (b, y), (c, z)):
            assert torch.equal(p, q)
            assert all(torch.equal(dion.state[p][k], muon.state[q][k]) for k in dion.state[p])


def test_add_param_group_takes_dions_group_keys_also_after_a_deepcopy():
    w, b, c = _params()
    opt = copy.deepcopy(Dion2([w], betas=(0.8, 0.9), fraction=0.5))
    opt.add_param_group(dict(params=[b], algorithm="lion", beta2=0.7))
    opt.add_param_group(dict(params=[_matrix()], ef_decay=0.6))
    lion = opt.param_groups[1]
    assert (lion["betas"], lion["algorithm"], lion["use_muon"]) == ((0.8, 0.7), "lion", False)
    assert opt.param_groups[2]["dion2_ef_decay"] == 0.6 and opt.param_groups[2]["use_muon"]
    with pytest.raises(ValueError, match="`beta1`"):
        opt.add_param_group(dict(params=[_matrix()], beta1=0.9))
    _grads(opt, 0)
    opt.step()


# --------------------------------------------------------------------------- refused keywords


@pytest.mark.parametrize("kwargs,match", [
    (dict(fraction=0.0), "`fraction`"), (dict(fraction=1.5), "`fraction`"), (dict(ef_decay=-0.1), "`ef_decay`"),
    (dict(adjust_lr="original"), "`adjust_lr`"), (dict(newton_schulz_func=lambda x: x), "`newton_schulz_func`"),
    (dict(triton_post_ortho=True), "`triton_post_ortho`"), (dict(selection_scope="exact"), "`selection_scope`"),
    (dict(use_triton="yes"), "`use_triton`"), (dict(betas=(0.9, 1.5)), "betas"), (dict(epsilon=-1.0), "epsilon"),
    (dict(flatten="no"), "`flatten`"),
])
def test_wrong_keywords_are_refused_by_dions_name(kwargs, match):
    w, _, _ = _params()
    with pytest.raises(ValueError, match=match):
        Dion2([w], **kwargs)


def test_wrong_group_keys_and_meshes_are_refused():
    w, b, _ = _params()
    e = Parameter(torch.randn(2, 4, 6))
    cases = [([dict(params=[w], algorithm="dion")], "algorithm='dion'"),
             ([dict(params=[w], num_heads=2)], "`num_heads`"), ([dict(params=[w], split_sizes=[4, 4])], "`split_sizes`"),
             ([dict(params=[w], beta1=0.9)], "`beta1`"), ([dict(params=[b], algorithm="adamw", fraction=0.5)], "`fraction`"),
             ([dict(params=[b], algorithm="lion", epsilon=1e-8)], "`epsilon`"),
             ([dict(params=[e], flatten=True)], "flatten=True"), ([b], "Dion2 group")]
    for groups, match in cases:
        with pytest.raises(ValueError, match=match):
            Dion2(groups)
    with pytest.raises(ValueError, match="`mu`"):
        NorDion2([w], mu=-1)
    with pytest.raises(ValueError, match="`muon_beta2`"):
        NorDion2([w], muon_beta2=1.5)
    with pytest.raises(TypeError, match="distributed_mesh"):
        Dion2([w], distributed_mesh="cpu")
    with pytest.raises(TypeError, match="unexpected keyword"):
        Dion2([w], momentum=0.9)
    Dion2([dict(params=[e])])  # an expert stack without flatten: each matrix its own selection


def test_selection_scope_local_warns_once(caplog, monkeypatch):
    import optimizer.dion2.constructors as api
    monkeypatch.setattr(api, "_WARNED_LOCAL", [])
    w, _, _ = _params()
    with caplog.at_level(logging.WARNING, logger="optimizer.dion2.constructors"):
        Dion2([w], selection_scope="local")
        Dion2([w], selection_scope="local")
        Dion2([w], selection_scope="global")
    assert [r.getMessage().count("selection_scope='local'") for r in caplog.records] == [1]


# --------------------------------------------------------------------------- refusals leave everything as it was


def _built():
    w, b, c = _params()
    opt = Muon([{"params": [w], "param_names": ["w"], "use_muon": True, "dion2_fraction": 0.5},
                {"params": [b], "param_names": ["b"], "use_muon": False},
                {"params": [c], "param_names": ["c"], "use_muon": False, "algorithm": "lion"}], lr=0.02)
    for i in range(2):
        _grads(opt, i)
        opt.step()
    return opt


def _matrix():
    return Parameter(torch.randn(6, 10, dtype=torch.float64))


BAD_GROUPS = [  # (group keys on a Dion2 group, words the error names)
    ({"dion2_fraction": 0.0}, "dion2_fraction"), ({"dion2_fraction": 1.5}, "dion2_fraction"),
    ({"dion2_fraction": 0.5, "dion2_ef_decay": -1.0}, "dion2_ef_decay"),
    ({"dion2_fraction": 0.5, "momentum": 0.9}, "sets `momentum`"),
    ({"dion2_fraction": 0.5, "nesterov": False}, "sets `nesterov`"),
    ({"dion2_fraction": 0.5, "muon_row_blocks": "heads:4"}, "muon_row_blocks='heads:4'"),  # 6 rows
    ({"dion2_fraction": 0.5, "ns_split": "always"}, "ns_split.*k-slice submatrix.*Remove `ns_split`"),
    ({"dion2_ef_decay": 0.5}, "applies to Dion2 groups only"),
]


@pytest.mark.parametrize("keys,match", BAD_GROUPS, ids=[m for _, m in BAD_GROUPS])
def test_a_refused_dion2_group_leaves_everything_as_it_was(keys, match):
    opt = _built()
    snapshot = Snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [_matrix()], "param_names": ["m"], "use_muon": True, **keys})
    snapshot.assert_unchanged(opt)
    with pytest.raises(ValueError, match=match):
        Muon([{"params": [_matrix()], "use_muon": True, **keys}])
    opt.add_param_group({"params": [_matrix()], "param_names": ["m"], "use_muon": True, "dion2_fraction": 0.5})
    _grads(opt, 9)
    opt.step()


def test_vectors_and_momentum_keywords_with_dion2_are_refused_at_construction():
    w, b, _ = _params()
    with pytest.raises(ValueError, match=r"'b' has shape \(12,\) but is in a Dion2 group"):
        Muon([{"params": [w, b], "param_names": ["w", "b"], "use_muon": True}], dion2_fraction=0.25)
    with pytest.raises(ValueError, match="`momentum` was passed with dion2_fraction"):
        Muon([{"params": [w], "use_muon": True}], dion2_fraction=0.25, momentum=0.9)


IN_PLACE = [  # (change to group 0 of _built(), words the step's error names)
    (lambda g: g.__setitem__("momentum", 0.9), "cycle_momentum=False"),
    (lambda g: g.__setitem__("dion2_fraction", 1.5), "dion2_fraction"),
    (lambda g: g.__setitem__("dion2_ef_decay", -0.5), "dion2_ef_decay"),
    (lambda g: g.__setitem__("muon_row_blocks", "heads:3"), "muon_row_blocks='heads:3'"),  # 8 rows
    (lambda g: g.__setitem__("dion2_fraction", None), "no `momentum`"),  # back to Muon: it needs its momentum
]


@pytest.mark.parametrize("change,match", IN_PLACE, ids=[m for _, m in IN_PLACE])
def test_options_written_in_place_are_refused_at_step_before_anything_changes(change, match):
    opt = _built()
    change(opt.param_groups[0])
    _grads(opt, 5)
    snapshot = Snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.step()
    snapshot.assert_unchanged(opt)


def test_onecycle_cycling_momentum_is_refused_for_dion2():
    """dion's Dion2 has no momentum, so OneCycleLR(cycle_momentum=True) refuses it at construction;
    ours too (torch's defaults hold no momentum when every use_muon group is Dion2)."""
    w, _, _ = _params()
    opt = Dion2([w])
    with pytest.raises(ValueError, match="momentum"):
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10, cycle_momentum=False)


# --------------------------------------------------------------------------- Lion


def lion_formula(w, g, m, lr, beta1, beta2, wd, cautious=False):
    """dion's scalar_opts.lion_update, in fp64: U = sign(b1 M + (1 - b1) G), M <- b2 M + (1 - b2) G,
    W <- W (1 - lr wd) - lr U (cautious: decay only where W U >= 0)."""
    u = torch.sign(beta1 * m + (1 - beta1) * g)
    decay = lr * wd * w * ((w * u >= 0) if cautious else 1)
    return w - decay - lr * u, beta2 * m + (1 - beta2) * g


@pytest.mark.parametrize("variant", [{}, {"cautious_wd": True}, {"maximize": True}, {"lr_tensor": True}])
def test_lion_matches_the_formula(variant):
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(7, 5, generator=g, dtype=torch.float64)
    w0[0, 0] = 0.0
    p = Parameter(w0.clone())
    lr = torch.tensor([0.01], dtype=torch.float64) if variant.get("lr_tensor") else 0.01
    opt = Muon([{"params": [p], "use_muon": False, "algorithm": "lion", "betas": (0.8, 0.9),
                 "cautious_wd": variant.get("cautious_wd", False), "maximize": variant.get("maximize", False)}],
               lr=lr, weight_decay=0.3)
    w, m = w0.clone(), torch.zeros_like(w0)
    for step in range(4):
        grad = torch.randn(7, 5, generator=g, dtype=torch.float64)
        grad[1, :] = 0.0  # sign(0) = 0 at the first step: only weight decay
        p.grad = grad.clone()
        opt.step()
        w, m = lion_formula(w, -grad if variant.get("maximize") else grad, m, 0.01, 0.8, 0.9, 0.3,
                            cautious=variant.get("cautious_wd", False))
        # torch's lerp and the formula's two products round differently: a few ulps of the terms
        u = 2**-53
        torch.testing.assert_close(opt.state[p]["exp_avg"], m, atol=4 * u * (step + 1) * float(m.abs().max() + grad.abs().max()),
                                   rtol=0)
        torch.testing.assert_close(p.detach(), w, atol=4 * u * (step + 1) * (1 + float(w.abs().max())), rtol=0)
    assert set(opt.state[p]) == {"exp_avg"}


def test_lion_refuses_eps_and_adamw_keeps_it():
    _, b, _ = _params()
    with pytest.raises(ValueError, match="Lion has no epsilon"):
        Muon([{"params": [b], "use_muon": False, "algorithm": "lion", "eps": 1e-8}])
    with pytest.raises(ValueError, match="algorithm` must be one of"):
        Muon([{"params": [b], "use_muon": False, "algorithm": "sgd"}])


# --------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_resumes_dion2_nordion2_and_lion_bit_for_bit():
    """state_dict -> a fresh optimizer -> load: the next steps equal the uninterrupted run's."""
    def build(params):
        return NorDion2([dict(params=[params[0]]), dict(params=[params[1]], algorithm="lion"),
                         dict(params=[params[2]], algorithm="adamw")], lr=0.02, fraction=0.5)
    a = _params()
    b = [Parameter(p.detach().clone()) for p in a]
    run, resumed = build(a), build(b)
    for i in range(2):
        _grads(run, i)
        run.step()
    saved = copy.deepcopy(run.state_dict())
    for p, q in zip(a, b):
        q.data.copy_(p.detach())
    resumed.load_state_dict(saved)
    for i in range(2, 4):
        _grads(run, i)
        _grads(resumed, i)
        run.step()
        resumed.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert set(resumed.state[b[0]]) == {"momentum_buffer", "normuon_v"} and set(resumed.state[b[1]]) == {"exp_avg"}


def test_a_checkpoint_of_another_algorithm_is_refused_and_changes_nothing():
    w, b, c = _params()
    opt = Dion2([dict(params=[w]), dict(params=[b], algorithm="lion"), dict(params=[c], algorithm="adamw")])
    _grads(opt, 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][1]["algorithm"] = "adamw"
    snapshot = Snapshot(opt)
    with pytest.raises(ValueError, match="algorithm='adamw'"):
        opt.load_state_dict(saved)
    snapshot.assert_unchanged(opt)


# --------------------------------------------------------------------------- DTensors (2 gloo ranks)


def _dtensor_in_a_dion2_group(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    w = Parameter(distribute_tensor(torch.ones(8, 6), mesh, [Shard(0)]))
    v = Parameter(distribute_tensor(torch.ones(6), mesh, [Shard(0)]))
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, call in {"muon": lambda: Muon([{"params": [w], "param_names": ["w"], "use_muon": True}],
                                               dion2_fraction=0.25),
                           "dion2": lambda: Dion2([("w", w)], distributed_mesh=mesh)}.items():
            try:
                call()
                out[name] = None
            except ValueError as err:
                out[name] = str(err)
    # the chosen slices alone travel (docs/dion2.md): nothing to warn about
    out["warnings"] = [str(c.message) for c in caught if "Dion2" in str(c.message) or "DTensor" in str(c.message)]
    # made a DTensor after construction (accelerate's FSDP2 idiom): steps as the same weight held whole
    late = Muon([{"params": [Parameter(torch.ones(8, 6))], "param_names": ["w"], "use_muon": True}],
                dion2_fraction=0.25)
    late.param_groups[0]["params"][0] = w
    w.grad = distribute_tensor(torch.arange(48.0).reshape(8, 6), mesh, [Shard(0)])
    whole = Parameter(torch.ones(8, 6))
    whole.grad = torch.arange(48.0).reshape(8, 6)
    Muon([{"params": [whole], "param_names": ["w"], "use_muon": True}], dion2_fraction=0.25).step()
    try:
        late.step()
        out["late"] = None
    except ValueError as err:
        out["late"] = str(err)
    out["late as whole"] = bool(torch.equal(w.full_tensor(), whole.detach())) and not torch.equal(whole, torch.ones(8, 6))
    # a DTensor on a sub-mesh (this rank alone) does not hold distributed_mesh's ranks
    grid = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("a", "b"))
    alone = Parameter(distribute_tensor(torch.ones(6), grid["b"], [Shard(0)]))
    try:
        Dion2([dict(params=[alone], algorithm="lion")], distributed_mesh=grid)
        out["sub-mesh"] = None
    except ValueError as err:
        out["sub-mesh"] = str(err)
    Dion2([dict(params=[alone], algorithm="lion")], distributed_mesh=grid["b"])
    opt = Dion2([dict(params=[v], algorithm="lion")], distributed_mesh=mesh)  # elementwise: any DTensor
    v.grad = distribute_tensor(torch.full((6,), 2.0), mesh, [Shard(0)])
    opt.step()
    out["lion"] = v.full_tensor().tolist()
    return out


def test_a_dtensor_in_a_dion2_group_is_taken():
    """Construction takes a DTensor in a Dion2 group (``tests/parallel/test_dion2_dtensor.py``
    checks its steps on every layout); one swapped in after construction steps as the whole weight."""
    for out in run_ranks(_dtensor_in_a_dion2_group, 2, timeout=60):
        for name in ("muon", "dion2"):
            assert out[name] is None, out[name]
        assert out["late"] is None and out["late as whole"], out["late"]
        assert out["warnings"] == [], out["warnings"]  # no "gathered path" warning any more
        assert out["sub-mesh"] is not None and "do not include distributed_mesh's [0, 1]" in out["sub-mesh"]
        # Lion with weight decay 0.01, lr 0.01: 1 * (1 - 1e-4) - 0.01 * sign(0.05 * 2)
        assert out["lion"] == pytest.approx([1 - 1e-4 - 0.01] * 6, abs=1e-7)
        assert math.isfinite(out["lion"][0])
