"""torchtitan 0.3 on a CPU-only machine, and tiny models built with its own code.

torchtitan assumes an accelerator. On CPU with gloo it runs our optimizer unchanged given four
shims, all here:

1. Device type. ``torchtitan.tools.utils`` picks ``"cuda"`` when no accelerator is found, and a
   few modules copy ``device_type`` / ``device_module`` at import; :func:`use_cpu` sets them to
   ``"cpu"`` / ``torch.cpu`` everywhere they were copied (its DeviceMesh is built from them).
2. Gradient reduction. FSDP2 reduce-scatters with ``PREMUL_SUM`` to fold in its divide
   factor; gloo has no ``PREMUL_SUM``. :func:`force_sum_reduction` calls torchtitan/FSDP's own
   ``set_force_sum_reduction_for_comms(True)`` on every FSDP module (sum, then divide).
3. Attention. Its language models use FlexAttention compiled by inductor (triton kernels,
   block masks); :func:`tiny_llama3` / :func:`tiny_qwen3_moe` build the layers with its
   ``ScaledDotProductAttention`` instead (eager, causal), and the model is called without masks.
4. ``triton`` importable: part of its model code imports it. CI installs it (scripts/install.sh).

Its default ``spmd_backend="spmd_types"`` does not run on torch 2.13 (FSDP refuses its plain
tensors); ``"partial_dtensor"`` and ``"full_dtensor"`` do.

Models are built from torchtitan's own config helpers (``_build_llama3_layers``,
``_build_qwen3_moe_layers``, ``_build_dsv3_layers`` and their init tables, private but pinned
with torchtitan==0.3.0): llama3 with separate ``wq``/``wk``/``wv`` (``"llama3"``) or torchtitan's
default fused ``wqkv`` (``"llama3_fused"``), qwen3 MoE, and deepseek_v3 (``"deepseek_v3"``: MLA
with a query LoRA, i.e. ``wq_a``/``wq_b``, YaRN rope so its softmax scale is not ``1/sqrt(d)``,
one dense and one MoE layer, and one multi-token-prediction layer). Parallelised with
torchtitan's ``parallelize_llama`` / ``parallelize_qwen3`` / ``parallelize_deepseekv3``.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import torchtitan.distributed.parallel_dims as _parallel_dims
import torchtitan.distributed.utils as _dist_utils
import torchtitan.models.common.token_dispatcher as _token_dispatcher
import torchtitan.tools.utils as _tools_utils
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import distribute_tensor
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, parallelize_deepseekv3
from torchtitan.models.llama3 import Llama3Model, parallelize_llama
from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3

# Model configs' update_from_config imports torchtitan.trainer (which imports `datasets` and
# pandas: ~3 s). Imported here, once, before the test ranks fork, instead of in every rank.
import torchtitan.trainer  # noqa: E402,F401

from optimizer.tensors import is_dtensor

VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 128, 64, 4, 2, 2
HEAD_DIM = DIM // HEADS
# deepseek_v3 MLA sizes (distinct, so that a mixed-up split shows)
Q_LORA, KV_LORA, QK_NOPE, QK_ROPE, V_HEAD = 24, 16, 12, 4, 8


def use_cpu() -> None:
    """Shim 1: torchtitan's device type is "cpu" (call in every rank before building meshes)."""
    for module in (_tools_utils, _parallel_dims, _dist_utils, _token_dispatcher):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu


def force_sum_reduction(model: nn.Module) -> None:
    """Shim 2: FSDP reduce-scatters with SUM (gloo has no PREMUL_SUM)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def _eager_attention(layers: list) -> list:
    """Shim 3: every layer's inner attention is torchtitan's eager causal SDPA."""
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def tiny_llama3(fuse_qkv: bool = False) -> Llama3Model.Config:
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init

    layers = _build_llama3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=2 * DIM, fuse_qkv=fuse_qkv,
        rope=ComplexRoPE.Config(dim=HEAD_DIM, max_seq_len=64, theta=10000.0, scaling="none"), attn_backend="flex",
    )
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_eager_attention(layers),
    )


def tiny_qwen3_moe(num_experts: int = 4, top_k: int = 2) -> Qwen3Model.Config:
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm

    layers = _build_qwen3_moe_layers(
        n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, moe_hidden_dim=DIM,
        num_experts=num_experts, top_k=top_k, fuse_qkv=False, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=64, theta=10000.0),
    )
    return Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_eager_attention(layers),
    )


def tiny_deepseek_v3(num_experts: int = 4, top_k: int = 2, num_mtp_layers: int = 1) -> DeepSeekV3Model.Config:
    from torchtitan.models.deepseek_v3 import _EMBEDDING_INIT, _NORM_INIT, _build_dsv3_layers, _build_mtp_layers, \
        _output_linear_init

    layers = _build_dsv3_layers(
        n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
        qk_nope_head_dim=QK_NOPE, qk_rope_head_dim=QK_ROPE, v_head_dim=V_HEAD, mscale=0.7,
        dense_hidden_dim=2 * DIM, moe_hidden_dim=DIM // 2, num_experts=num_experts, num_shared_experts=1,
        router_top_k=top_k, router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=QK_ROPE, max_seq_len=64, theta=10000.0, scaling="yarn", rope_factor=4.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=16),
    )
    layers = _eager_attention(layers)
    return DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers,
        mtp_layers=_build_mtp_layers(layers[-1], dim=DIM, num_mtp_layers=num_mtp_layers),
    )


MODELS: dict[str, tuple[Callable, Callable]] = {
    "llama3": (tiny_llama3, parallelize_llama),
    "llama3_fused": (lambda: tiny_llama3(fuse_qkv=True), parallelize_llama),
    "qwen3_moe": (tiny_qwen3_moe, parallelize_qwen3),
    "deepseek_v3": (tiny_deepseek_v3, parallelize_deepseekv3),
}


def build(model: str, world_size: int, *, backend: str = "partial_dtensor", seed: int = 0, **degrees):
    """(torchtitan-parallelised model, its full weights {name: tensor}, ParallelDims).

    ``degrees``: ParallelismConfig fields (data_parallel_shard_degree, tensor_parallel_degree,
    ...). The full weights come from a plain single-device build of the same config initialised
    with ``seed``; the parallel model's shards are cut from them with ``distribute_tensor``.
    """
    use_cpu()
    make_config, parallelize = MODELS[model]
    parallelism = ParallelismConfig(spmd_backend=backend, **degrees)
    _dist_utils.set_spmd_backend(backend)
    config = make_config()
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    torch.manual_seed(seed)
    reference = config.build()
    with torch.no_grad():
        reference.init_weights(buffer_device=torch.device("cpu"))
    full = {n: p.detach().clone() for n, p in reference.named_parameters()}

    with torch.device("meta"):
        parallel = config.build()
    dims = ParallelDims.from_config(parallelism, world_size)
    parallel = parallelize(
        parallel, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism, compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp",
    )
    parallel.to_empty(device="cpu")
    with torch.no_grad():
        parallel.init_weights(buffer_device=torch.device("cpu"))  # buffers (rope caches, expert bias)
        load_full_weights(parallel, full)
    force_sum_reduction(parallel)
    return parallel, full, dims


def plain_model(model: str, weights: dict[str, torch.Tensor] | None = None, seed: int = 0) -> nn.Module:
    """The model on one device (no parallelism), holding copies of ``weights`` (default: initialised with ``seed``)."""
    config = MODELS[model][0]()
    config.update_from_config(config=types.SimpleNamespace(parallelism=ParallelismConfig()))
    torch.manual_seed(seed)
    plain = config.build()
    with torch.no_grad():
        plain.init_weights(buffer_device=torch.device("cpu"))
        if weights is not None:
            load_full_weights(plain, weights)
    return plain


def load_full_weights(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full weights into a (possibly sharded) model: each rank keeps its shard."""
    for name, p in model.named_parameters():
        w = full[name]
        if is_dtensor(p):
            w = distribute_tensor(w, p.device_mesh, p.placements)
        p.copy_(w)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtensor(t) else t


def batch_tokens(step: int, batch: int = 2, seq: int = 8, stream: int = 0) -> torch.Tensor:
    """``[batch, seq + 1]`` tokens of ``step``; ``stream`` picks an independent batch (e.g. a data-parallel rank's)."""
    g = torch.Generator().manual_seed(1000 + step + 7919 * stream)
    return torch.randint(0, VOCAB, (batch, seq + 1), generator=g)


def forward_backward(model: nn.Module, step: int, dims: ParallelDims | None = None, batch: int = 2, seq: int = 8,
                     stream: int = 0) -> float:
    """Next-token cross-entropy on a batch drawn from ``step`` (the same on every rank unless ``stream`` differs).

    Under ``spmd_backend="full_dtensor"`` inputs must be DTensors: they are wrapped as
    torchtitan's trainer wraps them (``full_dtensor.parallelize_inputs``; pass ``dims``).
    A model with multi-token prediction returns one output per depth; their losses are summed.
    """
    tokens = batch_tokens(step, batch, seq, stream)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if _dist_utils.get_spmd_backend() == "full_dtensor":
        from torchtitan.distributed import full_dtensor

        inputs, labels, _ = full_dtensor.parallelize_inputs(dims, inputs, labels, {})
    outputs = model(inputs)
    labels = full_tensor(labels).flatten()
    loss = sum(F.cross_entropy(full_tensor(logits).flatten(0, 1).float(), labels)
               for logits in (outputs if isinstance(outputs, list) else [outputs]))
    loss.backward()
    return loss.item()


def data_parallel_rank(dims: ParallelDims) -> int:
    """This rank's index among the ranks that see different batches (tensor-parallel peers share one)."""
    mesh = dims.get_optional_mesh("batch")
    return 0 if mesh is None else mesh.get_local_rank()
