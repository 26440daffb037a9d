"""Build ``optimizer.Muon`` for a Hugging Face model: transformers' Trainer factory and a plain builder."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from ...muon import Muon
from ...param_groups import get_default_muon_param_groups
from ...qk_clip import QKClipConfig, classify_qk_param
from .attention import qk_clip_config_for
from .max_logits import MaxLogitRecorder

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16}


def _dtype(value):
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    raise ValueError(f"compute_dtype must be a torch.dtype, one of {sorted(_DTYPES)} or None, got {value!r}")


def hf_param_groups(model: nn.Module, *, is_muon: Callable[[str, Tensor], bool] | None = None,
                    adamw_options: Mapping | None = None, no_decay="trainer", fused_gate_up: str = "split",
                    example_inputs=None, **muon_group_options) -> list[dict]:
    """:func:`optimizer.get_default_muon_param_groups` with transformers Trainer's conventions:
    biases and norm weights of the AdamW part get no weight decay (``no_decay="trainer"``).
    ``example_inputs`` (e.g. ``{"input_ids": ..., "pixel_values": ...}``) lets the roles see one
    forward: the weights producing the logits are heads (CLIP's projections)."""
    return get_default_muon_param_groups(model, is_muon, adamw_options=adamw_options, no_decay=no_decay,
                                         fused_gate_up=fused_gate_up, example_inputs=example_inputs,
                                         **muon_group_options)


def build_muon(
    model: nn.Module,
    *,
    qk_clip: QKClipConfig | float | None = None,
    qk_clip_every: int = 1,
    record_max_logits_dtype: torch.dtype | str = torch.float32,
    is_muon: Callable[[str, Tensor], bool] | None = None,
    adamw_options: Mapping | None = None,
    no_decay="trainer",
    fused_gate_up: str = "split",
    muon_row_blocks=None,
    example_inputs=None,
    **muon_kwargs,
) -> Muon:
    """``optimizer.Muon`` over a Hugging Face model, for a Trainer, an accelerate loop or plain PyTorch.

    Param groups: :func:`hf_param_groups` (heads, embeddings, routers, adapters, norms and biases to
    AdamW; biases and norm weights without weight decay, as Trainer does; ``adamw_options`` for the
    AdamW groups' ``lr``/``weight_decay``/``betas``/``eps``; fused MoE ``gate_up_proj`` split;
    ``muon_transposed`` for GPT-2's ``Conv1D``; convolutions and vectors in disguise such as
    ``[1, C, 1]`` per-channel scales to AdamW: docs/param_roles.md). ``muon_row_blocks`` (a
    ``{name: spec}`` or one spec) is added to the Muon group. ``example_inputs``: one forward's
    inputs for the roles (:func:`hf_param_groups`).

    ``qk_clip``: a threshold (the config comes from :func:`qk_clip_config_for`) or a
    :class:`~optimizer.QKClipConfig`. The logits are recorded from the model's own training
    forwards (:class:`MaxLogitRecorder`, every ``qk_clip_every`` steps, in
    ``record_max_logits_dtype``) and handed to ``step()`` through ``Muon.set_qk_logits_source``,
    so a training loop that calls ``optimizer.step()`` without ``qk_logits`` (Trainer, accelerate)
    clips. The recorder is ``optimizer.qk_logits_recorder``.

    Every other keyword is a ``Muon`` option, passed through: ``lr``, ``weight_decay``,
    ``momentum``, ``nesterov``, ``ns_steps``, ``adjust_lr``, ``adamw_betas``, ``compute_dtype``
    (a dtype or "bfloat16"/"float32"), ``distributed_mode``, ``skip_nonfinite``, ...
    """
    if "compute_dtype" in muon_kwargs:
        muon_kwargs["compute_dtype"] = _dtype(muon_kwargs["compute_dtype"])
    record_dtype = _dtype(record_max_logits_dtype)
    group_options = {} if muon_row_blocks is None else {"muon_row_blocks": muon_row_blocks}
    groups = hf_param_groups(model, is_muon=is_muon, adamw_options=adamw_options, no_decay=no_decay,
                             fused_gate_up=fused_gate_up, example_inputs=example_inputs, **group_options)
    if qk_clip is None:
        return Muon(groups, **muon_kwargs)
    if isinstance(qk_clip, numbers.Real) and not isinstance(qk_clip, bool):
        qk_clip = qk_clip_config_for(model, float(qk_clip))
    if not isinstance(qk_clip, QKClipConfig):
        raise ValueError(f"qk_clip must be a threshold, an optimizer.QKClipConfig or None, got {qk_clip!r}")
    layers = {role[0] for g in groups if g["use_muon"] for n in g["param_names"]
              for role in [classify_qk_param(n, qk_clip)] if role is not None}
    opt = Muon(groups, qk_clip=qk_clip, **muon_kwargs)  # checks the q/k weights, their pairs and head counts
    recorder = MaxLogitRecorder(model, layers=layers, every=qk_clip_every, compute_dtype=record_dtype)
    opt.set_qk_logits_source(recorder)
    opt.qk_logits_recorder = recorder
    return opt


class MuonFactory:
    """transformers' optimizer-factory protocol: ``Trainer(..., optimizer_cls_and_kwargs=(MuonFactory, kwargs))``.

    Trainer's ``create_optimizer`` treats anything that is not a ``torch.optim.Optimizer`` subclass
    as a factory (``transformers.trainer_optimizer.is_optimizer_factory``) and builds the optimizer
    as ``MuonFactory()(model, **kwargs)``: this calls :func:`build_muon`. Trainer's
    ``learning_rate``, ``weight_decay`` and ``adam_*`` arguments do not reach a factory: put ``lr``,
    ``weight_decay`` (and ``adamw_options``) in ``kwargs``. Trainer's LR scheduler then scales every
    group's ``lr``, Muon and AdamW alike.
    """

    def __call__(self, model: nn.Module, **kwargs) -> Muon:
        return build_muon(model, **kwargs)
