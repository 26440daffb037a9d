"""QK-clip: configuration, name classification and the report (the per-row rule and the per-step
math are tested in test_qk_clip_head_map.py, test_qk_clip_mla.py and test_qk_clip_fused.py)."""

import logging

import pytest
import torch

from optimizer.qk_clip import QKClipConfig, QKClipReport, classify_qk_param, log_report

THRESHOLD = 50.0


# ---------------------------------------------------------------- config and classification


def test_classify_default_names():
    cfg = QKClipConfig(head_dim=8, threshold=100.0)
    assert classify_qk_param("model.layers.3.self_attn.q_proj.weight", cfg) == (3, "q")
    assert classify_qk_param("model.layers.12.self_attn.k_proj.weight", cfg) == (12, "k")
    assert classify_qk_param("layers.0.attention.wq.weight", cfg) == (0, "q")
    assert classify_qk_param("layers.5.attention.wk.weight", cfg) == (5, "k")
    # FSDP / compile wrappers add non-integer components only
    assert classify_qk_param("_orig_mod.layers.2._fsdp_wrapped_module.attn.q_proj.weight", cfg) == (2, "q")
    # not q/k weights
    assert classify_qk_param("model.layers.3.self_attn.q_proj.bias", cfg) is None
    assert classify_qk_param("model.layers.3.self_attn.v_proj.weight", cfg) is None
    assert classify_qk_param("model.layers.3.self_attn.o_proj.weight", cfg) is None
    assert classify_qk_param("model.layers.3.self_attn.q_proj_extra.weight", cfg) is None  # components only
    assert classify_qk_param("model.layers.3.mlp.up_proj.weight", cfg) is None


def test_classify_without_layer_index_is_an_error():
    cfg = QKClipConfig(head_dim=8, threshold=100.0)
    with pytest.raises(ValueError, match=r"'attn\.q_proj\.weight'.*classify"):
        classify_qk_param("attn.q_proj.weight", cfg)


def test_custom_patterns_and_classify():
    cfg = QKClipConfig(head_dim=8, threshold=100.0, q_patterns="query", k_patterns=("key",))
    assert classify_qk_param("encoder.layer.4.attention.self.query.weight", cfg) == (4, "q")
    assert classify_qk_param("encoder.layer.4.attention.self.key.weight", cfg) == (4, "k")
    assert classify_qk_param("model.layers.3.self_attn.q_proj.weight", cfg) is None

    def fused(name):
        return (int(name.split(".")[1]), "q") if name.endswith("qk.weight") else None

    cfg2 = QKClipConfig(head_dim=8, threshold=100.0, classify=fused)
    assert classify_qk_param("blocks.7.qk.weight", cfg2) == (7, "q")
    assert classify_qk_param("blocks.7.q_proj.weight", cfg2) is None
    bad = QKClipConfig(head_dim=8, threshold=100.0, classify=lambda n: (1, "v"))
    with pytest.raises(ValueError, match="must return None or"):
        classify_qk_param("x.1.weight", bad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(head_dim=0, threshold=1.0), "head_dim"),
        (dict(head_dim=8.0, threshold=1.0), "head_dim"),
        (dict(head_dim=8, threshold=0.0), "threshold"),
        (dict(head_dim=8, threshold=float("inf")), "threshold"),
        (dict(head_dim=8, threshold="big"), "threshold"),
        (dict(head_dim=8, threshold=1.0, q_patterns=()), "q_patterns"),
        (dict(head_dim=8, threshold=1.0, k_patterns=("a.b",)), "k_patterns"),
        (dict(head_dim=8, threshold=1.0, q_patterns=("x",), k_patterns=("x",)), "both"),
        (dict(head_dim=8, threshold=1.0, classify=3), "classify"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QKClipConfig(**kwargs)


# ---------------------------------------------------------------- validation and report


def test_report_and_log_line(caplog):
    # per layer: heads over the threshold and the max logit, kept as tensors until read
    report = QKClipReport.lazy(THRESHOLD, (0, 2), torch.tensor([2.0, 0.0]), torch.tensor([70.0, 2.0]))
    assert report.clipped_heads == {0: 2, 2: 0}
    assert report.max_logit == {0: 70.0, 2: 2.0}
    assert report.total_clipped == 2 and report.overall_max_logit == 70.0
    with caplog.at_level(logging.INFO, logger="optimizer.qk_clip"):
        log_report(report, step=7)
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert line.startswith("step 7: qk_clip: 2 heads clipped") and "L0:2" in line and "L2" not in line
