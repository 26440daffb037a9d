"""torchtitan's optimizer container with one ``optimizer.Muon`` per model part, built from config.

torchtitan's trainer builds ``config.optimizer.build(model_parts=...)`` and then uses the result
as a ``torch.optim.Optimizer`` (``step``, ``zero_grad``, hooks), hands it to its LR scheduler
(``LambdaLR`` per optimizer) and checkpoints it through DCP with FQN-keyed flat state dicts.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ...muon import Muon
from ...model_facts import ModelFacts
from ...param_groups import MOE_ROUTER_PATTERN, muon_choice_problems
from ...roles import RoleRow, RoleTable, decide
from ...qk_clip import QKClipConfig
from ...row_blocks import ROW_BLOCKS_KEY, SplitQKV
from ...settings import ADAMW, MUON, options_of
from ...tensors import is_dtensor
from ._torchtitan import OptimizersContainer, ParamGroupConfig, canonical_fqn
from .layouts import AttentionLayout, TorchtitanQKRoles, attention_layouts, check_known_fused, single

QKLogitsFn = Callable[[list[nn.Module]], Mapping[int, Tensor] | None]
logger = logging.getLogger(__name__)

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

# What a group's optimizer_kwargs may set: every per-group option of its kind (settings.GROUP_OPTIONS,
# so an option added there is accepted here too), except the row blocks this container sets itself
# (``fused_qkv_orthogonalization``).
MUON_GROUP_KEYS = frozenset(o.name for o in options_of(MUON) if o.name != ROW_BLOCKS_KEY)
ADAMW_GROUP_KEYS = frozenset(o.name for o in options_of(ADAMW))
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
            mla = single((a.mla for a in layouts), "MLA head sizes", "QK-clip needs one MLAHeads for every layer.")
            base = QKClipConfig(threshold=config.qk_clip_threshold, mla=mla, **patterns)
        else:
            fused = None
            if "fused" in kinds:
                check_known_fused(layouts, "QK-clip needs the row order of q and k")
                fused = single((a.fused for a in layouts if a.kind == "fused"), "fused wqkv layouts",
                                "QK-clip needs one FusedQKV for every fused layer.")
            head_dim = config.qk_clip_head_dim
            if head_dim is None and "separate" in kinds:
                head_dim = single((a.head_dim for a in layouts if a.kind == "separate"), "head_dim",
                                   "set qk_clip_head_dim.")
            elif head_dim is None and fused is None:
                raise ValueError(
                    "MuonOptimizersContainer: set qk_clip_head_dim; the model parts have no torchtitan attention "
                    "module to read it from."
                )
            base = QKClipConfig(head_dim=head_dim, threshold=config.qk_clip_threshold, fused_qkv=fused, **patterns)
        return dataclasses.replace(base, classify=TorchtitanQKRoles(base))

    @staticmethod
    def _fused_row_blocks(mode: str, layouts: Sequence[AttentionLayout]) -> dict[str, Any]:
        """``{fused weight FQN: row-block spec}`` for Muon's ``muon_row_blocks`` (empty for "whole")."""
        if mode == "whole":
            return {}
        check_known_fused(layouts, f"fused_qkv_orthogonalization={mode!r} needs the row order of q, k and v "
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
        _check_roles(part, part_index, groups, [pg.pattern for pg in configs])
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


def _check_roles(part: nn.Module, part_index: int, groups: Sequence[dict], patterns: Sequence[str]) -> None:
    """The roles' rule over the patterns' choice (``optimizer.roles``): a Muon pattern may not claim
    what Muon cannot read as a matrix (a convolution's kernel, a vector in disguise); the table of
    where each parameter went, with its role, is logged at DEBUG level."""
    facts = ModelFacts(part)
    problems = [problem for g, pattern in zip(groups, patterns) if g["use_muon"]
                for problem in muon_choice_problems(part, list(zip(g["param_names"], g["params"])),
                                                    f"param group pattern '{pattern}'", facts)]
    if problems:
        raise ValueError("MuonOptimizersContainer: " + "\n".join(problems) + "\nMatch these parameters with an AdamW "
                         "ParamGroupConfig placed before the Muon one (first match wins).")
    if logger.isEnabledFor(logging.DEBUG):
        table = RoleTable(
            RoleRow(name, tuple(p.shape), gi, "muon" if g["use_muon"] else "adamw", d.role,
                    f"pattern '{pattern}'; the role's rule: {d.rule}")
            for gi, (g, pattern) in enumerate(zip(groups, patterns)) for name, p in zip(g["param_names"], g["params"])
            for d in [decide(name, p, facts)])
        logger.debug("MuonOptimizersContainer: model part %d, where each parameter went\n%s", part_index, table)
