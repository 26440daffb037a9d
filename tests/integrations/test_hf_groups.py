"""get_default_muon_param_groups on tiny Hugging Face models: every role checked against the model's
own metadata (get_output_embeddings, base_model, module types, transformers' experts flags, PEFT's
wrapper attributes, Trainer's decay rule), not against the grouping code."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")

import hf_models  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

from optimizer.param_groups import (  # noqa: E402
    MOE_ROUTER_PATTERN,
    get_default_muon_param_groups,
    is_moe_router,
    param_roles,
)
from optimizer.row_blocks import spec_for  # noqa: E402

MODELS = {
    "llama_lm": hf_models.llama_lm,
    "llama_seq_cls": hf_models.llama_seq_cls,
    "gpt2_lm": hf_models.gpt2_lm,
    "gpt2_seq_cls": hf_models.gpt2_seq_cls,
    "bert_seq_cls": hf_models.bert_seq_cls,
    "qwen3_moe": hf_models.qwen3_moe,
    "mixtral": hf_models.mixtral,
    "deepseek_v3": hf_models.deepseek_v3,
    "gpt_oss": hf_models.gpt_oss,
    "lora_seq_cls": hf_models.lora_seq_cls,
    "lora_lm": hf_models.lora_lm,
}
_cache = {}


def model_of(key):
    if key not in _cache:
        _cache[key] = MODELS[key]()
    return _cache[key]


def split(groups):
    muon = [g for g in groups if g["use_muon"]]
    assert len(muon) <= 1
    muon = muon[0] if muon else {"param_names": []}
    adamw = {n for g in groups if not g["use_muon"] for n in g["param_names"]}
    return muon, set(muon["param_names"]), adamw


def name_of(model, param):
    return next(n for n, p in model.named_parameters() if p is param)


def outside_body(hf):
    """Parameters of a transformers task model that are not in its body (model.base_model)."""
    body = {id(p) for p in hf.base_model.parameters()}
    return {id(p) for p in hf.parameters()} - body


@pytest.mark.parametrize("key", list(MODELS))
def test_partition_and_trainer_decay_rule(key):
    model = model_of(key)
    groups = get_default_muon_param_groups(model, no_decay="trainer", adamw_options={"lr": 1e-3, "betas": (0.9, 0.99)},
                                           lr=0.02)
    named = dict(model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    listed = [n for g in groups for n in g["param_names"]]
    assert sorted(listed) == sorted(trainable)  # each trainable parameter exactly once
    for g in groups:
        assert [id(p) for p in g["params"]] == [id(named[n]) for n in g["param_names"]]
    # AdamW groups: Trainer's own rule decides decay vs no decay
    decayed_by_trainer = set(Trainer.get_decay_parameter_names(None, model))
    muon, muon_names, adamw = split(groups)
    adamw_groups = [g for g in groups if not g["use_muon"]]
    no_decay = {n for g in adamw_groups if g.get("weight_decay") == 0.0 for n in g["param_names"]}
    assert no_decay == adamw - decayed_by_trainer
    assert not muon_names - decayed_by_trainer  # Trainer exempts no Muon matrix either
    for g in adamw_groups:
        assert g["lr"] == 1e-3 and g["betas"] == (0.9, 0.99)
    assert muon.get("lr", 0.02) == 0.02
    # every Muon parameter is a 2-D/3-D weight; every 2-D/3-D trainable weight elsewhere has a reason
    assert all(named[n].ndim in (2, 3) for n in muon_names)


@pytest.mark.parametrize("key", ["llama_lm", "gpt2_lm", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_output_and_input_embeddings_go_to_adamw(key):
    model = model_of(key)
    _, muon_names, adamw = split(get_default_muon_param_groups(model))
    out = model.get_output_embeddings()
    assert out is not None and name_of(model, out.weight) in adamw
    assert name_of(model, model.get_input_embeddings().weight) in adamw
    # the body's Linear weights go to Muon, except the MoE routers (next test)
    for n, m in model.base_model.named_modules():
        if isinstance(m, (nn.Linear, Conv1D)) and not type(m).__name__.endswith("Router"):
            assert name_of(model, m.weight) in muon_names, n


@pytest.mark.parametrize("key, head", [("llama_seq_cls", {"score.weight"}), ("gpt2_seq_cls", {"score.weight"}),
                                       ("bert_seq_cls", {"classifier.weight", "classifier.bias"})])
def test_classification_heads_are_what_lies_outside_the_body(key, head):
    model = model_of(key)
    assert model.get_output_embeddings() is None  # the lm_head route alone would have missed them
    ids = outside_body(model)
    assert {n for n, p in model.named_parameters() if id(p) in ids} == head
    _, muon_names, adamw = split(get_default_muon_param_groups(model))
    assert head <= adamw and not head & muon_names
    if key == "bert_seq_cls":  # inside the body: hidden maps, Muon (a module named "output" owns no weight here)
        assert {"bert.pooler.dense.weight", "bert.encoder.layer.0.attention.output.dense.weight",
                "bert.encoder.layer.1.output.dense.weight"} <= muon_names


@pytest.mark.parametrize("key", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_moe_routers_go_to_adamw(key):
    model = model_of(key)
    _, muon_names, adamw = split(get_default_muon_param_groups(model))
    routers = {}
    for n, m in model.named_modules():
        experts = getattr(m, "experts", None)
        if experts is None or not hasattr(experts, "num_experts"):
            continue
        # the MoE block's router: the child module whose class the model calls a router
        (rname, router), = [(c, sub) for c, sub in m.named_children() if type(sub).__name__.lower().endswith("router")]
        assert router.weight.shape == (experts.num_experts, model.config.hidden_size)
        routers[f"{n}.{rname}.weight"] = router.weight
    assert routers
    assert set(routers) <= adamw and not set(routers) & muon_names
    roles = param_roles(model)
    assert {n for n, r in roles.items() if r == "router"} == set(routers)


def _expert_forward_by_hand(experts, x, idx, w, gate_rows):
    """Sum over chosen experts of w * down(act(gate(x)) * up(x)), with gate = gate_up[gate_rows]."""
    inter = experts.gate_up_proj.shape[1] // 2
    up_rows = slice(inter, 2 * inter) if gate_rows == slice(0, inter) else slice(0, inter)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gu = experts.gate_up_proj[e]
            h = experts.act_fn(gu[gate_rows] @ x[t]) * (gu[up_rows] @ x[t])
            out[t] += w[t, j] * (experts.down_proj[e] @ h)
    return out


@pytest.mark.parametrize("key", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_fused_gate_up_is_split_in_the_order_the_forward_uses(key):
    model = model_of(key)
    muon, muon_names, _ = split(get_default_muon_param_groups(model))
    found = 0
    for n, m in model.named_modules():
        gu = getattr(m, "gate_up_proj", None)
        if not isinstance(gu, nn.Parameter):
            continue
        found += 1
        assert m.is_concatenated and m.has_gate and not m.is_transposed  # transformers' own flags
        inter = m.intermediate_dim
        assert gu.shape == (m.num_experts, 2 * inter, model.config.hidden_size)
        name = f"{n}.gate_up_proj"
        assert name in muon_names and f"{n}.down_proj" in muon_names
        assert muon["muon_row_blocks"][name] == f"blocks:{inter},{inter}"
        assert spec_for(muon["muon_row_blocks"], f"{n}.down_proj", "g") is None
        # run the model's experts forward: the first `inter` rows are the gate, the rest the up projection
        g = torch.Generator().manual_seed(found)
        x = 50 * torch.randn(5, model.config.hidden_size, generator=g)  # past silu's near-linear range
        idx = torch.randint(0, m.num_experts, (5, 2), generator=g)
        w = torch.rand(5, 2, generator=g)
        with torch.no_grad():
            got = m(x, idx, w)
            want = _expert_forward_by_hand(m, x, idx, w, slice(0, inter))
            swapped = _expert_forward_by_hand(m, x, idx, w, slice(inter, 2 * inter))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        # the order matters (so the check has teeth): swapping gate and up changes the output a lot
        assert (got - swapped).abs().max() > 0.1 * got.abs().max()
    assert found == model.config.num_hidden_layers - getattr(model.config, "first_k_dense_replace", 0)
    assert "muon_transposed" not in muon
    # "whole" keeps the fused matrix as one
    muon, _, _ = split(get_default_muon_param_groups(model, fused_gate_up="whole"))
    assert "muon_row_blocks" not in muon


def test_gpt2_conv1d_weights_are_transposed():
    model = model_of("gpt2_lm")
    muon, muon_names, _ = split(get_default_muon_param_groups(model))
    conv1d = {n: m for n, m in model.named_modules() if isinstance(m, Conv1D)}
    assert len(conv1d) == 4 * model.config.n_layer
    assert muon["muon_transposed"] == {f"{n}.weight": True for n in conv1d}
    assert set(muon["muon_transposed"]) <= muon_names
    # the premise: Conv1D stores [in, out] and computes x @ W + b
    m = conv1d["transformer.h.0.mlp.c_fc"]
    x = torch.randn(3, m.weight.shape[0])
    torch.testing.assert_close(m(x), x @ m.weight + m.bias)
    assert m.weight.shape == (m.nx, m.nf)


def test_gpt_oss_transposed_interleaved_experts_and_2d_biases():
    model = model_of("gpt_oss")
    muon, muon_names, adamw = split(get_default_muon_param_groups(model))
    experts = model.model.layers[0].mlp.experts
    assert experts.is_transposed and not experts.is_concatenated and experts.has_bias  # transformers' flags
    p = "model.layers.0.mlp.experts."
    assert muon["muon_transposed"] == {p + "gate_up_proj": True, p + "down_proj": True}
    assert "muon_row_blocks" not in muon  # interleaved [g0, u0, g1, ...] columns: not consecutive blocks
    assert {p + "gate_up_proj_bias", p + "down_proj_bias"} <= adamw  # 2-D, but biases
    assert experts.gate_up_proj_bias.ndim == 2


def test_peft_lora_and_modules_to_save_take_their_module_roles():
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    model = model_of("lora_seq_cls")
    muon, muon_names, adamw = split(get_default_muon_param_groups(model))
    adapters, copies = set(), {}
    for n, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            for attr in m.adapter_layer_names:
                for pn, p in getattr(m, attr).named_parameters():
                    if p.requires_grad:
                        adapters.add(f"{n}.{attr}.{pn}")
        if isinstance(m, ModulesToSaveWrapper):
            for pn, p in m.modules_to_save.named_parameters():
                copies[f"{n}.modules_to_save.{pn}"] = n
    assert len(adapters) == 6 * model.config.num_hidden_layers  # A and B of q, v and gate
    assert adapters <= adamw  # LoRA factors: AdamW (param_groups docstring)
    score = {c for c, owner in copies.items() if owner.endswith(".score")}
    down = {c for c, owner in copies.items() if owner.endswith(".down_proj")}
    assert score == {"base_model.model.score.modules_to_save.default.weight"} and score <= adamw
    assert down and down <= muon_names  # a copy of a hidden matrix is a hidden matrix
    # the frozen originals are not in any group
    assert not any("original_module" in n or "base_layer" in n for n in muon_names | adamw)
    assert muon_names == down  # nothing else of the frozen model is trained


def test_peft_trainable_lm_head_copy_is_a_head():
    model = model_of("lora_lm")
    _, muon_names, adamw = split(get_default_muon_param_groups(model))
    head = model.get_output_embeddings()  # PEFT's ModulesToSaveWrapper around lm_head
    copy = head.modules_to_save["default"].weight
    assert copy.requires_grad and name_of(model, copy) == "base_model.model.lm_head.modules_to_save.default.weight"
    assert name_of(model, copy) in adamw and name_of(model, copy) not in muon_names


def test_router_policy_names():
    assert MOE_ROUTER_PATTERN.endswith(r"\.weight$")
    routers = [
        "layers.1.moe.router.gate.weight",  # torchtitan
        "model.layers.1.mlp.gate.weight",  # HF Mixtral / Qwen-MoE / DeepSeek-V3
        "model.layers.0.mlp.router.weight",  # HF gpt-oss
        "transformer.blocks.0.ffn.router.layer.weight",  # DBRX / Granite-MoE style
        "model.layers.0.mlp.shared_expert_gate.weight",  # Qwen2-MoE
        "base_model.model.model.layers.1.mlp.gate.base_layer.weight",  # LoRA-wrapped
        "layers.1._orig_mod.moe.router.gate.weight",  # torch.compile'd block
        "layers.0.moe.router.weight",  # this repository's example model
    ]
    hidden = ["model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.experts.gate_up_proj",
              "layers.1.moe.router.gate.bias", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.mlp.gate.lora_A.default.weight", "gates.weight", "aggregate.weight"]
    assert [is_moe_router(n) for n in routers] == [True] * len(routers)
    assert [is_moe_router(n) for n in hidden] == [False] * len(hidden)


def test_adamw_options_and_row_block_overrides():
    model = model_of("mixtral")
    with pytest.raises(ValueError, match="unknown keys \\['momentum'\\]"):
        get_default_muon_param_groups(model, adamw_options={"momentum": 0.9})
    with pytest.raises(ValueError, match="no_decay"):
        get_default_muon_param_groups(model, no_decay="all")
    gu = "model.layers.0.mlp.experts.gate_up_proj"
    groups = get_default_muon_param_groups(model, adamw_options={"weight_decay": 0.05})
    assert [g.get("weight_decay") for g in groups] == [None, 0.05]  # no_decay=None: one AdamW group
    # every AdamW group option is accepted, the variants included (cautious WD in AdamW groups)
    groups = get_default_muon_param_groups(model, adamw_options={"cautious_wd": True, "maximize": True})
    assert [(g.get("cautious_wd"), g.get("maximize")) for g in groups] == [(None, None), (True, True)]
    # a {name: spec} merges over the automatic blocks (yours win); a single spec replaces them
    q = "model.layers.0.self_attn.q_proj.weight"
    muon = get_default_muon_param_groups(model, muon_row_blocks={q: "heads:8", gu: None})[0]
    assert muon["muon_row_blocks"] == {q: "heads:8", "model.layers.1.mlp.experts.gate_up_proj": "blocks:24,24"}
    muon = get_default_muon_param_groups(model, muon_row_blocks="heads:8")[0]
    assert muon["muon_row_blocks"] == "heads:8"


def test_importing_optimizer_imports_no_transformers():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys; sys.path.insert(0, 'torch-ext'); import optimizer, optimizer.param_groups, "
            "optimizer.row_blocks; bad = [m for m in ('transformers', 'peft', 'accelerate') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)


def test_peft_copy_of_a_plain_models_lm_head_is_a_head_by_name():
    """A model without transformers' metadata: the lm_head name rule must see through PEFT's segments."""
    from peft import LoraConfig, get_peft_model

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.lm_head = nn.Linear(8, 11, bias=False)

        def forward(self, x):
            return self.lm_head(self.body(x))

    model = get_peft_model(Plain(), LoraConfig(r=2, target_modules=["body"], modules_to_save=["lm_head"]))
    assert not hasattr(model.get_base_model(), "get_output_embeddings")
    _, muon_names, adamw = split(get_default_muon_param_groups(model))
    assert "base_model.model.lm_head.modules_to_save.default.weight" in adamw
    assert not muon_names  # the LoRA factors of `body` are adapters: AdamW
