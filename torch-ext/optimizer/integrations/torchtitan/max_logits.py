"""Per-head max attention logits recorded from torchtitan's own attention modules (for QK-clip).

torchtitan's attention calls SDPA or FlexAttention and never materialises its logits, so
:class:`MaxLogitRecorder` puts a forward pre-hook on each attention's ``inner_attention``:
it sees q and k after RoPE and the module's softmax scale, recomputes the per-query-head
max of q·kᵀ·scale in chunks (``optimizer.max_logits.eager_max_logits``, with the same
causal or BlockMask mask), keeps a running max over a step's training forwards, and
before the optimizer step makes the per-layer vectors identical on every rank
(``gather_max_logits``: max over data-parallel ranks, gathered over tensor-parallel heads).
Cost: one more q·kᵀ per recorded forward (measured on a CPU: ~2.4x SDPA's forward, 0.7x
its forward + backward); ``every=N`` records one step in N.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import Shard
from torch.nn.attention.flex_attention import BlockMask

from ...max_logits import eager_max_logits, gather_max_logits
from ...qk_clip import LayerKey, layer_sort_key
from ...tensors import is_dtensor
from ._torchtitan import FlexAttention, ScaledDotProductAttention
from .container import MuonOptimizersContainer
from .layouts import attention_modules

_SDPA_IS_CAUSAL = inspect.signature(ScaledDotProductAttention.forward).parameters["is_causal"].default


class MaxLogitRecorder:
    """QK-clip's input from torchtitan's own attention: per-query-head max logits, recorded in the forward.

    torchtitan's attention computes the logits inside SDPA / FlexAttention and never exposes them.
    The recorder puts a forward pre-hook on every attention module's ``inner_attention``, which
    receives the query and key after RoPE (and after deepseek_v3's ``[nope; rope]`` concatenation)
    with the softmax ``scale`` the module uses. The hook recomputes ``max scale * q.k`` per query
    head with :func:`optimizer.max_logits.eager_max_logits` under the same mask (SDPA:
    ``is_causal``; FlexAttention: the ``BlockMask``'s ``mask_mod``, e.g. torchtitan's causal +
    packed-document mask), grouped-query heads without repeating keys, and keeps the running max
    over every training forward of the step (gradient accumulation, pipeline microbatches).
    Called as the container's ``qk_logits_fn`` before the optimizer step, it returns ``{layer
    key: [n_heads]}``, the same on every rank: max over the data-parallel group, heads gathered
    over the tensor-parallel group (:func:`optimizer.max_logits.gather_max_logits`, one
    collective per group for all layers).

    Cost: the hook recomputes ``q @ k^T`` — the first of attention's two matmuls, ``2 * B * H *
    L^2 * D`` flops per layer, unfused and over every (query, key) pair, also those a causal mask
    hides — in chunks of queries that hold at most ``[B, H, chunk, L]`` scores (64 MiB by
    default), in ``compute_dtype`` (float32 by default, so the max is not rounded to bf16: on GPUs
    fp32 matmuls are several times slower than bf16 ones). docs/torchtitan.md (Max logits) has a measurement. ``every=N`` records only the forwards of every N-th step (the other steps
    return None: Muon does not clip then). Not recorded: forwards without grad (validation) and
    activation-checkpointing recomputation during backward. Under ``torch.compile`` the hook
    runs eagerly (a graph break per attention module).

    Supported: ``ScaledDotProductAttention`` and ``FlexAttention`` without ``score_mod``
    (a ``score_mod`` changes the scores in ways a q.k maximum does not capture: refused when
    seen); query/key that are plain tensors or DTensors sharded over batch (``Shard(0)``) and
    heads (``Shard(2)``, tensor parallelism). Refused: ``VarlenAttention``, context parallelism
    (queries and keys hold only a part of the sequence).

    Args:
        model_parts: the model parts this rank holds.
        tp_group / dp_groups: the tensor-parallel group (its ranks hold contiguous ranges of
            heads, in rank order) and the groups whose ranks see different batches;
            :meth:`for_parallel_dims` takes them from torchtitan's ``ParallelDims``.
        every: record every N-th step (counted in calls of the recorder, i.e. optimizer steps).
        layers: the layer keys to record (default: every attention module); the container
            passes the layers it clips.
        chunk_size / compute_dtype: passed to ``eager_max_logits``.
    """

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        *,
        tp_group: dist.ProcessGroup | None = None,
        dp_groups: Sequence[dist.ProcessGroup] = (),
        every: int = 1,
        layers: Iterable[LayerKey] | None = None,
        chunk_size: int | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"MaxLogitRecorder: every must be a positive int (record every N-th step), got {every!r}")
        self.every = every
        self.tp_group = tp_group
        self.dp_groups = tuple(g for g in dp_groups if g is not None)
        self.chunk_size = chunk_size
        self.compute_dtype = compute_dtype
        self._tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self._local_heads: dict = {}  # layer -> query heads on this rank (to fill a layer that did not run)
        self._device: dict = {}
        self._hooks: list = []
        inners = self._attention_layers(model_parts, None if layers is None else set(layers))
        for layer, fqn, inner in inners:
            self._hooks.append(inner.register_forward_pre_hook(
                functools.partial(self._hook, layer, fqn), with_kwargs=True))
        self.layers = sorted(self._local_heads, key=layer_sort_key)
        self._step = 0
        self._local: dict = {}
        self._forwards = 0

    def _attention_layers(self, model_parts, wanted: set | None) -> list:
        """``[(layer, fqn, inner attention)]`` to hook, each checked (and this rank's heads and device
        of each recorded) before the first hook is registered."""
        inners = []
        for fqn, layer, m in attention_modules(model_parts):
            if wanted is not None and layer not in wanted:
                continue
            inner = getattr(m, "inner_attention", None)
            if not isinstance(inner, (ScaledDotProductAttention, FlexAttention)):
                raise ValueError(
                    f"MaxLogitRecorder: '{fqn}.inner_attention' is {type(inner).__name__}; the recorder supports "
                    "torchtitan's ScaledDotProductAttention and FlexAttention (use attn_backend 'flex'), or pass "
                    "your own qk_logits_fn."
                )
            if layer is None or layer in self._local_heads:
                raise ValueError(
                    f"MaxLogitRecorder: attention module '{fqn}' has layer key {layer!r}, "
                    + ("which another attention module has too" if layer is not None else "no integer component")
                    + "; QK-clip needs one attention per layer key."
                )
            if m.n_heads % self._tp:
                raise ValueError(f"MaxLogitRecorder: '{fqn}' has {m.n_heads} heads, not divisible by the "
                                 f"tensor-parallel degree {self._tp}")
            self._local_heads[layer] = m.n_heads // self._tp
            param = next(m.parameters(), None)
            self._device[layer] = torch.device("cpu") if param is None else \
                (param.to_local() if is_dtensor(param) else param).device
            inners.append((layer, fqn, inner))
        missing = sorted(wanted - set(self._local_heads), key=repr) if wanted is not None else []
        if missing or not self._local_heads:
            raise ValueError(
                f"MaxLogitRecorder: no torchtitan attention module (BaseAttention with an inner_attention) for layers "
                f"{missing or '(any)'} in the model parts; their logits cannot be recorded."
            )
        return inners

    @classmethod
    def for_parallel_dims(cls, model_parts: Sequence[nn.Module], parallel_dims, **kwargs) -> MaxLogitRecorder:
        """A recorder whose groups come from torchtitan's ``ParallelDims``: the ``"tp"`` mesh's group for
        the heads and the ``"loss"`` mesh's (data-parallel replicate x shard: the ranks that see
        different batches) for the maximum. Context parallelism is refused."""
        if parallel_dims.cp_enabled:
            raise ValueError(
                "MaxLogitRecorder: context parallelism is on; each rank's attention holds only a part of the "
                "sequence (and FlexAttention gathers the keys inside its forward), so local q.k maxima would be "
                "wrong. Pass your own qk_logits_fn, or disable context parallelism."
            )
        tp = parallel_dims.get_optional_mesh("tp")
        batch = parallel_dims.get_optional_mesh("loss")
        return cls(model_parts, tp_group=None if tp is None else tp.get_group(),
                   dp_groups=() if batch is None else (batch.get_group(),), **kwargs)

    @property
    def recording(self) -> bool:
        """Whether the forwards of the current step are recorded."""
        return self._step % self.every == 0

    def remove(self) -> None:
        """Remove the hooks (the recorder records nothing after this)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @torch.compiler.disable
    def _hook(self, layer, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.recording or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return None  # another step, a no-grad (validation) forward, or recomputation in backward
        mask = self._mask(module, kwargs, fqn)
        q = self._local_view(args[0], "query", fqn)
        k = self._local_view(args[1], "key", fqn)
        with torch.no_grad():
            m = eager_max_logits(q.detach().transpose(1, 2), k.detach().transpose(1, 2), scale=kwargs.get("scale"),
                                 chunk_size=self.chunk_size, compute_dtype=self.compute_dtype, **mask)
        previous = self._local.get(layer)
        self._local[layer] = m if previous is None else torch.maximum(previous, m)
        self._forwards += 1
        return None

    @staticmethod
    def _mask(module: nn.Module, kwargs: dict, fqn: str) -> dict:
        if isinstance(module, FlexAttention):
            if kwargs.get("score_mod") is not None:
                raise ValueError(
                    f"MaxLogitRecorder: '{fqn}' calls FlexAttention with a score_mod, which changes the scores "
                    "beyond scale * q.k; the recorder cannot reproduce them. Pass your own qk_logits_fn."
                )
            block_mask = kwargs.get("attention_masks")
            if not isinstance(block_mask, BlockMask):
                raise ValueError(f"MaxLogitRecorder: '{fqn}' got attention_masks of type "
                                 f"{type(block_mask).__name__}; FlexAttention takes a BlockMask")
            return {"mask_mod": block_mask.mask_mod}
        return {"is_causal": bool(kwargs.get("is_causal", _SDPA_IS_CAUSAL))}

    def _local_view(self, t: Tensor, what: str, fqn: str) -> Tensor:
        """This rank's ``[B, L, H, D]`` tensor; a DTensor may be sharded over batch and (tensor-parallel) heads."""
        if not is_dtensor(t):
            return t
        names = t.device_mesh.mesh_dim_names or tuple(str(i) for i in range(t.device_mesh.ndim))
        heads_over = []
        for axis, pl in enumerate(t.placements):
            if pl.is_replicate() or (type(pl) is Shard and pl.dim == 0):
                continue
            if type(pl) is Shard and pl.dim == 2:
                heads_over.append(axis)
                continue
            raise ValueError(
                f"MaxLogitRecorder: the {what} of '{fqn}' is a DTensor with placements {tuple(t.placements)} on mesh "
                f"{names}; only batch (Shard(0)) and head (Shard(2)) sharding are supported (a sequence-sharded or "
                "partial tensor would give wrong maxima)."
            )
        heads_tp = 1
        for axis in heads_over:
            heads_tp *= t.device_mesh.size(axis)
        if heads_tp != self._tp:
            raise ValueError(
                f"MaxLogitRecorder: the {what} heads of '{fqn}' are split over {heads_tp} ranks (mesh {names}, "
                f"placements {tuple(t.placements)}) but the tensor-parallel group given has {self._tp}."
            )
        return t.to_local()

    def __call__(self, model_parts: Sequence[nn.Module] | None = None) -> dict | None:
        """The step's ``{layer: [n_heads] max logits}`` (same on every rank), or None on a step not recorded.

        Collective over ``tp_group`` and ``dp_groups`` on recorded steps; call it on every rank once
        per optimizer step (the container does). Starts the next step.
        """
        recorded = self.recording
        local, forwards = self._local, self._forwards
        self._step += 1
        self._local, self._forwards = {}, 0
        if not recorded:
            return None
        if forwards == 0:
            raise RuntimeError(
                "MaxLogitRecorder: no training forward pass (with grad enabled) went through the recorded attention "
                "modules since the last step, so there are no logits for QK-clip. Run the forward before the "
                "optimizer step, and keep the recorder's hooks (remove() drops them)."
            )
        # a layer that did not run on this rank (its maximum comes from the others) must still
        # take part in the collectives with its local head count
        values = {layer: local.get(layer, torch.full((self._local_heads[layer],), float("-inf"),
                                                     device=self._device[layer]))
                  for layer in self.layers}
        return gather_max_logits(values, tp_group=self.tp_group, dp_groups=self.dp_groups)


def install_max_logit_recorder(optimizers, model_parts: list[nn.Module], parallel_dims) -> MaxLogitRecorder:
    """Attach a :class:`MaxLogitRecorder` as ``optimizers``' QK-clip logits source.

    The signature of torchtitan's ``ModelSpec.post_optimizer_build_fn`` (the trainer calls it with
    the container, the model parts and its ``ParallelDims`` right after building the optimizer);
    :func:`enable_muonclip` sets it. Records every ``Config.record_max_logits_every`` steps in
    ``Config.record_max_logits_dtype``, only the layers the container clips.
    """
    if not isinstance(optimizers, MuonOptimizersContainer):
        raise TypeError(
            f"install_max_logit_recorder: expected a MuonOptimizersContainer, got {type(optimizers).__name__}"
        )
    if optimizers.qk_clip_config is None or optimizers.record_max_logits_every is None:
        raise ValueError(
            "install_max_logit_recorder: the container does not record max logits; set "
            "MuonOptimizersContainer.Config.qk_clip_threshold and record_max_logits_every (enable_muonclip does)."
        )
    recorder = MaxLogitRecorder.for_parallel_dims(
        model_parts, parallel_dims, every=optimizers.record_max_logits_every, layers=optimizers.qk_layers,
        compute_dtype=optimizers.record_max_logits_dtype)
    optimizers.set_qk_logits_fn(recorder)
    return recorder


def _post_optimizer_build_with_recorder(original: Callable | None, optimizers, model_parts, parallel_dims) -> None:
    if original is not None:
        original(optimizers, model_parts, parallel_dims)  # e.g. MoE load balancing (deepseek_v3, qwen3)
    install_max_logit_recorder(optimizers, model_parts, parallel_dims)


def enable_muonclip(config, *, threshold: float = 100.0, every: int = 1):
    """Turn on QK-clip with recorded max logits in a torchtitan ``Trainer.Config`` whose optimizer is ours.

    Sets ``config.optimizer.qk_clip_threshold`` and ``record_max_logits_every``, and chains
    :func:`install_max_logit_recorder` after the model's own ``post_optimizer_build_fn`` (so the
    trainer attaches the recorder with its ``ParallelDims``). Returns ``config``.
    """
    if not isinstance(config.optimizer, MuonOptimizersContainer.Config):
        raise ValueError("enable_muonclip: set config.optimizer = MuonOptimizersContainer.Config(...) first")
    if config.model_spec is None:
        raise ValueError("enable_muonclip: config.model_spec is None; start from one of torchtitan's model configs")
    config.optimizer.qk_clip_threshold = threshold
    config.optimizer.record_max_logits_every = every
    original = config.model_spec.post_optimizer_build_fn
    if not (isinstance(original, functools.partial) and original.func is _post_optimizer_build_with_recorder):
        config.model_spec.post_optimizer_build_fn = functools.partial(_post_optimizer_build_with_recorder, original)
    return config
