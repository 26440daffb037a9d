"""Weights stored ``[in, out]`` (GPT-2's ``Conv1D``) marked ``muon_transposed`` are updated exactly
as their ``nn.Linear`` twin ``[out, in]``: the learning-rate adjustment, row blocks and QK-clip's
head rows read the transposed view (``optimizer/matrix_view.py``), on one device and sharded.

The reference is the same optimizer on the twin stored ``[out, in]`` without the key; placements
of the view are checked against DTensor's own transpose.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dist_cases import parse_placement, to_dtensor
from harness import run_ranks
from optimizer import Muon, QKClipConfig
from optimizer.matrix_view import view_placements

NAMES = ("layers.0.attn.wq.weight", "layers.0.attn.wk.weight", "layers.0.mlp.w1.weight")
SHAPES = {NAMES[0]: (8, 12), NAMES[1]: (4, 12), NAMES[2]: (20, 12)}  # [out, in]; w1 tall
STEPS = 4


def _weights_and_grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(STEPS)]
    return weights, grads


def _logits(step):
    return {0: torch.tensor([3.0, 0.5]) * (1 + step)}


def _run(transposed: bool, mesh=None, placements=None, **kw):
    """Train the three weights; stored [in, out] when ``transposed``. Returns [out, in] tensors."""
    weights, grads = _weights_and_grads()

    def stored(t):
        return t.T.contiguous() if transposed else t

    def make(t, name):
        t = stored(t)
        return to_dtensor(t, mesh, placements[name]) if mesh is not None else t

    params = [torch.nn.Parameter(make(weights[n], n)) for n in NAMES]
    group = {"params": params, "param_names": list(NAMES), "use_muon": True}
    if transposed:
        group["muon_transposed"] = {n: True for n in NAMES}
    opt = Muon([group], lr=0.02, compute_dtype=torch.float32, ns_method="classic", **kw)
    for step in range(STEPS):
        for p, n in zip(params, NAMES):
            p.grad = make(grads[step][n], n) if mesh is None else to_dtensor(stored(grads[step][n]), mesh,
                                                                            p.placements)
        opt.step(qk_logits=_logits(step) if opt.qk_clip is not None else None)
    out = {}
    for p, n in zip(params, NAMES):
        t = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        out[n] = t.T if transposed else t
    return out


CASES = {
    "original": dict(adjust_lr="original"),
    "match_rms_adamw": dict(adjust_lr="match_rms_adamw"),
    "no adjustment": dict(adjust_lr=None),
    "qk-clip": dict(adjust_lr="original", qk_clip=QKClipConfig(head_dim=4, threshold=2.0)),
    # NorMuon's statistics are per output row: per stored column of an [in, out] weight
    "normuon": dict(adjust_lr="original", normuon_beta2=0.9, cautious_wd=True, weight_decay=0.1),
    "normuon, gather mode": dict(adjust_lr="original", normuon_beta2=0.9, distributed_mode="gather"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_transposed_weight_is_updated_exactly_as_its_linear_twin(case):
    twin, conv = _run(False, **CASES[case]), _run(True, **CASES[case])
    for n in NAMES:
        assert torch.equal(conv[n], twin[n]), n
    # the premise: the rule reads rows (w1 is tall: "original" scales it by sqrt(20/12); QK-clip
    # scales query rows), so reading the stored [in, out] tensor as the matrix would differ
    if case in ("original", "qk-clip", "normuon"):
        wrong = _run(False, **CASES[case])
        assert not torch.equal(_transposed_as_stored(case)[NAMES[2]], wrong[NAMES[2]])


def _transposed_as_stored(case):
    """The [in, out] tensors trained without the key (Muon reads [in, out] as the matrix)."""
    weights, grads = _weights_and_grads()
    params = [torch.nn.Parameter(weights[n].T.contiguous()) for n in NAMES]
    opt = Muon([{"params": params, "param_names": list(NAMES), "use_muon": True}], lr=0.02,
               compute_dtype=torch.float32, ns_method="classic", **{k: v for k, v in CASES[case].items() if k != "qk_clip"})
    for step in range(STEPS):
        for p, n in zip(params, NAMES):
            p.grad = grads[step][n].T.contiguous()
        opt.step()
    return {n: p.detach().T for p, n in zip(params, NAMES)}


def test_normuon_v_of_a_transposed_weight_has_one_value_per_output_row_and_round_trips():
    weights, grads = _weights_and_grads()
    params = [torch.nn.Parameter(weights[n].T.contiguous()) for n in NAMES]
    opt = Muon([{"params": params, "param_names": list(NAMES), "use_muon": True, "muon_transposed": True}],
               lr=0.02, normuon_beta2=0.9)
    for p, n in zip(params, NAMES):
        p.grad = grads[0][n].T.contiguous()
    opt.step()
    for p, n in zip(params, NAMES):
        assert opt.state[p]["normuon_v"].shape == (SHAPES[n][0], 1), n  # [out, 1], not [in, 1]
    opt.load_state_dict(opt.state_dict())  # the checkpoint check reads v's shape off the view too


def test_row_blocks_describe_rows_of_the_view():
    """A head-blocked [in, out] weight: 'heads:4' cuts the rows of [out, in] (stored columns)."""
    twin = _run(False, adjust_lr="original")
    weights, grads = _weights_and_grads()
    out = {}
    for transposed in (False, True):
        params = [torch.nn.Parameter(weights[n].T.contiguous() if transposed else weights[n].clone()) for n in NAMES]
        group = {"params": params, "param_names": list(NAMES), "use_muon": True,
                 "muon_row_blocks": {NAMES[0]: "heads:4"}}
        if transposed:
            group["muon_transposed"] = True
        opt = Muon([group], lr=0.02, compute_dtype=torch.float32, ns_method="classic", adjust_lr="original")
        for step in range(STEPS):
            for p, n in zip(params, NAMES):
                p.grad = grads[step][n].T.contiguous() if transposed else grads[step][n].clone()
            opt.step()
        out[transposed] = {n: (p.detach().T if transposed else p.detach()) for p, n in zip(params, NAMES)}
    assert torch.equal(out[True][NAMES[0]], out[False][NAMES[0]])
    assert not torch.equal(out[False][NAMES[0]], twin[NAMES[0]])  # the blocks did change the update


# ------------------------------------------------------------------ sharded


LAYOUTS = {  # placements of the stored [in, out] tensors on a 2-rank mesh
    "fsdp Shard(0)": {n: ["S0"] for n in NAMES},
    "rowwise Shard(1)": {n: ["S1"] for n in NAMES},
}


def _sharded(rank, world_size, layout, case):
    mesh = init_device_mesh("cpu", (world_size,))
    placements = {n: [parse_placement(x) for x in pl] for n, pl in LAYOUTS[layout].items()}
    return _run(True, mesh, placements, **CASES[case])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", ["match_rms_adamw", "qk-clip", "normuon", "normuon, gather mode"])
def test_a_sharded_transposed_weight_equals_its_single_device_linear_twin(layout, case):
    twin = _run(False, **CASES[case])
    for out in run_ranks(_sharded, 2, layout, case, timeout=90):
        for n in NAMES:
            torch.testing.assert_close(out[n], twin[n], atol=1e-6, rtol=0, msg=n)


def _placements_of_transpose(rank, world_size):
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2))
    out = []
    for placements in ([_StridedShard(0, split_factor=2), parse_placement("S0")],
                       [parse_placement("S0"), parse_placement("S1")], [parse_placement("R"), parse_placement("S1")]):
        full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
        dt = to_dtensor(full, mesh, placements)
        ours = view_placements(dt.placements, 2, True)
        # DTensor's own transpose of the local shards must be the view: rebuild it from our placements
        view = DTensor.from_local(dt.to_local().mT, mesh, ours, run_check=False, shape=(6, 8), stride=(8, 1))
        out.append(torch.equal(view.full_tensor(), full.T))
    return out


def test_the_view_placements_rebuild_the_transposed_tensor():
    for out in run_ranks(_placements_of_transpose, 4, timeout=90):
        assert all(out), out
