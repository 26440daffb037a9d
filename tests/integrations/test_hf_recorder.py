"""MaxLogitRecorder on tiny Hugging Face models: the recorded per-head max equals the max of the logits
materialised here from the same query/key (eager, SDPA, flex; causal, GQA, padding), every rank gets
the same values, and the QK-clip configs built from HF models clip what they should (MLA row layout
checked by running DeepSeek-V3's own attention)."""

import contextlib
import inspect
import math

import pytest
import torch

pytest.importorskip("transformers")

import hf_models  # noqa: E402
from harness import run_ranks  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

from optimizer import Muon  # noqa: E402
from optimizer.attention_layouts import MLAHeads, Part  # noqa: E402
from optimizer.integrations.huggingface import MaxLogitRecorder, attention_modules, qk_clip_config_for  # noqa: E402
from optimizer.param_groups import get_default_muon_param_groups  # noqa: E402
from optimizer.qk_clip import classify_qk_param  # noqa: E402


@contextlib.contextmanager
def materialised_logits(model, monkeypatch):
    """Capture every attention call's query/key/scaling and materialise its full logits
    [B, Hq, Lq, Lk] = scaling * q @ repeat_kv(k)^T (eager: the model's own function, patched in its
    module; sdpa/flex: the registry entry). Yields {layer: [logits of each call]}."""
    captured = {}
    layer_of = {id(m): layer for _, layer, m in attention_modules(model)}

    def capture(fn):
        def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
            scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
            k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
            logits = torch.matmul(query.detach().double(), k.detach().double().transpose(2, 3)) * scaling
            captured.setdefault(layer_of[id(module)], []).append(logits)
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        return wrapper

    _, _, attn = attention_modules(model)[0]
    ns = inspect.unwrap(type(attn).forward).__globals__  # where its forward looks names up
    impl = model.config._attn_implementation
    if impl == "eager":
        monkeypatch.setitem(ns, "eager_attention_forward", capture(ns["eager_attention_forward"]))
    else:
        monkeypatch.setitem(AttentionInterface._global_mapping, impl, capture(AttentionInterface._global_mapping[impl]))
    yield captured


def visible_causal_padded(pad, lq, lk):
    """[B, 1, Lq, Lk]: key j visible to query i when j <= i and j is not padding."""
    causal = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None]
    return (causal[None] & pad.bool()[:, None, :])[:, None]


def visible_padded(pad, lq, lk):
    return pad.bool()[:, None, None, :].expand(-1, 1, lq, lk)


def max_over_visible(logits, visible):
    return logits.masked_fill(~visible, float("-inf")).amax(dim=(0, 2, 3)).float()


def batch(seed=0, b=3, length=9, padding="right", vocab=hf_models.VOCAB):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, length), generator=g)
    pad = torch.ones(b, length, dtype=torch.long)
    if padding == "right":  # every row padded, by different amounts
        pad[0, 6:] = 0
        pad[1, 4:] = 0
        pad[2, 2:] = 0
    elif padding == "left":
        pad[0, :3] = 0
        pad[1, :5] = 0
        pad[2, :7] = 0
    return ids, pad


def scaled_up(model, factor=8.0):
    """Larger q/k weights, so that logits are O(1..10) and a wrong mask would change the max."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if any(s in n for s in ("q_proj", "k_proj", "query", "key", "q_b_proj", "kv_b_proj", "kv_a_proj")):
                p.mul_(factor)
    return model


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_llama_gqa_causal_padding(attn, padding, monkeypatch):
    model = scaled_up(hf_models.llama_lm(attn=attn))
    assert model.config.num_attention_heads == 2 * model.config.num_key_value_heads  # GQA
    rec = MaxLogitRecorder(model)
    ids, pad = batch(padding=padding)
    with materialised_logits(model, monkeypatch) as logits:
        model(input_ids=ids, attention_mask=None if padding == "none" else pad).logits.sum().backward()
    got = rec()
    rec.remove()
    assert sorted(got) == [0, 1]
    differs = []
    for layer, (full,) in logits.items():
        want = max_over_visible(full, visible_causal_padded(pad, *full.shape[-2:]))
        torch.testing.assert_close(got[layer], want, atol=1e-5, rtol=1e-5)
        assert got[layer].shape == (model.config.num_attention_heads,)
        unpadded = max_over_visible(full, visible_causal_padded(torch.ones_like(pad), *full.shape[-2:]))
        differs.append(not torch.allclose(want, unpadded))
    assert any(differs) == (padding != "none")  # the padding changes the answer: the check has teeth


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bert_bidirectional_with_padding(attn, monkeypatch):
    model = scaled_up(hf_models.bert_seq_cls(attn=attn))
    rec = MaxLogitRecorder(model)
    ids, pad = batch(padding="right")
    with materialised_logits(model, monkeypatch) as logits:
        model(input_ids=ids, attention_mask=pad).logits.sum().backward()
    got = rec()
    rec.remove()
    differs = []
    for layer, (full,) in logits.items():
        want = max_over_visible(full, visible_padded(pad, *full.shape[-2:]))
        torch.testing.assert_close(got[layer], want, atol=1e-5, rtol=1e-5)
        causal = max_over_visible(full, visible_causal_padded(pad, *full.shape[-2:]))
        differs.append(not torch.allclose(want, causal))
    assert any(differs)  # not causal: BERT sees every unpadded key, and that changes the answer


def test_flex_attention_block_mask(monkeypatch):
    """flex: the BlockMask's mask_mod (causal + padding). Forward only (CPU flex has no backward), with
    the eager flex_attention and block mask instead of transformers' compiled ones (compiling takes
    ~30 s on CPU)."""
    import transformers.integrations.flex_attention as hf_flex
    import transformers.masking_utils as hf_masks
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention",
                        lambda q, k, v, training=False, **kw: flex_attention(q, k, v, **kw))
    monkeypatch.setattr(hf_masks, "create_block_mask",
                        lambda *a, **kw: create_block_mask(*a, **{**kw, "_compile": False}))
    model = scaled_up(hf_models.llama_lm(attn="flex_attention"))
    rec = MaxLogitRecorder(model)
    ids, pad = batch(padding="right")
    with materialised_logits(model, monkeypatch) as logits, torch.no_grad():
        model(input_ids=ids, attention_mask=pad)  # in training mode: recorded
    got = rec()
    rec.remove()
    for layer, (full,) in logits.items():
        want = max_over_visible(full, visible_causal_padded(pad, *full.shape[-2:]))
        torch.testing.assert_close(got[layer], want, atol=1e-5, rtol=1e-5)


def test_running_max_reset_every_and_what_is_not_recorded():
    model = hf_models.llama_lm(attn="sdpa")
    model.activation_checkpointing_enable()
    rec = MaxLogitRecorder(model, every=2)
    ids, pad = batch()
    single = []
    for seed in (1, 2):  # two micro-batches of one step (gradient accumulation)
        one = MaxLogitRecorder(model)
        ids, pad = batch(seed=seed)
        model(input_ids=ids, attention_mask=pad).logits.sum().backward()  # recomputation in backward: skipped
        single.append(one())
        one.remove()
    assert rec._forwards == 2 * model.config.num_hidden_layers  # one per layer and forward, none from recompute
    model.eval()
    model(input_ids=ids, attention_mask=pad)  # evaluation: not recorded
    model.train()
    assert rec._forwards == 2 * model.config.num_hidden_layers
    got = rec()
    for layer in got:
        torch.testing.assert_close(got[layer], torch.maximum(single[0][layer], single[1][layer]))
    # every=2: the next step is not recorded and returns None; the one after is
    model(input_ids=ids, attention_mask=pad)
    assert rec() is None
    with pytest.raises(RuntimeError, match="no training forward"):
        rec()
    rec.remove()
    model(input_ids=ids, attention_mask=pad)
    assert rec._forwards == 0  # removed: unhooked (the registry itself: test_two_recorders_...)


def test_layer_keys_match_qk_clip_config_and_peft_prefix():
    model = hf_models.lora_seq_cls()  # names under PEFT's base_model.model. prefix
    rec = MaxLogitRecorder(model)
    cfg = qk_clip_config_for(hf_models.llama_lm(), threshold=10.0)
    layers = {classify_qk_param(n, cfg)[0] for n, _ in hf_models.llama_lm().named_parameters()
              if classify_qk_param(n, cfg) is not None}
    assert rec.layers == sorted(layers) == [0, 1]
    rec.remove()


def test_refusals():
    with pytest.raises(ValueError, match="flash_attention_2"):
        model = hf_models.llama_lm()
        model.config._attn_implementation = "flash_attention_2"
        MaxLogitRecorder(model)
    with pytest.raises(ValueError, match=r"no attention module for layers \[7\]"):
        MaxLogitRecorder(hf_models.llama_lm(), layers=[0, 7])
    with pytest.raises(ValueError, match="q_norm/k_norm"):
        qk_clip_config_for(hf_models.qwen3_lm(), 10.0)
    with pytest.raises(ValueError, match="q_norm/k_norm"):
        qk_clip_config_for(hf_models.qwen3_moe(), 10.0)
    with pytest.raises(ValueError, match="fused"):
        qk_clip_config_for(hf_models.gpt2_lm(), 10.0)
    with pytest.raises(ValueError, match="not trained"):
        qk_clip_config_for(hf_models.lora_lm(), 10.0)  # q_proj frozen under LoRA


def test_qwen3_qk_norm_premise():
    """Why Qwen3 is refused: halving q_proj and k_proj leaves its logits unchanged (q_norm/k_norm)."""
    model = hf_models.qwen3_lm()
    ids, _ = batch()
    rec = MaxLogitRecorder(model)
    model(input_ids=ids)
    before = rec()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(0.5)
            layer.self_attn.k_proj.weight.mul_(0.5)
    model(input_ids=ids)
    after = rec()
    for k in before:
        torch.testing.assert_close(before[k], after[k], atol=1e-3, rtol=1e-3)


def _mla_scale_head(model, head, q_nope, q_pe, k_nope, v):
    """Scale head `head`'s rows of q_b_proj / q_proj and kv_b_proj, part by part, by MLAHeads' layout."""
    cfg = model.config
    mla = MLAHeads(cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    q_layout, kv_layout = mla.q_layout(cfg.num_attention_heads), mla.kv_b_layout(cfg.num_attention_heads)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            wq = (attn.q_b_proj if attn.q_b_proj is not None else attn.q_proj).weight
            wq[q_layout.rows(Part.Q_NOPE, head)] *= q_nope
            wq[q_layout.rows(Part.Q_PE, head)] *= q_pe
            attn.kv_b_proj.weight[kv_layout.rows(Part.K_NOPE, head)] *= k_nope
            attn.kv_b_proj.weight[kv_layout.rows(Part.V, head)] *= v


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_deepseek_v3_mla_row_layout_by_running_its_attention(q_lora_rank, monkeypatch):
    """MLAHeads' rows (per head [q_nope; q_pe] in q_b_proj / q_proj, [k_nope; v] in kv_b_proj) are
    transformers' DeepseekV3Attention's: scaling head 1's q_nope and k_nope rows by sqrt(g) and its
    q_pe rows by g (MuonClip for MLA) multiplies exactly head 1's logits by g, and its value rows
    none; the shared rotary key (kv_a_proj_with_mqa) is untouched. Checked on the first layer,
    whose input the scaling does not change (later layers see its changed output)."""
    model = scaled_up(hf_models.deepseek_v3(attn="eager", q_lora_rank=q_lora_rank), 3.0)
    ids, pad = batch(padding="right")
    g = 0.3

    def logits_of():
        with materialised_logits(model, monkeypatch) as captured:
            model(input_ids=ids, attention_mask=pad)
        monkeypatch.undo()
        return {k: v[0] for k, v in captured.items()}

    before = logits_of()[0]
    _mla_scale_head(model, 1, math.sqrt(g), g, math.sqrt(g), 7.0)
    after = logits_of()[0]
    expect = before.clone()
    expect[:, 1] *= g
    torch.testing.assert_close(after, expect, atol=1e-6, rtol=1e-5)
    # the wrong layout (rows of the parts swapped) does not scale the logits by g
    _mla_scale_head(model, 1, 1 / math.sqrt(g), 1 / g, 1 / math.sqrt(g), 1 / 7.0)  # undo
    _mla_scale_head(model, 2, g, math.sqrt(g), math.sqrt(g), 1.0)  # q_nope by g, q_pe by sqrt(g): wrong
    wrong = logits_of()[0]
    expect = before.clone()
    expect[:, 2] *= g
    assert not torch.allclose(wrong, expect, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("key, exact", [("deepseek_v3", True), ("deepseek_v3_no_q_lora", True), ("llama", False),
                                        ("mixtral", False)])
def test_qk_clip_config_for_clips_to_the_threshold(key, exact):
    """End to end with step(qk_logits=recorder()): lr 0, no decay, so the step only clips; in the next
    forward the first layer's max logit per head (its input is unchanged) is at most the threshold,
    and exactly min(before, threshold) where the head's clip was its own (MHA/MLA; GQA keys take
    their group's strongest clip)."""
    build = {"deepseek_v3": lambda: hf_models.deepseek_v3(), "deepseek_v3_no_q_lora":
             lambda: hf_models.deepseek_v3(q_lora_rank=None), "llama": hf_models.llama_lm,
             "mixtral": hf_models.mixtral}[key]
    model = scaled_up(build(), 6.0)
    ids, pad = batch(padding="right")
    rec = MaxLogitRecorder(model)
    model(input_ids=ids, attention_mask=pad).logits.sum().backward()
    before = rec()
    threshold = 0.5 * float(before[0].max())
    cfg = qk_clip_config_for(model, threshold)
    if key.startswith("deepseek"):
        assert cfg.mla == MLAHeads(8, 4, 6) and cfg.head_dim is None
    opt = Muon(get_default_muon_param_groups(model), lr=0.0, weight_decay=0.0, qk_clip=cfg)
    opt.step(qk_logits=before)
    assert opt.qk_clip_report.total_clipped > 0
    model.zero_grad()
    model(input_ids=ids, attention_mask=pad)
    after = rec()
    rec.remove()
    assert float(before[0].max()) > threshold  # the first layer is clipped
    want = torch.clamp(before[0], max=threshold)
    assert bool((after[0] <= want * (1 + 1e-5)).all())
    if exact:
        torch.testing.assert_close(after[0], want, atol=1e-5, rtol=1e-5)
    else:  # GQA: each clipped key group has one head exactly at the threshold
        assert math.isclose(float(after[0].max()), threshold, rel_tol=1e-5)


def _ranks_get_the_same_max(rank, world):
    torch.manual_seed(0)
    model = hf_models.llama_lm(attn="sdpa")
    rec = MaxLogitRecorder(model)  # default: max over the default process group
    ids, pad = batch(seed=10 + rank)  # each rank its own batch
    model(input_ids=ids, attention_mask=pad).logits.sum().backward()
    local = {k: v.clone() for k, v in rec._local.items()}
    return local, rec()


def test_every_rank_gets_the_max_over_ranks():
    (local0, got0), (local1, got1) = run_ranks(_ranks_get_the_same_max, 2, timeout=120)
    for layer in got0:
        assert torch.equal(got0[layer], got1[layer])
        torch.testing.assert_close(got0[layer], torch.maximum(local0[layer], local1[layer]))
        assert not torch.equal(local0[layer], local1[layer])  # different batches: the reduction matters


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_deepseek_v3_mla_with_yarn_scaling(attn, monkeypatch):
    """MLA: q/k heads of qk_nope + qk_rope dims, and a YaRN softmax scale that is not 1/sqrt(head_dim)."""
    rope = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0,
            "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}
    model = scaled_up(hf_models.deepseek_v3(attn=attn, rope_parameters=rope), 3.0)
    attn0 = model.model.layers[0].self_attn
    assert not math.isclose(attn0.scaling, attn0.qk_head_dim ** -0.5)  # the scale matters here
    rec = MaxLogitRecorder(model)
    ids, pad = batch(padding="left")
    with materialised_logits(model, monkeypatch) as logits:
        model(input_ids=ids, attention_mask=pad).logits.sum().backward()
    got = rec()
    rec.remove()
    for layer, (full,) in logits.items():
        want = max_over_visible(full, visible_causal_padded(pad, *full.shape[-2:]))
        torch.testing.assert_close(got[layer], want, atol=1e-5, rtol=1e-5)


def test_two_recorders_and_a_dropped_one_unhook_cleanly():
    import gc

    from optimizer.integrations.huggingface import max_logits as hf_max_logits

    model = hf_models.llama_lm()
    ns = inspect.unwrap(type(model.model.layers[0].self_attn).forward).__globals__
    users_before = hf_max_logits._PATCHED.get(id(ns), [None, None, 0])[2]  # other tests' live recorders
    a, b = MaxLogitRecorder(model), MaxLogitRecorder(model, layers=[1])
    assert hf_max_logits._PATCHED[id(ns)][2] == users_before + 2
    ids, _ = batch()
    model(input_ids=ids)
    got_a, got_b = a(), b()
    assert sorted(got_a) == [0, 1] and sorted(got_b) == [1] and torch.equal(got_a[1], got_b[1])
    a.remove()
    model(input_ids=ids)
    assert a._forwards == 0 and b._forwards == 1
    del b  # dropped without remove(): unhooked when collected
    gc.collect()
    assert hf_max_logits._PATCHED.get(id(ns), [None, None, 0])[2] == users_before
    if users_before == 0:
        assert type(ns["ALL_ATTENTION_FUNCTIONS"]) is AttentionInterface and id(ns) not in hf_max_logits._PATCHED
    assert not any(id(m) in hf_max_logits._ACTIVE for m in model.modules())
