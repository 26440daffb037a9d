"""QK-clip (MuonClip): cap attention logits by scaling the query and key projections' rows.

- ``config``        what the user declares: :class:`QKClipConfig` and the name rules;
- ``head_map``      which rows of which weight belong to which head, and their scale-table slots (built once);
- ``logits_checks`` one step's ``qk_logits`` checked before the ranks agree, and after;
- ``step``          per step, on the device: the scale table, each weight's local row slots, the scaling;
- ``report``        what a step did (:class:`QKClipReport`), read from the device only when asked.
"""

from .config import LayerKey, QKClipConfig, QKRole, classify_qk_param, config_from_record, config_record, \
    layer_sort_key
from .report import QKClipReport, log_report

__all__ = [
    "LayerKey",
    "QKClipConfig",
    "QKClipReport",
    "QKRole",
    "classify_qk_param",
    "config_from_record",
    "config_record",
    "layer_sort_key",
    "log_report",
]
