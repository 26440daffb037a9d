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


def measure_recorder_cost(batch: int = 1, heads: int = 8, kv_heads: int = 2, seq: int = 2048, head_dim: int = 64,
                          device: str = "cpu", dtype=None, repeats: int = 5) -> dict:
    """What MaxLogitRecorder adds per attention layer: ``eager_max_logits`` (its q.k recomputation)
    timed against causal SDPA's forward and forward + backward on the same q, k, v, in one process.

        python examples/torchtitan_muon.py [--device cuda] [--seq 4096]
    """
    import time

    import torch
    import torch.nn.functional as F

    from optimizer.max_logits import eager_max_logits

    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, seq, head_dim, generator=g, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, generator=g, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))

    def sdpa_forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def sdpa_forward_backward():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    def record(compute_dtype):
        def run():
            with torch.no_grad():
                eager_max_logits(q, k, is_causal=True, compute_dtype=compute_dtype)
        return run

    def best(fn):
        fn()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    out = {"sdpa_forward_s": best(sdpa_forward), "sdpa_forward_backward_s": best(sdpa_forward_backward),
           "record_fp32_s": best(record(torch.float32))}
    if dtype == torch.bfloat16:
        out["record_bf16_s"] = best(record(torch.bfloat16))
    return out


if __name__ == "__main__":
    import argparse
    import platform

    import torch

    parser = argparse.ArgumentParser(description=measure_recorder_cost.__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = dict(batch=1, heads=8, kv_heads=2, seq=args.seq, head_dim=64)
    times = measure_recorder_cost(device=args.device, **shape)
    base = times["sdpa_forward_s"]
    print(f"{platform.processor() or platform.machine()} / {args.device}, {args.threads} thread(s), {shape}")
    for name, seconds in times.items():
        print(f"  {name:24s} {seconds * 1e3:9.1f} ms   {seconds / base:5.2f} x SDPA forward")
