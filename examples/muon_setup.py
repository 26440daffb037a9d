"""How the examples configure Muon for a run config: QK-clip and split orthogonalisation.

Both follow ``[model] attention`` (``examples/model.py``):

* QK-clip (:func:`qk_clip_config`): separate ``wq``/``wk`` take ``QKClipConfig(head_dim=...)``;
  a fused ``wqkv`` ``QKClipConfig(fused_qkv=FusedQKV(..., layout="grouped"))`` (its q and k
  rows are clipped, v rows untouched); MLA ``QKClipConfig(mla=MLAHeads(...))`` (q_nope and
  k_nope rows by sqrt(gamma), q_pe rows by gamma, ``wkv_a``'s shared rotary key untouched).
* Split orthogonalisation (:func:`muon_row_blocks`, ``[muon] row_blocks``): Muon's
  ``"muon_row_blocks"`` param-group key, ``{parameter name: spec}`` for the attention weights.
* Dion2 / NorDion2 (``[muon] dion2_fraction``, ``dion2_ef_decay``, ``normuon_beta2``): set on the
  Muon group (:func:`muon_param_groups`).

The same functions build the distributed optimizer and the single-device reference, so the
lockstep check compares like with like.
"""

from __future__ import annotations

from optimizer import QKClipConfig, SplitQKV, get_default_muon_param_groups
from optimizer.row_blocks import ROW_BLOCKS_KEY

from .config import RunConfig


def qk_clip_config(cfg: RunConfig) -> QKClipConfig:
    """QK-clip at ``[qk_clip] threshold`` for the config's attention."""
    m, threshold = cfg.model, cfg.qk_clip.threshold
    if m.attention == "mla":
        return QKClipConfig(threshold=threshold, mla=m.mla_heads)
    if m.attention == "fused_qkv":
        return QKClipConfig(threshold=threshold, fused_qkv=m.fused_qkv)
    return QKClipConfig(head_dim=m.head_dim, threshold=threshold)


def muon_row_blocks(cfg: RunConfig, names) -> dict:
    """``{name: row-block spec}`` for the attention weights among ``names`` per ``[muon] row_blocks``.

    ``"qkv"``: a fused ``wqkv`` as its q, k and v blocks (``FusedQKV``: exactly as separate
    ``wq``/``wk``/``wv``).  ``"heads"``: every head its own block (``"heads:<rows per head>"``
    for ``wq``/``wk``/``wv`` and MLA's ``wq``/``wq_b`` (``[q_nope; q_pe]``) and ``wkv_b``
    (``[k_nope; v]``); ``SplitQKV(per_head=True)`` for ``wqkv``).  ``"none"``: ``{}``.
    """
    mode, m = cfg.muon.row_blocks, cfg.model
    if mode == "none":
        return {}
    specs = {}
    for name in names:
        parts = name.split(".")
        if len(parts) < 3 or parts[-3] != "attention" or parts[-1] != "weight":
            continue
        proj = parts[-2]
        if m.attention == "fused_qkv" and proj == "wqkv":
            specs[name] = m.fused_qkv if mode == "qkv" else SplitQKV(m.fused_qkv, per_head=True)
        elif mode != "heads":
            continue
        elif m.attention == "gqa" and proj in ("wq", "wk", "wv"):
            specs[name] = f"heads:{m.head_dim}"
        elif m.attention == "mla" and proj in ("wq", "wq_b"):
            specs[name] = f"heads:{m.qk_nope_head_dim + m.qk_rope_head_dim}"
        elif m.attention == "mla" and proj == "wkv_b":
            specs[name] = f"heads:{m.qk_nope_head_dim + m.v_head_dim}"
    if not specs:  # a config that asks for blocks must get some: never a silent no-op
        raise ValueError(f"{cfg.name}: [muon] row_blocks = {mode!r} matched no attention weight of the model")
    return specs


def muon_param_groups(model, cfg: RunConfig) -> list[dict]:
    """``get_default_muon_param_groups(model)`` with the config's row blocks and ``[muon]`` group
    options (Dion2, NorDion2: ``MuonSettings.group_options``) on the Muon group."""
    groups = get_default_muon_param_groups(model)
    for group in groups:
        if group["use_muon"]:
            group.update(cfg.muon.group_options())
            specs = muon_row_blocks(cfg, group["param_names"])
            if specs:
                group[ROW_BLOCKS_KEY] = specs
    return groups
