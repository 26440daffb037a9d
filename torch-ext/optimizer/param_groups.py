"""Default split of a model's parameters into a Muon group and AdamW groups.

Muon is for the hidden weight matrices. Embeddings and output heads are matrices too, but they
are lookup tables / classifiers rather than linear maps between hidden states, and Muon's
orthogonalised update is known to do worse on them (Keller Jordan, Moonlight), so they stay on
AdamW together with everything that is not a matrix (norm weights, biases, scalars).

Every parameter gets a **role** (:func:`param_roles`), read from the model itself wherever it says
so, and only the role ``"matrix"`` goes to Muon:

==============  ==========================================================================
role            how it is recognised
==============  ==========================================================================
``adapter``     a PEFT adapter weight (LoRA ``lora_A``/``lora_B``, ...): the sub-modules a
                PEFT tuner layer lists in its ``adapter_layer_names``
``embedding``   an ``nn.Embedding``/``EmbeddingBag``, the module ``model.get_input_embeddings()``
                returns, or a name component containing "embed"
``head``        the module ``model.get_output_embeddings()`` returns; every parameter of a
                Hugging Face model outside its body (``model.base_model``, named by
                ``base_model_prefix``): ``lm_head``, ``score``, ``classifier``, ...; a weight whose
                owning module is named ``lm_head`` or ``output``
``router``      an MoE router weight, by :data:`MOE_ROUTER_PATTERN` (:func:`is_moe_router`)
``conv``        a ``torch.nn`` convolution's parameters (a conv kernel is not a linear map
                between hidden states in its last two dims)
``bias``        a parameter whose own name contains "bias" (also 2-D ones, e.g. MoE expert
                biases ``[E, out]``)
``vector``      0-D/1-D (norm weights, scalars); ``tensor``: 4-D and higher
``matrix``      everything else: 2-D weights and 3-D ``[E, out, in]`` expert stacks -> Muon
==============  ==========================================================================

PEFT wrappers take their module's role: a ``modules_to_save`` copy (``score.modules_to_save.
default.weight``) sits inside the module it copies, so it is a head, a hidden matrix, ... as that
module is; ``base_layer`` / ``original_module`` / ``modules_to_save.<adapter>`` name segments are
ignored by the name rules (:func:`canonical_param_name`).

**LoRA adapters go to AdamW.** ``lora_B @ lora_A`` is a low-rank update of a frozen weight, and
Muon's argument (steepest descent under the spectral norm of the *weight*) is about that product,
not about each factor: orthogonalising the factors separately is not the spectral step of the
product (LoRA-Muon, Cesista et al., arXiv:2606.12921, derives the right rule, which needs the
factors' Gram matrices, and is not what ``Muon`` computes), and ``lora_A`` ``[r, in]`` with ``r``
much smaller than ``in`` has the extreme aspect ratio where an orthogonalised update is mostly
noise (OneTrainer PR #1314 moved ``lora_A`` back to Adam for that). PEFT's own recipes train
adapters with AdamW. Pass ``is_muon`` to choose otherwise.

Two per-parameter facts go into the Muon group for the optimizer core:

* ``"muon_transposed": {param_name: True}`` for weights stored ``[in, out]`` rather than
  ``[out, in]``: Hugging Face's ``Conv1D`` (GPT-2; recognised by module type
  ``transformers.pytorch_utils.Conv1D``) and MoE expert stacks whose module says
  ``is_transposed`` (``[E, in, out]``).
* ``"muon_row_blocks": {param_name: "blocks:I,I"}`` for Hugging Face's fused MoE
  ``gate_up_proj`` ``[E, 2 * I, H]`` (experts modules with ``has_gate`` and
  ``is_concatenated``, transformers' ``use_experts_implementation`` metadata): each expert's
  gate rows and up rows are orthogonalised as the two matrices a dense MLP's ``gate_proj`` and
  ``up_proj`` are. Row specs describe rows of the ``[out, in]`` view, i.e. of the transposed
  tensor for a ``muon_transposed`` weight.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping

from torch import Tensor, nn

from .matrix_view import TRANSPOSED_KEY
from .row_blocks import ROW_BLOCKS_KEY, row_blocks_to_plain
from .settings import ADAMW, options_of

# Owning-module names of output heads ("lm_head.weight" in HF, "output.weight" in torchtitan).
# Matched against the module that owns the weight only, so e.g. BERT's
# "attention.output.dense.weight" (owned by "dense") is still a hidden matrix.
HEAD_MODULE_NAMES = ("lm_head", "output")

#: The MoE router policy, shared by every default grouping (``get_default_muon_param_groups``,
#: the Hugging Face factory, torchtitan's ``default_param_groups``): a router is the ``weight`` of
#: a module named ``gate`` (Hugging Face Mixtral / Qwen-MoE / DeepSeek-V3 ``mlp.gate``, torchtitan
#: ``moe.router.gate``), ``router`` or a child of one (``mlp.router``, ``router.layer``,
#: ``router.classifier``), or ``shared_expert_gate`` (Qwen2-MoE's ``[1, dim]`` shared-expert gate).
#: Routers go to AdamW: a ``[num_experts, dim]`` router is a classifier over experts, like an output
#: head, not a linear map between hidden states. Match it against names without wrapper segments
#: (:func:`canonical_param_name`), or use :func:`is_moe_router`, which does.
MOE_ROUTER_PATTERN = r"(?:^|\.)(?:gate|shared_expert_gate|router(?:\.[A-Za-z_]\w*)?)\.weight$"
_ROUTER_RE = re.compile(MOE_ROUTER_PATTERN)

# Name segments that wrap a module without changing what it is: torch.compile, activation
# checkpointing, FSDP1, and PEFT (LoRA's base_layer, modules_to_save's original_module and
# "modules_to_save.<adapter name>").
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "base_layer",
                    "original_module")

#: transformers' ``Trainer.get_decay_parameter_names`` (5.x): parameters inside an ``nn.LayerNorm``,
#: and parameters whose lower-cased name matches one of these, get no weight decay.
TRAINER_NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
_NO_DECAY_RES = tuple(re.compile(p) for p in TRAINER_NO_DECAY_PATTERNS)

# what ``adamw_options`` may set: every AdamW group option the optimizer declares
ADAMW_OPTION_KEYS = tuple(o.name for o in options_of(ADAMW))
FUSED_GATE_UP_MODES = ("split", "whole")

ROLES = ("matrix", "embedding", "head", "router", "adapter", "conv", "bias", "vector", "tensor")
MUON_ROLES = frozenset({"matrix"})


def canonical_param_name(name: str) -> str:
    """``name`` without wrapper segments (:data:`WRAPPER_SEGMENTS` and PEFT's
    ``modules_to_save.<adapter>``): ``lm_head.modules_to_save.default.weight -> lm_head.weight``."""
    parts = name.split(".")
    out, i = [], 0
    while i < len(parts):
        if parts[i] == "modules_to_save" and i + 1 < len(parts) - 1:
            i += 2  # "modules_to_save.<adapter name>"
            continue
        if parts[i] not in WRAPPER_SEGMENTS:
            out.append(parts[i])
        i += 1
    return ".".join(out)


def is_moe_router(name: str) -> bool:
    """True for an MoE router weight by :data:`MOE_ROUTER_PATTERN` (on :func:`canonical_param_name`)."""
    return _ROUTER_RE.search(canonical_param_name(name)) is not None


def _is_embedding_or_head(name: str, param: Tensor, excluded_param_ids: set[int]) -> bool:
    if id(param) in excluded_param_ids:
        return True
    parts = canonical_param_name(name).split(".")
    if any("embed" in p.lower() for p in parts):
        return True
    return len(parts) >= 2 and parts[-2] in HEAD_MODULE_NAMES


def _named_bias(name: str) -> bool:
    return "bias" in canonical_param_name(name).split(".")[-1].lower()


def default_is_muon(name: str, param: Tensor, excluded_param_ids: set[int] = frozenset()) -> bool:
    """True for hidden weight matrices by name and shape: 2-D, or 3-D ``[E, out, in]`` stacked experts.

    The name-only rules of :func:`param_roles` (no module metadata): not an embedding or head by
    name, not an MoE router (:func:`is_moe_router`), not named "bias". ``excluded_param_ids``
    holds params of modules recognised otherwise (embeddings, convs, heads, adapters). 4-D and
    higher are left to AdamW: Muon orthogonalises the last two dims, and for a conv kernel those
    are input channels x taps, not the layer's linear map. Pass ``is_muon`` to route such weights
    differently.
    """
    return (
        param.ndim in (2, 3)
        and not _is_embedding_or_head(name, param, excluded_param_ids)
        and not is_moe_router(name)
        and not _named_bias(name)
    )


# --------------------------------------------------------------------------- model metadata


def _unwrap(model: nn.Module) -> nn.Module:
    """The model under a PEFT wrapper (``PeftModel.get_base_model()``), else ``model``."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        try:
            inner = get_base()
        except Exception:  # noqa: BLE001 - not PEFT's method after all
            return model
        if isinstance(inner, nn.Module):
            return inner
    return model


def _module_from(model: nn.Module, method: str) -> nn.Module | None:
    fn = getattr(model, method, None)
    if not callable(fn):
        return None
    try:
        m = fn()
    except (NotImplementedError, AttributeError, TypeError):
        return None
    return m if isinstance(m, nn.Module) else None


def _ids(module: nn.Module | None) -> set[int]:
    return set() if module is None else {id(p) for p in module.parameters()}


def _type_named(module: nn.Module, module_name: str, class_name: str) -> bool:
    """isinstance against a class of a module that may not be imported (then nothing is one)."""
    mod = sys.modules.get(module_name)
    cls = getattr(mod, class_name, None) if mod is not None else None
    return isinstance(cls, type) and isinstance(module, cls)


class _ModelFacts:
    """What the model's own metadata says about its parameters (ids of parameter objects)."""

    def __init__(self, model: nn.Module):
        inner = _unwrap(model)
        self.embedding: set[int] = set()
        self.head: set[int] = set()
        self.conv: set[int] = set()
        self.adapter: set[int] = set()
        self.transposed: set[int] = set()
        self.row_blocks: dict[int, str] = {}  # id -> plain spec of a fused gate_up weight
        for m in model.modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                self.embedding |= _ids(m)
            elif isinstance(m, nn.modules.conv._ConvNd):
                self.conv |= _ids(m)
            if _type_named(m, "peft.tuners.tuners_utils", "BaseTunerLayer"):
                for attr in getattr(m, "adapter_layer_names", ()):
                    sub = getattr(m, attr, None)
                    if isinstance(sub, nn.Module):
                        self.adapter |= _ids(sub)
            if _type_named(m, "transformers.pytorch_utils", "Conv1D"):
                w = getattr(m, "weight", None)
                if isinstance(w, nn.Parameter):
                    self.transposed.add(id(w))
            self._experts(m)
        for wrapper in {id(model): model, id(inner): inner}.values():
            self.embedding |= _ids(_module_from(wrapper, "get_input_embeddings"))
            self.head |= _ids(_module_from(wrapper, "get_output_embeddings"))
        # A Hugging Face task model is its body (`base_model`, named by `base_model_prefix`) plus a
        # task head: every parameter outside the body (lm_head, score, classifier, qa_outputs, ...).
        prefix = getattr(inner, "base_model_prefix", None)
        body = getattr(inner, prefix, None) if isinstance(prefix, str) and prefix else None
        if isinstance(body, nn.Module) and body is not inner:
            self.head |= _ids(inner) - _ids(body)

    def _experts(self, m: nn.Module) -> None:
        """transformers' fused experts (``use_experts_implementation``): [gate; up] rows, transposition."""
        if not hasattr(m, "is_transposed") or not hasattr(m, "has_gate"):
            return
        transposed = bool(getattr(m, "is_transposed", False))
        for pname, p in m.named_parameters(recurse=False):
            if p.ndim != 3:
                continue
            if transposed:
                self.transposed.add(id(p))
            if pname == "gate_up_proj" and getattr(m, "has_gate", False) and getattr(m, "is_concatenated", False):
                out_features = p.shape[-1] if transposed else p.shape[-2]
                if out_features % 2 == 0:
                    half = out_features // 2
                    self.row_blocks[id(p)] = f"blocks:{half},{half}"


def param_roles(model: nn.Module) -> dict[str, str]:
    """``{parameter name: role}`` for every parameter (module docstring: the roles and their rules).

    Tied parameters appear once, under their first name (as ``named_parameters`` gives them).
    Only the role ``"matrix"`` goes to Muon by default.
    """
    facts = _ModelFacts(model)
    return {name: _role(name, p, facts) for name, p in model.named_parameters()}


def _role(name: str, p: Tensor, facts: _ModelFacts) -> str:
    pid = id(p)
    if pid in facts.adapter:
        return "adapter"
    if pid in facts.embedding:
        return "embedding"
    if pid in facts.head:
        return "head"
    if pid in facts.conv:
        return "conv"
    if _is_embedding_or_head(name, p, set()):
        parts = canonical_param_name(name).split(".")
        return "embedding" if any("embed" in q.lower() for q in parts) else "head"
    if is_moe_router(name):
        return "router"
    if _named_bias(name):
        return "bias"
    if p.ndim < 2:
        return "vector"
    if p.ndim > 3:
        return "tensor"
    return "matrix"


def trainer_no_decay_names(model: nn.Module) -> set[str]:
    """Names (as ``model.named_parameters()`` gives them) that transformers' Trainer exempts from
    weight decay: inside an ``nn.LayerNorm`` (not the model itself), or a lower-cased name matching
    :data:`TRAINER_NO_DECAY_PATTERNS` ("bias", "layernorm", "rmsnorm", a "norm" component, a
    component ending in "_norm"). The complement of ``Trainer.get_decay_parameter_names``."""
    exempt: set[str] = set()

    def walk(module: nn.Module, prefix: str, in_layernorm: bool) -> None:
        for pname, p in module.named_parameters(recurse=False):
            full = prefix + pname
            if in_layernorm or any(r.search(full.lower()) for r in _NO_DECAY_RES):
                exempt.add(full)
        for cname, child in module.named_children():
            walk(child, f"{prefix}{cname}.", in_layernorm or isinstance(child, nn.LayerNorm))

    walk(model, "", False)
    return exempt


# --------------------------------------------------------------------------- the groups


def get_default_muon_param_groups(
    model: nn.Module,
    is_muon: Callable[[str, Tensor], bool] | None = None,
    *,
    adamw_options: Mapping | None = None,
    no_decay: str | Callable[[str, Tensor], bool] | None = None,
    fused_gate_up: str = "split",
    **muon_group_options,
) -> list[dict]:
    """``[{"params", "param_names", "use_muon": True, ...}, {..., "use_muon": False}, ...]``.

    Trainable parameters only (``requires_grad``), each once (tied weights are shared objects
    and appear under their first name). Empty groups are left out.

    Args:
        is_muon: ``(name, param) -> bool`` replacing the default choice (parameters whose
            :func:`param_roles` role is ``"matrix"``: 2-D/3-D weights that are not embeddings,
            heads, MoE routers, adapters, conv kernels or biases).
        adamw_options: options of the AdamW groups: ``lr``, ``weight_decay``, ``betas``, ``eps``,
            ``maximize`` (unset ones take the optimizer's defaults).
        no_decay: which AdamW parameters get ``weight_decay=0.0`` (in a group of their own):
            ``None`` (default) none; ``"trainer"`` transformers' Trainer rule (biases and norm
            weights, :func:`trainer_no_decay_names`); or ``(name, param) -> bool``.
        fused_gate_up: ``"split"`` (default) orthogonalises a Hugging Face fused MoE
            ``gate_up_proj``'s gate and up rows as two matrices (``"muon_row_blocks"``
            ``"blocks:I,I"``); ``"whole"`` as one.
        **muon_group_options: keys of the Muon group (``lr``, ``weight_decay``, ``momentum``,
            ``muon_row_blocks``, ...). A ``{name: spec}`` ``muon_row_blocks`` is merged over the
            automatic blocks (yours win); a single spec replaces them.

    The Muon group also carries ``"muon_transposed": {name: True}`` for weights stored
    ``[in, out]`` and ``"muon_row_blocks"`` for fused ``gate_up_proj`` weights, when there are
    any (module docstring). Row-block specs are in their plain form, so the optimizer's state dict
    loads with ``torch.load(weights_only=True)``.
    """
    adamw_options, exempt = _check_arguments(model, is_muon, adamw_options, no_decay, fused_gate_up,
                                             muon_group_options)
    facts = _ModelFacts(model)
    muon, decay, no_decay_group = ([], []), ([], []), ([], [])
    transposed, blocks = {}, {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if _goes_to_muon(name, param, is_muon, facts):
            target = muon
            if id(param) in facts.transposed:
                transposed[name] = True
            if fused_gate_up == "split" and id(param) in facts.row_blocks:
                blocks[name] = facts.row_blocks[id(param)]
        elif exempt is not None and exempt(name, param):
            target = no_decay_group
        else:
            target = decay
        target[0].append(param)
        target[1].append(name)

    groups = []
    if muon[0]:
        options = _muon_group_options(muon_group_options, blocks, transposed)
        groups.append({"params": muon[0], "param_names": muon[1], "use_muon": True, **options})
    if decay[0]:
        groups.append({"params": decay[0], "param_names": decay[1], "use_muon": False, **adamw_options})
    if no_decay_group[0]:
        groups.append({"params": no_decay_group[0], "param_names": no_decay_group[1], "use_muon": False,
                       **adamw_options, "weight_decay": 0.0})
    return groups


def _check_arguments(model, is_muon, adamw_options, no_decay, fused_gate_up, muon_group_options):
    """Refuse bad arguments by name; returns the AdamW options and the no-decay predicate."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"get_default_muon_param_groups expects an nn.Module, got {type(model).__name__}"
        )
    if is_muon is not None and not callable(is_muon):
        raise TypeError(f"is_muon must be a callable (name, param) -> bool, got {is_muon!r}")
    if "params" in muon_group_options or "use_muon" in muon_group_options:
        raise ValueError("muon_group_options cannot set 'params' or 'use_muon'; they are filled in here")
    adamw_options = dict(adamw_options or {})
    unknown = sorted(set(adamw_options) - set(ADAMW_OPTION_KEYS))
    if unknown:
        raise ValueError(f"adamw_options has unknown keys {unknown}; AdamW groups take {list(ADAMW_OPTION_KEYS)}")
    if fused_gate_up not in FUSED_GATE_UP_MODES:
        raise ValueError(f"fused_gate_up must be one of {FUSED_GATE_UP_MODES}, got {fused_gate_up!r}")
    if no_decay is None:
        return adamw_options, None
    if no_decay == "trainer":
        names = trainer_no_decay_names(model)
        return adamw_options, lambda name, p: name in names
    if callable(no_decay):
        return adamw_options, no_decay
    raise ValueError(f"no_decay must be None, 'trainer' or a callable (name, param) -> bool, got {no_decay!r}")


def _goes_to_muon(name: str, param: Tensor, is_muon, facts: "_ModelFacts") -> bool:
    if is_muon is None:
        return _role(name, param, facts) in MUON_ROLES
    use_muon = bool(is_muon(name, param))
    if use_muon and param.ndim < 2:
        raise ValueError(
            f"is_muon chose Muon for {name!r} of shape {tuple(param.shape)}; Muon needs a "
            "matrix (or a batch of matrices [..., m, n]); send it to AdamW instead"
        )
    return use_muon


def _muon_group_options(muon_group_options: Mapping, blocks: dict, transposed: dict) -> dict:
    """The Muon group's keys: the caller's, the automatic row blocks under the caller's
    ``{name: spec}`` (a single spec replaces them), and the transposed weights."""
    options = dict(muon_group_options)
    user_blocks = options.pop(ROW_BLOCKS_KEY, None)
    if user_blocks is not None and not isinstance(user_blocks, Mapping):
        options[ROW_BLOCKS_KEY] = user_blocks  # one spec for the whole group: as given
    else:
        merged = {**blocks, **row_blocks_to_plain(dict(user_blocks or {}))}
        merged = {k: v for k, v in merged.items() if v is not None}
        if merged:
            options[ROW_BLOCKS_KEY] = merged
    if transposed:
        options[TRANSPOSED_KEY] = transposed
    return options
