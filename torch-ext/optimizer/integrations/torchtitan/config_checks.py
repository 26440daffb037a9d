"""The checks of ``MuonOptimizersContainer.Config``: each bad value refused with a message that
names the field and what to do, before the container builds anything."""

from __future__ import annotations

from typing import Any

import torch

# Names a Config may give a dtype by (torchtitan's configs are plain strings).
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

FUSED_QKV_ORTHOGONALIZATION = ("split", "per_head", "whole")


def check_config(config: Any) -> None:
    """Refuse a ``MuonOptimizersContainer.Config`` whose values cannot work, before anything is built."""
    if config.implementation != "auto":
        raise ValueError(
            f"MuonOptimizersContainer: implementation={config.implementation!r} is not used by Muon, which "
            "picks AdamW's kernel itself (fused on CUDA, foreach elsewhere); leave it at 'auto'."
        )
    if config.compute_dtype is not None and config.compute_dtype not in DTYPES:
        raise ValueError(
            f"MuonOptimizersContainer: compute_dtype must be one of {sorted(DTYPES)} or None, "
            f"got {config.compute_dtype!r}"
        )
    if config.fused_qkv_orthogonalization not in FUSED_QKV_ORTHOGONALIZATION:
        raise ValueError(
            "MuonOptimizersContainer: fused_qkv_orthogonalization must be one of "
            f"{FUSED_QKV_ORTHOGONALIZATION}, got {config.fused_qkv_orthogonalization!r}"
        )
    every = config.record_max_logits_every
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(
            f"MuonOptimizersContainer: record_max_logits_every must be a positive int (record every N-th "
            f"step) or None, got {every!r}"
        )
    if config.record_max_logits_dtype not in ("float32", "bfloat16"):
        raise ValueError(
            "MuonOptimizersContainer: record_max_logits_dtype must be 'float32' or 'bfloat16', got "
            f"{config.record_max_logits_dtype!r}"
        )
    if config.qk_clip_threshold is None:
        for name in ("qk_logits_fn", "record_max_logits_every"):
            if getattr(config, name) is not None:
                raise ValueError(
                    f"MuonOptimizersContainer: {name} is set but qk_clip_threshold is None; set the threshold "
                    f"to enable QK-clip, or drop {name}."
                )
    if config.qk_logits_fn is not None and every is not None:
        raise ValueError(
            "MuonOptimizersContainer: qk_logits_fn and record_max_logits_every are both set; QK-clip takes "
            "its logits from one source: keep one of them."
        )
