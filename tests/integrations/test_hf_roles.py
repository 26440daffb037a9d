"""Roles of Hugging Face models beyond language models (issue 30), each checked against the
model's own metadata: ViT (image classifier and base model), CLIP (a dual encoder), Whisper and
wav2vec2 (convolutional stems, a weight-normed positional conv) and the DAC audio codec (Snake
scales ``[1, C, 1]``) through ``build_muon``; the language models of test_hf_groups.py keep their
groups there."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import hf_models  # noqa: E402

from optimizer import Muon, get_default_muon_param_groups, param_role_table  # noqa: E402
from optimizer.integrations.huggingface import build_muon  # noqa: E402

PATHS = ("bare", "named", "build_muon")


def placed_by(model, path):
    """{id(param): use_muon} of the optimizer a path builds."""
    if path == "bare":
        opt = Muon(list(model.parameters()), lr=0.02)
    elif path == "named":
        opt = Muon(list(model.named_parameters()), lr=0.02)
    else:
        opt = build_muon(model, lr=0.02)
    return {id(p): g["use_muon"] for g in opt.param_groups for p in g["params"]}


def params_of(modules):
    return [p for m in modules for p in m.parameters()]


def convs_of(model):
    return [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)]


def hidden_linears(body):
    return [m.weight for m in body.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("key", ["vit_cls", "vit_base"])
def test_vit(key, path):
    """ViT's ``cls_token [1, 1, D]`` and ``position_embeddings [1, N, D]`` (attributes of its
    ``ViTEmbeddings``) and its patch projection (the module ``get_input_embeddings()`` returns, a
    Conv2d) go to AdamW in every path; the classifier (outside ``base_model``) to AdamW where the
    model is known; the encoder's Linear weights (and the base model's pooler, inside the body) to Muon."""
    model = getattr(hf_models, key)()
    placed = placed_by(model, path)
    emb = model.base_model.embeddings
    assert emb.cls_token.shape[:2] == (1, 1) and emb.position_embeddings.shape[0] == 1
    patch = model.get_input_embeddings()
    assert isinstance(patch.projection, nn.Conv2d)
    for p in (emb.cls_token, emb.position_embeddings, *patch.parameters()):
        assert placed[id(p)] is False, tuple(p.shape)
    hidden = hidden_linears(model.base_model)  # the body's Linear layers: attention, MLP, the base model's pooler
    assert hidden and all(placed[id(w)] for w in hidden)
    assert (key == "vit_base") == any(w is model.base_model.pooler.dense.weight for w in hidden
                                      if getattr(model.base_model, "pooler", None) is not None)
    if path == "build_muon" and key == "vit_cls":
        body = {id(p) for p in model.base_model.parameters()}
        head = [p for p in model.parameters() if id(p) not in body]
        assert head and not any(placed[id(p)] for p in head)
    if path == "build_muon":
        roles = param_role_table(model).by_name()
        prefix = "vit." if key == "vit_cls" else ""
        # inside ViTEmbeddings: both by the name rule ("embed"); the hand-written ViT of tests/core/test_roles.py,
        # whose names say nothing, has them by shape
        assert roles[prefix + "embeddings.cls_token"].role == "embedding"
        assert roles[prefix + "embeddings.position_embeddings"].role == "embedding"
        assert roles[prefix + "embeddings.patch_embeddings.projection.weight"].rule.startswith("model.get_input_emb")


def _clip_inputs():
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(3, hf_models.VOCAB, (2, 5), generator=g),
            "pixel_values": torch.randn(2, 3, 16, 16, generator=g)}


def test_clip_projections_produce_the_logits():
    """The premise of CLIP's roles, from the model itself: its logits are the scaled cosine
    similarities of ``text_projection`` and ``visual_projection`` of the towers' pooled outputs."""
    model, inputs = hf_models.clip(), _clip_inputs()
    with torch.no_grad():
        out = model(**inputs)
        text = model.text_projection(model.text_model(input_ids=inputs["input_ids"]).pooler_output)
        image = model.visual_projection(model.vision_model(pixel_values=inputs["pixel_values"]).pooler_output)
        text, image = text / text.norm(dim=-1, keepdim=True), image / image.norm(dim=-1, keepdim=True)
        torch.testing.assert_close(out.logits_per_text, model.logit_scale.exp() * text @ image.T)


@pytest.mark.parametrize("traced", [False, True], ids=["metadata", "traced"])
def test_clip_roles(traced):
    """Embeddings (``nn.Embedding`` modules, and the vision class embedding ``[D]`` by its name),
    ``logit_scale`` (a 0-D vector), the patch Conv2d (a convolution): AdamW. The towers' Linear weights: Muon. The two
    projections produce the logits: a head once the forward is seen (``example_inputs``); CLIP's
    metadata alone (no ``get_output_embeddings``, no task head outside a body) cannot say so, and
    they are then hidden matrices (docs/param_roles.md)."""
    model = hf_models.clip()
    inputs = _clip_inputs() if traced else None
    groups = get_default_muon_param_groups(model, example_inputs=inputs)
    placed = {id(p): g["use_muon"] for g in groups for p in g["params"]}
    roles = param_role_table(model, example_inputs=inputs).by_name()
    names = {id(p): n for n, p in model.named_parameters()}
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    assert len(embeddings) == 3  # text token and position, vision position
    for p in params_of(embeddings):
        assert placed[id(p)] is False and roles[names[id(p)]].role == "embedding"
    class_embedding = model.vision_model.embeddings.class_embedding  # [D], inside the "embeddings" module
    assert class_embedding.ndim == 1 and model.logit_scale.ndim == 0
    assert placed[id(class_embedding)] is False and roles[names[id(class_embedding)]].role == "embedding"
    assert placed[id(model.logit_scale)] is False and roles["logit_scale"].role == "vector"
    for p in params_of(convs_of(model)):
        assert placed[id(p)] is False and roles[names[id(p)]].role == "conv"
    towers = hidden_linears(model.text_model.encoder) + hidden_linears(model.vision_model.encoder)
    assert towers and all(placed[id(w)] for w in towers)
    for proj in (model.text_projection, model.visual_projection):
        row = roles[names[id(proj.weight)]]
        assert placed[id(proj.weight)] is (not traced) and row.role == ("head" if traced else "matrix")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("key", ["whisper", "wav2vec2"])
def test_audio_convolutional_stems_go_to_adamw(key, path):
    """Whisper's Conv1d stem and wav2vec2's feature encoder and weight-normed grouped positional
    conv (its ``parametrizations.weight.original0/1``): every parameter of every convolution module
    to AdamW, in every path; the encoder's attention and MLP weights to Muon."""
    model = getattr(hf_models, key)()
    placed = placed_by(model, path)
    convs = convs_of(model)
    assert len(convs) >= 2
    for p in params_of(convs):
        assert placed[id(p)] is False, tuple(p.shape)
    encoder = model.get_encoder() if key == "whisper" else model.wav2vec2.encoder
    attention = [m.weight for n, m in encoder.named_modules() if isinstance(m, nn.Linear)]
    assert attention and all(placed[id(w)] for w in attention)


def test_dac_snake_scales_and_convolutions_through_build_muon(caplog):
    """The issue's audio codec: DAC's 30 Snake ``alpha [1, C, 1]`` go to AdamW (role vector), and so
    does every convolution; one step moves each of them exactly as ``torch.optim.AdamW``. Nothing is
    left for Muon, and a warning says so."""
    model, ref = hf_models.dac(), hf_models.dac()
    alphas = [p for n, p in model.named_parameters() if n.endswith(".alpha")]
    assert len(alphas) == 30 and all(p.shape[0] == 1 and p.shape[2] == 1 for p in alphas)
    with caplog.at_level(logging.WARNING, logger="optimizer.param_groups"):
        opt = build_muon(model, lr=0.01, weight_decay=0.1, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, no_decay=None)
    assert any("no parameter of this DacModel is a matrix Muon orthogonalises" in r.getMessage() for r in caplog.records)
    placed = {id(p): g["use_muon"] for g in opt.param_groups for p in g["params"]}
    roles = param_role_table(model).by_name()
    names = {id(p): n for n, p in model.named_parameters()}
    for p in alphas:
        assert placed[id(p)] is False and roles[names[id(p)]].role == "vector"
    convs = params_of(convs_of(model))
    assert convs and not any(placed[id(p)] for p in convs)
    reference = torch.optim.AdamW(list(ref.parameters()), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                  foreach=True)
    g = torch.Generator().manual_seed(1)
    for p, r in zip(model.parameters(), ref.parameters()):
        p.grad = torch.randn(p.shape, generator=g)
        r.grad = p.grad.clone()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    reference.step()
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert not torch.equal(p, before[n]) and torch.equal(p, r), n
