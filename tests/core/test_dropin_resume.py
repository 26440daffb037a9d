"""Resuming across torch.compile / activation-checkpointing wrappers (issue 13).

``torch.compile(model)`` names parameters ``_orig_mod.<name>`` and activation checkpointing
``..._checkpoint_wrapped_module.<name>``; torch.distributed.checkpoint drops those segments, and
torch.optim.AdamW loads such a checkpoint. So must Muon, through ``load_state_dict`` and through
DCP, in both directions; and a checkpoint of a different model is refused with a message that
says what differs (not "group order" when the order is fine).

The reference for "resumed correctly" is an uninterrupted run of the same optimizer on the same
gradients, and torch.optim.AdamW's own behaviour for loadability.
"""

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from optimizer import Muon, get_default_muon_param_groups
from optimizer.checkpoint import canonical_name


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(12, 20, bias=False)
        self.w2 = nn.Linear(20, 12, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Net(nn.Module):
    def __init__(self, ac=False):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(12)
        if ac:  # what torchtitan's activation checkpointing does to each block
            self.layers = nn.ModuleList([checkpoint_wrapper(b) for b in self.layers])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.norm(x)


def wrapped(kind):
    """(module whose parameters the optimizer sees, the plain Net inside it)."""
    if kind == "plain":
        net = Net()
        return net, net
    if kind == "compile":
        net = Net()
        return torch.compile(net), net
    if kind == "ac":
        net = Net(ac=True)
        return net, net
    if kind == "compile+ac":
        net = Net(ac=True)
        return torch.compile(net), net
    raise ValueError(kind)


def make_opt(module):
    return Muon(get_default_muon_param_groups(module), lr=0.02, weight_decay=0.1)


def train(module, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in module.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def by_canonical_name(module):
    return {canonical_name(n): p.detach().clone() for n, p in module.named_parameters()}


KINDS = ["plain", "compile", "ac", "compile+ac"]
PAIRS = [(a, b) for a in KINDS for b in KINDS if a != b and "plain" in (a, b)] + [("compile", "ac")]


def test_wrappers_add_name_segments():
    """The premise: the wrapped models name their parameters differently."""
    names = {kind: [n for n, _ in wrapped(kind)[0].named_parameters()] for kind in KINDS}
    assert names["compile"][0].startswith("_orig_mod.")
    assert any("_checkpoint_wrapped_module" in n for n in names["ac"])
    assert len({tuple(v) for v in names.values()}) == len(KINDS)
    assert len({tuple(canonical_name(n) for n in v) for v in names.values()}) == 1


@pytest.mark.parametrize("saved_kind,loaded_kind", PAIRS, ids=lambda k: k)
def test_load_state_dict_across_wrappers(saved_kind, loaded_kind):
    src, _ = wrapped(saved_kind)
    src_opt = make_opt(src)
    train(src, src_opt, 2, seed=1)
    sd = copy.deepcopy(src_opt.state_dict())

    # torch.optim.AdamW loads the same kind of checkpoint (the behaviour we match)
    ta_src = torch.optim.AdamW(src.named_parameters())
    train(src, ta_src, 1, seed=9)
    dst_for_adamw, _ = wrapped(loaded_kind)
    torch.optim.AdamW(dst_for_adamw.named_parameters()).load_state_dict(ta_src.state_dict())

    dst, _ = wrapped(loaded_kind)
    with torch.no_grad():  # same weights as the saved run
        for (_, p), q in zip(dst.named_parameters(), src.parameters()):
            p.copy_(q)
    dst_opt = make_opt(dst)
    dst_opt.load_state_dict(sd)
    train(src, src_opt, 2, seed=2)  # the uninterrupted run
    train(dst, dst_opt, 2, seed=2)  # the resumed one
    a, b = by_canonical_name(src), by_canonical_name(dst)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("saved_kind,loaded_kind", [("plain", "compile+ac"), ("compile+ac", "plain")], ids=lambda k: k)
def test_dcp_across_wrappers(tmp_path, saved_kind, loaded_kind):
    src, _ = wrapped(saved_kind)
    src_opt = make_opt(src)
    train(src, src_opt, 2, seed=1)
    dcp.save({"optim": get_optimizer_state_dict(src, src_opt)}, checkpoint_id=str(tmp_path))

    dst, _ = wrapped(loaded_kind)
    dst_opt = make_opt(dst)
    train(dst, dst_opt, 1, seed=7)  # state exists, as DCP needs, and differs from the checkpoint's
    with torch.no_grad():  # the model weights come from the same checkpoint
        for (_, p), q in zip(dst.named_parameters(), src.parameters()):
            p.copy_(q)
    target = {"optim": get_optimizer_state_dict(dst, dst_opt)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(dst, dst_opt, target["optim"])
    train(src, src_opt, 2, seed=2)
    train(dst, dst_opt, 2, seed=2)
    a, b = by_canonical_name(src), by_canonical_name(dst)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _sd_of(module):
    opt = make_opt(module)
    train(module, opt, 1, seed=3)
    return opt.state_dict()


def test_other_model_is_refused_naming_what_differs():
    sd = _sd_of(torch.compile(Net()))

    class Renamed(Net):
        def __init__(self):
            super().__init__()
            self.layers[1].w3 = self.layers[1].w2  # same shapes, another name
            del self.layers[1].w2

    with pytest.raises(ValueError) as err:
        make_opt(Renamed()).load_state_dict(sd)
    msg = str(err.value)
    assert "only the checkpoint has 'layers.1.w2.weight'" in msg
    assert "only this optimizer has 'layers.1.w3.weight'" in msg
    assert "order" not in msg


def test_other_order_is_refused_as_an_order_problem():
    net = Net()
    sd = _sd_of(net)
    groups = get_default_muon_param_groups(Net())
    muon = groups[0]
    muon["params"], muon["param_names"] = muon["params"][::-1], muon["param_names"][::-1]
    with pytest.raises(ValueError, match=r"another order \(position 0 is 'layers.0.w1.weight' in the checkpoint"):
        Muon(groups, lr=0.02).load_state_dict(sd)
