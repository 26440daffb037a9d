"""torch's own fused and 3-D weights get the role their module gives them (issue 38), in the
model-aware path (``get_default_muon_param_groups``) and its role table:

* ``nn.MultiheadAttention.in_proj_weight`` ``[3E, E]`` is q, k and v stacked: three row blocks,
  each orthogonalised as if it were its own weight;
* ``nn.LSTM``/``nn.GRU`` (and their cells) stack one block of rows per gate in ``weight_ih*`` and
  ``weight_hh*`` (LSTM i, f, g, o; GRU r, z, n, torch's documented order): one row block per gate;
* ``nn.Bilinear``'s ``[out, in1, in2]`` weight and a free ``[heads, L, L]`` table are not expert
  stacks: AdamW (the table, which nothing explains, with a warning naming it); a 3-D tensor whose
  name says experts, or whose module is torchtitan's ``GroupedExperts``, is one.

Expected roles and blocks are written here from the modules' documented layouts; every Muon block
after one step is compared with Muon's first step on that block alone (``muon_reference.py``,
float64 formulas), and every AdamW parameter with ``torch.optim.AdamW`` bit for bit.  Hugging
Face's transposed experts (``AriaExperts``): tests/integrations/test_hf_transposed_experts.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import muon_reference
from optimizer import Muon, get_default_muon_param_groups, param_role_table
from tolerances import newton_schulz_atol

HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=0.02, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


class TorchModules(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)
        self.lstm = nn.LSTM(6, 5)
        self.gru = nn.GRU(6, 4)
        self.cell = nn.GRUCell(4, 3)
        self.bilinear = nn.Bilinear(4, 5, 3)
        self.rel_pos = nn.Parameter(torch.randn(2, 7, 7))  # [heads, L, L]: a table, not experts
        self.moe = nn.Module()
        self.moe.experts_w1 = nn.Parameter(torch.randn(3, 4, 6))  # [E, out, in], its name says so


def _model():
    torch.manual_seed(0)
    return TorchModules().double()


# what each parameter is, from torch's documented layouts: (optimizer, role, row blocks of the [out, in] rows)
E, H_LSTM, H_GRU, H_CELL = 8, 5, 4, 3
EXPECTED = {
    "attn.in_proj_weight": ("muon", "matrix", [E, E, E]),  # q; k; v
    "attn.in_proj_bias": ("adamw", "bias", None),
    "attn.out_proj.weight": ("muon", "matrix", None),
    "attn.out_proj.bias": ("adamw", "bias", None),
    **{f"lstm.{w}_l0": ("muon", "matrix", [H_LSTM] * 4) for w in ("weight_ih", "weight_hh")},  # i, f, g, o
    **{f"lstm.{b}_l0": ("adamw", "bias", None) for b in ("bias_ih", "bias_hh")},
    **{f"gru.{w}_l0": ("muon", "matrix", [H_GRU] * 3) for w in ("weight_ih", "weight_hh")},  # r, z, n
    **{f"gru.{b}_l0": ("adamw", "bias", None) for b in ("bias_ih", "bias_hh")},
    **{f"cell.{w}": ("muon", "matrix", [H_CELL] * 3) for w in ("weight_ih", "weight_hh")},
    **{f"cell.{b}": ("adamw", "bias", None) for b in ("bias_ih", "bias_hh")},
    "bilinear.weight": ("adamw", "tensor", None),
    "bilinear.bias": ("adamw", "bias", None),
    "rel_pos": ("adamw", "tensor", None),
    "moe.experts_w1": ("muon", "matrix", None),
}


def test_the_groups_and_the_table_follow_the_modules(caplog):
    model = _model()
    with caplog.at_level(logging.WARNING, logger="optimizer.param_groups"):
        groups = get_default_muon_param_groups(model)
    table = param_role_table(model).by_name()
    assert set(table) == set(EXPECTED) == {n for n, _ in model.named_parameters()}
    muon = groups[0]
    assert muon["use_muon"] and all(not g["use_muon"] for g in groups[1:])
    blocks = muon.get("muon_row_blocks", {})
    for name, (optimizer, role, rows) in EXPECTED.items():
        row = table[name]
        assert (row.optimizer, row.role) == (optimizer, role), (name, row)
        assert (name in muon["param_names"]) is (optimizer == "muon"), name
        want = None if rows is None else "blocks:" + ",".join(map(str, rows))
        assert blocks.get(name) == want, (name, blocks.get(name))
        assert (want is not None) is ("row blocks" in row.rule), (name, row.rule)
    assert "q, k, v" in table["attn.in_proj_weight"].rule
    assert "gates i, f, g, o" in table["lstm.weight_hh_l0"].rule and "gates r, z, n" in table["gru.weight_ih_l0"].rule
    assert "Bilinear" in table["bilinear.weight"].rule
    warned = [r.getMessage() for r in caplog.records if "3-D parameter(s) went to AdamW" in r.getMessage()]
    assert len(warned) == 1 and "rel_pos (2, 7, 7)" in warned[0] and "bilinear" not in warned[0]


def _stepped(model):
    """The model after one step of Muon(get_default_muon_param_groups(model)), and AdamW's reference."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = Muon(get_default_muon_param_groups(model), **HP, adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
               ns_method="classic", compute_dtype=torch.float64)
    adamw_names = [n for g in opt.param_groups if not g["use_muon"] for n in g["param_names"]]
    copies = {n: nn.Parameter(before[n].clone()) for n in adamw_names}
    reference = torch.optim.AdamW(list(copies.values()), **ADAMW, foreach=True)
    g = torch.Generator().manual_seed(1)
    grads = {}
    for n, p in model.named_parameters():
        grads[n] = p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        if n in copies:
            copies[n].grad = grads[n].clone()
    opt.step()
    reference.step()
    return before, grads, copies


def test_one_step_orthogonalises_each_block_alone_and_steps_the_rest_with_adamw():
    model = _model()
    before, grads, adamw = _stepped(model)
    params = dict(model.named_parameters())
    for name, (optimizer, _, rows) in EXPECTED.items():
        p = params[name].detach()
        if optimizer == "adamw":
            assert torch.equal(p, adamw[name].detach()), name
            continue
        matrices = [(p, before[name], grads[name])] if p.ndim == 2 else list(zip(p, before[name], grads[name]))
        for got, w, gr in matrices:  # every expert of a stack: a matrix of its own
            start = 0
            for size in rows or [w.shape[0]]:
                r = slice(start, start + size)
                want = muon_reference.first_step(w[r], gr[r], **HP)
                atol = newton_schulz_atol(want.shape, torch.float64)
                torch.testing.assert_close(got[r], want, atol=atol, rtol=0, msg=f"{name} rows {r}")
                start += size
        if rows:  # the blocks made a difference the comparison can see
            whole = muon_reference.first_step(before[name], grads[name], **HP)
            assert (p - whole).abs().max() > 1e-3, name


def test_mha_q_k_and_v_each_move_as_muon_on_that_block_alone():
    """The issue's check, by name: each of q, k and v of ``in_proj_weight`` equals Muon on that block alone."""
    model = _model()
    before, grads, _ = _stepped(model)
    w = model.attn.in_proj_weight.detach()
    for i, part in enumerate("qkv"):
        r = slice(i * E, (i + 1) * E)
        alone = muon_reference.first_step(before["attn.in_proj_weight"][r], grads["attn.in_proj_weight"][r], **HP)
        torch.testing.assert_close(w[r], alone, atol=newton_schulz_atol((E, E), torch.float64), rtol=0, msg=part)


def test_a_3d_tensor_is_an_expert_stack_only_when_its_module_or_name_says_so():
    torchtitan_moe = pytest.importorskip("torchtitan.models.common.moe")
    model = nn.Module()
    model.ffn = torchtitan_moe.GroupedExperts(torchtitan_moe.GroupedExperts.Config(dim=6, hidden_dim=4, num_experts=3))
    model.free = nn.Parameter(torch.randn(3, 4, 6))
    for p in model.ffn.parameters():
        nn.init.normal_(p)
    table = param_role_table(model).by_name()
    for name, _ in model.ffn.named_parameters():  # "ffn.w1_EFD": no "expert" in the name, the module says so
        assert table[f"ffn.{name}"].optimizer == "muon" and "torchtitan experts module" in table[f"ffn.{name}"].rule
    assert table["free"].optimizer == "adamw" and table["free"].role == "tensor"
    groups = get_default_muon_param_groups(model, is_muon=lambda n, p: n == "free" or p.ndim == 3)
    assert "free" in groups[0]["param_names"]  # an explicit choice sends it to Muon
