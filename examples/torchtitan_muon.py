"""torchtitan configs that train with optimizer.Muon (a ``config_registry`` module for torchtitan 0.3).

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module examples.torchtitan_muon --config llama3_8b_muon \\
        --parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 2

Each function takes one of torchtitan's own configs and swaps in ``MuonOptimizersContainer``
(Muon for matrices, AdamW for embeddings, output head, router gates, norms and biases) and
torchtitan's DTensor backend (Muon must see every shard's layout). Everything else (LR
schedule, checkpointing, data) is torchtitan's. The ``*_muonclip`` configs add QK-clip with max
logits recorded from the attention modules (``enable_muonclip``).
"""

from __future__ import annotations

from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3_configs
from torchtitan.models.llama3 import config_registry as llama3_configs
from torchtitan.models.qwen3 import config_registry as qwen3_configs
from torchtitan.trainer import Trainer

from optimizer.integrations.torchtitan import MuonOptimizersContainer, default_param_groups, enable_muonclip


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


def llama3_debugmodel_muonclip() -> Trainer.Config:
    """Muon with QK-clip (MuonClip) on torchtitan's default fused ``wqkv``.

    The fused layout is read from the model; ``wqkv``'s q, k and v rows are orthogonalised as
    three matrices (``--optimizer.fused_qkv_orthogonalization``). The per-head max logits are
    recorded from the attention's query and key in the training forward (``enable_muonclip``;
    ``--optimizer.record_max_logits_every N`` records, and clips, every N-th step only).
    """
    return enable_muonclip(with_muon(llama3_configs.llama3_debugmodel()), threshold=100.0)


def deepseek_v3_debugmodel_muonclip() -> Trainer.Config:
    """Muon with QK-clip on deepseek_v3's multi-head latent attention (Kimi K2's MuonClip):
    q_nope / k_nope rows of ``wq`` and ``wkv_b`` scaled by sqrt(gamma), q_pe rows by gamma."""
    return enable_muonclip(with_muon(deepseek_v3_configs.deepseek_v3_debugmodel()), threshold=100.0)
