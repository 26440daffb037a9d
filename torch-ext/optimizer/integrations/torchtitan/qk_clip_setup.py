"""What the container sets up for QK-clip and fused weights from the model's attention modules:
the QKClipConfig, the row blocks of fused ``wqkv`` weights, the layers each model part clips, and
the logits source named in the config."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Any

from ...qk_clip import QKClipConfig
from ...qk_clip.config import refuse_qk_norm
from ...row_blocks import SplitQKV
from .layouts import AttentionLayout, TorchtitanQKRoles, check_known_fused, single


def qk_clip_config(config: Any, layouts: Sequence[AttentionLayout]) -> QKClipConfig | None:
    """The QKClipConfig for the model's attention layouts (separate q/k, fused ``wqkv`` or MLA, read from
    its attention modules), or None when ``config.qk_clip_threshold`` is None."""
    if config.qk_clip_threshold is None:
        return None
    refuse_qk_norm("MuonOptimizersContainer", [a.fqn for a in layouts if a.qk_norm],
                   "leave qk_clip_threshold unset for this model")
    kinds = {a.kind for a in layouts}
    patterns = dict(q_patterns=config.qk_clip_q_patterns, k_patterns=config.qk_clip_k_patterns)
    if "mla" in kinds:
        if kinds != {"mla"}:
            raise ValueError(
                "MuonOptimizersContainer: the model mixes multi-head latent attention with other attention "
                f"({sorted(kinds)}); one QK-clip config describes one kind. Build optimizer.Muon with "
                "QKClipConfig(classify=...) by hand for such a model."
            )
        if config.qk_clip_head_dim is not None:
            raise ValueError(
                "MuonOptimizersContainer: qk_clip_head_dim is set, but the model uses multi-head latent "
                "attention, whose head sizes are read from its attention modules; leave it None."
            )
        mla = single((a.mla for a in layouts), "MLA head sizes", "QK-clip needs one MLAHeads for every layer.")
        base = QKClipConfig(threshold=config.qk_clip_threshold, mla=mla, **patterns)
    else:
        fused = None
        if "fused" in kinds:
            check_known_fused(layouts, "QK-clip needs the row order of q and k")
            fused = single((a.fused for a in layouts if a.kind == "fused"), "fused wqkv layouts",
                            "QK-clip needs one FusedQKV for every fused layer.")
        head_dim = config.qk_clip_head_dim
        if head_dim is None and "separate" in kinds:
            head_dim = single((a.head_dim for a in layouts if a.kind == "separate"), "head_dim",
                               "set qk_clip_head_dim.")
        elif head_dim is None and fused is None:
            raise ValueError(
                "MuonOptimizersContainer: set qk_clip_head_dim; the model parts have no torchtitan attention "
                "module to read it from."
            )
        base = QKClipConfig(head_dim=head_dim, threshold=config.qk_clip_threshold, fused_qkv=fused, **patterns)
    return dataclasses.replace(base, classify=TorchtitanQKRoles(base))


def fused_row_blocks(mode: str, layouts: Sequence[AttentionLayout]) -> dict[str, Any]:
    """``{fused weight FQN: row-block spec}`` for Muon's ``muon_row_blocks`` (empty for "whole")."""
    if mode == "whole":
        return {}
    check_known_fused(layouts, f"fused_qkv_orthogonalization={mode!r} needs the row order of q, k and v "
                                "(or set it to 'whole')")
    return {a.fused_weight: a.fused if mode == "split" else SplitQKV(a.fused, per_head=True)
            for a in layouts if a.kind == "fused"}


def layers_with_q(qk_clip: QKClipConfig | None, groups: Sequence[dict]) -> set:
    """Layers with a query, key or fused weight among ``groups``' parameters.

    That every such layer has both its query and its key weight, in Muon groups, is checked
    by Muon itself when it is built (one error naming the weights).
    """
    if qk_clip is None:
        return set()
    return {role[0] for group in groups for name in group["param_names"]
            for role in [qk_clip.classify(name)] if role is not None}



def resolve_callable(spec: str) -> Callable:
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"qk_logits_fn must be 'package.module:function', got {spec!r}")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"qk_logits_fn {spec!r} is not callable")
    return fn
