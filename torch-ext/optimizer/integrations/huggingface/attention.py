"""The attention modules of a Hugging Face model and the QK-clip config that fits them.

An attention module is found by what it does, not by its class name: its ``forward`` dispatches
through transformers' attention registry (``ALL_ATTENTION_FUNCTIONS.get_interface(...)``, the
call every transformers 5 attention makes before ``attention_interface(self, query, key, value,
attention_mask, scaling=..., ...)``). Its layer key is the first integer component of its name,
as :class:`optimizer.QKClipConfig` derives it from parameter names
(``model.layers.3.self_attn`` -> 3, also under PEFT's ``base_model.model.`` prefix).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from ...attention_layouts import MLAHeads
from ...param_groups import canonical_param_name
from ...qk_clip import QKClipConfig
from ...qk_clip.config import refuse_qk_norm

#: (query, key) projection child names of separate-projection attention, in the order tried.
SEPARATE_QK_NAMES = (("q_proj", "k_proj"), ("query", "key"))
MLA_Q_NAMES = ("q_b_proj", "q_proj")  # DeepSeek-V2/V3: q_b_proj after q_a_proj (q LoRA), else q_proj
MLA_K_NAMES = ("kv_b_proj",)


def layer_key(fqn: str) -> int | None:
    """The first integer component of a module or parameter name (QKClipConfig's layer key)."""
    return next((int(p) for p in canonical_param_name(fqn).split(".") if p.isdigit()), None)


def dispatches_attention(module: nn.Module) -> bool:
    """True when the module's class forward looks up transformers' attention registry."""
    forward = getattr(type(module), "forward", None)
    if forward is None:
        return False
    fn = inspect.unwrap(forward)
    code = getattr(fn, "__code__", None)
    return (code is not None and "get_interface" in code.co_names
            and "ALL_ATTENTION_FUNCTIONS" in getattr(fn, "__globals__", {}))


def attention_modules(model: nn.Module) -> list[tuple[str, int | None, nn.Module]]:
    """``(fqn, layer key, module)`` of every attention module that dispatches through transformers'
    registry (:func:`dispatches_attention`), in model order."""
    return [(fqn, layer_key(fqn), m) for fqn, m in model.named_modules() if dispatches_attention(m)]


def query_heads(module: nn.Module) -> int:
    """The number of query heads of an attention module (its config's ``num_attention_heads``)."""
    for owner, attr in ((module, "num_heads"), (getattr(module, "config", None), "num_attention_heads"),
                        (module, "num_attention_heads")):
        value = getattr(owner, attr, None) if owner is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ValueError(f"{type(module).__name__}: cannot tell its number of query heads (no num_heads, "
                     "config.num_attention_heads or num_attention_heads)")


@dataclass(frozen=True)
class HFAttentionLayout:
    """How one attention module projects its queries and keys (what QK-clip scales).

    ``kind``: ``"separate"`` (``q_name``/``k_name`` children, ``head_dim`` rows per head), ``"mla"``
    (DeepSeek-V2/V3 multi-head latent attention, ``mla``), or ``"unsupported"`` (``reason`` says why).
    ``qk_norm``: q and k are RMS-normalised per head after the projections (Qwen3's q_norm/k_norm).
    """

    fqn: str
    layer: int | None
    kind: str
    n_heads: int
    q_name: str | None = None
    k_name: str | None = None
    head_dim: int | None = None
    mla: MLAHeads | None = None
    qk_norm: bool = False
    reason: str = ""


def _child_weight(module: nn.Module, name: str):
    child = getattr(module, name, None)
    return getattr(child, "weight", None) if isinstance(child, nn.Module) else None


def attention_layout(fqn: str, layer: int | None, m: nn.Module) -> HFAttentionLayout:
    n_heads = query_heads(m)
    qk_norm = getattr(m, "q_norm", None) is not None or getattr(m, "k_norm", None) is not None
    if all(isinstance(getattr(m, a, None), int) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")) \
            and _child_weight(m, "kv_b_proj") is not None:
        q_name = next((q for q in MLA_Q_NAMES if _child_weight(m, q) is not None), None)
        mla = MLAHeads(int(m.qk_nope_head_dim), int(m.qk_rope_head_dim), int(m.v_head_dim))
        return HFAttentionLayout(fqn, layer, "mla", n_heads, q_name=q_name, k_name="kv_b_proj", mla=mla,
                                 qk_norm=qk_norm)
    for q_name, k_name in SEPARATE_QK_NAMES:
        q, k = _child_weight(m, q_name), _child_weight(m, k_name)
        if q is None or k is None:
            continue
        if not isinstance(getattr(m, q_name), nn.Linear) and not hasattr(getattr(m, q_name), "base_layer"):
            return HFAttentionLayout(fqn, layer, "unsupported", n_heads, reason=(
                f"its {q_name} is a {type(getattr(m, q_name)).__name__}, not an nn.Linear [out, in]"))
        if q.shape[0] % n_heads:
            return HFAttentionLayout(fqn, layer, "unsupported", n_heads, reason=(
                f"{q_name} has {q.shape[0]} rows, not a multiple of its {n_heads} heads"))
        return HFAttentionLayout(fqn, layer, "separate", n_heads, q_name=q_name, k_name=k_name,
                                 head_dim=q.shape[0] // n_heads, qk_norm=qk_norm)
    fused = [c for c in ("c_attn", "qkv_proj", "query_key_value", "Wqkv", "W_pack") if hasattr(m, c)]
    reason = (f"its query/key/value projection is fused ({fused[0]}); QK-clip on a Hugging Face fused "
              "projection needs its row layout, which is not known here" if fused
              else "it has no q_proj/k_proj (or query/key, or MLA q_b_proj/kv_b_proj) child")
    return HFAttentionLayout(fqn, layer, "unsupported", n_heads, reason=reason)


def attention_layouts(model: nn.Module) -> list[HFAttentionLayout]:
    return [attention_layout(fqn, layer, m) for fqn, layer, m in attention_modules(model)]


def qk_clip_config_for(model: nn.Module, threshold: float) -> QKClipConfig:
    """A :class:`~optimizer.QKClipConfig` for a Hugging Face model's attention, read from its modules.

    * separate q/k projections (Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, BERT's ``query``/``key``,
      ...): ``QKClipConfig(head_dim=..., q_patterns=("q_proj",), k_patterns=("k_proj",))``;
    * DeepSeek-V2/V3 multi-head latent attention: ``mla=MLAHeads(qk_nope_head_dim,
      qk_rope_head_dim, v_head_dim)`` with ``q_patterns=("q_b_proj", "q_proj")`` (``q_proj`` when
      ``q_lora_rank`` is None) and ``k_patterns=("kv_b_proj",)``. transformers' ``DeepseekV3Attention``
      views ``q_b_proj``'s output per head as ``[q_nope; q_rot]`` and ``kv_b_proj``'s as
      ``[k_nope; v]``: the layout ``MLAHeads`` assumes (tests check it by running the forward).

    Refused, with the reason: attention that RMS-normalises q and k per head after the projections
    (Qwen3, Qwen3-MoE: ``q_norm``/``k_norm`` undo any row scaling, so QK-clip would change nothing;
    QK-norm bounds the logits itself), fused or transposed projections (GPT-2's ``c_attn``),
    query/key weights that are not trained (frozen, e.g. under LoRA), layers without an integer
    in their name, and models mixing kinds.
    """
    layouts = attention_layouts(model)
    if not layouts:
        raise ValueError(
            f"qk_clip_config_for: {type(model).__name__} has no attention module that dispatches through "
            "transformers' ALL_ATTENTION_FUNCTIONS; build optimizer.QKClipConfig by hand"
        )
    bad = [f"'{a.fqn}': {a.reason}" for a in layouts if a.kind == "unsupported"]
    if bad:
        raise ValueError("qk_clip_config_for: QK-clip cannot be set up for " + "; ".join(bad[:3])
                         + ("; ..." if len(bad) > 3 else ""))
    refuse_qk_norm("qk_clip_config_for", [a.fqn for a in layouts if a.qk_norm], "train this model without qk_clip")
    no_layer = [a.fqn for a in layouts if a.layer is None]
    if no_layer:
        raise ValueError(f"qk_clip_config_for: attention modules {no_layer[:3]} have no integer component in their "
                         "name to key their layer by; pass QKClipConfig(classify=...) by hand")
    kinds = {a.kind for a in layouts}
    if len(kinds) != 1:
        raise ValueError(f"qk_clip_config_for: the model mixes attention kinds {sorted(kinds)}; build "
                         "QKClipConfig(classify=...) by hand")
    modules = dict((fqn, m) for fqn, _, m in attention_modules(model))
    frozen = []
    for a in layouts:
        for child in (a.q_name, a.k_name):
            w = _child_weight(modules[a.fqn], child)
            if w is None or not w.requires_grad:
                frozen.append(f"{a.fqn}.{child}")
    if frozen:
        raise ValueError(
            f"qk_clip_config_for: the query/key weights {frozen[:3]} are not trained (requires_grad=False, e.g. "
            "frozen under LoRA); QK-clip bounds the logits by scaling those weights, so it cannot act here"
        )
    if kinds == {"mla"}:
        mlas = {a.mla for a in layouts}
        if len(mlas) != 1:
            raise ValueError(f"qk_clip_config_for: the layers have different MLA head sizes {sorted(mlas, key=repr)}")
        return QKClipConfig(threshold=threshold, mla=mlas.pop(), q_patterns=MLA_Q_NAMES, k_patterns=MLA_K_NAMES)
    names = {(a.q_name, a.k_name) for a in layouts}
    dims = {a.head_dim for a in layouts}
    if len(names) != 1 or len(dims) != 1:
        raise ValueError(f"qk_clip_config_for: the layers differ in projection names {sorted(names)} or head_dim "
                         f"{sorted(dims)}; build QKClipConfig(classify=...) by hand")
    (q_name, k_name), = names
    return QKClipConfig(head_dim=dims.pop(), threshold=threshold, q_patterns=(q_name,), k_patterns=(k_name,))
