"""QK-clip per step, on the device: check the logits, build the scale table, scale rows.

Everything here runs without host synchronisation: :func:`check_step_logits` checks
``qk_logits``' metadata (keys, shapes, dtypes, devices) and returns messages instead of raising,
so the caller can agree across ranks first; :func:`compute_clip_step` builds the step's scale
table and a 0-d "some logit is NaN/+inf" flag in a constant number of kernels; :func:`apply_clip_`
scales a local shard (one gather, one multiply).  The report keeps device tensors and reads them
only when the user asks.  The table's layout is in ``plan.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import layer_sort_key
from .plan import QKClipPlan
from .report import QKClipReport


def check_step_logits(plan: QKClipPlan | None, qk_logits, device: torch.device | str | None) -> list[str]:
    """Problems with one step's ``qk_logits`` (metadata only: no host synchronisation).

    Returns messages instead of raising, so the caller can agree across ranks first.  Checks:
    a mapping; keys are int/str layer keys; exactly the plan's layers (a layer left out would
    silently go unclipped); per layer a floating 1-D tensor with one value per query head, on
    ``device`` (the device of the weights it clips; None skips that check).
    """
    if qk_logits is None:
        return []
    if plan is None:
        return ["Muon.step: qk_logits was passed but QK-clip is not configured; pass "
                "qk_clip=QKClipConfig(...) to Muon, or stop passing qk_logits."]
    if not isinstance(qk_logits, Mapping):
        return [f"Muon.step: qk_logits must be a dict {{layer: 1-D tensor of per-query-head max logits}}, "
                f"got {type(qk_logits).__name__}"]
    errors = []
    bad_keys = [k for k in qk_logits if isinstance(k, bool) or not isinstance(k, (int, str))]
    if bad_keys:
        return [f"Muon.step: qk_logits keys must be int or str layer keys (as in 'layers.3.' -> 3), got {bad_keys!r}"]
    extra = [k for k in qk_logits if k not in plan.layers]
    missing = [k for k in plan.layers if k not in qk_logits]
    if extra:
        errors.append(
            f"Muon.step: qk_logits has layers {sorted(extra, key=layer_sort_key)} that QK-clip does not know; its "
            f"layers are {list(plan.layers)} ({plan.describe()}). Pass logits only for those layers, or adjust "
            "QKClipConfig patterns/classify."
        )
    if missing:
        errors.append(
            f"Muon.step: qk_logits has no entry for layers {missing}, which would go unclipped; pass every "
            f"layer's per-head max logits ({len(plan.layers)} layers), or leave a layer out of QK-clip with "
            "QKClipConfig.classify returning None for its weights."
        )
    want_device = None if device is None else torch.device(device)
    for layer, heads in plan.layers.items():
        if layer not in qk_logits:
            continue
        t = qk_logits[layer]
        where = f"qk_logits[{layer!r}] (for {', '.join(repr(w) for w in heads.weights)})"
        if not isinstance(t, Tensor):
            errors.append(f"Muon.step: {where} must be a 1-D tensor of {heads.n_q_heads} per-query-head max "
                          f"logits, got {type(t).__name__}")
            continue
        if t.ndim != 1 or t.numel() != heads.n_q_heads:
            errors.append(
                f"Muon.step: {where} has shape {tuple(t.shape)}, but the layer has {heads.n_q_heads} query heads; "
                f"pass a 1-D tensor of length {heads.n_q_heads}, each query head's max attention logit (max over "
                "batch and positions, max-reduced over data-parallel ranks and gathered over tensor-parallel "
                "ranks: optimizer.max_logits.gather_max_logits)."
            )
            continue
        if not t.is_floating_point():
            errors.append(f"Muon.step: {where} has dtype {t.dtype}; pass floating-point logits")
        elif t.device.type == "meta":
            errors.append(f"Muon.step: {where} is on the meta device and holds no values; pass the logits "
                          "computed in the forward pass")
        elif want_device is not None and not _same_device(t.device, want_device):
            errors.append(f"Muon.step: {where} is on {t.device} but the weights it clips are on {want_device}; "
                          "keep the logits on the weights' device (moving them would synchronise the host)")
    return errors


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_layer_gradients(plan: QKClipPlan, has_grad: Mapping[str, bool]) -> tuple[list[str], tuple]:
    """Which layers to clip this step, given which clipped weights have a gradient.

    Rule: a layer is clipped when every one of its clipped weights has a gradient; a layer none of
    whose weights has a gradient is skipped (it was not trained this step, like any parameter
    without a gradient, and is listed in the report's ``skipped_layers``); a layer where some do
    and some do not is an error, because scaling one side of the logit would not bound it (a
    frozen ``wq`` with a trained ``wk``: freeze or train both, or leave the layer out of QK-clip).
    Returns ``(errors, active_layers)``.  ``has_grad`` must be agreed across ranks.
    """
    errors, active = [], []
    for layer, heads in plan.layers.items():
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


@dataclass(eq=False)
class ClipStep:
    """One step's QK-clip values, all on the device."""

    table: Tensor  # [plan.table_size] float32 scale table
    nonfinite: Tensor  # 0-d bool: some logit is NaN or +inf (the caller agrees on it, then raises)
    flat_logits: Tensor  # [plan.total_q] float32, the step's logits in plan order (for agreement digests)
    report: QKClipReport


def gamma(logits: Tensor, threshold: float) -> Tensor:
    """``min(1, threshold / logit)`` per head, never NaN/inf: heads at or under the threshold, and
    NaN / +inf logits (which the caller reports as errors), get 1; ``logit <= 0`` and ``-inf``
    (nothing attended) are under any positive threshold."""
    logits = logits.float()
    over = clipped_heads(logits, threshold)
    return torch.where(over, threshold / torch.where(over, logits, threshold), 1.0)


def clipped_heads(logits: Tensor, threshold: float) -> Tensor:
    """Bool per head: the head is clipped (a finite logit over the threshold)."""
    return (logits > threshold) & torch.isfinite(logits)


def nonfinite_flag(logits: Tensor) -> Tensor:
    """0-d bool device tensor: some logit is NaN or +inf (``-inf`` means nothing was attended: fine)."""
    return (torch.isnan(logits) | torch.isposinf(logits)).any()


def compute_clip_step(
    plan: QKClipPlan,
    qk_logits: Mapping,
    device: torch.device | str,
    *,
    skipped_layers: Sequence = (),
) -> ClipStep:
    """The step's scale table, NaN/+inf flag and (lazy) report, from checked ``qk_logits``.

    A constant number of kernels whatever the number of layers, and no host synchronisation.
    Call :func:`check_step_logits` first.
    """
    kv_of_q, layer_of_q = plan.device_tensors(device)
    flat = torch.cat([qk_logits[layer].detach().reshape(-1).float() for layer in plan.layers]
                     or [torch.zeros(0, device=device)])
    g = gamma(flat, plan.threshold)
    g_kv = torch.ones(plan.total_kv, device=flat.device).scatter_reduce_(0, kv_of_q, g, "amin")
    table = torch.cat([g.sqrt(), g, g_kv.sqrt(), torch.ones(1, device=flat.device)])
    clipped = clipped_heads(flat, plan.threshold).float()
    n_layers = len(plan.layers)
    counts = torch.zeros(n_layers, device=flat.device).index_add_(0, layer_of_q, clipped)
    maxima = torch.full((n_layers,), float("-inf"), device=flat.device).scatter_reduce_(0, layer_of_q, flat, "amax")
    skipped = tuple(layer for layer in plan.layers if layer in set(skipped_layers))
    report = QKClipReport.lazy(plan.threshold, tuple(plan.layers), counts, maxima, skipped_layers=skipped)
    return ClipStep(table=table, nonfinite=nonfinite_flag(flat), flat_logits=flat, report=report)


def apply_clip_(local_weight: Tensor, table: Tensor, local_index: Tensor) -> None:
    """Scale a weight's local rows in place: ``local_weight[i] *= table[local_index[i]]``.

    ``local_index`` from :meth:`ClipRows.local_index` (on the weight's device).  Two kernels; the
    product is computed in float32 and rounded once to the weight's dtype.  Rows whose slot is the
    table's ``1`` are bit-identical afterwards.
    """
    if local_weight.shape[0] != local_index.numel():
        raise ValueError(
            f"apply_clip_: {local_index.numel()} row slots for a local weight with {local_weight.shape[0]} rows"
        )
    if local_index.numel() == 0:
        return
    local_weight.mul_(table[local_index].view(-1, *([1] * (local_weight.ndim - 1))))


def describe_nonfinite(qk_logits: Mapping) -> str:
    """The error for NaN/+inf logits, naming the layers (reads the logits: call only to raise)."""
    bad = [layer for layer, t in qk_logits.items()
           if isinstance(t, Tensor) and bool(nonfinite_flag(t))]
    where = f"qk_logits{bad}" if bad else "qk_logits on another rank"
    return (f"Muon.step: {where} contain NaN or +inf; the forward pass diverged or the max was taken over "
            "uninitialised values. Pass finite per-head max logits (-inf, nothing attended, is fine).")
