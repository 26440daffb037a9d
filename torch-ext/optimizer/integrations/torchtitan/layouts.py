"""What a torchtitan model's attention looks like to QK-clip and split orthogonalisation.

Layer keys of FQNs (:func:`layer_key`), the attention modules of the model parts
(:func:`attention_modules`) and each one's query/key row layout (:func:`attention_layouts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from ...attention_layouts import FusedQKV, MLAHeads
from ...qk_clip import LayerKey, QKClipConfig, QKRole, classify_qk_param
from ._torchtitan import BaseAttention, FusedQKVLinear, canonical_fqn


def layer_key(fqn: str) -> LayerKey | None:
    """The QK-clip layer key of a parameter or module FQN of a torchtitan model.

    ``layers.3.attention.qkv_linear.wqkv.weight -> 3`` (an int, as ``qk_logits`` of the main
    layers are keyed); a block in another list keeps its list's name, so deepseek_v3's
    multi-token-prediction layer ``mtp_layers.0.attention.wq_b.weight -> "mtp_layers.0"`` does not
    collide with ``layers.0``. Wrapper segments (``_orig_mod``, ``_checkpoint_wrapped_module``,
    ``_fsdp_wrapped_module``) are ignored. None when no component is an integer.
    """
    parts = canonical_fqn(fqn).split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return int(part) if parts[:i] == ["layers"] else ".".join(parts[: i + 1])
    return None


@dataclass(frozen=True, eq=False)
class TorchtitanQKRoles:
    """``QKClipConfig.classify`` for torchtitan FQNs: roles by the name patterns, layers by :func:`layer_key`.

    A module-level class rather than a closure: picklable, with a readable repr.
    """

    patterns: QKClipConfig

    def __call__(self, name: str) -> QKRole | None:
        role = classify_qk_param(name, self.patterns)
        return None if role is None else (layer_key(name), role[1])


@dataclass(frozen=True)
class AttentionLayout:
    """How one torchtitan attention module lays out its query/key rows.

    ``kind`` is ``"separate"`` (``wq``/``wk``, ``head_dim`` rows per head), ``"fused"``
    (``FusedQKVLinear.wqkv``: ``fused`` holds its :class:`~optimizer.attention_layouts.FusedQKV`
    with torchtitan's ``"grouped"`` layout; None for another projection class with a ``wqkv``,
    whose row order is unknown) or ``"mla"`` (deepseek_v3 ``Attention``: ``mla``).
    ``fused_weight`` is the FQN of the fused weight (canonical, as param groups name it).
    ``qk_norm``: q and k are RMS-normalised per head after the projection (qwen3's
    ``q_norm``/``k_norm``), which undoes any scaling of the projection rows.
    """

    fqn: str
    layer: LayerKey | None
    kind: str
    n_heads: int
    n_kv_heads: int
    head_dim: int | None = None
    fused: FusedQKV | None = None
    fused_weight: str | None = None
    mla: MLAHeads | None = None
    qk_norm: bool = False


def attention_modules(model_parts: Sequence[nn.Module]):
    """Yield ``(fqn, layer key, module)`` for every torchtitan attention module (``BaseAttention``)
    of ``model_parts``, FQNs without wrapper segments."""
    for part in model_parts:
        for name, m in part.named_modules():
            if isinstance(m, BaseAttention):
                fqn = canonical_fqn(name)
                yield fqn, layer_key(fqn), m


def attention_layouts(model_parts: Sequence[nn.Module]) -> list[AttentionLayout]:
    """Every attention module (torchtitan ``BaseAttention``) of ``model_parts`` and its q/k layout.

    Read from the modules themselves (their ``n_heads``/``n_kv_heads``/``head_dim`` are the
    config's global values; tensor parallelism does not change them), so pipeline stages,
    whose parts have no model config, work too.

    torchtitan 0.3's ``FusedQKVLinear`` views ``wqkv``'s output as ``[..., n_kv_heads,
    n_heads // n_kv_heads + 2, head_dim]`` and splits the second-last dimension into the group's
    query heads, its key head and its value head: the ``"grouped"`` layout of
    :class:`~optimizer.attention_layouts.FusedQKV` (tests check it against that module's forward).
    Another projection class with a ``wqkv`` gets ``fused=None``: QK-clip and split
    orthogonalisation refuse it rather than guess its row order.
    """
    found = []
    for fqn, layer, m in attention_modules(model_parts):
        if all(hasattr(m, a) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "wkv_b")):
            found.append(AttentionLayout(
                fqn, layer, "mla", int(m.n_heads), int(m.n_heads),
                mla=MLAHeads(int(m.qk_nope_head_dim), int(m.qk_rope_head_dim), int(m.v_head_dim))))
            continue
        qk_norm = getattr(m, "q_norm", None) is not None or getattr(m, "k_norm", None) is not None
        qkv = getattr(m, "qkv_linear", None)
        if qkv is not None and hasattr(qkv, "wqkv"):
            n_heads, n_kv, head_dim = int(m.n_heads), int(m.n_kv_heads), int(m.head_dim)
            fused = FusedQKV(n_heads, n_kv, head_dim, "grouped") if isinstance(qkv, FusedQKVLinear) else None
            found.append(AttentionLayout(fqn, layer, "fused", n_heads, n_kv, head_dim, fused=fused,
                                         fused_weight=f"{fqn}.qkv_linear.wqkv.weight", qk_norm=qk_norm))
            continue
        head_dim = getattr(m, "head_dim", None)
        n_heads = getattr(m, "n_heads", None)
        if isinstance(head_dim, int) and isinstance(n_heads, int):
            n_kv = getattr(m, "n_kv_heads", None) or n_heads
            found.append(AttentionLayout(fqn, layer, "separate", n_heads, int(n_kv), head_dim, qk_norm=qk_norm))
    return found


def single(values: Iterable, what: str, hint: str):
    distinct = sorted(set(values), key=repr)
    if len(distinct) != 1:
        raise ValueError(
            f"MuonOptimizersContainer: the model's attention modules have {what} "
            f"{distinct or 'nowhere'}, not one value; {hint}"
        )
    return distinct[0]


def check_known_fused(layouts: Sequence[AttentionLayout], need: str) -> None:
    unknown = [a.fqn for a in layouts if a.kind == "fused" and a.fused is None]
    if unknown:
        raise ValueError(
            f"MuonOptimizersContainer: {unknown[:3]} project q/k/v with a fused `wqkv` that is not torchtitan's "
            f"FusedQKVLinear, whose row order ('grouped') is known here; {need}. Build optimizer.Muon with "
            "QKClipConfig(fused_qkv=FusedQKV(..., layout=...)) and muon_row_blocks by hand for such a model."
        )
