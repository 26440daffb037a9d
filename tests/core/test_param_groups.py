"""get_default_muon_param_groups on small models whose split is written out by hand."""

import pytest
import torch
from torch import nn

from optimizer.param_groups import get_default_muon_param_groups


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)  # with bias
        self.experts = nn.Parameter(torch.zeros(3, 2 * d, d))  # [E, out, in]


class TinyLM(nn.Module):
    def __init__(self, vocab=11, d=4, tie=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)  # embedding found by module type, not name
        self.pos_embedding = nn.Parameter(torch.zeros(7, d))  # found by "embed" in the name
        self.layers = nn.ModuleList([Block(d), Block(d)])
        self.conv = nn.Conv1d(d, d, 3)
        self.final_norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.tok.weight


class TitanStyle(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.tok_embeddings = nn.Parameter(torch.zeros(9, d))
        self.attention = nn.Module()
        self.attention.wq = nn.Linear(d, d, bias=False)
        self.attention.output = nn.Module()  # BERT-style "...output.dense": a hidden matrix
        self.attention.output.dense = nn.Linear(d, d, bias=False)
        self.output = nn.Linear(d, 9, bias=False)  # torchtitan's head


def names(group):
    return set(group["param_names"])


def test_split_tiny_lm():
    model = TinyLM()
    model.layers[1].norm.weight.requires_grad_(False)
    groups = get_default_muon_param_groups(model, lr=0.02, momentum=0.9)
    assert len(groups) == 2
    muon, adamw = groups
    assert muon["use_muon"] is True and adamw["use_muon"] is False
    assert muon["lr"] == 0.02 and muon["momentum"] == 0.9 and "lr" not in adamw
    hidden = {f"layers.{i}.{n}" for i in range(2) for n in ("q_proj.weight", "k_proj.weight", "up.weight", "experts")}
    assert names(muon) == hidden
    assert names(adamw) == {
        "tok.weight",
        "pos_embedding",
        "conv.weight",  # 3-D [out, in, k] but a conv kernel, not stacked matrices
        "conv.bias",
        "final_norm.weight",
        "lm_head.weight",
        "layers.0.norm.weight",
        "layers.0.norm.bias",
        "layers.1.norm.bias",  # layers.1.norm.weight is frozen: skipped
        "layers.0.up.bias",
        "layers.1.up.bias",
    }
    # params and names line up, and each param is in exactly one group
    named = dict(model.named_parameters())
    for g in groups:
        assert [id(p) for p in g["params"]] == [id(named[n]) for n in g["param_names"]]
    all_ids = [id(p) for g in groups for p in g["params"]]
    assert len(all_ids) == len(set(all_ids))


def test_is_muon_override():
    model = TinyLM()
    muon, adamw = get_default_muon_param_groups(
        model, is_muon=lambda n, p: n.startswith("layers.0.") and p.ndim == 2
    )
    assert names(muon) == {"layers.0.q_proj.weight", "layers.0.k_proj.weight", "layers.0.up.weight"}
    assert "layers.1.q_proj.weight" in names(adamw) and "layers.0.experts" in names(adamw)
    # the override may also send an embedding to Muon
    muon, _ = get_default_muon_param_groups(model, is_muon=lambda n, p: n == "tok.weight")
    assert names(muon) == {"tok.weight"}


def test_tied_head_appears_once():
    model = TinyLM(tie=True)
    muon, adamw = get_default_muon_param_groups(model)
    assert "tok.weight" in names(adamw) and "lm_head.weight" not in names(adamw) | names(muon)


def test_torchtitan_style_names():
    muon, adamw = get_default_muon_param_groups(TitanStyle())
    assert names(muon) == {"attention.wq.weight", "attention.output.dense.weight"}
    assert names(adamw) == {"tok_embeddings", "output.weight"}


def test_4d_goes_to_adamw_and_empty_groups_are_omitted():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.LayerNorm(3))
    groups = get_default_muon_param_groups(model)
    assert len(groups) == 1 and groups[0]["use_muon"] is False
    only_matrix = nn.Linear(3, 3, bias=False)
    groups = get_default_muon_param_groups(only_matrix, weight_decay=0.0)
    assert len(groups) == 1 and groups[0]["use_muon"] is True and groups[0]["weight_decay"] == 0.0


def test_groups_are_accepted_by_torch_optimizers():
    # torch's named-parameter groups: 'param_names' is understood by torch.optim.Optimizer
    groups = get_default_muon_param_groups(TinyLM(), lr=0.02)
    opt = torch.optim.SGD(groups, lr=0.1)
    assert opt.param_groups[0]["param_names"] == groups[0]["param_names"]


def test_errors():
    with pytest.raises(TypeError, match="nn.Module"):
        get_default_muon_param_groups([nn.Parameter(torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="Muon needs a matrix"):
        get_default_muon_param_groups(TinyLM(), is_muon=lambda n, p: True)
    with pytest.raises(ValueError, match="cannot set 'params'"):
        get_default_muon_param_groups(TinyLM(), params=[])


class TinyMoE(nn.Module):
    def __init__(self, d=4, experts=3):
        super().__init__()
        self.moe = nn.Module()
        self.moe.router = nn.Linear(d, experts, bias=False)  # this repository's example model names it so
        self.moe.experts = nn.Parameter(torch.zeros(experts, 2 * d, d))
        self.moe.expert_bias = nn.Parameter(torch.zeros(experts, 2 * d))  # 2-D, but a bias
        self.ln = nn.LayerNorm(d)
        self.proj = nn.Linear(d, d)


def test_router_and_2d_bias_go_to_adamw():
    muon, adamw = get_default_muon_param_groups(TinyMoE())
    assert names(muon) == {"moe.experts", "proj.weight"}
    assert names(adamw) == {"moe.router.weight", "moe.expert_bias", "ln.weight", "ln.bias", "proj.bias"}


def test_trainer_no_decay_and_adamw_options():
    groups = get_default_muon_param_groups(TinyMoE(), no_decay="trainer", adamw_options={"lr": 1e-3, "weight_decay": 0.2},
                                           lr=0.02)
    assert [names(g) for g in groups] == [
        {"moe.experts", "proj.weight"},
        {"moe.router.weight"},  # decayed, as Trainer does (not a bias, not a norm)
        {"moe.expert_bias", "ln.weight", "ln.bias", "proj.bias"},  # "bias" in the name, or inside a LayerNorm
    ]
    assert [(g.get("lr"), g.get("weight_decay")) for g in groups] == [(0.02, None), (1e-3, 0.2), (1e-3, 0.0)]
    # a callable rule
    groups = get_default_muon_param_groups(TinyMoE(), no_decay=lambda n, p: n.startswith("ln."))
    assert names(groups[2]) == {"ln.weight", "ln.bias"} and groups[2]["weight_decay"] == 0.0
