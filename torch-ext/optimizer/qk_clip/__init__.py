"""QK-clip (MuonClip): cap attention logits by scaling the query and key projections' rows.

- ``config``  what the user declares: :class:`QKClipConfig` and the name rules;
- ``plan``    the static plan: which rows of which weight belong to which head (built once);
- ``step``    per step, on the device: check the logits, build the scale table, scale rows;
- ``report``  what a step did (:class:`QKClipReport`), read from the device only when asked.
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
