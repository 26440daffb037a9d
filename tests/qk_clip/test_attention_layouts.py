"""Attention row layouts (separate, fused QKV in three layouts, MLA) and split orthogonalisation.

References: fused weights are assembled here with explicit loops over heads from separate
q/k/v weights, and with torchtitan's own merge formula (FusedQKVLinear._merge_qkv_on_load);
MLA rows are identified by running torchtitan's forward reshapes on a weight whose rows are their
own index; split orthogonalisation is compared with orthogonalising each block on its own.
"""

import math

import pytest
import torch

from optimizer import zeropower_via_newtonschulz
from optimizer.attention_layouts import FusedQKV, MLAHeads, Part, separate_k_layout, separate_q_layout
from optimizer.rule import adjust_lr, orthogonalize_in_blocks
from optimizer.row_blocks import (
    HeadBlocks,
    SplitQKV,
    check_group_row_blocks,
    compile_blocks,
    parse_spec,
    resolve_row_blocks,
    spec_for,
)
from tolerances import newton_schulz_atol, unit_roundoff

# ---------------------------------------------------------------- fused QKV layouts


def fuse_by_loops(wq, wk, wv, n_heads, n_kv, head_dim, layout):
    """Reference fusion, one head at a time."""
    q = [wq[h * head_dim:(h + 1) * head_dim] for h in range(n_heads)]
    k = [wk[j * head_dim:(j + 1) * head_dim] for j in range(n_kv)]
    v = [wv[j * head_dim:(j + 1) * head_dim] for j in range(n_kv)]
    pieces = []
    if layout == "concat":
        pieces = q + k + v
    elif layout == "interleaved":
        for h in range(n_heads):
            pieces += [q[h], k[h], v[h]]
    else:  # grouped
        g = n_heads // n_kv
        for j in range(n_kv):
            pieces += q[j * g:(j + 1) * g] + [k[j], v[j]]
    return torch.cat(pieces)


def tagged(n_heads, n_kv, head_dim, cols=1):
    """Separate weights whose entries say (part, head, offset): part*1e4 + head*100 + offset."""
    def w(part, n):
        return torch.tensor([[part * 10000 + h * 100 + o] * cols for h in range(n) for o in range(head_dim)],
                            dtype=torch.float64)
    return w(int(Part.Q), n_heads), w(int(Part.K), n_kv), w(int(Part.V), n_kv)


@pytest.mark.parametrize("layout", ["grouped", "concat", "interleaved"])
@pytest.mark.parametrize("n_heads, n_kv", [(4, 4), (8, 2), (6, 3), (4, 1)])
def test_fused_layout_matches_loop_fusion(layout, n_heads, n_kv):
    if layout == "interleaved" and n_kv != n_heads:
        with pytest.raises(ValueError, match="interleaved.*n_kv_heads == n_heads"):
            FusedQKV(n_heads, n_kv, 3, layout)
        return
    head_dim = 3
    fused = FusedQKV(n_heads, n_kv, head_dim, layout)
    wq, wk, wv = tagged(n_heads, n_kv, head_dim)
    ref = fuse_by_loops(wq, wk, wv, n_heads, n_kv, head_dim, layout)[:, 0].long()
    rl = fused.row_layout()
    assert rl.num_rows == fused.num_rows == ref.numel()
    assert torch.equal(rl.part, ref // 10000)
    assert torch.equal(rl.head, (ref // 100) % 100)
    # rows(part) returns rows in the separate weight's order
    for part, w in ((Part.Q, wq), (Part.K, wk), (Part.V, wv)):
        fused_w = fuse_by_loops(wq, wk, wv, n_heads, n_kv, head_dim, layout)
        assert torch.equal(fused_w[rl.rows(part)], w)


@pytest.mark.parametrize("n_heads, n_kv", [(8, 2), (4, 4)])
def test_grouped_layout_is_torchtitans_merge(n_heads, n_kv):
    """torchtitan FusedQKVLinear._merge_qkv_on_load: cat([q.view(n_kv, hpk, hd, *), k.view(n_kv, 1, hd, *),
    v.view(n_kv, 1, hd, *)], dim=1).reshape(-1, *)."""
    hd, dim = 4, 5
    hpk = n_heads // n_kv
    g = torch.Generator().manual_seed(0)
    wq, wk, wv = (torch.randn(n * hd, dim, generator=g) for n in (n_heads, n_kv, n_kv))
    merged = torch.cat([wq.reshape(n_kv, hpk, hd, dim), wk.reshape(n_kv, 1, hd, dim), wv.reshape(n_kv, 1, hd, dim)],
                       dim=1).reshape(-1, dim)
    rl = FusedQKV(n_heads, n_kv, hd, "grouped").row_layout()
    assert torch.equal(merged[rl.rows(Part.Q)], wq)
    assert torch.equal(merged[rl.rows(Part.K)], wk)
    assert torch.equal(merged[rl.rows(Part.V)], wv)
    # torchtitan's forward: view(T, n_kv, hpk + 2, hd), split [hpk, 1, 1] on dim -2
    x = torch.randn(3, dim, generator=g)
    qkv = (x @ merged.T).view(3, n_kv, hpk + 2, hd)
    xq, xk, xv = torch.split(qkv, [hpk, 1, 1], dim=-2)
    torch.testing.assert_close(xq.reshape(3, -1), x @ wq.T)
    torch.testing.assert_close(xk.reshape(3, -1), x @ wk.T)
    torch.testing.assert_close(xv.reshape(3, -1), x @ wv.T)


def test_interleaved_equals_grouped_for_mha():
    a = FusedQKV(4, 4, 2, "interleaved").row_layout()
    b = FusedQKV(4, 4, 2, "grouped").row_layout()
    assert torch.equal(a.part, b.part) and torch.equal(a.head, b.head)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_heads=6, n_kv_heads=4, head_dim=2), "multiple of n_kv_heads"),
    (dict(n_heads=4, n_kv_heads=2, head_dim=0), "head_dim"),
    (dict(n_heads=4, n_kv_heads=2, head_dim=2, layout="blocked"), "layout"),
    (dict(n_heads=True, n_kv_heads=1, head_dim=2), "n_heads"),
])
def test_fused_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedQKV(**kwargs)


def test_separate_layouts():
    q = separate_q_layout(4, 3, n_kv_heads=2)
    assert q.n_q_heads == 4 and q.n_kv_heads == 2
    assert torch.equal(q.head, torch.arange(12) // 3) and bool((q.part == int(Part.Q)).all())
    k = separate_k_layout(2, 3, n_q_heads=4)
    assert torch.equal(k.head, torch.arange(6) // 3) and bool((k.part == int(Part.K)).all())


# ---------------------------------------------------------------- MLA layouts


def test_mla_layouts_follow_torchtitan_forward():
    """Run torchtitan deepseek_v3 Attention.forward's reshapes on a weight whose rows are their own
    index: q.view(T, -1, nope + rope) split [nope, rope]; kv.view(T, -1, nope + v) split [nope, v];
    wkv_a output split [kv_lora_rank, rope]."""
    nope, rope, v, H, rank = 3, 2, 4, 5, 6
    mla = MLAHeads(nope, rope, v)
    q_rows = torch.arange(H * (nope + rope)).float()[None]  # the output of a "row id" weight for T=1
    q = q_rows.view(1, -1, nope + rope)
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    rl = mla.q_layout(H)
    for h in range(H):
        assert torch.equal(rl.rows(Part.Q_NOPE, h), q_nope[0, h].long())
        assert torch.equal(rl.rows(Part.Q_PE, h), q_pe[0, h].long())
    kv = torch.arange(H * (nope + v)).float()[None].view(1, -1, nope + v)
    k_nope, vv = torch.split(kv, [nope, v], dim=-1)
    rl = mla.kv_b_layout(H)
    for h in range(H):
        assert torch.equal(rl.rows(Part.K_NOPE, h), k_nope[0, h].long())
        assert torch.equal(rl.rows(Part.V, h), vv[0, h].long())
    a = torch.arange(rank + rope).float()[None]
    latent, k_pe = torch.split(a, [rank, rope], dim=-1)
    rl = mla.kv_a_layout(rank, H)
    assert torch.equal(rl.rows(Part.LATENT), latent[0].long())
    assert torch.equal(rl.rows(Part.K_PE_SHARED), k_pe[0].long())
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        MLAHeads(128, 0, 128)


# ---------------------------------------------------------------- split orthogonalisation


# Split orthogonalisation batches same-shape blocks into one call; the reference orthogonalises each
# block alone: the same iteration in another order.  Both run in float64, where the bound on that
# difference (tests/tolerances.py) is ~1e-10, far below what a misplaced row or block changes
# (entries of an orthogonal factor are ~0.1-1); in float32 the same bound would be ~0.05.
def ns(x):
    return zeropower_via_newtonschulz(x, ns_steps=5, compute_dtype=torch.float64, method="classic")


def ns_atol(shape):
    return newton_schulz_atol(shape, torch.float64)


def test_blocks_equal_separate_orthogonalisation_batched_by_shape():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(20, 7, generator=g, dtype=torch.float64)
    blocks = [slice(0, 4), torch.tensor([4, 9, 5, 6]), slice(10, 20), torch.tensor([7, 8])]
    calls = []

    def counting(x):
        calls.append(tuple(x.shape))
        return ns(x)

    got = orthogonalize_in_blocks(m, blocks, counting)
    want = torch.empty_like(m)
    for b in blocks:
        want[b] = ns(m[b])
    torch.testing.assert_close(got, want, atol=ns_atol(m.shape), rtol=0)
    assert sorted(calls) == sorted([(2, 4, 7), (1, 10, 7), (1, 2, 7)])  # two 4-row blocks in one call


@pytest.mark.parametrize("layout, n_heads, n_kv", [("grouped", 8, 2), ("concat", 4, 2), ("interleaved", 3, 3)])
def test_fused_qkv_blocks_equal_separate_weights(layout, n_heads, n_kv):
    hd, dim = 4, 12
    g = torch.Generator().manual_seed(2)
    wq, wk, wv = (torch.randn(n * hd, dim, generator=g, dtype=torch.float64) for n in (n_heads, n_kv, n_kv))
    fused_w = fuse_by_loops(wq, wk, wv, n_heads, n_kv, hd, layout)
    spec = FusedQKV(n_heads, n_kv, hd, layout)
    blocks = resolve_row_blocks(spec, "layers.0.attention.wqkv.weight", fused_w.shape)
    got = orthogonalize_in_blocks(fused_w, blocks, ns)
    want = fuse_by_loops(ns(wq), ns(wk), ns(wv), n_heads, n_kv, hd, layout)
    torch.testing.assert_close(got, want, atol=ns_atol(fused_w.shape), rtol=0)
    # per head: every q, k and v head on its own
    blocks = resolve_row_blocks(SplitQKV(spec, per_head=True), "w", fused_w.shape)
    got = orthogonalize_in_blocks(fused_w, blocks, ns)
    per_head = lambda w: torch.cat([ns(w[i:i + hd]) for i in range(0, w.shape[0], hd)])  # noqa: E731
    want = fuse_by_loops(per_head(wq), per_head(wk), per_head(wv), n_heads, n_kv, hd, layout)
    torch.testing.assert_close(got, want, atol=ns_atol(fused_w.shape), rtol=0)
    assert len(blocks.classes) == 1 and blocks.classes[0].count == n_heads + 2 * n_kv


@pytest.mark.parametrize("mode", ["match_rms_adamw", "original", None])
def test_block_lr_factor_gives_each_block_its_own_adjusted_lr(mode):
    g = torch.Generator().manual_seed(3)
    m = torch.randn(24, 16, generator=g, dtype=torch.float64)
    blocks = [slice(0, 4), slice(4, 24)]
    got = orthogonalize_in_blocks(m, blocks, ns, adjust_lr_mode=mode) * adjust_lr(0.1, m.shape, mode)
    want = torch.cat([ns(m[b]) * adjust_lr(0.1, m[b].shape, mode) for b in blocks])
    # the lr factors (a product below 1) scale the bound down; each side's multiplications add 2 u
    torch.testing.assert_close(got, want, atol=ns_atol(m.shape), rtol=4 * unit_roundoff(torch.float64))
    if mode == "match_rms_adamw":  # the factor is not 1 here: the test would notice a missing factor
        assert not math.isclose(adjust_lr(1, (4, 16), mode), adjust_lr(1, (24, 16), mode))


def test_heads_spec_and_parse():
    assert parse_spec("heads:64", "g") == HeadBlocks(64)
    assert parse_spec(None, "g") is None
    rb = resolve_row_blocks("heads:4", "layers.0.attention.wq.weight", (12, 5))
    assert [b for b in rb.blocks] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    with pytest.raises(ValueError, match="'layers.0.attention.wq.weight' has 12 rows, not a multiple of the block size 5"):
        resolve_row_blocks("heads:5", "layers.0.attention.wq.weight", (12, 5))
    with pytest.raises(ValueError, match="not understood"):
        parse_spec("qkv", "param_groups[0]")
    # 3-D expert stacks [E, R, C]: the spec splits every expert's [R, C] matrix alike
    rb = resolve_row_blocks("heads:4", "experts.w1", (2, 8, 4))
    assert rb.num_rows == 8 and list(rb.blocks) == [slice(0, 4), slice(4, 8)]
    with pytest.raises(ValueError, match="2-D weight .* or a 3-D stack"):
        resolve_row_blocks("heads:4", "conv.weight", (2, 2, 8, 4))
    with pytest.raises(ValueError, match="FusedQKV head counts"):
        resolve_row_blocks(FusedQKV(4, 2, 2), "w", (10, 3))
    # per-parameter dict, and its name check
    assert spec_for({"a": "heads:2"}, "a", "g") == HeadBlocks(2)
    assert spec_for({"a": "heads:2"}, "b", "g") is None
    with pytest.raises(ValueError, match=r"names \['c'\]"):
        check_group_row_blocks({"c": "heads:2"}, ["a", "b"], "param_groups[0]")


def test_callable_spec_and_partition_errors():
    rb = resolve_row_blocks(lambda name, shape: [slice(0, 3), torch.tensor([5, 3, 4])], "w", (6, 2))
    assert rb.shapes == [3, 3] and rb.classes[0].count == 2
    with pytest.raises(ValueError, match="exactly once.*1 rows in no block"):
        compile_blocks([slice(0, 3), torch.tensor([3, 4])], 6)
    with pytest.raises(ValueError, match="exactly once.*1 in more than one"):
        compile_blocks([slice(0, 4), torch.tensor([3, 4, 5])], 6)
    with pytest.raises(ValueError, match="outside"):
        compile_blocks([slice(0, 6), torch.tensor([6])], 6)
    with pytest.raises(ValueError, match="empty"):
        compile_blocks([slice(0, 6), slice(6, 6)], 6)
