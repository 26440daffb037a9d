"""Default split of a model's parameters into a Muon group and AdamW groups.

Muon is for the hidden weight matrices. Embeddings and output heads are matrices too, but they
are lookup tables / classifiers rather than linear maps between hidden states, and Muon's
orthogonalised update is known to do worse on them (Keller Jordan, Moonlight), so they stay on
AdamW together with everything that is not a matrix (norm weights, biases, scalars).

Every parameter gets a **role** and the rule that decided it (:mod:`optimizer.roles`, the one rule
every path uses; :func:`param_role_table` prints them), read from the model itself wherever it
says so, then from names, then from shapes; only the role ``"matrix"`` goes to Muon:

==============  ==========================================================================
role            how it is recognised (first match, top to bottom)
==============  ==========================================================================
``adapter``     a PEFT adapter weight (LoRA ``lora_A``/``lora_B``, ...): the sub-modules a
                PEFT tuner layer lists in its ``adapter_layer_names``
``embedding``   an ``nn.Embedding``/``EmbeddingBag``, the module ``model.get_input_embeddings()``
                returns
``head``        the module ``model.get_output_embeddings()`` returns; every parameter of a
                Hugging Face model outside its body (``model.base_model``, named by
                ``base_model_prefix``): ``lm_head``, ``score``, ``classifier``, ...; with
                ``example_inputs``, the weights that produce the logits in a traced forward
``conv``        a ``torch.nn`` convolution's parameters, any dimension, transposed or grouped
                (docs/param_roles.md: why AdamW)
(names)         a name component containing "embed" (``embedding``); a weight owned by a module
                named ``lm_head``/``output``/``head``/``classifier`` (``head``); an MoE router
                (``router``, :data:`MOE_ROUTER_PATTERN`); a name containing "bias" (``bias``, also
                2-D expert biases ``[E, out]``)
``embedding``   with ``example_inputs``: a parameter added to or concatenated with activations
``vector``      0-D/1-D, or a vector in disguise: a dimension of 1 in the matrix view once
                leading 1s are dropped (``[1, C, 1]`` per-channel scales, ``[1, 1, D]`` tokens)
``embedding``   a leading dim of 1 before a matrix (``[1, N, D]``): broadcast over the batch
``tensor``      4-D and higher
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

import logging
import re
from collections import Counter
from collections.abc import Callable, Mapping

from torch import Tensor, nn

from .matrix_view import TRANSPOSED_KEY
from .model_facts import ModelFacts
from .roles import Decision, RoleRow, RoleTable, decide, decide_torch_style, refusal
# the names this module has always offered (tests, the torchtitan adapter), now defined in roles.py
from .roles import HEAD_MODULE_NAMES, MOE_ROUTER_PATTERN, MUON_ROLES, ROLES, WRAPPER_SEGMENTS  # noqa: F401
from .roles import canonical_param_name, is_moe_router  # noqa: F401
from .row_blocks import ROW_BLOCKS_KEY, row_blocks_to_plain
from .settings import ADAMW, options_of

logger = logging.getLogger(__name__)

#: transformers' ``Trainer.get_decay_parameter_names`` (5.x): parameters inside an ``nn.LayerNorm``,
#: and parameters whose lower-cased name matches one of these, get no weight decay.
TRAINER_NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
_NO_DECAY_RES = tuple(re.compile(p) for p in TRAINER_NO_DECAY_PATTERNS)

# what ``adamw_options`` may set: every AdamW group option the optimizer declares
ADAMW_OPTION_KEYS = tuple(o.name for o in options_of(ADAMW))
FUSED_GATE_UP_MODES = ("split", "whole")


def param_roles(model: nn.Module, example_inputs=None) -> dict[str, str]:
    """``{parameter name: role}`` for every parameter (:mod:`optimizer.roles`: the roles and their rules).

    Tied parameters appear once, under their first name (as ``named_parameters`` gives them).
    Only the role ``"matrix"`` goes to Muon by default. ``example_inputs``: see
    :func:`get_default_muon_param_groups`."""
    facts = ModelFacts(model, example_inputs)
    return {name: decide(name, p, facts).role for name, p in model.named_parameters()}


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
    example_inputs=None,
    **muon_group_options,
) -> list[dict]:
    """``[{"params", "param_names", "use_muon": True, ...}, {..., "use_muon": False}, ...]``.

    Trainable parameters only (``requires_grad``), each once (tied weights are shared objects
    and appear under their first name). Empty groups are left out.

    Args:
        is_muon: ``(name, param) -> bool`` replacing the default choice (parameters whose
            :func:`param_roles` role is ``"matrix"``: 2-D/3-D weights that are not embeddings,
            heads, MoE routers, adapters, conv kernels, biases or vectors in disguise). Choosing
            Muon for what Muon cannot read as a matrix (a vector, a vector in disguise, a
            convolution kernel) is refused, naming the parameter.
        adamw_options: options of the AdamW groups: ``lr``, ``weight_decay``, ``betas``, ``eps``,
            ``maximize`` (unset ones take the optimizer's defaults).
        no_decay: which AdamW parameters get ``weight_decay=0.0`` (in a group of their own):
            ``None`` (default) none; ``"trainer"`` transformers' Trainer rule (biases and norm
            weights, :func:`trainer_no_decay_names`); or ``(name, param) -> bool``.
        fused_gate_up: ``"split"`` (default) orthogonalises a Hugging Face fused MoE
            ``gate_up_proj``'s gate and up rows as two matrices (``"muon_row_blocks"``
            ``"blocks:I,I"``); ``"whole"`` as one.
        example_inputs: inputs of one forward (a dict of keyword arguments, a tuple of positional
            ones, or a tensor) that lets the roles see the model at work
            (:mod:`optimizer.forward_trace`): the weights producing the logits become heads (a
            plain model's ``head``/``fc``, CLIP's projections), parameters added to activations
            embeddings. Runs the forward once, in eval mode, on an unsharded model.
        **muon_group_options: keys of the Muon group (``lr``, ``weight_decay``, ``momentum``,
            ``muon_row_blocks``, ...). A ``{name: spec}`` ``muon_row_blocks`` is merged over the
            automatic blocks (yours win); a single spec replaces them.

    The Muon group also carries ``"muon_transposed": {name: True}`` for weights stored
    ``[in, out]`` and ``"muon_row_blocks"`` for fused ``gate_up_proj`` weights, when there are
    any (module docstring). Row-block specs are in their plain form, so the optimizer's state dict
    loads with ``torch.load(weights_only=True)``.

    Where each parameter went, with its role and the rule that decided it, is logged at DEBUG
    level (logger ``optimizer.param_groups``); :func:`param_role_table` returns it.
    """
    groups, table = _groups_and_table(model, is_muon, adamw_options, no_decay, fused_gate_up, example_inputs,
                                      muon_group_options)
    _log_table(model, table)
    return groups


def _log_table(model: nn.Module, table: RoleTable) -> None:
    """The table at DEBUG level; a warning when no parameter goes to Muon, and one naming the 3-D
    tensors that went to AdamW because nothing called them expert stacks."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("get_default_muon_param_groups: where each parameter went\n%s", table)
    if table and not any(row.optimizer == "muon" for row in table):
        roles = Counter(row.role for row in table)
        logger.warning("get_default_muon_param_groups: no parameter of this %s is a matrix Muon orthogonalises (%s): "
                       "AdamW steps all of them. optimizer.param_role_table(model) shows why; docs/param_roles.md.",
                       type(model).__name__, ", ".join(f"{n} {role}" for role, n in roles.most_common()))
    unexplained = [f"{row.name} {row.shape}" for row in table if row.ambiguous and row.optimizer == "adamw"]
    if unexplained:
        logger.warning("get_default_muon_param_groups: %d 3-D parameter(s) went to AdamW: %s. Neither their module "
                       "nor their name says [E, out, in] expert stack (docs/param_roles.md). To send expert stacks to "
                       "Muon, give them a name with an 'experts' component (moe.experts.w1), pass is_muon, or put them "
                       "in a group {'params': [...], 'use_muon': True}.", len(unexplained), ", ".join(unexplained))


def param_role_table(model_or_params, is_muon=None, **kwargs) -> RoleTable:
    """Each parameter's group, role and the rule that decided it (``print()`` it for a table).

    For an ``nn.Module``: what :func:`get_default_muon_param_groups` does with the same arguments
    (``group`` indexes the list it returns). For anything else ``Muon`` accepts as ``params`` (a
    list of tensors, ``named_parameters()``, groups with or without ``use_muon``): what ``Muon``
    does with it (``group`` indexes ``Muon(params).param_groups``).
    """
    if isinstance(model_or_params, nn.Module):
        options = dict(kwargs)
        args = [options.pop(k, d) for k, d in (("adamw_options", None), ("no_decay", None),
                                                ("fused_gate_up", "split"), ("example_inputs", None))]
        return _groups_and_table(model_or_params, is_muon, *args, options)[1]
    if is_muon is not None or kwargs:
        raise ValueError("param_role_table: is_muon and grouping options apply to a model only; a parameter list "
                         "is grouped as Muon groups it")
    return _torch_style_table(model_or_params)


def _torch_style_table(params) -> RoleTable:
    """What ``Muon(params)`` does with each parameter (``Muon.add_param_group``: ``split_by_kind``)."""
    from .muon import _named_params, split_by_kind

    if isinstance(params, Tensor):
        params = [params]
    params = list(params)
    groups = params if params and all(isinstance(g, dict) for g in params) else [{"params": params}]
    rows, index = [], 0
    for group in groups:
        parts = [group] if "use_muon" in group else split_by_kind(group, log=False)
        for part in parts:
            kind = "muon" if part["use_muon"] else "adamw"
            for i, (n, p) in enumerate(_named_params(part)[0]):
                d = decide_torch_style(n, p.shape)
                rule = f"explicit group (use_muon={part['use_muon']})" if "use_muon" in group else d.rule
                rows.append(RoleRow(n if n is not None else f"param_groups[{index}]['params'][{i}]", tuple(p.shape),
                                    index, kind, d.role, rule))
            index += 1
    return RoleTable(rows)


def _groups_and_table(model, is_muon, adamw_options, no_decay, fused_gate_up, example_inputs,
                      muon_group_options) -> tuple[list[dict], RoleTable]:
    """The groups and, for every parameter in them, its row (``param_role_table``)."""
    adamw_options, exempt = _check_arguments(model, is_muon, adamw_options, no_decay, fused_gate_up,
                                             muon_group_options)
    facts = ModelFacts(model, example_inputs)
    muon, decay, no_decay_group = ([], []), ([], []), ([], [])
    transposed, blocks, decisions = {}, {}, {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decisions[name] = _decision(name, param, is_muon, facts)
        if decisions[name].use_muon:
            target = muon
            if id(param) in facts.transposed:
                transposed[name] = True
            fused = facts.row_blocks.get(id(param))
            if fused is not None and (fused_gate_up == "split" or not fused.gate_up):
                blocks[name] = fused
        elif exempt is not None and exempt(name, param):
            target = no_decay_group
        else:
            target = decay
        target[0].append(param)
        target[1].append(name)

    groups = []
    if muon[0]:
        options = _muon_group_options(muon_group_options, {n: f.spec for n, f in blocks.items()}, transposed)
        groups.append({"params": muon[0], "param_names": muon[1], "use_muon": True, **options})
        decisions.update(_with_row_blocks(decisions, options.get(ROW_BLOCKS_KEY), blocks))
    if decay[0]:
        groups.append({"params": decay[0], "param_names": decay[1], "use_muon": False, **adamw_options})
    if no_decay_group[0]:
        groups.append({"params": no_decay_group[0], "param_names": no_decay_group[1], "use_muon": False,
                       **adamw_options, "weight_decay": 0.0})
    rows = [RoleRow(n, tuple(p.shape), gi, "muon" if g["use_muon"] else "adamw", decisions[n].role, decisions[n].rule,
                    decisions[n].ambiguous)
            for gi, g in enumerate(groups) for n, p in zip(g["param_names"], g["params"])]
    order = {n: i for i, n in enumerate(decisions)}  # the model's order, not the groups'
    return groups, RoleTable(sorted(rows, key=lambda r: order[r.name]))


def _with_row_blocks(decisions: Mapping[str, Decision], group_blocks, automatic: Mapping) -> dict[str, Decision]:
    """The decisions of the Muon group's weights with row blocks, their rule saying so (the table
    reports what the group does: the automatic blocks of a fused layout, or yours)."""
    out = {}
    for name, spec in (group_blocks or {}).items() if isinstance(group_blocks, Mapping) else ():
        d = decisions[name]
        why = automatic[name].what if name in automatic and automatic[name].spec == spec else "muon_row_blocks (yours)"
        out[name] = Decision(d.role, f"{d.rule}; row blocks {spec}: {why}", d.ambiguous, d.muon)
    return out


def muon_choice_problems(model: nn.Module, chosen, chooser: str, facts: ModelFacts | None = None) -> list[str]:
    """One line per ``(name, param)`` in ``chosen`` that ``chooser`` (an explicit choice: a
    torchtitan Muon pattern) sends to Muon although Muon cannot read it as a matrix
    (:func:`optimizer.roles.refusal`); ``model`` gives the modules."""
    facts = ModelFacts(model) if facts is None else facts
    return [problem for name, p in chosen
            if (problem := refusal(name, p.shape, decide(name, p, facts), chooser)) is not None]


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


def _decision(name: str, param: Tensor, is_muon, facts: ModelFacts) -> Decision:
    """The role rule's decision, or ``is_muon``'s (refused where Muon cannot read a matrix)."""
    decision = decide(name, param, facts)
    if is_muon is None:
        return decision
    use_muon = bool(is_muon(name, param))
    if use_muon:
        problem = refusal(name, param.shape, decision, "is_muon")
        if problem is not None:
            raise ValueError(problem)
    if use_muon == decision.use_muon:
        return decision
    return Decision(decision.role, f"is_muon (yours) chose {'Muon' if use_muon else 'AdamW'}; the role's rule: "
                    f"{decision.rule}", muon=use_muon)


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
