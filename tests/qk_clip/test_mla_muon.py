"""MuonClip on MLA weights through ``Muon.step``, against the Kimi K2 rule written out here.

Reference: the same Muon without QK-clip, followed after every step by the rule as the
Kimi K2 report states it, per head h with gamma_h = min(1, tau / S_h): the head's
q_nope rows (of ``wq_b``) and k_nope rows (of ``wkv_b``) times sqrt(gamma_h), its q_pe
rows times gamma_h, value rows and ``wkv_a`` (latent and shared rotary key) untouched.
Checked on one device and with ``wq_b``/``wkv_b`` sharded FSDP-over-TP style (rows
interleaved across heads by ``_StridedShard``).
"""

from __future__ import annotations

import math

import torch

from dist_cases import parse_placement, to_dtensor
from harness import run_ranks
from optimizer import Muon, QKClipConfig
from optimizer.attention_layouts import MLAHeads

H, NOPE, ROPE, V, DIM, Q_LORA, KV_LORA = 4, 8, 4, 8, 16, 12, 10
TAU, STEPS = 2.0, 3
KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
SHAPES = {
    "layers.0.attention.wq_a.weight": (Q_LORA, DIM),
    "layers.0.attention.wq_b.weight": (H * (NOPE + ROPE), Q_LORA),
    "layers.0.attention.wkv_a.weight": (KV_LORA + ROPE, DIM),
    "layers.0.attention.wkv_b.weight": (H * (NOPE + V), KV_LORA),
    "layers.0.attention.wo.weight": (DIM, H * V),
}
PLACEMENTS = {  # on a (dp, tp) = (2, 2) mesh, as fully_shard over colwise/rowwise TP gives
    "layers.0.attention.wq_a.weight": ["S0", "R"],
    "layers.0.attention.wq_b.weight": ["SS0/2", "S0"],
    "layers.0.attention.wkv_a.weight": ["S0", "R"],
    "layers.0.attention.wkv_b.weight": ["SS0/2", "S0"],
    "layers.0.attention.wo.weight": ["S0", "S1"],
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(STEPS)]
    logits = [{0: torch.rand(H, generator=g) * 3 * TAU} for _ in range(STEPS)]
    return params, grads, logits


def kimi_k2_clip_(weights: dict, max_logits: torch.Tensor) -> None:
    """The rule, row by row (nothing from the optimizer's QK-clip code)."""
    for h in range(H):
        gamma = min(1.0, TAU / float(max_logits[h]))
        q = weights["layers.0.attention.wq_b.weight"]
        base = h * (NOPE + ROPE)
        q[base: base + NOPE] *= math.sqrt(gamma)
        q[base + NOPE: base + NOPE + ROPE] *= gamma
        kv = weights["layers.0.attention.wkv_b.weight"]
        base = h * (NOPE + V)
        kv[base: base + NOPE] *= math.sqrt(gamma)  # k_nope; the v rows after it stay


def _reference():
    params, grads, logits = _inputs()
    named = {n: torch.nn.Parameter(t.clone()) for n, t in params.items()}
    opt = Muon([{"params": list(named.values()), "param_names": list(named), "use_muon": True}], **KW)
    for s in range(STEPS):
        for n, p in named.items():
            p.grad = grads[s][n].clone()
        opt.step()
        with torch.no_grad():
            kimi_k2_clip_({n: p.data for n, p in named.items()}, logits[s][0])
    return {n: p.detach() for n, p in named.items()}


def _config():
    return QKClipConfig(threshold=TAU, mla=MLAHeads(qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V))


def test_mla_clip_on_one_device_follows_kimi_k2():
    want = _reference()
    params, grads, logits = _inputs()
    named = {n: torch.nn.Parameter(t.clone()) for n, t in params.items()}
    opt = Muon([{"params": list(named.values()), "param_names": list(named), "use_muon": True}],
               qk_clip=_config(), **KW)
    for s in range(STEPS):
        for n, p in named.items():
            p.grad = grads[s][n].clone()
        opt.step(qk_logits=logits[s])
    for n in want:
        torch.testing.assert_close(named[n].detach(), want[n], atol=2e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")
    assert opt.qk_clip_report.total_clipped > 0


def _sharded(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    params, grads, logits = _inputs()
    named = {n: torch.nn.Parameter(to_dtensor(t, mesh, [parse_placement(x) for x in PLACEMENTS[n]]))
             for n, t in params.items()}
    opt = Muon([{"params": list(named.values()), "param_names": list(named), "use_muon": True}],
               qk_clip=_config(), **KW)
    for s in range(STEPS):
        for n, p in named.items():
            p.grad = to_dtensor(grads[s][n], mesh, p.placements)
        opt.step(qk_logits=logits[s])
    return {n: p.full_tensor().detach() for n, p in named.items()}


def test_mla_clip_on_interleaved_shards_follows_kimi_k2():
    want = _reference()
    for got in run_ranks(_sharded, 4, timeout=90):
        for n in want:
            torch.testing.assert_close(got[n], want[n], atol=2e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")


def test_the_rule_changes_something():
    """Not vacuous: with these logits the clip moves the weights, and leaves wkv_a alone."""
    params, grads, logits = _inputs()
    w = {n: t.clone() for n, t in params.items()}
    kimi_k2_clip_(w, logits[0][0])
    assert not torch.equal(w["layers.0.attention.wq_b.weight"], params["layers.0.attention.wq_b.weight"])
    assert torch.equal(w["layers.0.attention.wkv_a.weight"], params["layers.0.attention.wkv_a.weight"])
