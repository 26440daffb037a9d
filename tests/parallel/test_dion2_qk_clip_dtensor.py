"""QK-clip in Dion2 and NorDion2 groups of DTensors, on 2 forked gloo ranks, against single device.

A GQA attention layer (``wq`` tall: columns chosen, ``wk``/``wv`` wide: rows chosen) and an MLA
one (``wq`` and ``wkv_b``, both tall) in a Dion2 group (and a NorDion2 one) with QK-clip, laid out
FSDP ``Shard(0)`` (every rank a run of rows), TP rowwise ``Shard(1)`` (every rank every row,
part of the columns) and FSDP-over-TP ``_StridedShard(0)`` (every rank rows of every head,
interleaved), and the same weights held whole: after 3 steps every weight and momentum,
assembled from the ranks' pieces (``strided_layouts.full_of``), equals the single-device run's bit
for bit.  The single-device run is itself checked against the float64 formulas
(``tests/qk_clip/test_dion2_qk_clip.py``); since a row scaled by another head's factor differs by
10% or more, this checks every rank's row slots.  Not vacuous: the same run without QK-clip ends
elsewhere.

With per-head row blocks (``muon_row_blocks``: each head its own Dion2 matrix) the same holds: QK-clip
after the per-block update, on DTensors, equals single device bit for bit.  Row blocks with Dion2 on
a DTensor are taken at construction and at the step of a weight made a DTensor after construction
(which then equals the weight held whole); a spec that does not fit is refused naming
``muon_row_blocks`` and the parameter, at construction and at the step (changing nothing).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import Parameter

from dist_cases import parse_placement
from harness import run_ranks
from strided_layouts import full_of, make_dtensor

T, STEPS = 2.0, 3
P = "layers.0.attention."
GQA = {P + "wq.weight": (16, 12), P + "wk.weight": (8, 12), P + "wv.weight": (8, 12)}
MLA = {P + "wq.weight": (24, 16), P + "wkv_b.weight": (32, 10)}
LAYOUTS = {"fsdp_rows": ["S0"], "tp_rowwise": ["S1"], "fsdp_over_tp_interleaved": ["SS0/2"]}
VARIANTS = {"dion2": dict(dion2_fraction=0.3, weight_decay=0.1, adjust_lr="spectral_norm"),
            "nordion2": dict(dion2_fraction=0.5, normuon_beta2=0.9, weight_decay=0.1),
            # per-head row blocks: GQA's heads of 4 rows; MLA's wq heads of 6 (nope 4 + rope 2), wkv_b's of 8
            "dion2_heads": dict(dion2_fraction=0.3, weight_decay=0.1, adjust_lr="spectral_norm",
                                muon_row_blocks={P + "wq.weight": "heads:4", P + "wk.weight": "heads:4",
                                                 P + "wv.weight": "heads:4"}),
            "nordion2_heads": dict(dion2_fraction=0.5, normuon_beta2=0.9, weight_decay=0.1,
                                   muon_row_blocks={P + "wq.weight": "heads:6", P + "wkv_b.weight": "heads:8"})}


def _full(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(torch.float32)


def _logits(step):
    g = torch.Generator().manual_seed(1000 + step)
    s = torch.rand(4, generator=g) * 3 * T
    s[0], s[-1] = 0.5 * T, 2.5 * T  # one head under the threshold, one over
    return {0: s}


def _config(attention):
    from optimizer import QKClipConfig
    from optimizer.attention_layouts import MLAHeads

    if attention == "mla":
        return QKClipConfig(threshold=T, mla=MLAHeads(qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4))
    return QKClipConfig(head_dim=4, threshold=T)


def _run(make_param, shapes, options, qk_clip, grad_of):
    from optimizer import Muon

    params = {n: Parameter(make_param(_full(s, i))) for i, (n, s) in enumerate(shapes.items())}
    opt = Muon([{"params": list(params.values()), "param_names": list(params), "use_muon": True, **options}],
               lr=0.05, qk_clip=qk_clip)
    for step in range(STEPS):
        for i, (n, p) in enumerate(params.items()):
            p.grad = grad_of(_full(shapes[n], 100 * step + i + 7))
        opt.step(qk_logits=_logits(step) if qk_clip is not None else None)
    whole = lambda t: t if make_param is _plain else full_of(t)  # noqa: E731
    return {n: (whole(p.detach()), whole(opt.state[p]["momentum_buffer"])) for n, p in params.items()}


def _plain(t):
    return t


def _rank(rank, world, attention, variant):
    mesh = init_device_mesh("cpu", (world,))
    shapes, options = {"gqa": GQA, "mla": MLA}[attention], VARIANTS[variant]
    whole = _run(_plain, shapes, options, _config(attention), _plain)
    unclipped = _run(_plain, shapes, options, None, _plain)
    out = {"clip moved the single-device weights": all(not torch.equal(whole[n][0], unclipped[n][0])
                                                      for n in shapes if not n.endswith("wv.weight"))}
    for layout, names in LAYOUTS.items():
        pls = [parse_placement(x) for x in names]
        got = _run(lambda t: make_dtensor(t, mesh, pls), shapes, options, _config(attention),
                   lambda g: make_dtensor(g, mesh, pls))
        for n in shapes:
            out[f"{layout} {n} weight"] = bool(torch.equal(got[n][0], whole[n][0]))
            out[f"{layout} {n} momentum"] = bool(torch.equal(got[n][1], whole[n][1]))
    return out


@pytest.mark.parametrize("attention, variant", [("gqa", "dion2"), ("mla", "dion2"), ("gqa", "nordion2"),
                                                ("gqa", "dion2_heads"), ("mla", "nordion2_heads")])
def test_dion2_qk_clip_on_dtensors_equals_single_device(attention, variant):
    for rank, out in enumerate(run_ranks(_rank, 2, attention, variant, timeout=180)):
        assert all(out.values()), (rank, {k: v for k, v in out.items() if not v})


def _blocks_rank(rank, world):
    from optimizer import Muon

    mesh = init_device_mesh("cpu", (world,))
    shard = lambda t: make_dtensor(t, mesh, [parse_placement("S0")])  # noqa: E731
    group = lambda w, spec: {"params": [w], "param_names": ["w"], "use_muon": True,  # noqa: E731
                             "dion2_fraction": 0.25, "muon_row_blocks": spec}
    out = {}
    for spec in ("heads:4", "heads:5"):  # 16 rows: heads of 4 fit, heads of 5 do not
        try:
            Muon([group(Parameter(shard(_full((16, 12), 0))), spec)])
            out[f"construction {spec}"] = None
        except ValueError as err:
            out[f"construction {spec}"] = str(err)
    # made a DTensor after construction (accelerate's FSDP2 idiom): heads:4 steps as the weight held whole
    whole = Parameter(_full((16, 12), 0))
    whole.grad = _full((16, 12), 1)
    Muon([group(whole, "heads:4")]).step()
    for spec in ("heads:4", "heads:5"):
        late = Muon([group(Parameter(_full((16, 12), 0)), "heads:4")])
        late.param_groups[0]["muon_row_blocks"] = spec  # written in place: the step checks it again
        w = Parameter(shard(_full((16, 12), 0)))
        late.param_groups[0]["params"][0] = w
        w.grad = shard(_full((16, 12), 1))
        before = w.to_local().clone()
        try:
            late.step()
            out[f"step {spec}"] = None
        except ValueError as err:
            out[f"step {spec}"] = str(err)
        if spec == "heads:4":
            out["late as whole"] = bool(torch.equal(full_of(w.detach()), whole.detach()))
        else:
            out["refused unchanged"] = bool(torch.equal(w.to_local(), before)) and len(late.state) == 0
    return out


def test_row_blocks_with_dion2_on_dtensors_step_and_misfits_are_refused_by_name():
    for out in run_ranks(_blocks_rank, 2, timeout=120):
        for when in ("construction", "step"):
            assert out[f"{when} heads:4"] is None, out[f"{when} heads:4"]
            refused = out[f"{when} heads:5"]
            assert refused is not None, when
            for words in ("'w'", "muon_row_blocks"):
                assert words in refused, refused
        assert out["late as whole"] and out["refused unchanged"], out
