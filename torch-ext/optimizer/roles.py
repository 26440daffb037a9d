"""Every parameter's role, and whether that role calls for Muon: one rule, used by every path.

Muon orthogonalises linear maps between hidden states: 2-D weights ``[out, in]`` and stacks of
them (MoE experts ``[E, out, in]``). Everything else goes to AdamW. Each parameter gets a **role**
and the **rule** that decided it (a few words a user can read in :func:`param_role_table`);
only the role ``"matrix"`` goes to Muon. docs/param_roles.md explains each choice.

Paths and what they know:

* **model-aware** (``get_default_muon_param_groups(model)``, the Hugging Face factory and
  ``build_muon``, the torchtitan container's check): the modules (:mod:`optimizer.model_facts`),
  the names, the shapes, and optionally one traced forward (:mod:`optimizer.forward_trace`):
  :func:`decide`;
* **torch-style** (``Muon(model.parameters())``, ``named_parameters()``, groups without
  ``use_muon``): shapes, and names where given, only to tell a convolution kernel from an expert
  stack: :func:`decide_torch_style`. Like ``torch.optim.Muon``, every true matrix goes to Muon.

Rules shared by both, in :func:`shape_decision`:

* **Not a matrix, never Muon.** After dropping leading singleton dims, a parameter with fewer
  than two dims, or whose matrix view (its last two dims) has a dimension of 1, is a vector in
  disguise (``[1, C, 1]`` per-channel scales, ``[1, 1, D]`` class tokens, ``[1, D]`` gates).
  Newton–Schulz of a vector is that vector normalised: no orthogonalisation happens, only a
  rescaling that ignores the gradient's size per element.
* **Broadcast over the batch.** A parameter with a leading singleton dim and a matrix behind it
  (``[1, N, D]``) is added to (or concatenated with) a batch of activations: a position or class
  embedding, not a linear map.
* **Convolutions: AdamW** (``Conv1d/2d/3d``, ``ConvTranspose*``, grouped and depthwise alike).
  Where only a name is known a component containing "conv" marks one. See docs/param_roles.md
  for why (the convention must be the same in every path, and grouped kernels cannot be told
  from plain ones without their module).
* **4-D and higher** (not a convolution by module or name): AdamW (``tensor``).
* **3-D**: an expert stack ``[E, out, in]`` (Muon) only where something says so: its module (the
  expert-stack modules of transformers and torchtitan, model-aware paths), a name with an
  "expert" component, or an explicit group. Anything else 3-D (``nn.Bilinear``'s weight, a free
  ``[heads, L, L]`` bias table, an ``[out, in, k]`` kernel) is AdamW, and both paths warn once,
  naming the tensors nothing explained and how to send experts to Muon.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

ROLES = ("matrix", "embedding", "head", "router", "adapter", "conv", "bias", "vector", "tensor")
MUON_ROLES = frozenset({"matrix"})
#: roles whose tensors Muon cannot read as matrices at all: an override choosing Muon for them is refused
NOT_MATRIX_ROLES = frozenset({"vector", "conv"})

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

#: Names of output heads when no module metadata says so: the module owning the weight is named
#: one of these ("lm_head.weight" in Hugging Face, "output.weight" in torchtitan, "head.weight" in
#: timm/ViT-style models, "classifier.weight"), or, except "output", the module above it is
#: ("head.fc.weight", "classifier.1.weight"). Owner only for "output", so BERT's
#: "attention.output.dense.weight" is still a hidden matrix.
HEAD_MODULE_NAMES = ("lm_head", "output", "head", "classifier")
_HEAD_PARENT_NAMES = ("lm_head", "head", "classifier")

# Name segments that wrap a module without changing what it is: torch.compile, activation
# checkpointing, FSDP1, and PEFT (LoRA's base_layer, modules_to_save's original_module and
# "modules_to_save.<adapter name>").
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "base_layer",
                    "original_module")


@dataclass(frozen=True)
class Decision:
    """A parameter's role and the rule that gave it (words for the table)."""

    role: str
    rule: str
    ambiguous: bool = False  # decided by the documented default for a 3-D tensor nothing else explains
    muon: bool | None = None  # an override's choice (is_muon); None: the role's

    @property
    def use_muon(self) -> bool:
        return self.role in MUON_ROLES if self.muon is None else self.muon


# --------------------------------------------------------------------------- shapes (pure)


def matrix_dims(shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` without its leading singleton dims (``[1, C, 1] -> [C, 1]``, ``[1, 1, D] -> [D]``)."""
    dims = tuple(int(d) for d in shape)
    i = 0
    while i < len(dims) and dims[i] == 1:
        i += 1
    return dims[i:]


def is_vector_in_disguise(shape: Sequence[int]) -> bool:
    """Fewer than two dims after dropping leading singletons, or a matrix view (last two dims)
    with a dimension of 1: what Newton–Schulz would only normalise."""
    dims = matrix_dims(shape)
    return len(dims) < 2 or 1 in dims[-2:]


def shape_decision(shape: Sequence[int], experts: bool = False) -> Decision | None:
    """What the shape alone decides, or None (2-D and 3-D tensors, which need more to tell).

    ``experts``: the tensor is known to be an expert stack (its module or name says so), so a
    leading singleton dim is ``E = 1``, not a batch broadcast."""
    ndim = len(shape)
    if ndim < 2:
        return Decision("vector", f"{ndim}-D")
    if is_vector_in_disguise(shape):
        return Decision("vector", f"vector in disguise: {tuple(shape)} is a vector once leading 1s are dropped")
    if shape[0] == 1 and not experts:
        return Decision("embedding", "leading dim of 1: broadcast over the batch (position/class embedding)")
    return None


# --------------------------------------------------------------------------- names (pure)


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


def _parts(name: str) -> list[str]:
    return canonical_param_name(name).split(".")


def name_says_conv(name: str | None) -> bool:
    """A module component containing "conv" (``conv1``, ``pos_conv_embed``, ``depthwise_conv``)."""
    return name is not None and any("conv" in p.lower() for p in _parts(name)[:-1])


def name_says_experts(name: str | None) -> bool:
    """A component containing "expert" (``mlp.experts.gate_up_proj``, ``moe.experts.w1``)."""
    return name is not None and any("expert" in p.lower() for p in _parts(name))


def name_decision(name: str) -> Decision | None:
    """The name rules of the model-aware path (used where no module metadata decided)."""
    parts = _parts(name)
    if any("embed" in p.lower() for p in parts):
        return Decision("embedding", 'name: a component contains "embed"')
    owner, parent = (parts[-2] if len(parts) >= 2 else None), (parts[-3] if len(parts) >= 3 else None)
    if owner in HEAD_MODULE_NAMES or parent in _HEAD_PARENT_NAMES:
        return Decision("head", f"name: owned by a module named {owner if owner in HEAD_MODULE_NAMES else parent!r}")
    if is_moe_router(name):
        return Decision("router", "name: MoE router (MOE_ROUTER_PATTERN)")
    if "bias" in parts[-1].lower():
        return Decision("bias", 'name: "bias"')
    return None


# --------------------------------------------------------------------------- the rule


def decide(name: str, param, facts) -> Decision:
    """The model-aware rule: what the model's modules (and traced forward) say first, then names,
    then shapes (module docstring). ``facts``: :class:`optimizer.model_facts.ModelFacts`."""
    pid = id(param)
    for table, role in ((facts.adapter, "adapter"), (facts.embedding, "embedding"), (facts.head, "head"),
                        (facts.conv, "conv"), (facts.tensor, "tensor")):
        if pid in table:
            return Decision(role, facts.with_aliases(pid, table[pid]))
    by_name = name_decision(name)
    if by_name is not None:
        return by_name
    if pid in facts.additive and len(matrix_dims(param.shape)) >= 2:
        return Decision("embedding", facts.additive[pid])
    experts = pid in facts.experts or name_says_experts(name)
    by_shape = shape_decision(param.shape, experts)
    if by_shape is not None:
        return by_shape
    if param.ndim > 3:
        return Decision("tensor", f"{param.ndim}-D, not a convolution's module")
    if param.ndim == 3 and experts:
        why = facts.experts.get(pid) or "name: an \"expert\" component"
        return Decision("matrix", f"3-D [E, out, in] expert stack ({why})")
    if param.ndim == 3:
        return Decision("tensor", "3-D, and neither its module nor its name says [E, out, in] expert stack: AdamW",
                        ambiguous=True)
    return Decision("matrix", "2-D weight")


def decide_torch_style(name: str | None, shape: Sequence[int]) -> Decision:
    """The torch-style rule: shapes, and a name only to tell a kernel from an expert stack."""
    if name_says_conv(name) and len(shape) >= 3:
        return Decision("conv", 'name: a module component contains "conv"')
    experts = len(shape) == 3 and name_says_experts(name)
    by_shape = shape_decision(shape, experts)
    if by_shape is not None:
        return by_shape
    if len(shape) > 3:
        return Decision("tensor", f"{len(shape)}-D: a kernel or a batch, not a matrix")
    if len(shape) == 3:
        if experts:
            return Decision("matrix", 'name: 3-D with an "expert" component, an [E, out, in] expert stack')
        return Decision("tensor", "3-D, ambiguous ([E, out, in] experts or an [out, in, k] kernel): AdamW by "
                        "default", ambiguous=True)
    return Decision("matrix", "2-D weight")


def refusal(name: str, shape: Sequence[int], decision: Decision, chooser: str) -> str | None:
    """Why ``chooser`` (an override: ``is_muon``, a torchtitan pattern) may not send this tensor
    to Muon, or None. Only where Muon cannot read it as a matrix (:data:`NOT_MATRIX_ROLES`):
    other roles are choices an override may make."""
    if decision.role not in NOT_MATRIX_ROLES:
        return None
    if decision.role == "conv":
        what = ("as a kernel, Muon would orthogonalise its trailing [in, *kernel] slices, not the convolution's "
                "[out, in*k] map (docs/param_roles.md: convolutions go to AdamW)")
    else:
        what = "Newton–Schulz of a vector only normalises it (docs/param_roles.md)"
    return (f"{chooser} chose Muon for {name!r} of shape {tuple(shape)}; Muon needs a matrix (or a batch of "
            f"matrices [..., m, n]), and this is a {decision.role} ({decision.rule}): {what}. Send it to AdamW "
            "instead.")


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class RoleRow:
    """One parameter in :func:`optimizer.param_groups.param_role_table`."""

    name: str
    shape: tuple[int, ...]
    group: int  # index into the param groups the path builds
    optimizer: str  # "muon" or "adamw"
    role: str
    rule: str
    ambiguous: bool = False  # a 3-D tensor nothing called an expert stack (``Decision.ambiguous``)


class RoleTable(tuple):
    """:class:`RoleRow` s; ``str()`` is an aligned text table, ``by_name()`` a dict."""

    def by_name(self) -> dict[str, RoleRow]:
        return {row.name: row for row in self}

    def __str__(self) -> str:
        header = ("parameter", "shape", "group", "role", "rule")
        lines = [(r.name, "x".join(map(str, r.shape)) or "scalar", f"{r.group} {r.optimizer}", r.role, r.rule)
                 for r in self]
        widths = [max(len(str(c)) for c in col) for col in zip(header, *lines)]
        return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
                         for row in (header, *lines))
