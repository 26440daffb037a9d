"""Fused q/k/v through ``Muon.step``: split orthogonalisation and QK-clip equal separate weights.

A fused ``wqkv`` declared with ``muon_row_blocks=FusedQKV(...)`` (and, for QK-clip,
``QKClipConfig(fused_qkv=...)``) must be updated exactly as the separate ``wq``/``wk``/``wv``
would be: each block orthogonalised on its own with its own adjusted learning rate, and
each q/k row clipped by its own head.  The reference is Muon on the separate weights (on
one device); the fused weight is checked whole on one device, and sharded with
FSDP+TP-style interleaved rows in the parallel pipeline (whose owner splits the gathered
matrix into blocks).
"""

from __future__ import annotations

import pytest
import torch

from dist_cases import parse_placement, to_dtensor
from harness import run_ranks
from optimizer import Muon, QKClipConfig
from optimizer.attention_layouts import FusedQKV, Part

N_HEADS, N_KV, HEAD_DIM, DIM = 4, 2, 4, 12
STEPS, THRESHOLD = 3, 1.0
KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr="match_rms_adamw")


def _inputs(n_kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"wq": (N_HEADS * HEAD_DIM, DIM), "wk": (n_kv * HEAD_DIM, DIM), "wv": (n_kv * HEAD_DIM, DIM)}
    params = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(STEPS)]
    logits = [{0: torch.rand(N_HEADS, generator=g) * 3 * THRESHOLD} for _ in range(STEPS)]
    return params, grads, logits


def _fuse(parts: dict, fused: FusedQKV) -> torch.Tensor:
    layout = fused.row_layout()
    out = torch.empty(fused.num_rows, DIM)
    for part, name in ((Part.Q, "wq"), (Part.K, "wk"), (Part.V, "wv")):
        out[layout.rows(part)] = parts[name]
    return out


def _unfuse(w: torch.Tensor, fused: FusedQKV) -> dict:
    layout = fused.row_layout()
    return {name: w[layout.rows(part)] for part, name in ((Part.Q, "wq"), (Part.K, "wk"), (Part.V, "wv"))}


def _separate(qk: bool, n_kv: int = N_KV):
    params, grads, logits = _inputs(n_kv)
    names = {k: f"layers.0.attention.{k}.weight" for k in params}
    named = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = Muon([{"params": list(named.values()), "param_names": [names[k] for k in named], "use_muon": True}],
               qk_clip=QKClipConfig(head_dim=HEAD_DIM, threshold=THRESHOLD) if qk else None, **KW)
    for s in range(STEPS):
        for k, p in named.items():
            p.grad = grads[s][k].clone()
        opt.step(qk_logits=logits[s] if qk else None)
    return {k: p.detach() for k, p in named.items()}


def _fused_optimizer(w, fused, qk):
    group = {"params": [w], "param_names": ["layers.0.attention.wqkv.weight"], "use_muon": True,
             "muon_row_blocks": fused}
    return Muon([group], qk_clip=QKClipConfig(threshold=THRESHOLD, fused_qkv=fused) if qk else None, **KW)


def _fused_single(fused: FusedQKV, qk: bool):
    params, grads, logits = _inputs(fused.n_kv_heads)
    w = torch.nn.Parameter(_fuse(params, fused))
    opt = _fused_optimizer(w, fused, qk)
    for s in range(STEPS):
        w.grad = _fuse(grads[s], fused)
        opt.step(qk_logits=logits[s] if qk else None)
    return _unfuse(w.detach(), fused)


LAYOUTS = {
    "grouped": FusedQKV(N_HEADS, N_KV, HEAD_DIM, "grouped"),
    "concat": FusedQKV(N_HEADS, N_KV, HEAD_DIM, "concat"),
    "interleaved": FusedQKV(N_HEADS, N_HEADS, HEAD_DIM, "interleaved"),  # MHA only
}


@pytest.mark.parametrize("qk", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fused_weight_on_one_device_equals_separate_weights(layout, qk):
    fused = LAYOUTS[layout]
    want = _separate(qk, fused.n_kv_heads)  # interleaved is MHA: its separate weights too
    got = _fused_single(fused, qk)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=2e-6, rtol=1e-5, msg=lambda m: f"{layout} qk={qk} {k}: {m}")


def test_blocks_change_the_result():
    """Not vacuous: orthogonalising the fused matrix whole gives another update."""
    fused = LAYOUTS["grouped"]
    params, grads, _ = _inputs(N_KV)
    w = torch.nn.Parameter(_fuse(params, fused))
    opt = Muon([{"params": [w], "use_muon": True}], **KW)
    for s in range(STEPS):
        w.grad = _fuse(grads[s], fused)
        opt.step()
    whole = _unfuse(w.detach(), fused)
    blocked = _fused_single(fused, False)
    assert not torch.allclose(whole["wq"], blocked["wq"], atol=1e-4)


def _fused_sharded(rank, world_size, layout, qk, placements):
    from torch.distributed.device_mesh import init_device_mesh

    fused = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (2, 2))
    params, grads, logits = _inputs(fused.n_kv_heads)
    pl = [parse_placement(x) for x in placements]
    w = torch.nn.Parameter(to_dtensor(_fuse(params, fused), mesh, pl))
    opt = _fused_optimizer(w, fused, qk)
    for s in range(STEPS):
        w.grad = to_dtensor(_fuse(grads[s], fused), mesh, pl)
        opt.step(qk_logits=logits[s] if qk else None)
    return _unfuse(w.full_tensor().detach(), fused), opt.last_step_stats.owned


@pytest.mark.parametrize("placements", [["SS0/2", "S0"], ["S0", "S1"]])
@pytest.mark.parametrize("layout", ["grouped", "concat"])
def test_sharded_fused_weight_in_the_pipeline_equals_separate_weights(layout, placements):
    for qk in (False, True):
        want = _separate(qk)
        results = run_ranks(_fused_sharded, 4, layout, qk, placements, timeout=90)
        assert sum(owned for _, owned in results) >= 1  # an owner gathered and split it
        for got, _ in results:
            for k in want:
                torch.testing.assert_close(got[k], want[k], atol=2e-6, rtol=1e-5,
                                           msg=lambda m: f"{layout} {placements} qk={qk} {k}: {m}")
