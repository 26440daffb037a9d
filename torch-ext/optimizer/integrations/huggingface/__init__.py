"""Train Hugging Face models with ``optimizer.Muon``: transformers' Trainer, accelerate, PEFT.

::

    from transformers import Trainer
    from optimizer.integrations.huggingface import MuonFactory

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizer_cls_and_kwargs=(MuonFactory, {"lr": 2e-2, "weight_decay": 0.1,
                                                              "qk_clip": 100.0}))

    # accelerate / a plain loop: the same optimizer, and optimizer.step() with no arguments clips
    opt = build_muon(model, lr=2e-2, weight_decay=0.1, qk_clip=100.0)
    model, opt = accelerator.prepare(model, opt)

* :class:`MuonFactory` / :func:`build_muon`: param groups from the model's own metadata
  (:func:`optimizer.param_groups.get_default_muon_param_groups` with Trainer's no-decay rule), every
  ``Muon`` option passed through, and QK-clip fed from the model's own training forwards.
* :func:`qk_clip_config_for`: the ``QKClipConfig`` for Llama/Mistral/Mixtral/Qwen2(-MoE) (separate
  ``q_proj``/``k_proj``) or DeepSeek-V2/V3 MLA (``q_b_proj``/``q_proj``, ``kv_b_proj``); refuses
  Qwen3's per-head QK-norm, fused projections and frozen q/k.
* :class:`MaxLogitRecorder`: per-query-head max pre-softmax logits of every attention module,
  recorded through transformers' attention dispatch (eager, SDPA, flex), the same on every rank.

Needs transformers 5 (``pip install 'parallel-muon-optimizer[hf]'``, with torch pinned as a
constraint); the rest of ``optimizer`` does not import it.
"""

try:
    import transformers  # noqa: F401
    from transformers.modeling_utils import AttentionInterface  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only where transformers is missing
    raise ImportError(
        "optimizer.integrations.huggingface needs transformers 5 (pip install transformers==5.24.0 accelerate==1.15.0 "
        "peft==0.21.2, or the package's [hf] extra; install torch first and keep it as a constraint). The rest of "
        f"the `optimizer` package works without it. ({err})"
    ) from err

from .attention import HFAttentionLayout, attention_layouts, attention_modules, layer_key, qk_clip_config_for
from .factory import MuonFactory, build_muon, hf_param_groups
from .max_logits import SUPPORTED_IMPLEMENTATIONS, MaxLogitRecorder

__all__ = [
    "HFAttentionLayout",
    "MaxLogitRecorder",
    "MuonFactory",
    "SUPPORTED_IMPLEMENTATIONS",
    "attention_layouts",
    "attention_modules",
    "build_muon",
    "hf_param_groups",
    "layer_key",
    "qk_clip_config_for",
]
