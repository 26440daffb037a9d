"""QK-clip on a fused QKV weight equals QK-clip on the same weights kept separate.

For each layout (torchtitan's grouped ``wqkv``, [Q; K; V] concatenation, per-head interleaving)
the separate ``wq``/``wk``/``wv`` are clipped with the separate-weight rule, fused with an explicit
loop over heads, and compared bit for bit with the fused weight clipped directly: whole, by
contiguous row shards, and by interleaved row sets.
"""

import pytest
import torch

from optimizer.attention_layouts import FusedQKV
from optimizer.qk_clip import QKClipConfig
from optimizer.qk_clip.head_map import build_head_map
from optimizer.qk_clip.step import apply_clip_, compute_clip_step
from test_attention_layouts import fuse_by_loops

T = 40.0
CASES = [("grouped", 8, 2), ("grouped", 6, 6), ("grouped", 4, 1), ("concat", 8, 2), ("concat", 4, 4),
         ("interleaved", 4, 4)]


def shards(n_rows, world):
    """Row sets of contiguous shards (uneven) and of interleaved ones (two blocks per rank, as
    ``_StridedShard(0, split_factor=2)`` gives)."""
    per = -(-n_rows // world)
    contiguous = [slice(min(r * per, n_rows), min((r + 1) * per, n_rows)) for r in range(world)]
    half, per2 = n_rows // 2, -(-(n_rows // 2) // world)
    interleaved = [torch.cat([torch.arange(r * per2, min((r + 1) * per2, half)),
                              torch.arange(half + r * per2, min(half + (r + 1) * per2, n_rows))]) for r in range(world)]
    return contiguous + interleaved


@pytest.mark.parametrize("layout, n_q, n_kv", CASES)
def test_fused_clip_equals_separate_clip(layout, n_q, n_kv):
    d, hidden = 4, 6
    g = torch.Generator().manual_seed(n_q * 10 + n_kv)
    wq, wk, wv = (torch.randn(n * d, hidden, generator=g) for n in (n_q, n_kv, n_kv))
    logits = {0: torch.rand(n_q, generator=g) * 3 * T, 1: torch.rand(n_q, generator=g) * 3 * T}
    logits[0][0], logits[0][-1] = 0.5 * T, 2.5 * T  # at least one head under and one over


    sep_params = []
    for layer in (0, 1):
        sep_params += [(f"layers.{layer}.attention.wq.weight", tuple(wq.shape), True, 0),
                       (f"layers.{layer}.attention.wk.weight", tuple(wk.shape), True, 0),
                       (f"layers.{layer}.attention.wv.weight", tuple(wv.shape), True, 0)]
    sep_plan = build_head_map(QKClipConfig(head_dim=d, threshold=T), sep_params)
    fused_cfg = QKClipConfig(threshold=T, fused_qkv=FusedQKV(n_q, n_kv, d, layout))
    fused_shape = ((n_q + 2 * n_kv) * d, hidden)
    fused_plan = build_head_map(fused_cfg, [(f"layers.{layer}.attention.qkv_linear.wqkv.weight", fused_shape, True, 0)
                                                for layer in (0, 1)])
    sep_step = compute_clip_step(sep_plan, logits, "cpu")
    fused_step = compute_clip_step(fused_plan, logits, "cpu")
    for layer in (0, 1):
        q, k = wq.clone(), wk.clone()
        apply_clip_(q, sep_step.table, sep_plan.weights[f"layers.{layer}.attention.wq.weight"].local_index())
        apply_clip_(k, sep_step.table, sep_plan.weights[f"layers.{layer}.attention.wk.weight"].local_index())
        want = fuse_by_loops(q, k, wv, n_q, n_kv, d, layout)
        fused_w = fuse_by_loops(wq, wk, wv, n_q, n_kv, d, layout)
        rows = fused_plan.weights[f"layers.{layer}.attention.qkv_linear.wqkv.weight"]
        whole = fused_w.clone()
        apply_clip_(whole, fused_step.table, rows.local_index())
        assert torch.equal(whole, want)
        v_rows = rows.layout.rows(6)  # Part.V: value rows bit-identical
        assert torch.equal(whole[v_rows], fused_w[v_rows])
        for r in shards(fused_w.shape[0], 3):
            local = fused_w[r].clone()
            apply_clip_(local, fused_step.table, rows.local_index(r, "cpu"))
            assert torch.equal(local, want[r])
    assert fused_step.report.clipped_heads == sep_step.report.clipped_heads
