"""The example model's attention variants (examples/model.py) against references written here.

* The per-head max logit each attention records (``last_max_logits``, from
  ``optimizer.max_logits.eager_max_logits``) equals the max of logits materialised here
  from the weights, head by head, with the layouts written out independently: torchtitan's
  "grouped" ``wqkv`` and deepseek_v3's MLA (rotary embedding as complex multiplication).
* The fused model computes what the separate-weight model computes when ``wqkv`` is
  assembled from ``wq``/``wk``/``wv`` in the "grouped" layout, and that layout is the
  library's ``FusedQKV(..., "grouped")``.
* A QK-clip-only step (lr 0) of ``Muon`` configured by ``examples/muon_setup.py`` shrinks
  every head's max logit exactly as MuonClip says: MLA heads above the threshold land on it;
  GQA heads by ``sqrt(gamma_h * min gamma of the heads sharing the key)``.
* Lockstep runs (forked ranks, FSDP+TP) of variants the shipped configs do not cover (MLA
  without query LoRA, per-head row blocks) equal single-device Muon, and a reference that
  declares another fused layout is caught.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import pytest
import torch

from examples.config import MuonSettings, QKClipSettings, RunConfig, load_config
from examples.model import ModelArgs, build_model, collect_qk_logits
from examples.muon_setup import muon_param_groups, qk_clip_config
from harness import run_ranks
from optimizer import FusedQKV, Muon
from optimizer.attention_layouts import Part
from repo import CONFIGS

CONFIG_DIR = str(CONFIGS)

SMALL = dict(vocab_size=16, dim=24, n_layers=1, ffn_dim=8, n_experts=2, expert_dim=4, qk_init_gain=3.0)
ARGS = {
    "gqa": ModelArgs(**SMALL, n_heads=6, n_kv_heads=2, head_dim=4),
    "fused_qkv": ModelArgs(**SMALL, n_heads=6, n_kv_heads=2, head_dim=4, attention="fused_qkv"),
    "mla": ModelArgs(**SMALL, n_heads=3, attention="mla", kv_lora_rank=8, qk_nope_head_dim=4,
                     qk_rope_head_dim=6, v_head_dim=5),
    "mla_q_lora": ModelArgs(**SMALL, n_heads=3, attention="mla", q_lora_rank=10, kv_lora_rank=8,
                            qk_nope_head_dim=4, qk_rope_head_dim=6, v_head_dim=5),
}
B, L = 3, 7


def _x(dim, seed=0):
    return torch.randn(B, L, dim, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------- independent q/k per head


def grouped_rows(n_heads, n_kv_heads, head_dim):
    """torchtitan's "grouped" wqkv, written out: per kv group g, its query heads, its key, its value."""
    group = n_heads // n_kv_heads
    q, k, v, row = {}, {}, {}, 0
    for g in range(n_kv_heads):
        for j in range(group):
            q[g * group + j] = list(range(row, row + head_dim))
            row += head_dim
        k[g] = list(range(row, row + head_dim))
        row += head_dim
        v[g] = list(range(row, row + head_dim))
        row += head_dim
    return q, k, v


def rotary_complex(x, theta):
    """[B, L, H, d] rotated as torchtitan does: pairs as complex numbers times exp(i pos freq)."""
    d = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(x.shape[1], dtype=torch.float64), freqs)
    cis = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * cis).flatten(-2)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def per_head_qk(attn, args, x):
    """``{query head: (q [B, L, d], k [B, L, d])}`` in float64, from the weights alone."""
    x = x.double()
    if args.attention in ("gqa", "fused_qkv"):
        group = args.n_heads // args.n_kv_heads
        if args.attention == "gqa":
            wq, wk = attn.wq.weight.double(), attn.wk.weight.double()
            rows_q = {h: list(range(h * args.head_dim, (h + 1) * args.head_dim)) for h in range(args.n_heads)}
            rows_k = {g: list(range(g * args.head_dim, (g + 1) * args.head_dim)) for g in range(args.n_kv_heads)}
        else:
            wq = wk = attn.wqkv.weight.double()
            rows_q, rows_k, _ = grouped_rows(args.n_heads, args.n_kv_heads, args.head_dim)
        return {h: (x @ wq[rows_q[h]].T, x @ wk[rows_k[h // group]].T) for h in range(args.n_heads)}
    nope, rope, vd = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    if args.q_lora_rank == 0:
        q = x @ attn.wq.weight.double().T
    else:
        q_a = rms(x @ attn.wq_a.weight.double().T, attn.q_norm.weight.double(), args.norm_eps)
        q = q_a @ attn.wq_b.weight.double().T
    kv_a = x @ attn.wkv_a.weight.double().T
    latent, k_pe = kv_a[..., :args.kv_lora_rank], kv_a[..., args.kv_lora_rank:]
    kv = rms(latent, attn.kv_norm.weight.double(), args.norm_eps) @ attn.wkv_b.weight.double().T
    k_pe = rotary_complex(k_pe[:, :, None], args.rope_theta)[:, :, 0]
    out = {}
    for h in range(args.n_heads):
        qh = q[..., h * (nope + rope):(h + 1) * (nope + rope)]  # per head [q_nope; q_pe]
        q_pe = rotary_complex(qh[..., nope:][:, :, None], args.rope_theta)[:, :, 0]
        k_nope = kv[..., h * (nope + vd):h * (nope + vd) + nope]  # per head [k_nope; v]
        out[h] = (torch.cat([qh[..., :nope], q_pe], -1), torch.cat([k_nope, k_pe], -1))
    return out


def materialised_max_logits(attn, args, x):
    want = []
    for q, k in per_head_qk(attn, args, x).values():
        logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, L, L]
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        want.append(logits.masked_fill(~causal, -math.inf).amax())
    return torch.stack(want).float()


@pytest.mark.parametrize("kind", list(ARGS))
def test_recorded_max_equals_materialised_logits(kind):
    args = ARGS[kind]
    model = build_model(args, seed=1)
    attn = model.layers[0].attention
    x = _x(args.dim)
    with torch.no_grad():
        attn(x)
    want = materialised_max_logits(attn, args, x)
    assert attn.last_max_logits.shape == (args.n_heads,) and attn.last_max_logits.dtype == torch.float32
    torch.testing.assert_close(attn.last_max_logits, want, rtol=1e-5, atol=1e-5)
    assert want.max() > 1.0  # qk_init_gain makes the logits large enough to be worth clipping
    # and collect_qk_logits (no process group) hands them over as they are
    torch.testing.assert_close(collect_qk_logits(model)[0], attn.last_max_logits, rtol=0, atol=0)


def test_grouped_layout_is_the_librarys():
    args = ARGS["fused_qkv"]
    q, k, v = grouped_rows(args.n_heads, args.n_kv_heads, args.head_dim)
    layout = args.fused_qkv.row_layout()
    assert args.fused_qkv == FusedQKV(args.n_heads, args.n_kv_heads, args.head_dim, "grouped")
    for part, rows in ((Part.Q, q), (Part.K, k), (Part.V, v)):
        for head, r in rows.items():
            assert layout.rows(part, head).tolist() == r, (part, head)


def test_fused_model_equals_separate_weights():
    sep = build_model(ARGS["gqa"], seed=2)
    fused = build_model(ARGS["fused_qkv"], seed=3)
    args = ARGS["fused_qkv"]
    q, k, v = grouped_rows(args.n_heads, args.n_kv_heads, args.head_dim)
    with torch.no_grad():
        for name, p in fused.named_parameters():
            if not name.endswith("wqkv.weight"):
                p.copy_(sep.get_parameter(name))
                continue
            attn = sep.layers[0].attention
            d = args.head_dim
            for rows, weight, heads in ((q, attn.wq.weight, args.n_heads), (k, attn.wk.weight, args.n_kv_heads),
                                        (v, attn.wv.weight, args.n_kv_heads)):
                for h in range(heads):
                    p[rows[h]] = weight[h * d:(h + 1) * d]
    tokens = torch.randint(args.vocab_size, (B, L), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens), sep(tokens), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused.layers[0].attention.last_max_logits,
                                   sep.layers[0].attention.last_max_logits, rtol=1e-6, atol=1e-6)


# ------------------------------------------- QK-clip on the example's weights


def _run_config(args, threshold, row_blocks="none"):
    return RunConfig(name="t", model=args, qk_clip=QKClipSettings(enabled=True, threshold=threshold),
                     muon=MuonSettings(row_blocks=row_blocks))


@pytest.mark.parametrize("kind", list(ARGS))
def test_clip_only_step_shrinks_each_heads_max_logit_as_muonclip_says(kind):
    args = ARGS[kind]
    model = build_model(args, seed=5)
    tokens = torch.randint(args.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(6))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    before = collect_qk_logits(model)[0].clone()
    tau = before.median().item()  # about half of the heads above it
    cfg = _run_config(args, tau)
    opt = Muon(muon_param_groups(model, cfg), lr=0.0, weight_decay=0.0, qk_clip=qk_clip_config(cfg))
    opt.step(qk_logits={0: before})
    clipped = before > tau
    assert 0 < int(clipped.sum()) < args.n_heads and opt.qk_clip_report.total_clipped == int(clipped.sum())
    with torch.no_grad():
        model(tokens[:, :-1])
    after = model.layers[0].attention.last_max_logits
    gamma = torch.where(clipped, tau / before, torch.ones_like(before))
    if args.attention == "mla":  # every head its own key: q_nope, k_nope by sqrt(gamma), q_pe by gamma
        want = before * gamma
    else:  # the key of a kv head is scaled by sqrt(min gamma) over the query heads sharing it
        group = args.n_heads // args.n_kv_heads
        key_gamma = gamma.view(args.n_kv_heads, group).amin(1).repeat_interleave(group)
        want = before * (gamma * key_gamma).sqrt()
    torch.testing.assert_close(after, want, rtol=2e-6, atol=0)
    assert bool((after <= tau * (1 + 1e-6)).all())


# ------------------------------------------- lockstep variants on FSDP+TP


def _lockstep(rank, world_size, config, model_overrides, row_blocks, reference_layout):
    import examples.muon_setup as setup
    import examples.train as train_mod

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    cfg = load_config(os.path.join(CONFIG_DIR, f"{config}.toml"), world_size=world_size)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model_overrides),
                              muon=MuonSettings(row_blocks=row_blocks))
    made, original = [], train_mod.make_optimizer

    def make(model, cfg_, use_qk_clip, mode, compute_dtype):
        made.append(model)
        if len(made) == 2 and reference_layout is not None:  # rank 0's single-device reference
            wrong = dataclasses.replace(cfg_.model.fused_qkv, layout=reference_layout)
            groups = setup.muon_param_groups(model, cfg_)
            groups[0]["muon_row_blocks"] = {n: wrong for n in groups[0]["muon_row_blocks"]}
            qk = dataclasses.replace(setup.qk_clip_config(cfg_), fused_qkv=wrong)
            return Muon(groups, lr=cfg_.train.lr, weight_decay=cfg_.train.weight_decay,
                        momentum=cfg_.train.momentum, qk_clip=qk)
        return original(model, cfg_, use_qk_clip, mode, compute_dtype)

    train_mod.make_optimizer = make
    try:
        return train_mod.train(cfg, steps=3, use_qk_clip=True, log=lambda *_: None)
    finally:
        train_mod.make_optimizer = original


LOCKSTEP = {
    "mla_no_q_lora_per_head": ("mla", {"q_lora_rank": 0}, "heads"),
    "fused_qkv_per_head": ("fused_qkv", {}, "heads"),
}


@pytest.mark.parametrize("case", list(LOCKSTEP))
def test_variant_matches_single_device_muon(case):
    from examples.train import DEFAULT_TOLERANCE

    config, overrides, row_blocks = LOCKSTEP[case]
    s = run_ranks(_lockstep, 4, config, overrides, row_blocks, None, timeout=240)[0]
    assert s["max_param_deviation"] <= DEFAULT_TOLERANCE, s["worst_param"]
    assert sum(s["heads_clipped"]) > 0 and s["last_loss"] < s["first_loss"]


def test_reference_with_another_fused_layout_is_caught():
    """The check can see a layout mistake: a reference told "concat" (q/k/v blocks and clipped rows
    in the wrong places) leaves the sharded run, which is told the truth ("grouped")."""
    from examples.train import DEFAULT_TOLERANCE

    s = run_ranks(_lockstep, 4, "fused_qkv", {}, "qkv", "concat", timeout=240)[0]
    assert s["max_param_deviation"] > 100 * DEFAULT_TOLERANCE
    assert "wqkv" in s["worst_param"], s["worst_param"]


def test_recorded_max_is_bit_for_bit_the_largest_logit_the_softmax_sees():
    """The forward divides q.k by sqrt(d); the recorded max must be exactly the largest of those
    logits (QK-clip then bounds what the model computed, and the main job's numbers do not move
    when the max comes from the library's helper).  At the main job's attention sizes."""
    args = ModelArgs(vocab_size=16, dim=128, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=8,
                     n_experts=2, expert_dim=4)
    attn = build_model(args, seed=7).layers[0].attention
    mismatches = 0
    for seed in range(5):
        x = torch.randn(4, 128, args.dim, generator=torch.Generator().manual_seed(seed)) * 3
        with torch.no_grad():
            attn(x)
            q = (x @ attn.wq.weight.T).view(4, 128, 4, 32).transpose(1, 2)
            k = (x @ attn.wk.weight.T).view(4, 128, 2, 32).transpose(1, 2).repeat_interleave(2, dim=1)
            logits = (q @ k.transpose(-2, -1)) / math.sqrt(32)
            causal = torch.ones(128, 128, dtype=torch.bool).tril()
            want = logits.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))
        mismatches += not torch.equal(attn.last_max_logits, want)
    assert mismatches == 0
