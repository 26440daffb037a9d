"""QK-clip's checks of one step's ``qk_logits``, before and after the ranks agree (no host reads).

Before: :func:`check_step_logits` checks ``qk_logits``' metadata (keys, shapes, dtypes, devices)
against the head map and :func:`check_layer_gradients` which layers can be clipped; both return
messages instead of raising, so the caller can agree across ranks first.  After:
:func:`check_agreed_logits` raises the same error on every rank when the ranks passed different
logits, or some logit is NaN or +inf.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .config import layer_sort_key
from .head_map import HeadMap, LayerHeads


def check_step_logits(head_map: HeadMap | None, qk_logits, device: torch.device | str | None) -> list[str]:
    """Problems with one step's ``qk_logits`` (metadata only: no host synchronisation).

    Checks: a mapping; keys are int/str layer keys; exactly the head map's layers (a layer left
    out would silently go unclipped); per layer a floating 1-D tensor with one value per query
    head, on ``device`` (the device of the weights it clips; None skips that check).
    """
    if qk_logits is None:
        return []
    if head_map is None:
        return ["Muon.step: qk_logits was passed but QK-clip is not configured; pass "
                "qk_clip=QKClipConfig(...) to Muon, or stop passing qk_logits."]
    if not isinstance(qk_logits, Mapping):
        return [f"Muon.step: qk_logits must be a dict {{layer: 1-D tensor of per-query-head max logits}}, "
                f"got {type(qk_logits).__name__}"]
    bad_keys = [k for k in qk_logits if isinstance(k, bool) or not isinstance(k, (int, str))]
    if bad_keys:
        return [f"Muon.step: qk_logits keys must be int or str layer keys (as in 'layers.3.' -> 3), got {bad_keys!r}"]
    errors = _layer_key_problems(head_map, qk_logits)
    want_device = None if device is None else torch.device(device)
    for layer, heads in head_map.layers.items():
        if layer in qk_logits:
            problem = _layer_logits_problem(layer, heads, qk_logits[layer], want_device)
            if problem:
                errors.append(problem)
    return errors


def _layer_key_problems(head_map: HeadMap, qk_logits: Mapping) -> list[str]:
    """Layers QK-clip does not know, and layers it knows that the logits leave out."""
    errors = []
    extra = [k for k in qk_logits if k not in head_map.layers]
    missing = [k for k in head_map.layers if k not in qk_logits]
    if extra:
        errors.append(
            f"Muon.step: qk_logits has layers {sorted(extra, key=layer_sort_key)} that QK-clip does not know; its "
            f"layers are {list(head_map.layers)} ({head_map.describe()}). Pass logits only for those layers, or adjust "
            "QKClipConfig patterns/classify."
        )
    if missing:
        errors.append(
            f"Muon.step: qk_logits has no entry for layers {missing}, which would go unclipped; pass every "
            f"layer's per-head max logits ({len(head_map.layers)} layers), or leave a layer out of QK-clip with "
            "QKClipConfig.classify returning None for its weights."
        )
    return errors


def _layer_logits_problem(layer, heads: LayerHeads, t, want_device: torch.device | None) -> str | None:
    """What is wrong with one layer's logits ``t``, or None."""
    where = f"qk_logits[{layer!r}] (for {', '.join(repr(w) for w in heads.weights)})"
    if not isinstance(t, Tensor):
        return (f"Muon.step: {where} must be a 1-D tensor of {heads.n_q_heads} per-query-head max "
                f"logits, got {type(t).__name__}")
    if t.ndim != 1 or t.numel() != heads.n_q_heads:
        return (
            f"Muon.step: {where} has shape {tuple(t.shape)}, but the layer has {heads.n_q_heads} query heads; "
            f"pass a 1-D tensor of length {heads.n_q_heads}, each query head's max attention logit (max over "
            "batch and positions, max-reduced over data-parallel ranks and gathered over tensor-parallel "
            "ranks: optimizer.max_logits.gather_max_logits)."
        )
    if not t.is_floating_point():
        return f"Muon.step: {where} has dtype {t.dtype}; pass floating-point logits"
    if t.device.type == "meta":
        return (f"Muon.step: {where} is on the meta device and holds no values; pass the logits "
                "computed in the forward pass")
    if want_device is not None and not _same_device(t.device, want_device):
        return (f"Muon.step: {where} is on {t.device} but the weights it clips are on {want_device}; "
                "keep the logits on the weights' device (moving them would synchronise the host)")
    return None


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_layer_gradients(head_map: HeadMap, has_grad: Mapping[str, bool]) -> tuple[list[str], tuple]:
    """Which layers to clip this step, given which clipped weights have a gradient.

    Rule: a layer is clipped when every one of its clipped weights has a gradient; a layer none of
    whose weights has a gradient is skipped (it was not trained this step, like any parameter
    without a gradient, and is listed in the report's ``skipped_layers``); a layer where some do
    and some do not is an error, because scaling one side of the logit would not bound it (a
    frozen ``wq`` with a trained ``wk``: freeze or train both, or leave the layer out of QK-clip).
    Returns ``(errors, active_layers)``.  ``has_grad`` must be agreed across ranks.
    """
    errors, active = [], []
    for layer, heads in head_map.layers.items():
        flags = {w: bool(has_grad.get(w, False)) for w in heads.weights}
        if all(flags.values()):
            active.append(layer)
        elif any(flags.values()):
            with_grad = [w for w, f in flags.items() if f]
            without = [w for w, f in flags.items() if not f]
            errors.append(
                f"Muon.step: QK-clip must scale layer {layer!r}'s query and key weights together, but {without} "
                f"have no gradient this step while {with_grad} do. Give both a gradient (use them in the forward, "
                "or zero_grad(set_to_none=False)), freeze both, or leave the layer out of QK-clip via "
                "QKClipConfig.classify."
            )
    return errors, tuple(active)


def check_agreed_logits(passed: int, ranks: int, same_everywhere: bool, nonfinite: int, qk_logits) -> None:
    """After the ranks agree: raise the same error on every rank when ``qk_logits`` was passed on
    ``passed`` of ``ranks`` ranks only, differs between ranks, or holds NaN/+inf on ``nonfinite``."""
    if 0 < passed < ranks:
        raise RuntimeError(
            f"Muon.step: qk_logits was passed on {passed} of {ranks} ranks and None on the others; "
            "pass the same qk_logits on every rank (reduce them over the data-parallel ranks first)."
        )
    if not same_everywhere:
        raise RuntimeError(
            "Muon.step: qk_logits differ between ranks; every rank must pass the same per-head max "
            "logits (optimizer.max_logits.gather_max_logits max-reduces over data-parallel ranks and "
            "gathers over tensor-parallel ranks)."
        )
    if nonfinite:
        raise ValueError(describe_nonfinite(qk_logits))  # every rank: they all pass the same logits


def nonfinite_flag(logits: Tensor) -> Tensor:
    """0-d bool device tensor: some logit is NaN or +inf (``-inf`` means nothing was attended: fine)."""
    return (torch.isnan(logits) | torch.isposinf(logits)).any()


def describe_nonfinite(qk_logits: Mapping) -> str:
    """The error for NaN/+inf logits, naming the layers (reads the logits: call only to raise)."""
    bad = [layer for layer, t in qk_logits.items()
           if isinstance(t, Tensor) and bool(nonfinite_flag(t))]
    where = f"qk_logits{bad}" if bad else "qk_logits on another rank"
    return (f"Muon.step: {where} contain NaN or +inf; the forward pass diverged or the max was taken over "
            "uninitialised values. Pass finite per-head max logits (-inf, nothing attended, is fine).")
