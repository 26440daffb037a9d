"""QK-clip (MuonClip, Kimi K2): cap attention logits by shrinking the query and key projections.

After an optimizer step, for every attention head whose largest pre-softmax logit in the last
forward pass exceeded ``threshold``, the rows of the weights that produce the head's query and
key are scaled so that the logit shrinks by ``gamma = threshold / max_logit``: ``sqrt(gamma)``
on each side for ordinary heads.  With grouped-query attention a key head serves several query
heads and takes the strongest clip of its group.  MLA (DeepSeek-V3, Kimi K2) and fused QKV
weights are described in ``attention_layouts.py``; the per-row rule is in ``head_map.py``.

This module holds the user-facing configuration: :class:`QKClipConfig`, its savable record and
the name rules that classify weights.  ``head_map.py`` turns a config and the parameters into a
head map, ``step.py`` does the per-step device math, ``report.py`` says what a step did.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..attention_layouts import FUSED_QKV_LAYOUTS, FusedQKV, MLAHeads

LayerKey = int | str
QKRole = tuple[LayerKey, str]  # (layer key, "q" | "k" | "qkv")
ROLES = ("q", "k", "qkv")

_SEPARATE_Q = ("q_proj", "wq")
_SEPARATE_K = ("k_proj", "wk")
_MLA_Q = ("wq", "wq_b", "q_proj", "q_b_proj")  # torchtitan deepseek_v3; Hugging Face DeepSeek-V2/V3
_MLA_K = ("wkv_b", "kv_b_proj")


def layer_sort_key(layer: LayerKey) -> tuple:
    """Deterministic order of layer keys that may mix ints and strings (ints first)."""
    return (0, layer, "") if isinstance(layer, int) else (1, 0, str(layer))


@dataclass
class QKClipConfig:
    """Which parameters are attention query/key projections, their layout, and the threshold.

    Three kinds of attention, one per config:

    * separate query and key weights (MHA / GQA): ``head_dim`` (rows per head);
      weights matched by ``q_patterns`` / ``k_patterns`` (default ``q_proj``/``wq``,
      ``k_proj``/``wk``).  Both get ``sqrt(gamma)`` per head.
    * fused ``wqkv`` weights: ``fused_qkv=FusedQKV(n_heads, n_kv_heads, head_dim, layout)``,
      matched by ``qkv_patterns`` (default ``wqkv``, ``qkv_proj``, ``query_key_value``); may be
      combined with separate weights in other layers.  Value rows are untouched.
    * MLA: ``mla=MLAHeads(qk_nope_head_dim, qk_rope_head_dim, v_head_dim)``; the query weight is
      ``wq``/``wq_b`` (``q_proj``/``q_b_proj`` in Hugging Face's DeepSeek-V2/V3) and the key weight
      ``wkv_b`` (``kv_b_proj``) (torchtitan deepseek_v3 and Hugging Face names, the defaults
      in this mode).  q_nope and k_nope rows get ``sqrt(gamma)``, q_pe rows ``gamma``, value rows
      and ``wkv_a`` (the shared rotary key) are untouched (Kimi K2's MuonClip).

    Args:
        head_dim: rows per head of separate q/k weights (defaults to ``fused_qkv.head_dim``;
            must be None with ``mla``).
        threshold: largest allowed attention logit (Kimi K2 uses 100), in the units of the
            logits passed to ``step(qk_logits=...)`` (normally including the softmax scale).
        q_patterns / k_patterns / qkv_patterns: dotted name components that mark a query / key /
            fused weight, e.g. ``"q_proj"`` matches ``model.layers.3.self_attn.q_proj.weight``.
            The layer key is the name's first integer component.
        classify: optional ``name -> (layer, "q" | "k" | "qkv") | None`` replacing the name rules;
            the layer may be an int or a str (e.g. ``"encoder.3"`` and ``"decoder.3"`` for two
            towers), and ``qk_logits`` is keyed the same way.
        fused_qkv: the layout of fused weights (:class:`~optimizer.attention_layouts.FusedQKV`).
        mla: MLA head sizes (:class:`~optimizer.attention_layouts.MLAHeads`).
    """

    head_dim: int | None = None
    threshold: float | None = None
    q_patterns: tuple[str, ...] | None = None
    k_patterns: tuple[str, ...] | None = None
    classify: Callable[[str], QKRole | None] | None = None
    qkv_patterns: tuple[str, ...] = ("wqkv", "qkv_proj", "query_key_value")
    fused_qkv: FusedQKV | None = None
    mla: MLAHeads | None = None

    def __post_init__(self):
        if self.fused_qkv is not None and not isinstance(self.fused_qkv, FusedQKV):
            raise ValueError(
                f"QKClipConfig.fused_qkv must be an optimizer.attention_layouts.FusedQKV, got {self.fused_qkv!r}"
            )
        if self.mla is not None and not isinstance(self.mla, MLAHeads):
            raise ValueError(f"QKClipConfig.mla must be an optimizer.attention_layouts.MLAHeads, got {self.mla!r}")
        if self.mla is not None:
            if self.head_dim is not None or self.fused_qkv is not None:
                raise ValueError(
                    "QKClipConfig: with mla=MLAHeads(...) the head sizes come from mla; leave head_dim and "
                    "fused_qkv unset (MLA models have no separate-head or fused qkv weights)"
                )
        elif self.head_dim is None and self.fused_qkv is not None:
            self.head_dim = self.fused_qkv.head_dim
        if self.mla is None and (
            isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim <= 0
        ):
            raise ValueError(
                f"QKClipConfig.head_dim must be a positive int (rows per attention head), got {self.head_dim!r}; "
                "for MLA attention pass mla=MLAHeads(...) instead"
            )
        if self.threshold is None:
            raise ValueError("QKClipConfig.threshold is required: the largest allowed attention logit (e.g. 100)")
        try:
            threshold = float(self.threshold)
        except (TypeError, ValueError):
            raise ValueError(
                f"QKClipConfig.threshold must be a positive number, got {self.threshold!r}"
            ) from None
        if not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"QKClipConfig.threshold must be positive and finite, got {self.threshold!r}")
        self.threshold = threshold
        mla = self.mla is not None
        self.q_patterns = _as_patterns(
            self.q_patterns if self.q_patterns is not None else (_MLA_Q if mla else _SEPARATE_Q), "q_patterns")
        self.k_patterns = _as_patterns(
            self.k_patterns if self.k_patterns is not None else (_MLA_K if mla else _SEPARATE_K), "k_patterns")
        self.qkv_patterns = _as_patterns(self.qkv_patterns, "qkv_patterns")
        for a, b in (("q_patterns", "k_patterns"), ("q_patterns", "qkv_patterns"), ("k_patterns", "qkv_patterns")):
            both = set(getattr(self, a)) & set(getattr(self, b))
            if both:
                raise ValueError(
                    f"QKClipConfig: {sorted(both)} appear in both {a} and {b}; "
                    "a weight must be one of a query, a key or a fused qkv projection"
                )
        if self.classify is not None and not callable(self.classify):
            raise ValueError(
                f"QKClipConfig.classify must be a callable name -> (layer, 'q'|'k'|'qkv') | None, "
                f"got {self.classify!r}"
            )


def _as_patterns(value, what: str) -> tuple[str, ...]:
    if isinstance(value, str):  # a lone string would otherwise iterate as characters
        value = (value,)
    try:
        patterns = tuple(value)
    except TypeError:
        raise ValueError(f"QKClipConfig.{what} must be a sequence of strings, got {value!r}") from None
    if not patterns or not all(isinstance(p, str) and p and "." not in p for p in patterns):
        raise ValueError(
            f"QKClipConfig.{what} must be non-empty strings without dots (one name component "
            f"each, e.g. 'q_proj'), got {value!r}"
        )
    return patterns


def config_record(cfg: QKClipConfig | None) -> dict:
    """The savable part of a config, with the same keys whether QK-clip is on or off.

    Only plain values (floats, ints, strs, tuples), so torch.distributed.checkpoint can match
    keys; ``classify`` is a callable and cannot be saved (``custom_classify`` records its use).
    """
    if cfg is None:
        return {"threshold": None, "head_dim": None, "q_patterns": (), "k_patterns": (), "custom_classify": False,
                "qkv_patterns": (), "fused_qkv": (), "mla": ()}
    fused, mla = cfg.fused_qkv, cfg.mla
    return {
        "threshold": float(cfg.threshold),
        "head_dim": None if cfg.head_dim is None else int(cfg.head_dim),
        "q_patterns": tuple(cfg.q_patterns),
        "k_patterns": tuple(cfg.k_patterns),
        "custom_classify": cfg.classify is not None,
        "qkv_patterns": tuple(cfg.qkv_patterns),
        "fused_qkv": () if fused is None else (fused.n_heads, fused.n_kv_heads, fused.head_dim, fused.layout),
        "mla": () if mla is None else (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim),
    }


def config_from_record(record: Mapping, classify: Callable | None = None) -> QKClipConfig | None:
    """Inverse of :func:`config_record` (``classify`` from the live config; None if QK-clip was off).

    Records written before ``qkv_patterns`` / ``fused_qkv`` / ``mla`` existed load with their
    defaults (separate q/k weights).
    """
    if record.get("threshold") is None:
        return None
    fused = tuple(record.get("fused_qkv") or ())
    mla = tuple(record.get("mla") or ())
    kwargs = {}
    if record.get("qkv_patterns"):
        kwargs["qkv_patterns"] = tuple(record["qkv_patterns"])
    if fused and fused[3] not in FUSED_QKV_LAYOUTS:
        raise ValueError(f"QK-clip record: unknown fused_qkv layout {fused[3]!r}")
    return QKClipConfig(
        head_dim=record.get("head_dim"),
        threshold=record["threshold"],
        q_patterns=tuple(record["q_patterns"]) or None,
        k_patterns=tuple(record["k_patterns"]) or None,
        classify=classify,
        fused_qkv=FusedQKV(*fused) if fused else None,
        mla=MLAHeads(*mla) if mla else None,
        **kwargs,
    )


def classify_qk_param(name: str, cfg: QKClipConfig) -> QKRole | None:
    """``(layer, "q" | "k" | "qkv")`` for a query / key / fused weight, else ``None``.

    Default rule: the name ends in ``.weight``, one of its dotted components equals a qkv, q or k
    pattern (checked in that order), and the layer is the first integer component
    (``model.layers.3.self_attn.q_proj.weight -> (3, "q")``). ``cfg.classify`` replaces the rule.
    """
    if cfg.classify is not None:
        role = cfg.classify(name)
        if role is None:
            return None
        ok = (
            isinstance(role, tuple)
            and len(role) == 2
            and isinstance(role[0], (int, str))
            and not isinstance(role[0], bool)
            and role[1] in ROLES
        )
        if not ok:
            raise ValueError(
                f"QKClipConfig.classify({name!r}) returned {role!r}; it must return None or "
                "(layer: int | str, 'q' | 'k' | 'qkv')"
            )
        return role
    parts = name.split(".")
    if len(parts) < 2 or parts[-1] != "weight":
        return None
    kind = None
    for candidate, patterns in (("qkv", cfg.qkv_patterns), ("q", cfg.q_patterns), ("k", cfg.k_patterns)):
        if any(p in patterns for p in parts[:-1]):
            kind = candidate
            break
    if kind is None:
        return None
    layer = next((int(p) for p in parts if p.isdigit()), None)
    if layer is None:
        raise ValueError(
            f"QK-clip: {name!r} looks like a {kind} projection but its name has no integer "
            "component to use as the layer index; pass QKClipConfig(classify=...) returning "
            "(layer, 'q' | 'k' | 'qkv') or None for each parameter name"
        )
    return (layer, kind)


def refuse_qk_norm(caller: str, normed: Sequence[str], advice: str) -> None:
    """Raise if any attention module in ``normed`` (their names) RMS-normalises q and k per head
    after the projections: that undoes any scaling of the projections' rows, so QK-clip would
    change nothing (QK-norm bounds the logits itself). ``caller`` prefixes the message,
    ``advice`` ends it with what to do in the caller's terms."""
    if normed:
        more = " ..." if len(normed) > 3 else ""
        raise ValueError(
            f"{caller}: QK-clip scales the rows of the query/key projections, but {list(normed[:3])}{more} "
            "RMS-normalise q and k per head after them (q_norm/k_norm, as Qwen3 does), which undoes that "
            f"scaling: QK-clip would change nothing. QK-norm bounds the logits itself; {advice}."
        )
