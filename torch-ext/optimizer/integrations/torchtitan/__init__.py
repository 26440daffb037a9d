"""Train with ``optimizer.Muon`` in torchtitan 0.3: an optimizer container its trainer builds from config.

torchtitan's trainer builds ``config.optimizer.build(model_parts=...)`` and then uses the result
as a ``torch.optim.Optimizer`` (``step``, ``zero_grad``, hooks), hands it to its LR scheduler
(``LambdaLR`` per optimizer) and checkpoints it through DCP with FQN-keyed flat state dicts.
:class:`MuonOptimizersContainer` is such a container: one ``optimizer.Muon`` per model part,
holding both its Muon groups and its AdamW groups, so torchtitan's scheduler and checkpointing
work unchanged. In a ``config_registry`` function::

    from optimizer.integrations.torchtitan import MuonOptimizersContainer, default_param_groups, enable_muonclip

    config.optimizer = MuonOptimizersContainer.Config(param_groups=default_param_groups(lr=2e-2))
    config.parallelism.spmd_backend = "partial_dtensor"   # or "full_dtensor"; see below
    enable_muonclip(config, threshold=100.0)              # optional: QK-clip, max logits recorded

Param groups are torchtitan's ``ParamGroupConfig`` (regex on the parameter FQN, first match
wins) with ``optimizer_name`` ``"Muon"`` or ``"AdamW"`` and that group's hyperparameters in
``optimizer_kwargs``. :func:`default_param_groups` sends embeddings, the output head, MoE router
gates, norms and biases to AdamW and every other parameter (2-D weights, 3-D expert stacks) to
Muon. A Muon pattern that matches what Muon cannot read as a matrix (a convolution's kernel, a
vector in disguise such as a ``[1, C, 1]`` scale) is refused when the container is built, naming
each parameter (``optimizer.roles``, docs/param_roles.md).

Fused ``wqkv`` (torchtitan's default ``fuse_qkv=True``): Muon orthogonalises its query, key and
value rows as three matrices by default (``Config.fused_qkv_orthogonalization="split"``), so
that fusing stays what torchtitan means it to be, a kernel-launch optimisation with the same
training maths as separate ``wq``/``wk``/``wv``.

QK-clip (``Config.qk_clip_threshold``): the attention layout of every layer is read from the
model's attention modules: separate ``wq``/``wk`` (head_dim), torchtitan's fused ``wqkv``
(``FusedQKV(n_heads, n_kv_heads, head_dim, "grouped")``) or deepseek_v3's multi-head latent
attention (``MLAHeads(qk_nope_head_dim, qk_rope_head_dim, v_head_dim)``). torchtitan's attention
does not report its logits, so they come either from :class:`MaxLogitRecorder` (hooks on the
attention modules that recompute ``max q.k * scale`` per head during the training forward:
:func:`enable_muonclip`) or from a callable ``qk_logits_fn(model_parts) -> {layer: per-query-head
max logits} | None`` (``Config.qk_logits_fn`` as ``"package.module:function"``, or
:meth:`~MuonOptimizersContainer.set_qk_logits_fn`). Layers are keyed by :func:`layer_key`:
``layers.3....`` is ``3``, deepseek_v3's multi-token-prediction layer ``mtp_layers.0....`` is
``"mtp_layers.0"``.

Layouts: Muon needs to see the layout of every sharded parameter. torchtitan's
``"partial_dtensor"`` and ``"full_dtensor"`` backends give DTensors (FSDP, HSDP, TP with and
without sequence parallel, EP, their combinations); its default ``"spmd_types"`` backend keeps
tensor-parallel shards as plain tensors, and orthogonalising a shard is silently wrong, so a
plain parameter whose shape differs from the one the model config declares is refused.
"""

from __future__ import annotations

from . import _torchtitan  # noqa: F401 - first: says what to install if torchtitan is missing
from .container import ADAMW_PATTERN, MuonOptimizersContainer, QKLogitsFn, default_param_groups, find_hidden_shards
from .dist_muon import build_torchtitan_dist_muon, dist_muon_compute_layouts
from .layouts import AttentionLayout, attention_layouts, attention_modules, layer_key
from .max_logits import MaxLogitRecorder, enable_muonclip, install_max_logit_recorder

__all__ = [
    "ADAMW_PATTERN",
    "AttentionLayout",
    "MaxLogitRecorder",
    "MuonOptimizersContainer",
    "QKLogitsFn",
    "attention_layouts",
    "attention_modules",
    "build_torchtitan_dist_muon",
    "default_param_groups",
    "dist_muon_compute_layouts",
    "enable_muonclip",
    "find_hidden_shards",
    "install_max_logit_recorder",
    "layer_key",
]
