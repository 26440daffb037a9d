"""QK-clip per step, on the device: this step's scale table, each weight's local row slots, the scaling.

Everything here runs without host synchronisation: :func:`step_clip` checks ``qk_logits``
(``logits_checks.py``) and builds the step's scale table and a 0-d "some logit is NaN/+inf"
flag in a constant number of kernels (:func:`compute_clip_step`); :class:`ClipRowSlots` gives a
weight's local rows their table slots, once per placement; :func:`apply_clip_` scales a local
shard (one gather, one multiply).  The report keeps device tensors and reads them only when the
user asks.  The table's layout is in ``head_map.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .head_map import HeadMap
from .logits_checks import check_layer_gradients, check_step_logits, nonfinite_flag
from .report import QKClipReport


@dataclass(eq=False)
class ClipStep:
    """One step's QK-clip values, all on the device."""

    table: Tensor  # [head_map.table_size] float32 scale table
    nonfinite: Tensor  # 0-d bool: some logit is NaN or +inf (the caller agrees on it, then raises)
    flat_logits: Tensor  # [head_map.total_q] float32, the step's logits in head-map order (for agreement digests)
    report: QKClipReport


def step_clip(head_map: HeadMap | None, qk_logits, device: torch.device,
              has_grad: Mapping[str, bool]) -> tuple[ClipStep | None, list[str]]:
    """This step's QK-clip values (on the device, no host read), or the problems with ``qk_logits``
    (``has_grad``: which weights have a gradient this step, as the ranks agree on it)."""
    errors = check_step_logits(head_map, qk_logits, device)
    if errors or qk_logits is None or head_map is None:
        return None, errors
    errors, active = check_layer_gradients(head_map, has_grad)
    if errors:
        return None, errors
    skipped = [layer for layer in head_map.layers if layer not in active]
    return compute_clip_step(head_map, qk_logits, device, skipped_layers=skipped), []


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


def compute_clip_step(
    head_map: HeadMap,
    qk_logits: Mapping,
    device: torch.device | str,
    *,
    skipped_layers: Sequence = (),
) -> ClipStep:
    """The step's scale table, NaN/+inf flag and (lazy) report, from checked ``qk_logits``.

    A constant number of kernels whatever the number of layers, and no host synchronisation.
    Call :func:`~.logits_checks.check_step_logits` first.
    """
    kv_of_q, layer_of_q = head_map.device_tensors(device)
    flat = torch.cat([qk_logits[layer].detach().reshape(-1).float() for layer in head_map.layers]
                     or [torch.zeros(0, device=device)])
    g = gamma(flat, head_map.threshold)
    g_kv = torch.ones(head_map.total_kv, device=flat.device).scatter_reduce_(0, kv_of_q, g, "amin")
    table = torch.cat([g.sqrt(), g, g_kv.sqrt(), torch.ones(1, device=flat.device)])
    clipped = clipped_heads(flat, head_map.threshold).float()
    n_layers = len(head_map.layers)
    counts = torch.zeros(n_layers, device=flat.device).index_add_(0, layer_of_q, clipped)
    maxima = torch.full((n_layers,), float("-inf"), device=flat.device).scatter_reduce_(0, layer_of_q, flat, "amax")
    skipped = tuple(layer for layer in head_map.layers if layer in set(skipped_layers))
    report = QKClipReport.lazy(head_map.threshold, tuple(head_map.layers), counts, maxima, skipped_layers=skipped)
    return ClipStep(table=table, nonfinite=nonfinite_flag(flat), flat_logits=flat, report=report)


class ClipRowSlots:
    """Each clipped weight's table slots for this rank's rows, worked out once per placement (the
    step context keeps it: another placement is another context)."""

    def __init__(self, head_map: HeadMap):
        self.head_map = head_map
        self._index: dict[object, Tensor] = {}

    def rows(self, key, name: str, clip: ClipStep, local_rows: Callable[[], slice | Tensor],
             device: torch.device) -> tuple[Tensor, Tensor] | None:
        """(scale table, table slot of every local row) of weight ``name`` (None: not clipped);
        ``local_rows()``: the global rows of this rank's piece, asked the first time only."""
        rows = self.head_map.weights.get(name)
        if rows is None:
            return None
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = rows.local_index(local_rows(), device)
        return clip.table, index


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
