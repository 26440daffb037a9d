"""Train with ``optimizer.Muon`` in torchtitan 0.3: an optimizer container its trainer builds from config.

torchtitan's trainer builds ``config.optimizer.build(model_parts=...)`` and then uses the result
as a ``torch.optim.Optimizer`` (``step``, ``zero_grad``, hooks), hands it to its LR scheduler
(``LambdaLR`` per optimizer) and checkpoints it through DCP with FQN-keyed flat state dicts.
:class:`MuonOptimizersContainer` is such a container: one ``optimizer.Muon`` per model part,
holding both its Muon groups and its AdamW groups, so torchtitan's scheduler and checkpointing
work unchanged. In a ``config_registry`` function::

    from optimizer.integrations.torchtitan import MuonOptimizersContainer, default_param_groups

    config.optimizer = MuonOptimizersContainer.Config(param_groups=default_param_groups(lr=2e-2))
    config.parallelism.spmd_backend = "partial_dtensor"   # or "full_dtensor"; see below

Param groups are torchtitan's ``ParamGroupConfig`` (regex on the parameter FQN, first match
wins) with ``optimizer_name`` ``"Muon"`` or ``"AdamW"`` and that group's hyperparameters in
``optimizer_kwargs``. :func:`default_param_groups` sends embeddings, the output head, MoE router
gates, norms and biases to AdamW and every other parameter (2-D weights, 3-D expert stacks) to
Muon.

QK-clip: torchtitan's attention does not report max logits, so the container asks a callable,
``qk_logits_fn(model_parts) -> {layer index: per-query-head max logits} | None``, before each
step (``Config.qk_logits_fn`` as ``"package.module:function"``, or :meth:`set_qk_logits_fn`).
It needs separate q and k weights: torchtitan fuses them into ``wqkv`` unless the model is
built with ``fuse_qkv=False``, and such a model is refused when QK-clip is on.

Layouts: Muon needs to see the layout of every sharded parameter. torchtitan's
``"partial_dtensor"`` and ``"full_dtensor"`` backends give DTensors (FSDP, HSDP, TP with and
without sequence parallel, EP, their combinations); its default ``"spmd_types"`` backend keeps
tensor-parallel shards as plain tensors, and orthogonalising a shard is silently wrong, so a
plain parameter whose shape differs from the one the model config declares is refused.
"""

from __future__ import annotations

import glob
import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

try:
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.distributed.flex_shard import BucketConfig, ComputeLayout, Owned, build_dist_muon
except ImportError as err:  # pragma: no cover - exercised only where torchtitan is missing
    raise ImportError(
        "optimizer.integrations.torchtitan needs torchtitan 0.3 (pip install torchtitan==0.3.0; install "
        "torch first and keep it as a constraint so nothing pulls another torch build). The rest of the "
        f"`optimizer` package works without it. ({err})"
    ) from err

from ..muon import Muon
from ..qk_clip import QKClipConfig, classify_qk_param
from ..tensors import is_dtensor

__all__ = [
    "ADAMW_PATTERN",
    "MuonOptimizersContainer",
    "QKLogitsFn",
    "build_torchtitan_dist_muon",
    "default_param_groups",
    "find_hidden_shards",
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


def _attention_head_dims(model_parts: Sequence[nn.Module]) -> set[int]:
    """head_dim of every attention module (torchtitan's GQAttention has ``n_heads`` and ``head_dim``)."""
    return {
        int(m.head_dim)
        for part in model_parts
        for m in part.modules()
        if isinstance(getattr(m, "head_dim", None), int) and hasattr(m, "n_heads")
    }


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container with one ``optimizer.Muon`` per model part.

    Build it from :class:`MuonOptimizersContainer.Config` (the trainer calls
    ``config.build(model_parts=...)``). ``step()`` fetches QK-clip logits from
    ``qk_logits_fn`` when QK-clip is on and steps every part's Muon; ``zero_grad``,
    ``state_dict``/``load_state_dict`` (FQN-keyed, for DCP), step hooks and torchtitan's LR
    scheduler are those of torchtitan's container.
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

        qk_clip_threshold: float | None = None
        """Enable QK-clip with this max-logit threshold (Kimi K2 uses 100)."""

        qk_clip_head_dim: int | None = None
        """Rows per head in q/k weights; None reads it from the model's attention modules."""

        qk_clip_q_patterns: tuple[str, ...] = ("wq", "q_proj")
        qk_clip_k_patterns: tuple[str, ...] = ("wk", "k_proj")

        qk_logits_fn: str | None = None
        """"package.module:function" called as fn(model_parts) before each step; returns
        {layer index: per-query-head max logits (1-D, same on every rank)} or None."""

    optimizers: list[Muon]

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
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
        self.qk_clip_config = self._qk_clip_config(config, model_parts)
        self._qk_logits_fn: QKLogitsFn | None = None
        if config.qk_logits_fn is not None:
            self.set_qk_logits_fn(_resolve_callable(config.qk_logits_fn))

        self.optimizers = []
        self._qk_layers: list[set[int]] = []
        all_params: list[nn.Parameter] = []
        for part_index, part in enumerate(model_parts):
            groups = self._muon_param_groups(part, config.param_groups, part_index)
            opt = Muon(
                groups,
                eps=config.ns_eps,
                compute_dtype=None if config.compute_dtype is None else _DTYPES[config.compute_dtype],
                qk_clip=self.qk_clip_config,
                distributed_mode=config.distributed_mode,
                chunk_size=config.chunk_size,
                lookahead=config.lookahead,
                skip_nonfinite=config.skip_nonfinite,
            )
            self.optimizers.append(opt)
            self._qk_layers.append(self._layers_with_q(opt))
            for group in groups:
                all_params.extend(group["params"])
        if self.qk_clip_config is not None and not any(self._qk_layers):
            raise ValueError(
                "MuonOptimizersContainer: QK-clip is on but no Muon-group parameter is a query weight by the "
                f"patterns q={config.qk_clip_q_patterns}, k={config.qk_clip_k_patterns}. torchtitan fuses q/k/v "
                "into one `wqkv` weight unless the model is built with fuse_qkv=False; QK-clip needs them apart."
            )
        self._validate_params(all_params)
        self._post_init(all_params)

    # ------------------------------------------------------------------ building

    @staticmethod
    def _qk_clip_config(config: Config, model_parts: Sequence[nn.Module]) -> QKClipConfig | None:
        if config.qk_clip_threshold is None:
            if config.qk_logits_fn is not None:
                raise ValueError(
                    "MuonOptimizersContainer: qk_logits_fn is set but qk_clip_threshold is None; set the threshold "
                    "to enable QK-clip, or drop qk_logits_fn."
                )
            return None
        head_dim = config.qk_clip_head_dim
        if head_dim is None:
            dims = _attention_head_dims(model_parts)
            if len(dims) != 1:
                raise ValueError(
                    "MuonOptimizersContainer: set qk_clip_head_dim; the model's attention modules have head_dim "
                    f"{sorted(dims) or 'nowhere'}, not one value."
                )
            head_dim = dims.pop()
        return QKClipConfig(
            head_dim=head_dim,
            threshold=config.qk_clip_threshold,
            q_patterns=tuple(config.qk_clip_q_patterns),
            k_patterns=tuple(config.qk_clip_k_patterns),
        )

    @staticmethod
    def _muon_param_groups(part: nn.Module, configs: Sequence[ParamGroupConfig], part_index: int) -> list[dict]:
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
            groups.append({
                "params": [p for _, p in matched],
                "param_names": [canonical_fqn(n) for n, _ in matched],
                "use_muon": pg.optimizer_name == "Muon",
                **pg.optimizer_kwargs,
            })
        missing = [canonical_fqn(n) for n, p in named if id(p) not in claimed]
        if missing:
            raise ValueError(
                f"MuonOptimizersContainer: no param group pattern matches {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''} (model part {part_index}); end the list with a catch-all "
                "pattern '.*'."
            )
        return groups

    def _layers_with_q(self, opt: Muon) -> set[int]:
        """Layers whose query weight is in one of ``opt``'s Muon groups; each must have its key weight too."""
        if self.qk_clip_config is None:
            return set()
        roles: dict[int, set[str]] = {}
        for group in opt.param_groups:
            if group["use_muon"]:
                for name in group["param_names"]:
                    role = classify_qk_param(name, self.qk_clip_config)
                    if role is not None:
                        roles.setdefault(role[0], set()).add(role[1])
        lonely = sorted(layer for layer, kinds in roles.items() if kinds == {"q"})
        if lonely:
            raise ValueError(
                f"MuonOptimizersContainer: QK-clip found query weights but no key weight in layers {lonely} "
                f"(k patterns {self.qk_clip_config.k_patterns}); clipping queries alone is not QK-clip. "
                "Multi-head latent attention (deepseek_v3's wkv_b holds keys and values together) is not "
                "supported; for GQA set qk_clip_k_patterns to the key projection's name."
            )
        return {layer for layer, kinds in roles.items() if "q" in kinds}

    # ------------------------------------------------------------------ stepping

    def set_qk_logits_fn(self, fn: QKLogitsFn | None) -> None:
        """Where QK-clip logits come from: ``fn(model_parts) -> {layer: logits} | None``, called before each step."""
        if fn is not None and not callable(fn):
            raise ValueError(f"MuonOptimizersContainer: qk_logits_fn must be callable, got {fn!r}")
        if fn is not None and self.qk_clip_config is None:
            raise ValueError("MuonOptimizersContainer: QK-clip is off (qk_clip_threshold=None); no logits are used.")
        self._qk_logits_fn = fn

    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError("MuonOptimizersContainer.step: closures are not supported (as in torchtitan's container)")
        logits = None
        if self.qk_clip_config is not None:
            if self._qk_logits_fn is None:
                raise RuntimeError(
                    "MuonOptimizersContainer.step: QK-clip is on but no logits source is set; set "
                    "Config.qk_logits_fn or call set_qk_logits_fn(fn)."
                )
            logits = self._qk_logits_fn(self.model_parts)
        for opt, layers in zip(self.optimizers, self._qk_layers):
            # each model part (pipeline stage) clips only its own layers
            opt.step(qk_logits=None if logits is None else {k: v for k, v in logits.items() if k in layers})
        return None


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
