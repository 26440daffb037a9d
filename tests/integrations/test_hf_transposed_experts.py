"""transformers' transposed fused experts build and step from ``get_default_muon_param_groups``
(issue 38): a ``muon_row_blocks`` spec describes the rows of the ``[out, in]`` view, at
``add_param_group`` as at the step.

Every experts module of the installed transformers declared ``is_transposed=True`` (stored
``[E, in, out]``): ``AriaExperts`` (concatenated ``[gate; up]``: two row blocks of the view),
``OpenAIPrivacyFilterExperts`` (the same, with biases) and ``GptOssExperts`` (gate and up
interleaved, ``is_concatenated=False``: no blocks, each expert's view whole).  After one step,
every expert's view, block by block, equals Muon's first step on that block alone, written out in
float64 (``muon_reference.py``), and the biases are AdamW's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import muon_reference
from optimizer import Muon, get_default_muon_param_groups, param_role_table
from tolerances import newton_schulz_atol

transformers = pytest.importorskip("transformers")

HIDDEN, INTERMEDIATE, EXPERTS = 12, 10, 3
HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95)


def _aria():
    from transformers import AriaTextConfig
    from transformers.models.aria.modeling_aria import AriaExperts

    return AriaExperts(AriaTextConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, moe_num_experts=EXPERTS,
                                      num_attention_heads=2, num_key_value_heads=2))


def _privacy_filter():
    from transformers.models.openai_privacy_filter.configuration_openai_privacy_filter import OpenAIPrivacyFilterConfig
    from transformers.models.openai_privacy_filter.modeling_openai_privacy_filter import OpenAIPrivacyFilterExperts

    return OpenAIPrivacyFilterExperts(OpenAIPrivacyFilterConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS, num_attention_heads=2,
        num_key_value_heads=2, head_dim=6))


def _gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    return GptOssExperts(GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=6))


# the [out, in] view of gate_up_proj has 2 * INTERMEDIATE rows: [gate; up] when concatenated
CASES = {"aria": (_aria, [INTERMEDIATE, INTERMEDIATE]), "privacy_filter": (_privacy_filter, [INTERMEDIATE, INTERMEDIATE]),
         "gpt_oss": (_gpt_oss, None)}


def _model(build):
    torch.manual_seed(0)
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.experts = build()
    for p in model.parameters():
        nn.init.normal_(p)
    return model.double()


@pytest.mark.parametrize("case", list(CASES))
def test_transposed_experts_build_step_and_each_block_moves_as_muon_alone(case):
    build, gate_up_blocks = CASES[case]
    model = _model(build)
    assert model.mlp.experts.is_transposed  # the layout under test
    groups = get_default_muon_param_groups(model)
    muon = groups[0]
    assert muon["param_names"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert muon["muon_transposed"] == {"mlp.experts.gate_up_proj": True, "mlp.experts.down_proj": True}
    want_blocks = None if gate_up_blocks is None else "blocks:" + ",".join(map(str, gate_up_blocks))
    assert (muon.get("muon_row_blocks") or {}).get("mlp.experts.gate_up_proj") == want_blocks

    opt = Muon(groups, **HP, ns_method="classic", compute_dtype=torch.float64)  # refused before the fix (Aria)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n]
    opt.step()
    for name, blocks in (("mlp.experts.gate_up_proj", gate_up_blocks), ("mlp.experts.down_proj", None)):
        got = dict(model.named_parameters())[name].detach()
        for e in range(EXPERTS):  # expert e as Muon reads it: the transpose of what is stored
            view, w, gr = got[e].T, before[name][e].T, grads[name][e].T
            start = 0
            for size in blocks or [view.shape[0]]:
                r = slice(start, start + size)
                want = muon_reference.first_step(w[r], gr[r], **HP)
                torch.testing.assert_close(view[r], want, atol=newton_schulz_atol(want.shape, torch.float64), rtol=0,
                                           msg=f"{name} expert {e} rows {r}")
                start += size
    table = param_role_table(model).by_name()
    assert ("row blocks" in table["mlp.experts.gate_up_proj"].rule) is (want_blocks is not None)
    for name in before:
        if name.endswith("_bias"):
            assert table[name].optimizer == "adamw" and not torch.equal(dict(model.named_parameters())[name], before[name])


def test_a_spec_on_the_stored_rows_is_refused_when_the_group_is_added():
    """The other side: a spec that covers the stored rows of a transposed stack (its hidden size)
    describes no rows of its view, and is refused when the group is added, naming it."""
    model = _model(_aria)
    p = model.mlp.experts.gate_up_proj
    with pytest.raises(ValueError, match=r"'gate_up' has 20 rows per expert but muon_row_blocks='blocks:6,6'"):
        Muon([{"params": [p], "param_names": ["gate_up"], "use_muon": True, "muon_transposed": True,
               "muon_row_blocks": "blocks:6,6"}])
