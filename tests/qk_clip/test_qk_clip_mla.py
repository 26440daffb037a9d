"""QK-clip on MLA attention (DeepSeek-V3 / Kimi K2) against a direct implementation of Kimi K2's rule.

A small MLA attention (torchtitan deepseek_v3 ``Attention``: wq or wq_a -> q_norm -> wq_b, wkv_a ->
kv_norm -> wkv_b, rotary on q_pe and the shared k_pe) is written out here.  The reference rule is
a loop over heads with explicit row slices: q_nope and k_nope rows by sqrt(gamma_h), q_pe rows by
gamma_h, value rows and wkv_a untouched.  After the clip, recomputing the logits must show every
clipped head's max at the threshold.  Sharded weights (FSDP over TP, rows interleaved by
``_StridedShard``) come from DTensor's own ``distribute_tensor``.
"""

import math

import pytest
import torch
import torch._dynamo  # noqa: F401 - DTensor imports it lazily; once here, not in every forked rank
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from harness import run_ranks
from optimizer.attention_layouts import MLAHeads
from optimizer.max_logits import eager_max_logits
from optimizer.qk_clip import QKClipConfig
from optimizer.qk_clip.head_map import build_head_map
from optimizer.qk_clip.step import apply_clip_, compute_clip_step

DIM, H, NOPE, ROPE, V, KV_RANK, Q_RANK = 32, 4, 8, 4, 6, 10, 12
B, L = 2, 7


def make_weights(q_lora: bool, seed=0):
    g = torch.Generator().manual_seed(seed)

    def w(rows, cols, std=1.0):
        return torch.randn(rows, cols, generator=g) * std

    p = "layers.0.attention."
    weights = {}
    if q_lora:
        weights[p + "wq_a.weight"] = w(Q_RANK, DIM, 0.5)
        weights[p + "q_norm.weight"] = 1 + 0.1 * torch.randn(Q_RANK, generator=g)
        weights[p + "wq_b.weight"] = w(H * (NOPE + ROPE), Q_RANK, 0.8)
    else:
        weights[p + "wq.weight"] = w(H * (NOPE + ROPE), DIM, 0.5)
    weights[p + "wkv_a.weight"] = w(KV_RANK + ROPE, DIM, 0.5)
    weights[p + "kv_norm.weight"] = 1 + 0.1 * torch.randn(KV_RANK, generator=g)
    weights[p + "wkv_b.weight"] = w(H * (NOPE + V), KV_RANK, 0.8)
    weights[p + "wo.weight"] = w(DIM, H * V, 0.1)
    # heads of very different sizes so that some are clipped and some are not
    qw = weights[p + ("wq_b.weight" if q_lora else "wq.weight")]
    qw.view(H, NOPE + ROPE, -1).mul_(torch.tensor([3.0, 0.3, 2.0, 0.5])[:, None, None])
    return weights


def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions):
    """Rotary embedding on the last dim (pairs as complex numbers), x: [B, L, heads, ROPE]."""
    freqs = 1.0 / (10000 ** (torch.arange(0, ROPE, 2).float() / ROPE))
    angles = positions[:, None].float() * freqs[None]  # [L, ROPE/2]
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * rot).flatten(-2)


def mla_qk(weights, x, q_lora: bool):
    """q [B, H, L, NOPE+ROPE] and k [B, H, L, NOPE+ROPE] as torchtitan deepseek_v3 Attention.forward builds them."""
    p = "layers.0.attention."
    if q_lora:
        q = rms_norm(x @ weights[p + "wq_a.weight"].T, weights[p + "q_norm.weight"]) @ weights[p + "wq_b.weight"].T
    else:
        q = x @ weights[p + "wq.weight"].T
    q = q.view(B, L, H, NOPE + ROPE)
    q_nope, q_pe = torch.split(q, [NOPE, ROPE], dim=-1)
    kv = x @ weights[p + "wkv_a.weight"].T
    kv, k_pe = torch.split(kv, [KV_RANK, ROPE], dim=-1)
    positions = torch.arange(L)
    q_pe, k_pe = rope(q_pe, positions), rope(k_pe.unsqueeze(2), positions)
    q = torch.cat([q_nope, q_pe], dim=-1)
    kv = (rms_norm(kv, weights[p + "kv_norm.weight"]) @ weights[p + "wkv_b.weight"].T).view(B, L, H, NOPE + V)
    k_nope, _ = torch.split(kv, [NOPE, V], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(-1, -1, H, -1)], dim=-1)
    return q.transpose(1, 2), k.transpose(1, 2)


def explicit_head_max(q, k, scale):
    """Materialise every causal logit, then take the per-head max."""
    s = (q @ k.transpose(-1, -2)) * scale
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return s.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))


def kimi_k2_reference(weights, logits, threshold, q_name, kv_name):
    """MuonClip for MLA, head by head with explicit slices."""
    out = {n: w.clone() for n, w in weights.items()}
    for h in range(H):
        g = min(1.0, threshold / float(logits[h]))
        qb = h * (NOPE + ROPE)
        out[q_name][qb:qb + NOPE] *= math.sqrt(g)  # q_nope: head-specific, no rotary
        out[q_name][qb + NOPE:qb + NOPE + ROPE] *= g  # q_pe: head-specific rotary query
        kb = h * (NOPE + V)
        out[kv_name][kb:kb + NOPE] *= math.sqrt(g)  # k_nope; the value rows kb+NOPE.. stay
    return out


SCALE = (NOPE + ROPE) ** -0.5


@pytest.mark.parametrize("q_lora", [False, True])
def test_mla_clip_matches_kimi_k2_and_caps_logits(q_lora):
    weights = make_weights(q_lora)
    x = torch.randn(B, L, DIM, generator=torch.Generator().manual_seed(5))
    q, k = mla_qk(weights, x, q_lora)
    logits = explicit_head_max(q, k, SCALE)
    torch.testing.assert_close(eager_max_logits(q, k, scale=SCALE, is_causal=True, chunk_size=3), logits)
    threshold = float(logits.sort().values[1]) * 1.01  # two or three heads over, one or two under
    over = logits > threshold
    assert 0 < int(over.sum()) < H

    q_name = "layers.0.attention." + ("wq_b.weight" if q_lora else "wq.weight")
    kv_name = "layers.0.attention.wkv_b.weight"
    cfg = QKClipConfig(threshold=threshold, mla=MLAHeads(NOPE, ROPE, V))
    params = [(n, tuple(w.shape), w.ndim == 2, 0 if w.ndim == 2 else 1) for n, w in weights.items()]
    plan = build_head_map(cfg, params)
    assert set(plan.weights) == {q_name, kv_name}
    step = compute_clip_step(plan, {0: logits}, "cpu")
    clipped = {n: w.clone() for n, w in weights.items()}
    for name, rows in plan.weights.items():
        apply_clip_(clipped[name], step.table, rows.local_index())

    ref = kimi_k2_reference(weights, logits, threshold, q_name, kv_name)
    for name in weights:
        torch.testing.assert_close(clipped[name], ref[name], rtol=1e-6, atol=0)
    # untouched: wkv_a (the shared rotary key and the latent), value rows of wkv_b, wq_a, norms: bit-identical
    for name in weights:
        if name not in (q_name, kv_name):
            assert torch.equal(clipped[name], weights[name]), name
    v_rows = torch.cat([torch.arange(h * (NOPE + V) + NOPE, (h + 1) * (NOPE + V)) for h in range(H)])
    assert torch.equal(clipped[kv_name][v_rows], weights[kv_name][v_rows])
    # recomputed logits: clipped heads sit at the threshold, the others are unchanged
    q2, k2 = mla_qk(clipped, x, q_lora)
    after = explicit_head_max(q2, k2, SCALE)
    torch.testing.assert_close(after[over], torch.full((int(over.sum()),), threshold), rtol=2e-6, atol=0)
    assert torch.equal(after[~over], logits[~over])
    assert step.report.clipped_heads == {0: int(over.sum())}


def _sharded_mla_rank(rank, world_size, q_lora):
    """FSDP (dp_shard) over TP colwise wq_b / wkv_b: rows interleaved across heads on every rank."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    weights = make_weights(q_lora)
    x = torch.randn(B, L, DIM, generator=torch.Generator().manual_seed(5))
    q, k = mla_qk(weights, x, q_lora)
    logits = explicit_head_max(q, k, SCALE)
    threshold = float(logits.sort().values[1]) * 1.01
    cfg = QKClipConfig(threshold=threshold, mla=MLAHeads(NOPE, ROPE, V))
    plan = build_head_map(cfg, [(n, tuple(w.shape), w.ndim == 2, 0) for n, w in weights.items()])
    step = compute_clip_step(plan, {0: logits}, "cpu")
    mesh1 = init_device_mesh("cpu", (world_size,))
    checked = []
    for m, placements in (
        (mesh, [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP2 over TP colwise
        (mesh, [_StridedShard(0, split_factor=4), Shard(0)]),  # rows interleaved across heads
        (mesh1, [_StridedShard(0, split_factor=2)]),  # rows interleaved across heads
        (mesh, [Shard(0), Shard(0)]),
    ):
        for name, rows in plan.weights.items():
            full = weights[name]
            ids = torch.arange(full.shape[0], dtype=torch.float32)[:, None]
            local_rows = distribute_tensor(ids, m, placements, src_data_rank=None).to_local()[:, 0].long()
            local = distribute_tensor(full, m, placements, src_data_rank=None).to_local().clone()
            apply_clip_(local, step.table, rows.local_index(local_rows, "cpu"))
            # reassemble every rank's shard at its global rows
            gathered = [None] * world_size
            torch.distributed.all_gather_object(gathered, (local_rows, local))
            reassembled = torch.full_like(full, float("nan"))
            for r, t in gathered:
                reassembled[r] = t
            want = full.clone()
            apply_clip_(want, step.table, rows.local_index())
            assert torch.equal(reassembled, want), (name, placements)
            checked.append(local_rows.numel() > 1 and bool((local_rows.diff() != 1).any()))
    return any(checked)


@pytest.mark.parametrize("q_lora", [False, True])
def test_mla_clip_on_fsdp_tp_shards_equals_full(q_lora):
    # every rank held interleaved rows in some layout, so the LongTensor path was exercised
    assert all(run_ranks(_sharded_mla_rank, 4, q_lora, timeout=90))
