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
Muon.

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

import dataclasses
import functools
import glob
import importlib
import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import Shard
from torch.nn.attention.flex_attention import BlockMask

try:
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.distributed.flex_shard import BucketConfig, ComputeLayout, Owned, build_dist_muon
    from torchtitan.models.common.attention import (
        BaseAttention,
        FlexAttention,
        FusedQKVLinear,
        ScaledDotProductAttention,
    )
except ImportError as err:  # pragma: no cover - exercised only where torchtitan is missing
    raise ImportError(
        "optimizer.integrations.torchtitan needs torchtitan 0.3 (pip install torchtitan==0.3.0; install "
        "torch first and keep it as a constraint so nothing pulls another torch build). The rest of the "
        f"`optimizer` package works without it. ({err})"
    ) from err

from ..attention_layouts import FusedQKV, MLAHeads
from ..max_logits import eager_max_logits, gather_max_logits
from ..muon import Muon
from ..qk_clip import LayerKey, QKClipConfig, QKRole, classify_qk_param, layer_sort_key
from ..row_blocks import ROW_BLOCKS_KEY, SplitQKV
from ..tensors import is_dtensor

__all__ = [
    "ADAMW_PATTERN",
    "AttentionLayout",
    "MaxLogitRecorder",
    "MuonOptimizersContainer",
    "QKLogitsFn",
    "attention_layouts",
    "build_torchtitan_dist_muon",
    "default_param_groups",
    "enable_muonclip",
    "find_hidden_shards",
    "install_max_logit_recorder",
    "layer_key",
]

QKLogitsFn = Callable[[list[nn.Module]], Mapping[int, Tensor] | None]

# torchtitan 0.3 FQNs that belong on AdamW: embeddings (tok_embeddings), the output head
# (lm_head; "output" in older releases), MoE router gates (a [num_experts, dim] classifier, like a
# head), norms (attention_norm, ffn_norm, q_norm, k_norm, kv_norm, norm) and biases.
ADAMW_PATTERN = (
    r"(^|\.)(tok_embeddings|embed_tokens|lm_head|output)\.weight$"
    r"|(^|\.)router\.gate\.weight$"
    r"|norm\.weight$"
    r"|\.bias$"
)

MUON_GROUP_KEYS = frozenset({"lr", "weight_decay", "momentum", "nesterov", "ns_steps", "ns_coefficients", "adjust_lr"})
ADAMW_GROUP_KEYS = frozenset({"lr", "weight_decay", "betas", "eps"})
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def default_param_groups(
    *,
    lr: float = 2e-2,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    adjust_lr: str | None = "match_rms_adamw",
    adamw_lr: float | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float | None = None,
) -> list[ParamGroupConfig]:
    """Presets for torchtitan's models: :data:`ADAMW_PATTERN` to AdamW, everything else to Muon.

    With ``adjust_lr="match_rms_adamw"`` (the default) Muon's update has AdamW's RMS, so one
    ``lr`` and ``weight_decay`` serve both (``adamw_lr`` / ``adamw_weight_decay`` override).
    """
    return [
        ParamGroupConfig(
            pattern=ADAMW_PATTERN,
            optimizer_name="AdamW",
            optimizer_kwargs={
                "lr": lr if adamw_lr is None else adamw_lr,
                "betas": tuple(adamw_betas),
                "eps": adamw_eps,
                "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            },
        ),
        ParamGroupConfig(
            pattern=r".*",
            optimizer_name="Muon",
            optimizer_kwargs={
                "lr": lr,
                "weight_decay": weight_decay,
                "momentum": momentum,
                "nesterov": nesterov,
                "adjust_lr": adjust_lr,
            },
        ),
    ]


def find_hidden_shards(model_parts: Sequence[nn.Module]) -> list[str]:
    """Plain-tensor parameters that hold only a shard of what the model config declares.

    torchtitan models keep their config (``model.config``); building it on the meta device
    gives every parameter's full shape. A parameter that is not a DTensor and has another
    shape is a shard whose layout the optimizer cannot see (torchtitan's ``spmd_types``
    backend produces these for tensor parallelism). Parts without a buildable config are not
    checked. Returns one line per such parameter.
    """
    found = []
    declared_by_config: dict[int, dict[str, tuple[int, ...]]] = {}  # pipeline stages share one config
    for part in model_parts:
        config = getattr(part, "config", None)
        plain = [(n, p) for n, p in part.named_parameters() if not is_dtensor(p)]
        if not plain or config is None or not callable(getattr(config, "build", None)):
            continue
        if id(config) not in declared_by_config:
            with torch.device("meta"):
                declared_by_config[id(config)] = {
                    canonical_fqn(n): tuple(p.shape) for n, p in config.build().named_parameters()
                }
        declared = declared_by_config[id(config)]
        for name, p in plain:
            shape = declared.get(canonical_fqn(name))
            if shape is not None and shape != tuple(p.shape):
                found.append(f"'{canonical_fqn(name)}': local shape {tuple(p.shape)}, declared {shape}")
    return found


def _resolve_callable(spec: str) -> Callable:
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"qk_logits_fn must be 'package.module:function', got {spec!r}")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"qk_logits_fn {spec!r} is not callable")
    return fn


# ------------------------------------------------------------ attention layouts of the model

def layer_key(fqn: str) -> LayerKey | None:
    """The QK-clip layer key of a parameter or module FQN of a torchtitan model.

    ``layers.3.attention.qkv_linear.wqkv.weight -> 3`` (an int, as ``qk_logits`` of the main
    layers are keyed); a block in another list keeps its list's name, so deepseek_v3's
    multi-token-prediction layer ``mtp_layers.0.attention.wq_b.weight -> "mtp_layers.0"`` does not
    collide with ``layers.0``. Wrapper segments (``_orig_mod``, ``_checkpoint_wrapped_module``,
    ``_fsdp_wrapped_module``) are ignored. None when no component is an integer.
    """
    parts = canonical_fqn(fqn).split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return int(part) if parts[:i] == ["layers"] else ".".join(parts[: i + 1])
    return None


@dataclass(frozen=True, eq=False)
class _TorchtitanQKRoles:
    """``QKClipConfig.classify`` for torchtitan FQNs: roles by the name patterns, layers by :func:`layer_key`.

    A module-level class rather than a closure: picklable, with a readable repr.
    """

    patterns: QKClipConfig

    def __call__(self, name: str) -> QKRole | None:
        role = classify_qk_param(name, self.patterns)
        return None if role is None else (layer_key(name), role[1])


@dataclass(frozen=True)
class AttentionLayout:
    """How one torchtitan attention module lays out its query/key rows.

    ``kind`` is ``"separate"`` (``wq``/``wk``, ``head_dim`` rows per head), ``"fused"``
    (``FusedQKVLinear.wqkv``: ``fused`` holds its :class:`~optimizer.attention_layouts.FusedQKV`
    with torchtitan's ``"grouped"`` layout; None for another projection class with a ``wqkv``,
    whose row order is unknown) or ``"mla"`` (deepseek_v3 ``Attention``: ``mla``).
    ``fused_weight`` is the FQN of the fused weight (canonical, as param groups name it).
    ``qk_norm``: q and k are RMS-normalised per head after the projection (qwen3's
    ``q_norm``/``k_norm``), which undoes any scaling of the projection rows.
    """

    fqn: str
    layer: LayerKey | None
    kind: str
    n_heads: int
    n_kv_heads: int
    head_dim: int | None = None
    fused: FusedQKV | None = None
    fused_weight: str | None = None
    mla: MLAHeads | None = None
    qk_norm: bool = False


def attention_layouts(model_parts: Sequence[nn.Module]) -> list[AttentionLayout]:
    """Every attention module (torchtitan ``BaseAttention``) of ``model_parts`` and its q/k layout.

    Read from the modules themselves (their ``n_heads``/``n_kv_heads``/``head_dim`` are the
    config's global values; tensor parallelism does not change them), so pipeline stages,
    whose parts have no model config, work too.

    torchtitan 0.3's ``FusedQKVLinear`` views ``wqkv``'s output as ``[..., n_kv_heads,
    n_heads // n_kv_heads + 2, head_dim]`` and splits the second-last dimension into the group's
    query heads, its key head and its value head: the ``"grouped"`` layout of
    :class:`~optimizer.attention_layouts.FusedQKV` (tests check it against that module's forward).
    Another projection class with a ``wqkv`` gets ``fused=None``: QK-clip and split
    orthogonalisation refuse it rather than guess its row order.
    """
    found = []
    for part in model_parts:
        for name, m in part.named_modules():
            if not isinstance(m, BaseAttention):
                continue
            fqn = canonical_fqn(name)
            layer = layer_key(fqn)
            if all(hasattr(m, a) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "wkv_b")):
                found.append(AttentionLayout(
                    fqn, layer, "mla", int(m.n_heads), int(m.n_heads),
                    mla=MLAHeads(int(m.qk_nope_head_dim), int(m.qk_rope_head_dim), int(m.v_head_dim))))
                continue
            qk_norm = getattr(m, "q_norm", None) is not None or getattr(m, "k_norm", None) is not None
            qkv = getattr(m, "qkv_linear", None)
            if qkv is not None and hasattr(qkv, "wqkv"):
                n_heads, n_kv, head_dim = int(m.n_heads), int(m.n_kv_heads), int(m.head_dim)
                fused = FusedQKV(n_heads, n_kv, head_dim, "grouped") if isinstance(qkv, FusedQKVLinear) else None
                found.append(AttentionLayout(fqn, layer, "fused", n_heads, n_kv, head_dim, fused=fused,
                                             fused_weight=f"{fqn}.qkv_linear.wqkv.weight", qk_norm=qk_norm))
                continue
            head_dim = getattr(m, "head_dim", None)
            n_heads = getattr(m, "n_heads", None)
            if isinstance(head_dim, int) and isinstance(n_heads, int):
                n_kv = getattr(m, "n_kv_heads", None) or n_heads
                found.append(AttentionLayout(fqn, layer, "separate", n_heads, int(n_kv), head_dim, qk_norm=qk_norm))
    return found


def _single(values: Iterable, what: str, hint: str):
    distinct = sorted(set(values), key=repr)
    if len(distinct) != 1:
        raise ValueError(
            f"MuonOptimizersContainer: the model's attention modules have {what} "
            f"{distinct or 'nowhere'}, not one value; {hint}"
        )
    return distinct[0]


def _check_known_fused(layouts: Sequence[AttentionLayout], need: str) -> None:
    unknown = [a.fqn for a in layouts if a.kind == "fused" and a.fused is None]
    if unknown:
        raise ValueError(
            f"MuonOptimizersContainer: {unknown[:3]} project q/k/v with a fused `wqkv` that is not torchtitan's "
            f"FusedQKVLinear, whose row order ('grouped') is known here; {need}. Build optimizer.Muon with "
            "QKClipConfig(fused_qkv=FusedQKV(..., layout=...)) and muon_row_blocks by hand for such a model."
        )


FUSED_QKV_ORTHOGONALIZATION = ("split", "per_head", "whole")


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container with one ``optimizer.Muon`` per model part.

    Build it from :class:`MuonOptimizersContainer.Config` (the trainer calls
    ``config.build(model_parts=...)``). ``step()`` fetches QK-clip logits from the logits source
    (a :class:`MaxLogitRecorder` or ``qk_logits_fn``) when QK-clip is on and steps every part's
    Muon; ``zero_grad``, ``state_dict``/``load_state_dict`` (FQN-keyed, for DCP), step hooks and
    torchtitan's LR scheduler are those of torchtitan's container.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        param_groups: list[ParamGroupConfig] = field(default_factory=default_param_groups)
        """torchtitan ParamGroupConfigs with optimizer_name "Muon" or "AdamW" (first match wins)."""

        implementation: str = "auto"
        """Only "auto": Muon picks AdamW's kernel itself (fused on CUDA, foreach elsewhere)."""

        ns_eps: float = 1e-7
        """Newton–Schulz normalisation epsilon (Muon's ``eps``)."""

        compute_dtype: str | None = None
        """Newton–Schulz dtype: "bfloat16", "float32", or None (bf16 on CUDA, fp32 on CPU)."""

        distributed_mode: str = "parallel"
        """"parallel" (one owner per matrix) or "gather" (every rank gathers every matrix)."""

        chunk_size: int | None = None
        lookahead: int = 1
        skip_nonfinite: bool = False

        fused_qkv_orthogonalization: str = "split"
        """How Muon orthogonalises a fused ``wqkv`` (torchtitan's FusedQKVLinear): "split" — its q, k
        and v rows as three matrices, exactly as separate wq/wk/wv would be (the default: fusing is a
        kernel-launch optimisation and should not change the training maths); "per_head" — every q, k
        and v head as its own matrix; "whole" — the fused matrix as one."""

        qk_clip_threshold: float | None = None
        """Enable QK-clip with this max-logit threshold (Kimi K2 uses 100)."""

        qk_clip_head_dim: int | None = None
        """Rows per head of separate q/k weights; None reads it from the model's attention modules
        (fused wqkv and MLA head sizes are always read from them)."""

        qk_clip_q_patterns: tuple[str, ...] | None = None
        """Name components of query weights; None: ("wq", "q_proj"), or ("wq", "wq_b") for MLA."""

        qk_clip_k_patterns: tuple[str, ...] | None = None
        """Name components of key weights; None: ("wk", "k_proj"), or ("wkv_b",) for MLA."""

        qk_logits_fn: str | None = None
        """"package.module:function" called as fn(model_parts) before each step; returns
        {layer key: per-query-head max logits (1-D, same on every rank)} or None."""

        record_max_logits_every: int | None = None
        """Take QK-clip's logits from a MaxLogitRecorder that records them during the training
        forward of every N-th step (other steps do not clip). The recorder needs the trainer's
        ParallelDims: install_max_logit_recorder (torchtitan's post_optimizer_build_fn, which
        enable_muonclip sets) attaches it."""

        record_max_logits_dtype: str = "float32"
        """dtype of the recorder's q.k matmul: "float32" (the max is not rounded) or "bfloat16"
        (about as fast as the model's own bf16 matmuls; the max is rounded to bf16, ~0.4%)."""

    optimizers: list[Muon]

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        self._check_config(config)
        hidden = find_hidden_shards(model_parts)
        if hidden:
            raise ValueError(
                "MuonOptimizersContainer: these parameters are plain tensors holding a shard of the declared "
                "weight, so Muon cannot see their layout and would orthogonalise the shard alone:\n  "
                + "\n  ".join(hidden)
                + "\ntorchtitan's 'spmd_types' backend leaves tensor-parallel shards as plain tensors; set "
                "parallelism.spmd_backend to 'partial_dtensor' or 'full_dtensor'."
            )
        self.model_parts = model_parts
        layouts = attention_layouts(model_parts)
        self.qk_clip_config = self._qk_clip_config(config, layouts)
        self.record_max_logits_every = config.record_max_logits_every
        self.record_max_logits_dtype = _DTYPES[config.record_max_logits_dtype]
        self._qk_logits_fn: QKLogitsFn | None = None
        if config.qk_logits_fn is not None:
            self.set_qk_logits_fn(_resolve_callable(config.qk_logits_fn))
        row_blocks = self._fused_row_blocks(config.fused_qkv_orthogonalization, layouts)

        self.optimizers = []
        self._qk_layers: list[set] = []
        all_params: list[nn.Parameter] = []
        for part_index, part in enumerate(model_parts):
            groups = self._muon_param_groups(part, config.param_groups, part_index, row_blocks)
            layers = self._layers_with_q(groups)
            opt = Muon(
                groups,
                eps=config.ns_eps,
                compute_dtype=None if config.compute_dtype is None else _DTYPES[config.compute_dtype],
                # a pipeline stage without attention weights clips nothing (the library refuses an
                # empty QK-clip config); whether the model has any is checked below
                qk_clip=self.qk_clip_config if layers else None,
                distributed_mode=config.distributed_mode,
                chunk_size=config.chunk_size,
                lookahead=config.lookahead,
                skip_nonfinite=config.skip_nonfinite,
            )
            self.optimizers.append(opt)
            self._qk_layers.append(layers)
            for group in groups:
                all_params.extend(group["params"])
        if self.qk_clip_config is not None and not any(self._qk_layers):
            cfg = self.qk_clip_config.classify.patterns
            raise ValueError(
                "MuonOptimizersContainer: QK-clip is on but no Muon-group parameter is a query or key weight by "
                f"the patterns q={cfg.q_patterns}, k={cfg.k_patterns}, qkv={cfg.qkv_patterns}; set "
                "qk_clip_q_patterns / qk_clip_k_patterns to the names of the model's projections, or move them "
                "to a Muon param group."
            )
        self._validate_params(all_params)
        self._post_init(all_params)

    @property
    def qk_layers(self) -> set:
        """Layer keys of the query/key weights this container clips (over all model parts)."""
        return set().union(*self._qk_layers)

    # ------------------------------------------------------------------ building

    @staticmethod
    def _check_config(config: Config) -> None:
        if config.implementation != "auto":
            raise ValueError(
                f"MuonOptimizersContainer: implementation={config.implementation!r} is not used by Muon, which "
                "picks AdamW's kernel itself (fused on CUDA, foreach elsewhere); leave it at 'auto'."
            )
        if config.compute_dtype is not None and config.compute_dtype not in _DTYPES:
            raise ValueError(
                f"MuonOptimizersContainer: compute_dtype must be one of {sorted(_DTYPES)} or None, "
                f"got {config.compute_dtype!r}"
            )
        if config.fused_qkv_orthogonalization not in FUSED_QKV_ORTHOGONALIZATION:
            raise ValueError(
                "MuonOptimizersContainer: fused_qkv_orthogonalization must be one of "
                f"{FUSED_QKV_ORTHOGONALIZATION}, got {config.fused_qkv_orthogonalization!r}"
            )
        every = config.record_max_logits_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(
                f"MuonOptimizersContainer: record_max_logits_every must be a positive int (record every N-th "
                f"step) or None, got {every!r}"
            )
        if config.record_max_logits_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                "MuonOptimizersContainer: record_max_logits_dtype must be 'float32' or 'bfloat16', got "
                f"{config.record_max_logits_dtype!r}"
            )
        if config.qk_clip_threshold is None:
            for name in ("qk_logits_fn", "record_max_logits_every"):
                if getattr(config, name) is not None:
                    raise ValueError(
                        f"MuonOptimizersContainer: {name} is set but qk_clip_threshold is None; set the threshold "
                        f"to enable QK-clip, or drop {name}."
                    )
        if config.qk_logits_fn is not None and every is not None:
            raise ValueError(
                "MuonOptimizersContainer: qk_logits_fn and record_max_logits_every are both set; QK-clip takes "
                "its logits from one source: keep one of them."
            )

    @staticmethod
    def _qk_clip_config(config: Config, layouts: Sequence[AttentionLayout]) -> QKClipConfig | None:
        if config.qk_clip_threshold is None:
            return None
        normed = [a.fqn for a in layouts if a.qk_norm]
        if normed:
            raise ValueError(
                f"MuonOptimizersContainer: QK-clip scales the rows of the query/key projections, but {normed[:3]}"
                f"{' ...' if len(normed) > 3 else ''} RMS-normalise q and k per head after them (q_norm/k_norm, "
                "as qwen3 does), which undoes that scaling: QK-clip would change nothing. QK-norm bounds the "
                "logits itself; leave qk_clip_threshold unset for this model."
            )
        kinds = {a.kind for a in layouts}
        patterns = dict(q_patterns=config.qk_clip_q_patterns, k_patterns=config.qk_clip_k_patterns)
        if "mla" in kinds:
            if kinds != {"mla"}:
                raise ValueError(
                    "MuonOptimizersContainer: the model mixes multi-head latent attention with other attention "
                    f"({sorted(kinds)}); one QK-clip config describes one kind. Build optimizer.Muon with "
                    "QKClipConfig(classify=...) by hand for such a model."
                )
            if config.qk_clip_head_dim is not None:
                raise ValueError(
                    "MuonOptimizersContainer: qk_clip_head_dim is set, but the model uses multi-head latent "
                    "attention, whose head sizes are read from its attention modules; leave it None."
                )
            mla = _single((a.mla for a in layouts), "MLA head sizes", "QK-clip needs one MLAHeads for every layer.")
            base = QKClipConfig(threshold=config.qk_clip_threshold, mla=mla, **patterns)
        else:
            fused = None
            if "fused" in kinds:
                _check_known_fused(layouts, "QK-clip needs the row order of q and k")
                fused = _single((a.fused for a in layouts if a.kind == "fused"), "fused wqkv layouts",
                                "QK-clip needs one FusedQKV for every fused layer.")
            head_dim = config.qk_clip_head_dim
            if head_dim is None and "separate" in kinds:
                head_dim = _single((a.head_dim for a in layouts if a.kind == "separate"), "head_dim",
                                   "set qk_clip_head_dim.")
            elif head_dim is None and fused is None:
                raise ValueError(
                    "MuonOptimizersContainer: set qk_clip_head_dim; the model parts have no torchtitan attention "
                    "module to read it from."
                )
            base = QKClipConfig(head_dim=head_dim, threshold=config.qk_clip_threshold, fused_qkv=fused, **patterns)
        return dataclasses.replace(base, classify=_TorchtitanQKRoles(base))

    @staticmethod
    def _fused_row_blocks(mode: str, layouts: Sequence[AttentionLayout]) -> dict[str, Any]:
        """``{fused weight FQN: row-block spec}`` for Muon's ``muon_row_blocks`` (empty for "whole")."""
        if mode == "whole":
            return {}
        _check_known_fused(layouts, f"fused_qkv_orthogonalization={mode!r} needs the row order of q, k and v "
                                    "(or set it to 'whole')")
        return {a.fused_weight: a.fused if mode == "split" else SplitQKV(a.fused, per_head=True)
                for a in layouts if a.kind == "fused"}

    @staticmethod
    def _muon_param_groups(part: nn.Module, configs: Sequence[ParamGroupConfig], part_index: int,
                           row_blocks: Mapping[str, Any]) -> list[dict]:
        """Muon param groups for one model part: torchtitan's first-match-wins regex grouping."""
        claimed: set[int] = set()
        groups = []
        named = [(n, p) for n, p in part.named_parameters() if p.requires_grad]
        for pg in configs:
            if pg.optimizer_name not in ("Muon", "AdamW"):
                raise ValueError(
                    f"MuonOptimizersContainer: param group '{pg.pattern}' has optimizer_name "
                    f"{pg.optimizer_name!r}; use 'Muon' for matrices or 'AdamW' for the rest (one Muon runs both)."
                )
            allowed = MUON_GROUP_KEYS if pg.optimizer_name == "Muon" else ADAMW_GROUP_KEYS
            unknown = sorted(set(pg.optimizer_kwargs) - allowed)
            if unknown:
                raise ValueError(
                    f"MuonOptimizersContainer: param group '{pg.pattern}' ({pg.optimizer_name}) has unknown "
                    f"optimizer_kwargs {unknown}; allowed: {sorted(allowed)}."
                )
            pattern = re.compile(pg.pattern)
            matched = [(n, p) for n, p in named if id(p) not in claimed and pattern.search(n)]
            if not matched:
                raise ValueError(
                    f"MuonOptimizersContainer: param group pattern '{pg.pattern}' matched no parameter of model "
                    f"part {part_index}; remove it or fix the pattern."
                )
            claimed.update(id(p) for _, p in matched)
            names = [canonical_fqn(n) for n, _ in matched]
            group = {"params": [p for _, p in matched], "param_names": names,
                     "use_muon": pg.optimizer_name == "Muon", **pg.optimizer_kwargs}
            blocks = {n: row_blocks[n] for n in names if n in row_blocks}
            if group["use_muon"] and blocks:
                group[ROW_BLOCKS_KEY] = blocks
            groups.append(group)
        missing = [canonical_fqn(n) for n, p in named if id(p) not in claimed]
        if missing:
            raise ValueError(
                f"MuonOptimizersContainer: no param group pattern matches {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''} (model part {part_index}); end the list with a catch-all "
                "pattern '.*'."
            )
        return groups

    def _layers_with_q(self, groups: Sequence[dict]) -> set:
        """Layers with a query, key or fused weight among ``groups``' parameters.

        That every such layer has both its query and its key weight, in Muon groups, is checked
        by Muon itself when it is built (one error naming the weights).
        """
        if self.qk_clip_config is None:
            return set()
        return {role[0] for group in groups for name in group["param_names"]
                for role in [self.qk_clip_config.classify(name)] if role is not None}

    # ------------------------------------------------------------------ stepping

    def set_qk_logits_fn(self, fn: QKLogitsFn | None) -> None:
        """Where QK-clip logits come from: ``fn(model_parts) -> {layer: logits} | None``, called before each step.

        A :class:`MaxLogitRecorder` this replaces has its hooks removed.
        """
        if fn is not None and not callable(fn):
            raise ValueError(f"MuonOptimizersContainer: qk_logits_fn must be callable, got {fn!r}")
        if fn is not None and self.qk_clip_config is None:
            raise ValueError("MuonOptimizersContainer: QK-clip is off (qk_clip_threshold=None); no logits are used.")
        old = self._qk_logits_fn
        if isinstance(old, MaxLogitRecorder) and old is not fn:
            old.remove()
        self._qk_logits_fn = fn

    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError("MuonOptimizersContainer.step: closures are not supported (as in torchtitan's container)")
        logits = None
        if self.qk_clip_config is not None:
            if self._qk_logits_fn is None:
                how = (
                    "record_max_logits_every is set, so install the recorder: install_max_logit_recorder(container, "
                    "model_parts, parallel_dims) (enable_muonclip(config) makes torchtitan's trainer call it as "
                    "model_spec.post_optimizer_build_fn)"
                    if self.record_max_logits_every is not None
                    else "set Config.qk_logits_fn or call set_qk_logits_fn(fn)"
                )
                raise RuntimeError(f"MuonOptimizersContainer.step: QK-clip is on but no logits source is set; {how}.")
            logits = self._qk_logits_fn(self.model_parts)
        for opt, layers in zip(self.optimizers, self._qk_layers):
            # each model part (pipeline stage) clips only its own layers
            opt.step(qk_logits=None if logits is None or not layers else
                     {k: v for k, v in logits.items() if k in layers})
        return None


# ------------------------------------------------------------- max logits from the attention modules

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
    fp32 matmuls are several times slower than bf16 ones). README "torchtitan" has a measurement. ``every=N`` records only the forwards of every N-th step (the other steps
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
        wanted = None if layers is None else set(layers)
        self._local_heads: dict = {}  # layer -> query heads on this rank (to fill a layer that did not run)
        self._device: dict = {}
        self._hooks: list = []
        inners = []  # everything is checked before the first hook is registered
        for part in model_parts:
            for name, m in part.named_modules():
                if not isinstance(m, BaseAttention):
                    continue
                fqn = canonical_fqn(name)
                layer = layer_key(fqn)
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
        for layer, fqn, inner in inners:
            self._hooks.append(inner.register_forward_pre_hook(
                functools.partial(self._hook, layer, fqn), with_kwargs=True))
        self.layers = sorted(self._local_heads, key=layer_sort_key)
        self._step = 0
        self._local: dict = {}
        self._forwards = 0

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


# ----------------------------------------------------------------------- torchtitan's own Muon

def dist_muon_compute_layouts(named_params: Sequence[tuple[str, Tensor]]) -> dict[str, Any]:
    """The compute layout torchtitan's DistMuon needs per parameter, chosen like its Kimi recipe.

    2-D weights: ``Owned()`` (one owner rank orthogonalises the whole matrix) on every mesh axis
    the weight is sharded over; 3-D expert stacks ``[E, out, in]``: ``Shard(0)`` (whole experts
    per rank). DistMuon does not support ``_StridedShard`` (torchtitan TODO #3353: TP with
    FSDP), so such parameters are refused here.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    layouts = {}
    for name, p in named_params:
        if not is_dtensor(p) or p.device_mesh.mesh_dim_names is None:
            raise ValueError(f"torchtitan's DistMuon needs DTensors on a mesh with named axes; '{name}' is not one")
        if any(isinstance(pl, _StridedShard) for pl in p.placements):
            raise ValueError(
                f"torchtitan's DistMuon does not support _StridedShard ('{name}' has {tuple(p.placements)}, "
                "from TP combined with FSDP)"
            )
        if p.ndim not in (2, 3):
            raise ValueError(f"torchtitan's DistMuon handles 2-D and 3-D weights; '{name}' has shape {tuple(p.shape)}")
        sharded_axes = [ax for ax, pl in zip(p.device_mesh.mesh_dim_names, p.placements) if pl.is_shard()]
        if p.ndim == 3:
            spec = {ax: Shard(0) for ax in sharded_axes}
        else:
            spec = {ax: Owned() for ax in sharded_axes}
        layouts[name] = ComputeLayout(shardings_by_mesh_axis=spec or {p.device_mesh.mesh_dim_names[0]: Replicate()})
    return layouts


def build_torchtitan_dist_muon(
    named_params: Sequence[tuple[str, Tensor]],
    *,
    lr: float,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    adjust_lr: str = "match_rms_adamw",
) -> torch.optim.Optimizer:
    """torchtitan's own distributed Muon (``torchtitan.distributed.flex_shard.DistMuon``) on ``named_params``.

    For comparisons (benchmarks/step_time.py): the same hyperparameters as ``optimizer.Muon``
    with ``ns_coefficients="fixed"``. DistMuon runs only with one CUDA device per process and
    bf16 Newton–Schulz; on other devices this raises RuntimeError before building anything.
    """
    devices = {(p.to_local() if is_dtensor(p) else p).device.type for _, p in named_params}
    if devices != {"cuda"}:
        raise RuntimeError(
            f"torchtitan's DistMuon runs only on CUDA (one device per process); these parameters are on {sorted(devices)}"
        )
    if adjust_lr not in ("match_rms_adamw", "original"):
        raise ValueError(f"adjust_lr must be 'match_rms_adamw' or 'original' for DistMuon, got {adjust_lr!r}")
    layouts = dist_muon_compute_layouts(named_params)
    # A bucket must resolve to one transport group: one bucket per set of mesh axes sharded over.
    buckets: dict[tuple[str, ...], list[str]] = {}
    for name, _ in named_params:
        buckets.setdefault(tuple(layouts[name].shardings_by_mesh_axis), []).append(glob.escape(name))
    return build_dist_muon(
        [{"params": [p for _, p in named_params], "param_names": [n for n, _ in named_params]}],
        compute_sharding_by_fqn=layouts,
        bucket_configs=tuple(BucketConfig(patterns=tuple(names), name="-".join(axes)) for axes, names in buckets.items()),
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr,
    )
