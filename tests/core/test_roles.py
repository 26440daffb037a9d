"""Every parameter gets the optimizer its role calls for (issue 30), in every path: a bare list of
tensors, ``named_parameters()``, ``get_default_muon_param_groups(model)`` (with and without a
traced forward), and the role table.

Roles are checked against the models' own structure (module types, the attribute that holds a
parameter, the module whose output the forward returns), never against the grouping code; the
convolution convention (AdamW) and the per-channel scales are checked by one step's update
against ``torch.optim.AdamW`` itself, bit for bit. The pre-issue rules, put back on purpose
(a 3-D conv kernel as an expert stack; a ``[1, C, 1]`` scale as a matrix), fail those checks.
Hugging Face models (ViT, CLIP, Whisper, wav2vec2, an audio codec through ``build_muon``):
tests/integrations/test_hf_roles.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import optimizer.model_facts
import optimizer.roles
from optimizer import Muon, get_default_muon_param_groups, param_role_table
from optimizer.param_groups import param_roles
from optimizer.roles import Decision, is_vector_in_disguise, matrix_dims

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
HP = dict(lr=0.01, weight_decay=0.1, adamw_betas=(0.9, 0.95), adamw_eps=1e-8)  # explicit, for the AdamW reference


# --------------------------------------------------------------------------- models


class Snake(nn.Module):
    """DAC-style activation: a learned per-channel ``alpha`` of shape ``[1, C, 1]``."""

    def __init__(self, channels):
        super().__init__()
        self.alpha = nn.Parameter(torch.rand(1, channels, 1) + 0.5)

    def forward(self, x):
        return x + torch.sin(self.alpha * x) ** 2 / self.alpha


class AudioNet(nn.Module):
    """A 1-D CNN: plain, grouped, depthwise and transposed convolutions, Snake scales, a Linear head."""

    def __init__(self, c=8, classes=5):
        super().__init__()
        self.conv_in = nn.Conv1d(3, c, 5, padding=2)
        self.act1 = Snake(c)
        self.conv_grouped = nn.Conv1d(c, c, 3, padding=1, groups=2)
        self.act2 = Snake(c)
        self.conv_dw = nn.Conv1d(c, c, 3, padding=1, groups=c)
        self.up = nn.ConvTranspose1d(c, c // 2, 4, stride=2)  # named without "conv": only its module says so
        self.proj = nn.Linear(c // 2, c)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        h = self.act1(self.conv_in(x))
        h = self.act2(self.conv_grouped(h))
        h = self.up(self.conv_dw(h)).mean(-1)
        return self.head(torch.relu(self.proj(h)))


class AllConvs(nn.Module):
    """One of every torch convolution, grouped ones included, and a hidden Linear."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(4, 6, 3)
        self.c2 = nn.Conv2d(4, 6, (3, 2), groups=2)
        self.c3 = nn.Conv3d(2, 4, 2, bias=False)
        self.t1 = nn.ConvTranspose1d(4, 6, 3)
        self.t2 = nn.ConvTranspose2d(4, 6, 3, groups=2)
        self.t3 = nn.ConvTranspose3d(2, 4, 2)
        self.linear = nn.Linear(6, 6)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.out(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)
        return x + self.down(torch.relu(self.up(x)))


class TinyViT(nn.Module):
    """Hand-written ViT: patch conv, ``cls_token [1, 1, D]``, ``positions [1, N, D]``, a ``head``."""

    def __init__(self, d=16, patches=4, classes=3):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.positions = nn.Parameter(torch.randn(1, patches + 1, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.positions
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class PlainLM(nn.Module):
    """A plain transformer LM, its output layer called ``out_name`` (``head``, or torchvision's ``fc``),
    its positions a free ``[N, D]`` table named ``pos`` (neither "embed" in the name nor a leading 1)."""

    def __init__(self, vocab=20, d=16, n=6, out_name="head", tie=False):
        super().__init__()
        self.out_name = out_name
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(n, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d)])
        self.norm = nn.LayerNorm(d)
        setattr(self, out_name, nn.Linear(d, vocab, bias=False))
        if tie:
            getattr(self, out_name).weight = self.tok.weight

    def forward(self, ids):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return getattr(self, self.out_name)(self.norm(x))


def seeded(make, seed=0):
    torch.manual_seed(seed)
    return make()


# --------------------------------------------------------------------------- helpers


def groups_of(paths_model, path):
    """Param groups of one path: the optimizer's own groups after building it from that path's input."""
    model = paths_model
    if path == "bare":
        params = list(model.parameters())
    elif path == "named":
        params = list(model.named_parameters())
    else:
        params = get_default_muon_param_groups(model)
    return Muon(params, **HP)


def where(opt):
    """{id(param): use_muon} from a built optimizer."""
    return {id(p): g["use_muon"] for g in opt.param_groups for p in g["params"]}


def module_params(model, kind):
    """Parameters held by modules of ``kind`` (the model's own structure)."""
    return [p for m in model.modules() if isinstance(m, kind) for p in m.parameters(recurse=False)]


def check_convs_and_scales_on_adamw(model, opt):
    """Every convolution's parameters and every Snake ``alpha`` are in an AdamW group."""
    placed = where(opt)
    convs, scales = module_params(model, CONVS), module_params(model, Snake)
    assert convs or scales
    for p in convs + scales:
        assert placed[id(p)] is False, tuple(p.shape)


def check_one_step_is_adamw(make, path, seed=0):
    """One step of ``Muon`` built by ``path`` moves every conv parameter and every ``[1, C, 1]``
    scale exactly as ``torch.optim.AdamW`` (same lr, betas, eps, weight decay) moves a copy."""
    model, ref = seeded(make, seed), seeded(make, seed)
    opt = groups_of(model, path)
    chosen = [(p, r) for kind in (CONVS, Snake)
              for p, r in zip(module_params(model, kind), module_params(ref, kind))]
    reference = torch.optim.AdamW([r for _, r in chosen], lr=HP["lr"], betas=HP["adamw_betas"], eps=HP["adamw_eps"],
                                  weight_decay=HP["weight_decay"], foreach=True)
    g = torch.Generator().manual_seed(seed + 1)
    for p, r in zip(model.parameters(), ref.parameters()):
        p.grad = torch.randn(p.shape, generator=g)
        r.grad = p.grad.clone()
    opt.step()
    reference.step()
    for p, r in chosen:
        assert not torch.equal(p, seeded(make, seed).state_dict()[_name(model, p)]), "the step moved nothing"
        assert torch.equal(p, r), (path, _name(model, p), tuple(p.shape))


def _name(model, param):
    return next(n for n, p in model.named_parameters() if p is param)


# --------------------------------------------------------------------------- the shape rule (pure)


def test_vector_in_disguise_by_shape():
    cases = {  # shape: a vector once leading 1s are dropped (written out here)
        (): True, (5,): True, (1, 5): True, (5, 1): True, (1, 8, 1): True, (1, 1, 16): True,
        (8, 1, 3): True, (4, 8, 1, 1): True, (1, 8, 1, 1): True,
        (4, 5): False, (1, 6, 5): False, (3, 4, 5): False, (1, 1, 4, 5): False, (2, 3, 4, 5): False,
    }
    for shape, vector in cases.items():
        assert is_vector_in_disguise(shape) is vector, shape
    assert matrix_dims((1, 1, 4, 1)) == (4, 1) and matrix_dims((1, 1)) == ()


# --------------------------------------------------------------------------- the 1-D CNN, every path


@pytest.mark.parametrize("path", ["bare", "named", "model"])
def test_cnn_convs_and_scales_go_to_adamw(path, caplog):
    """Conv1d weights ``[out, in, k]`` (plain, grouped, depthwise) and ConvTranspose1d ``[in, out, k]``
    never go to Muon as expert stacks, and the Snake ``[1, C, 1]`` scales never as matrices, in any
    path; hidden Linear weights go to Muon in every path, the ``head`` in the torch-style ones only
    (as torch.optim.Muon, which knows no roles)."""
    model = seeded(AudioNet)
    with caplog.at_level(logging.WARNING, logger="optimizer.muon"):
        opt = groups_of(model, path)
    check_convs_and_scales_on_adamw(model, opt)
    placed = where(opt)
    assert placed[id(model.proj.weight)] is True
    assert placed[id(model.head.weight)] is (path != "model")
    warned = [r.getMessage() for r in caplog.records if "went to AdamW" in r.getMessage()]
    if path == "bare":  # nothing says what the 3-D tensors are: AdamW, named once in a warning
        kernels = [p for p in model.parameters() if p.ndim == 3 and not is_vector_in_disguise(p.shape)]
        assert len(warned) == 1 and f"{len(kernels)} 3-D parameter(s)" in warned[0]
        for p in kernels:
            assert str(tuple(p.shape)) in warned[0]
        assert "use_muon': True" in warned[0] and "get_default_muon_param_groups" in warned[0]
    elif path == "named":  # "up" has no "conv" in its name: the one ambiguous tensor
        assert len(warned) == 1 and "up.weight (8, 4, 4)" in warned[0] and "conv_in" not in warned[0]
    else:
        assert not warned


@pytest.mark.parametrize("path", ["bare", "named", "model"])
def test_cnn_one_step_equals_torch_adamw(path):
    check_one_step_is_adamw(AudioNet, path)


@pytest.mark.parametrize("path", ["bare", "named", "model"])
def test_every_convolution_kind_is_adamw(path):
    """Conv1d/2d/3d and ConvTranspose1d/2d/3d, grouped too: AdamW in every path, one step = torch's AdamW."""
    model = seeded(AllConvs)
    opt = groups_of(model, path)
    check_convs_and_scales_on_adamw(model, opt)
    assert where(opt)[id(model.linear.weight)] is True
    check_one_step_is_adamw(AllConvs, path)


def test_named_3d_experts_still_go_to_muon_and_the_roles_say_why():
    experts = nn.Parameter(torch.randn(4, 6, 5))
    kernel = nn.Parameter(torch.randn(6, 5, 3))
    opt = Muon([("moe.experts.w1", experts), ("encoder.conv1.weight", kernel)], lr=0.02)
    assert [(g["use_muon"], g["param_names"]) for g in opt.param_groups] == [
        (True, ["moe.experts.w1"]), (False, ["encoder.conv1.weight"])]
    rows = param_role_table([("moe.experts.w1", experts), ("encoder.conv1.weight", kernel)]).by_name()
    assert (rows["moe.experts.w1"].role, rows["encoder.conv1.weight"].role) == ("matrix", "conv")


# --------------------------------------------------------------------------- ViT, plain transformer


@pytest.mark.parametrize("path", ["bare", "named", "model"])
def test_vit_class_and_position_embeddings_go_to_adamw(path):
    """``cls_token [1, 1, D]`` (a vector in disguise) and ``positions [1, N, D]`` (broadcast over the
    batch) to AdamW in every path; the patch Conv2d to AdamW; the blocks' Linear weights to Muon."""
    model = seeded(TinyViT)
    placed = where(groups_of(model, path))
    for p in (model.cls_token, model.positions, model.patch.weight):
        assert placed[id(p)] is False, tuple(p.shape)
    hidden = [m.weight for m in model.blocks.modules() if isinstance(m, nn.Linear)]
    assert hidden and all(placed[id(w)] for w in hidden)


def test_vit_roles_say_what_the_model_holds():
    model = seeded(TinyViT)
    roles = param_roles(model)
    assert roles["cls_token"] == "vector" and roles["positions"] == "embedding"  # names that say nothing: by shape
    assert "broadcast over the batch" in param_role_table(model).by_name()["positions"].rule
    assert roles["patch.weight"] == "conv" and roles["head.weight"] == "head"
    # the model's own forward: the head's output is what the model returns, cls and pos are added in
    img = torch.randn(2, 3, 8, 8)
    seen = {}
    model.head.register_forward_hook(lambda m, i, o: seen.setdefault("head", o))
    assert torch.equal(model(img), seen["head"])


@pytest.mark.parametrize("out_name", ["head", "fc"])
def test_plain_transformer_output_layer(out_name):
    """A plain model's output layer: by name when it is called ``head``; by the traced forward
    whatever it is called (``fc``, as torchvision names it). Checked against the model itself: the
    module whose output the forward returns."""
    model = seeded(lambda: PlainLM(out_name=out_name))
    ids = torch.randint(0, 20, (2, 5))
    out = getattr(model, out_name)
    seen = {}
    out.register_forward_hook(lambda m, i, o: seen.setdefault("out", o))
    assert torch.equal(model(ids), seen["out"])  # the premise: this module produces the logits
    weight = f"{out_name}.weight"
    by_name = param_role_table(model).by_name()
    assert by_name[weight].role == ("head" if out_name == "head" else "matrix")  # fc: names cannot tell
    traced = param_role_table(model, example_inputs=(ids,)).by_name()
    assert traced[weight].role == "head" and traced[weight].optimizer == "adamw"
    assert "produces the logits" in traced[weight].rule or out_name == "head"
    # the free [N, D] position table is added to activations: an embedding once the forward is seen
    assert by_name["pos"].role == "matrix" and traced["pos"].role == "embedding"
    assert "added to activations" in traced["pos"].rule
    assert traced["tok.weight"].role == "embedding"
    for m in model.blocks.modules():
        if isinstance(m, nn.Linear):
            assert traced[f"blocks.0.{_child_name(model.blocks[0], m)}.weight"].optimizer == "muon"
    assert model.training  # the trace ran in eval mode and restored the flags


def _child_name(parent, module):
    return next(n for n, m in parent.named_modules() if m is module)


def test_traced_forward_changes_nothing_and_follows_logits_only():
    """The traced forward leaves parameters, gradients and batch-norm statistics as they were; a model
    returning a mapping is followed only through its "logits" entries (not router logits)."""

    class WithBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.body = nn.Linear(4, 4)
            self.router = nn.Linear(4, 3)
            self.cls = nn.Linear(4, 2)

        def forward(self, x):
            h = self.body(self.bn(x))
            return {"hidden": h, "router_logits": self.router(h), "logits": self.cls(h)}

    model = seeded(WithBN)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    table = param_role_table(model, example_inputs={"x": torch.randn(6, 4)}).by_name()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert table["cls.weight"].role == "head" and table["body.weight"].role == "matrix"
    assert table["router.weight"].role == "router"  # by its name; router_logits are not followed


def test_tied_head_is_an_embedding_and_the_rule_names_the_alias():
    model = seeded(lambda: PlainLM(tie=True))
    rows = param_role_table(model).by_name()
    assert "head.weight" not in rows  # one object, listed once
    assert rows["tok.weight"].role == "embedding" and "tied: also head.weight" in rows["tok.weight"].rule


# --------------------------------------------------------------------------- overrides, the table, the log


def test_is_muon_cannot_send_a_kernel_or_a_disguised_vector_to_muon():
    model = seeded(AudioNet)
    with pytest.raises(ValueError, match=r"'conv_in.weight'.*conv.*AdamW"):
        get_default_muon_param_groups(model, is_muon=lambda n, p: n == "conv_in.weight")
    with pytest.raises(ValueError, match=r"'act1.alpha' of shape \(1, 8, 1\).*vector in disguise"):
        get_default_muon_param_groups(model, is_muon=lambda n, p: n == "act1.alpha")
    # a role an override may change: the head to Muon, a hidden matrix to AdamW; the table says whose choice
    table = param_role_table(model, is_muon=lambda n, p: n in ("head.weight",)).by_name()
    assert table["head.weight"].optimizer == "muon" and "is_muon (yours) chose Muon" in table["head.weight"].rule
    assert table["proj.weight"].optimizer == "adamw" and "is_muon (yours) chose AdamW" in table["proj.weight"].rule


@pytest.mark.parametrize("path", ["model", "bare", "named", "groups"])
def test_role_table_matches_the_groups_and_prints(path):
    """Each row's group is the group that holds that parameter (model: the returned groups; a list:
    the optimizer's own ``param_groups``), and ``str()`` is a table naming every parameter."""
    model = seeded(AudioNet)
    if path == "model":
        groups, table = get_default_muon_param_groups(model), param_role_table(model)
        holder = {id(p): (i, g["use_muon"]) for i, g in enumerate(groups) for p in g["params"]}
        by_row = {id(dict(model.named_parameters())[r.name]): r for r in table}
    else:
        params = {"bare": lambda: list(model.parameters()), "named": lambda: list(model.named_parameters()),
                  "groups": lambda: [{"params": [model.proj.weight, model.act1.alpha]},
                                     {"params": [model.head.weight], "use_muon": False}]}[path]
        opt, table = Muon(params(), **HP), param_role_table(params())
        holder = {id(p): (i, g["use_muon"]) for i, g in enumerate(opt.param_groups) for p in g["params"]}
        by_row = {}
        for r in table:
            group = opt.param_groups[r.group]
            names = group.get("param_names") or [f"param_groups[{r.group}]['params'][{i}]"
                                                 for i in range(len(group["params"]))]
            by_row[id(group["params"][names.index(r.name)])] = r
    assert set(by_row) == set(holder)
    for pid, row in by_row.items():
        assert (row.group, row.optimizer == "muon") == holder[pid]
    text = str(table)
    assert text.splitlines()[0].split() == ["parameter", "shape", "group", "role", "rule"]
    assert len(text.splitlines()) == len(table) + 1


def test_table_logged_once_at_debug_when_groups_are_built(caplog):
    model = seeded(AudioNet)
    with caplog.at_level(logging.DEBUG, logger="optimizer.param_groups"):
        get_default_muon_param_groups(model)
    logged = [r for r in caplog.records if r.name == "optimizer.param_groups" and "where each parameter" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.DEBUG
    assert str(param_role_table(model)) in logged[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="optimizer.muon"):
        Muon(model.parameters(), lr=0.02)
    logged = [r for r in caplog.records if "where each torch-style parameter went" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.DEBUG and "vector in disguise" in logged[0].getMessage()


# --------------------------------------------------------------------------- the pre-issue rules fail these tests


def _pre_issue_rules(monkeypatch):
    """Put back what issue 30 found: shapes decide nothing but 0-D/1-D ([1, C, 1] is a matrix), and
    a 3-D kernel is an expert stack (no conv facts, no conv names)."""
    monkeypatch.setattr(optimizer.roles, "shape_decision",
                        lambda shape, experts=False: Decision("vector", "1-D") if len(shape) < 2 else None)
    init = optimizer.model_facts.ModelFacts.__init__

    def no_conv_facts(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.conv.clear()

    monkeypatch.setattr(optimizer.model_facts.ModelFacts, "__init__", no_conv_facts)
    monkeypatch.setattr(optimizer.roles, "name_says_conv", lambda name: False)
    monkeypatch.setattr(optimizer.roles, "name_says_experts", lambda name: True)  # every 3-D: experts


@pytest.mark.parametrize("path", ["named", "model"])
def test_pre_issue_rules_fail_the_checks(path, monkeypatch):
    _pre_issue_rules(monkeypatch)
    model = seeded(AudioNet)
    opt = groups_of(model, path)
    placed = where(opt)
    assert placed[id(model.conv_in.weight)] and placed[id(model.act1.alpha)]  # the wrong rules are in force
    with pytest.raises(AssertionError):
        check_convs_and_scales_on_adamw(model, opt)
    with pytest.raises(AssertionError):
        check_one_step_is_adamw(AudioNet, path)
    with pytest.raises(AssertionError):
        test_vit_class_and_position_embeddings_go_to_adamw(path)
