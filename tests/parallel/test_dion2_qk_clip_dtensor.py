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

Row blocks in a Dion2 group of DTensors are refused naming the option, saying they work on plain
tensors (``muon_row_blocks``): at construction, and at the step (changing nothing) for a weight
made a DTensor after construction.
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
            "nordion2": dict(dion2_fraction=0.5, normuon_beta2=0.9, weight_decay=0.1)}


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


@pytest.mark.parametrize("attention, variant", [("gqa", "dion2"), ("mla", "dion2"), ("gqa", "nordion2")])
def test_dion2_qk_clip_on_dtensors_equals_single_device(attention, variant):
    for rank, out in enumerate(run_ranks(_rank, 2, attention, variant, timeout=180)):
        assert all(out.values()), (rank, {k: v for k, v in out.items() if not v})


def _blocks_rank(rank, world):
    from optimizer import Muon

    mesh = init_device_mesh("cpu", (world,))
    w = Parameter(make_dtensor(_full((16, 12), 0), mesh, [parse_placement("S0")]))
    group = {"params": [w], "param_names": ["w"], "use_muon": True, "dion2_fraction": 0.25, "muon_row_blocks": "heads:4"}
    out = {}
    try:
        Muon([group])
        out["construction"] = None
    except ValueError as err:
        out["construction"] = str(err)
    # made a DTensor after construction (accelerate's FSDP2 idiom): the step refuses it, changing nothing
    late = Muon([{**group, "params": [Parameter(_full((16, 12), 0))]}])
    late.param_groups[0]["params"][0] = w
    w.grad = make_dtensor(_full((16, 12), 1), mesh, [parse_placement("S0")])
    before = w.to_local().clone()
    try:
        late.step()
        out["step"] = None
    except ValueError as err:
        out["step"] = str(err)
    out["unchanged"] = bool(torch.equal(w.to_local(), before)) and len(late.state) == 0
    return out


def test_row_blocks_with_dion2_on_dtensors_are_refused_by_name():
    for out in run_ranks(_blocks_rank, 2, timeout=120):
        for when in ("construction", "step"):
            assert out[when] is not None, when
            for words in ("'w'", "muon_row_blocks", "Dion2", "plain tensors, not yet for DTensors"):
                assert words in out[when], out[when]
        assert out["unchanged"]
