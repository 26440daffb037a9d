"""torchtitan configs that train with optimizer.Muon (a ``config_registry`` module for torchtitan 0.3).

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module examples.torchtitan_muon --config llama3_8b_muon \\
        --parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 2

Each function takes one of torchtitan's own configs and swaps in ``MuonOptimizersContainer``
(Muon for matrices, AdamW for embeddings, output head, router gates, norms and biases) and
torchtitan's DTensor backend (Muon must see every shard's layout). Everything else (LR
schedule, checkpointing, data) is torchtitan's.
"""

from __future__ import annotations

from torchtitan.models.llama3 import config_registry as llama3_configs
from torchtitan.models.qwen3 import config_registry as qwen3_configs
from torchtitan.trainer import Trainer

from optimizer.integrations.torchtitan import MuonOptimizersContainer, default_param_groups


def with_muon(config: Trainer.Config, *, lr: float = 2e-2, weight_decay: float = 0.1) -> Trainer.Config:
    """``config`` trained with Muon (AdamW for the non-matrix parameters) on torchtitan's DTensor backend."""
    config.optimizer = MuonOptimizersContainer.Config(param_groups=default_param_groups(lr=lr, weight_decay=weight_decay))
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def llama3_debugmodel_muon() -> Trainer.Config:
    return with_muon(llama3_configs.llama3_debugmodel())


def llama3_8b_muon() -> Trainer.Config:
    return with_muon(llama3_configs.llama3_8b())


def qwen3_moe_debug_muon() -> Trainer.Config:
    return with_muon(qwen3_configs.qwen3_moe_debug())


def qwen3_debugmodel_muonclip() -> Trainer.Config:
    """Muon with QK-clip (MuonClip) on a model with separate q/k weights.

    Set where the per-head max logits come from on the command line, e.g.
    ``--optimizer.qk_logits_fn my_project.attention_stats:max_qk_logits`` (a function
    ``fn(model_parts) -> {layer: per-query-head max logits}``; torchtitan's attention does not
    record them, so it reports what a wrapper around its inner attention saw).
    """
    config = with_muon(qwen3_configs.qwen3_debugmodel_non_fused_qkv())
    config.optimizer.qk_clip_threshold = 100.0
    return config
