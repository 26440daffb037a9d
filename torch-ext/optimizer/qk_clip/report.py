"""What one step's QK-clip did, read from the device only when someone looks."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from .config import layer_sort_key

logger = logging.getLogger("optimizer.qk_clip")


class QKClipReport:
    """What one step's QK-clip did: per layer, how many query heads were clipped and the max logit.

    A step builds it from device tensors (:meth:`lazy`) without reading them; the first access to
    ``clipped_heads`` / ``max_logit`` (or ``format``, ``total_clipped``) copies them to the host
    once (one synchronisation, at the user's request).  Layers skipped because none of their
    weights had a gradient are in ``skipped_layers`` and not in the dicts.
    """

    def __init__(self, threshold: float, clipped_heads: dict | None = None, max_logit: dict | None = None,
                 skipped_layers: tuple = ()):
        self.threshold = float(threshold)
        self.skipped_layers = tuple(skipped_layers)
        self._pending = None
        self._clipped = dict(clipped_heads or {})
        self._max = dict(max_logit or {})

    @classmethod
    def lazy(cls, threshold: float, layers: Sequence, counts: Tensor, maxima: Tensor,
             skipped_layers: tuple = ()) -> QKClipReport:
        """A report whose values stay on the device until read (``counts``/``maxima`` per layer)."""
        report = cls(threshold, skipped_layers=skipped_layers)
        report._pending = (tuple(layers), counts, maxima)
        return report

    def _materialise(self) -> None:
        if self._pending is None:
            return
        layers, counts, maxima = self._pending
        values = torch.stack([counts.float(), maxima.float()]).tolist() if layers else [[], []]
        skipped = set(self.skipped_layers)
        for layer, n, m in zip(layers, values[0], values[1]):
            if layer not in skipped:
                self._clipped[layer] = int(n)
                self._max[layer] = float(m)
        self._pending = None

    @property
    def clipped_heads(self) -> dict:
        self._materialise()
        return self._clipped

    @property
    def max_logit(self) -> dict:
        self._materialise()
        return self._max

    @property
    def total_clipped(self) -> int:
        return sum(self.clipped_heads.values())

    @property
    def overall_max_logit(self) -> float | None:
        return max(self.max_logit.values()) if self.max_logit else None

    def format(self) -> str:
        layers = ", ".join(
            f"L{layer}:{n}" for layer, n in sorted(self.clipped_heads.items(), key=lambda kv: layer_sort_key(kv[0]))
            if n
        )
        top = self.overall_max_logit
        top_s = "n/a" if top is None else f"{top:.3g}"
        skipped = f" skipped (no gradient): {list(self.skipped_layers)}" if self.skipped_layers else ""
        return (
            f"qk_clip: {self.total_clipped} heads clipped (threshold {self.threshold:g}, "
            f"max logit {top_s})" + (f" [{layers}]" if layers else "") + skipped
        )

    def __repr__(self) -> str:
        state = "pending" if self._pending is not None else f"clipped_heads={self._clipped}, max_logit={self._max}"
        return f"QKClipReport(threshold={self.threshold:g}, {state}, skipped_layers={self.skipped_layers})"


def log_report(report: QKClipReport, step: int | None = None, level: int = logging.INFO) -> None:
    """Log one line for ``report`` on the ``optimizer.qk_clip`` logger."""
    if logger.isEnabledFor(level):
        prefix = f"step {step}: " if step is not None else ""
        logger.log(level, prefix + report.format())

