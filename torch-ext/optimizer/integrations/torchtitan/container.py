"""torchtitan's optimizer container with one ``optimizer.Muon`` per model part, built from config.

torchtitan's trainer builds ``config.optimizer.build(model_parts=...)`` and then uses the result
as a ``torch.optim.Optimizer`` (``step``, ``zero_grad``, hooks), hands it to its LR scheduler
(``LambdaLR`` per optimizer) and checkpoints it through DCP with FQN-keyed flat state dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ...muon import Muon
from ...param_groups import MOE_ROUTER_PATTERN
from ...tensors import is_dtensor
from ._torchtitan import OptimizersContainer, ParamGroupConfig, canonical_fqn
# The container's parts by role: the Config's checks, the param groups, the QK-clip and fused-weight
# set-up.  Their names are re-exported here, where they were defined before the split.
from .config_checks import DTYPES, FUSED_QKV_ORTHOGONALIZATION, check_config  # noqa: F401
from .groups import ADAMW_GROUP_KEYS, MUON_GROUP_KEYS, muon_param_groups  # noqa: F401
from .layouts import attention_layouts
from .qk_clip_setup import fused_row_blocks, layers_with_q, qk_clip_config, resolve_callable

QKLogitsFn = Callable[[list[nn.Module]], Mapping[int, Tensor] | None]

# torchtitan 0.3 FQNs that belong on AdamW: embeddings (tok_embeddings), the output head
# (lm_head; "output" in older releases), MoE routers (torchtitan's router.gate; the one router
# policy of optimizer.param_groups, shared with the Hugging Face grouping), norms (attention_norm,
# ffn_norm, q_norm, k_norm, kv_norm, norm) and biases.
ADAMW_PATTERN = (
    r"(^|\.)(tok_embeddings|embed_tokens|lm_head|output)\.weight$"
    rf"|{MOE_ROUTER_PATTERN}"
    r"|norm\.weight$"
    r"|\.bias$"
)



def default_param_groups(
    *,
    lr: float = 2e-2,
    weight_decay: float = 0.1,
    momentum: float | None = None,
    nesterov: bool | None = None,
    adjust_lr: str | None = "match_rms_adamw",
    adamw_lr: float | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float | None = None,
    dion2_fraction: float | None = None,
    dion2_ef_decay: float | None = None,
    normuon_beta2: float | None = None,
) -> list[ParamGroupConfig]:
    """Presets for torchtitan's models: :data:`ADAMW_PATTERN` to AdamW, everything else to Muon.

    With ``adjust_lr="match_rms_adamw"`` (the default) Muon's update has AdamW's RMS, so one
    ``lr`` and ``weight_decay`` serve both (``adamw_lr`` / ``adamw_weight_decay`` override).
    ``momentum`` / ``nesterov``: None is Muon's 0.95 / True.  ``dion2_fraction`` makes the Muon
    group Dion2 (``dion2_ef_decay``; NorDion2 with ``normuon_beta2``: docs/dion2.md), which has no
    momentum coefficient: ``momentum`` / ``nesterov`` given with it are refused, naming them.
    """
    if dion2_fraction is not None:
        given = [name for name, value in (("momentum", momentum), ("nesterov", nesterov)) if value is not None]
        if given:
            raise ValueError(
                f"default_param_groups: {given} given with dion2_fraction={dion2_fraction!r}, but a Dion2 group has "
                "no momentum coefficient (its momentum is the sum M + G, the chosen slices decayed by "
                "dion2_ef_decay); remove them")
        muon_kwargs = {"dion2_fraction": dion2_fraction}
    else:
        muon_kwargs = {"momentum": 0.95 if momentum is None else momentum,
                       "nesterov": True if nesterov is None else nesterov}
    extra = {k: v for k, v in (("dion2_ef_decay", dion2_ef_decay), ("normuon_beta2", normuon_beta2)) if v is not None}
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
            optimizer_kwargs={"lr": lr, "weight_decay": weight_decay, **muon_kwargs, "adjust_lr": adjust_lr, **extra},
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
        """Name components of query weights; None: QKClipConfig's defaults (("q_proj", "wq"); for MLA also "wq_b", "q_b_proj")."""

        qk_clip_k_patterns: tuple[str, ...] | None = None
        """Name components of key weights; None: QKClipConfig's defaults (("k_proj", "wk"); for MLA "wkv_b", "kv_b_proj")."""

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
        check_config(config)
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
        self.qk_clip_config = qk_clip_config(config, layouts)
        self.record_max_logits_every = config.record_max_logits_every
        self.record_max_logits_dtype = DTYPES[config.record_max_logits_dtype]
        self._qk_logits_fn: QKLogitsFn | None = None
        if config.qk_logits_fn is not None:
            self.set_qk_logits_fn(resolve_callable(config.qk_logits_fn))
        row_blocks = fused_row_blocks(config.fused_qkv_orthogonalization, layouts)

        self.optimizers = []
        self._qk_layers: list[set] = []
        all_params: list[nn.Parameter] = []
        for part_index, part in enumerate(model_parts):
            groups = muon_param_groups(part, config.param_groups, part_index, row_blocks)
            layers = layers_with_q(self.qk_clip_config, groups)
            opt = Muon(
                groups,
                eps=config.ns_eps,
                compute_dtype=None if config.compute_dtype is None else DTYPES[config.compute_dtype],
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

    # ------------------------------------------------------------------ stepping

    def set_qk_logits_fn(self, fn: QKLogitsFn | None) -> None:
        """Where QK-clip logits come from: ``fn(model_parts) -> {layer: logits} | None``, called before each step.

        A source this replaces that has a ``remove()`` (a :class:`MaxLogitRecorder`) has its hooks removed.
        """
        if fn is not None and not callable(fn):
            raise ValueError(f"MuonOptimizersContainer: qk_logits_fn must be callable, got {fn!r}")
        if fn is not None and self.qk_clip_config is None:
            raise ValueError("MuonOptimizersContainer: QK-clip is off (qk_clip_threshold=None); no logits are used.")
        old = self._qk_logits_fn
        if old is not fn and callable(getattr(old, "remove", None)):
            old.remove()  # a MaxLogitRecorder: its hooks go with it
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
