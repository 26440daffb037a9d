"""Every option of Muon, declared once.

Two kinds of options:

* **optimizer options**, one value per optimizer: the fields of :class:`MuonSettings`, a frozen
  dataclass (how Newton–Schulz runs, how a step is distributed, QK-clip);
* **group options**, one value per param group: :data:`GROUP_OPTIONS` (the hyper-parameters a
  scheduler or a user may set per group: lr, momentum, ...).  The constructor keyword of the same
  name (or the declared ``keyword``) is the default for groups that do not set it.

Everything else is derived from these declarations: the constructor's keywords, their defaults
and validation (:func:`from_constructor`), the defaults torch's ``Optimizer`` fills into groups
(:func:`torch_defaults`), the per-kind defaults (:func:`kind_defaults`), the checks of a group
(:func:`check_group`), the record every rank compares before a step and its digest
(:func:`record`, :func:`digest`), the part of the step plan's cache key that settings make
(:func:`plan_key`) and the docstring of ``Muon.__init__`` (:func:`constructor_doc`).  Adding an
option is one declaration plus its use; the cross-rank agreement, pickling and the plan's cache
key pick it up with no other change.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .distributed import agreement
from .matrix_view import TRANSPOSED_KEY, check_transposed
from .newton_schulz.coefficients import resolve_ns_coefficients
from .newton_schulz.forms import check_ns_method
from .newton_schulz.implementation import check_ns_kernels
from .qk_clip import QKClipConfig, config_record
from .row_blocks import ROW_BLOCKS_KEY, check_group_row_blocks

MUON, ADAMW = "muon", "adamw"
KINDS = (MUON, ADAMW)

# ---------------------------------------------------------------------------- checks
# Each check is ``check(value, where, context)`` and raises ValueError naming ``where`` (the
# option's keyword, or ``param_groups[i] <name>``); ``context`` holds the option's siblings (the
# group, or the constructor's keywords) for the few checks that need them.


def check_number(where: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"Muon: `{where}` must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"Muon: `{where}` must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"Muon: `{where}` must be <= {high}, got {value!r}")


def _non_negative(value, where, context) -> None:
    check_number(where, value, low=0.0)


def _positive(value, where, context) -> None:
    check_number(where, value, low=0.0, low_open=True)


def _unit_interval(value, where, context) -> None:
    check_number(where, value, low=0.0, high=1.0)


def _optional_non_negative(value, where, context) -> None:
    if value is not None:
        check_number(where, value, low=0.0)


def _boolean(value, where, context) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"Muon: `{where}` must be True or False, got {value!r}")


def _one_of(*choices) -> Callable:
    def check(value, where, context) -> None:
        if not isinstance(value, (str, type(None))) or value not in choices:
            raise ValueError(f"Muon: `{where}` must be one of {choices}, got {value!r}")

    return check


def _int_at_least(low: int, *, optional: bool = False, high: int | None = None) -> Callable:
    def check(value, where, context) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ValueError(f"Muon: `{where}` must be an int {span}{' or None' if optional else ''}, got {value!r}")

    return check


def _lr(value, where, context) -> None:
    if torch.is_tensor(value) and value.numel() != 1:
        raise ValueError(f"Muon: `{where}` must be a number or a one-element tensor, got shape {tuple(value.shape)}")
    if not torch.is_tensor(value) or value.device.type == "cpu":  # a device tensor is not read (no host sync)
        check_number(where, float(value) if torch.is_tensor(value) else value, low=0.0)


def _betas(value, where, context) -> None:
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise ValueError(f"Muon: `{where}` must be a pair (beta1, beta2), got {value!r}")
    for i, b in enumerate(value):
        check_number(f"{where}[{i}]", b, low=0.0, high=1.0)
        if b == 1.0:
            raise ValueError(f"Muon: `{where}[{i}]` must be < 1, got {b!r}")


def _ns_coefficients(value, where, context) -> None:
    try:
        resolve_ns_coefficients(value, context.get("ns_steps", 5))
    except ValueError as err:
        raise ValueError(f"Muon: `{where}`: {err}") from None


def _ns_method(value, where, context) -> None:
    try:
        check_ns_method(value)
    except ValueError as err:
        raise ValueError(f"Muon: `{where}`: {err}") from None


def _ns_kernels(value, where, context) -> None:
    try:
        check_ns_kernels(value)
    except ValueError as err:
        raise ValueError(f"Muon: `{where}`: {err}") from None


def _row_blocks(value, where, context) -> None:
    group = where.removesuffix(ROW_BLOCKS_KEY).rstrip()  # its messages name the key themselves
    check_group_row_blocks(value, context.get("param_names") or [], f"Muon: {group}")


def _transposed(value, where, context) -> None:
    group = where.removesuffix(TRANSPOSED_KEY).rstrip()
    check_transposed(value, context.get("param_names") or [], f"Muon: {group}")


def _compute_dtype(value, where, context) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"Muon: `{where}` must be a floating torch.dtype or None, got {value!r}")


def dtype_of(value: Any) -> Any:
    """A dtype given as a ``torch.dtype`` or by name (``"bfloat16"``, ``"torch.bfloat16"``) as the
    ``torch.dtype``; any other value as it is (for the check to refuse)."""
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    return value


def _momentum_dtype(value, where, context) -> None:
    dtype = dtype_of(value)
    if value is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"Muon: `{where}` must be a floating torch.dtype (or its name, e.g. 'bfloat16') or None, "
                         f"got {value!r}")


def _normuon_beta2(value, where, context) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"Muon: `{where}` must be None (Muon) or a number in [0, 1) (NorMuon's beta2), got {value!r}")


def _qk_clip(value, where, context) -> None:
    if value is not None and not isinstance(value, QKClipConfig):
        raise ValueError(f"Muon: `{where}` must be an optimizer.QKClipConfig or None, got {type(value).__name__}")


# ---------------------------------------------------------------------------- how values are compared


def rank_independent_repr(value: Any) -> str:
    """``repr`` without what differs between processes: a function's repr holds its address, which
    differs from rank to rank under torchrun (a callable ``muon_row_blocks`` would then look like a
    setting that differs), so callables are named by module and qualified name.  A device tensor
    (``lr`` kept on the GPU) is not read: that would synchronise the host."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {rank_independent_repr(v)}" for k, v in value.items()) + "}"
    if torch.is_tensor(value):
        if value.device.type != "cpu":
            return "<device tensor>"
        return repr(value.item()) if value.numel() == 1 else f"<tensor of shape {tuple(value.shape)}>"
    if callable(value) and not isinstance(value, type) and not dataclasses.is_dataclass(value):
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return f"<callable {getattr(value, '__module__', '?')}.{name}>"
    return repr(value)


def _qk_clip_repr(value: QKClipConfig | None) -> str:
    return repr(config_record(value))


def snapshot(value: Any) -> Any:
    """A value as a cache key holds it: containers copied (so that mutating a group's dict in
    place is seen), everything else compared with ``==`` (callables and configs by identity or
    their own equality)."""
    if isinstance(value, Mapping):
        return tuple((k, snapshot(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(snapshot(v) for v in value)
    return value


# ---------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Declared:
    """What an option's declaration says besides its name and default."""

    doc: str
    check: Callable[[Any, str, Mapping], None]
    plan: bool = False  # the step plan depends on it: part of the plan's cache key
    show: Callable[[Any], str] = rank_independent_repr  # how ranks compare it


def _option(default: Any, doc: str, check: Callable, *, plan: bool = False, show: Callable = rank_independent_repr):
    return field(default=default, metadata={"declared": Declared(doc, check, plan, show)})


@dataclass(frozen=True)
class MuonSettings:
    """Muon's optimizer-wide options: one value per optimizer, validated on construction
    (also by ``dataclasses.replace``, which is how an option is changed on a live optimizer)."""

    compute_dtype: torch.dtype | None = _option(
        None, "Newton–Schulz dtype; None: fp32 on CPU (bf16 matmul is ~100x slower there), on CUDA bf16 for "
        "the classic form and fp16 for the Gram form (docs/newton_schulz.md); sharded pieces travel in it when "
        "narrower (bf16 for fp16)", _compute_dtype, plan=True)
    qk_clip: QKClipConfig | None = _option(
        None, "a QKClipConfig to enable QK-clip (MuonClip), or None", _qk_clip, plan=True, show=_qk_clip_repr)
    distributed_mode: str = _option(
        "parallel", "'parallel': one owner per matrix, all-to-all; 'gather': every rank gathers every matrix "
        "(the baseline)", _one_of("parallel", "gather"), plan=True)
    chunk_size: int | None = _option(
        None, "jobs per pipeline chunk (None: the ranks the matrices are spread over)",
        _int_at_least(1, optional=True), plan=True)
    lookahead: int = _option(1, "chunks gathered ahead of the one being orthogonalised", _int_at_least(0))
    replica_split: str = _option(
        "auto", "matrices held by several replicas (HSDP, replicated DTensors): 'always' orthogonalise each once "
        "in the world, 'never' once per replica, 'auto' per matrix by cost", _one_of("auto", "always", "never"),
        plan=True)
    replica_split_flops_per_byte: float | None = _option(
        None, "'auto' splits a matrix whose Newton–Schulz does at least this many FLOPs per byte of update "
        "shipped to the other replicas; None: 1e4 on CUDA, 50 on CPU", _optional_non_negative, plan=True)
    skip_nonfinite: bool = _option(
        False, "if any rank sees NaN/Inf in a Muon gradient, every rank skips the step", _boolean)

    def __post_init__(self):
        for f in fields(self):
            f.metadata["declared"].check(getattr(self, f.name), f.name, {})


@dataclass(frozen=True)
class GroupOption:
    """One per-group option of the groups of ``kinds``: its default (the constructor keyword's
    default), how it is checked, and whether the step plan depends on it.  One name may be
    declared once per kind (``eps`` is Newton–Schulz's in Muon groups and AdamW's in AdamW
    groups, each with its own constructor keyword)."""

    name: str
    kinds: tuple[str, ...]
    default: Any
    doc: str
    check: Callable[[Any, str, Mapping], None]
    plan: bool = False  # the step plan depends on it: part of the plan's cache key
    keyword: str | None = None  # the constructor keyword setting its default (None: ``name``)
    constructor: bool = True  # False: set per group only, never a constructor keyword
    # In torch's ``defaults`` (which torch fills into every group).  Not "betas": OneCycleLR and
    # CyclicLR cycle ``betas[0]`` of every group when the defaults have it, and Muon groups cycle
    # ``momentum`` instead (AdamW groups follow it as betas[0]: see ``Muon._follow_momentum``).
    in_torch_defaults: bool = True
    # The default torch.optim.Muon uses where it differs from ours, for torch-style calls (a plain
    # list of tensors, or groups without ``use_muon``) that do not set the option.
    torch_default: Any = None
    has_torch_default: bool = False
    # The value as groups hold it (e.g. a dtype given by name as the torch.dtype); None: as given.
    normalize: Callable[[Any], Any] | None = None
    # A group holds the option only when it is not at its default ("off"): a group without it reads
    # as the default.  So state dicts have exactly the keys they had before the option existed, and
    # torch.distributed.checkpoint (which loads the keys the loading optimizer's groups have, and
    # refuses a checkpoint without one) still loads checkpoints from before it.
    optional: bool = False
    # How this machine runs or stores the step, not what the run trains (``momentum_dtype``,
    # ``ns_kernels``): ``load_state_dict`` keeps the loading optimizer's value, whatever the
    # checkpoint says (a run resumed on another machine runs as that machine is set up to).
    kept_on_load: bool = False

    @property
    def ctor_keyword(self) -> str:
        return self.keyword or self.name


BOTH = (MUON, ADAMW)
ADJUST_LR_MODES = ("match_rms_adamw", "original", "none", None)

GROUP_OPTIONS: tuple[GroupOption, ...] = (
    GroupOption("lr", BOTH, 1e-3, "learning rate (a float or a 1-element tensor)", _lr),
    GroupOption("weight_decay", BOTH, 0.1, "decoupled weight decay: p *= 1 - lr * weight_decay", _non_negative),
    GroupOption("momentum", (MUON,), 0.95, "Muon momentum: buf.lerp_(grad, 1 - momentum)", _unit_interval),
    GroupOption("nesterov", (MUON,), True, "orthogonalise grad.lerp(buf, momentum) instead of buf", _boolean),
    GroupOption("ns_steps", (MUON,), 5, "Newton–Schulz iterations", _int_at_least(1, high=100), plan=True),
    GroupOption("ns_coefficients", (MUON,), "fixed",
                "'fixed' (3.4445, -4.7750, 2.0315), 'polar_express', a triple, or one triple per step",
                _ns_coefficients, plan=True),
    GroupOption("ns_method", (MUON,), "auto", "'auto' (fewer FLOPs per shape and dtype), 'classic' or 'gram'",
                _ns_method, plan=True),
    GroupOption("ns_kernels", (MUON,), "auto",
                "what runs Newton–Schulz's products and the fused elementwise stages around them (momentum, "
                "Nesterov input, weight decay with the update, docs/kernels.md): 'auto' the Triton kernels (one "
                "triangle of every symmetric product, fused epilogues, one pass per elementwise stage) on CUDA GPUs "
                "they support and torch elsewhere, 'torch' torch's matmuls and elementwise ops, 'triton' the kernels "
                "(on CPU only under TRITON_INTERPRET=1); a matrix cut by ns_split runs its products on the same choice",
                _ns_kernels, plan=True, optional=True, kept_on_load=True),
    GroupOption("eps", (MUON,), 1e-7, "Newton–Schulz normalisation epsilon: X / max(||X||_F, eps), in fp32 "
                "(torch.optim.Muon's eps)", _positive),
    GroupOption("ns_split", (MUON,), "auto",
                "Newton–Schulz of one matrix split over several ranks of its shard group: 'auto' where the cost "
                "model says it lowers the busiest rank, 'always' every matrix whose short side has at least as "
                "many rows as the shard group has ranks (over the whole shard group), 'never'",
                _one_of("auto", "never", "always"), plan=True, optional=True),
    GroupOption("adjust_lr", (MUON,), "match_rms_adamw",
                "'match_rms_adamw': 0.2 sqrt(max(A, B)); 'original': sqrt(max(1, A/B)); None: none. "
                "torch-style calls default to 'original', as torch.optim.Muon",
                _one_of(*ADJUST_LR_MODES), torch_default="original", has_torch_default=True),
    GroupOption("eps", (ADAMW,), 1e-8, "AdamW's epsilon", _positive, keyword="adamw_eps", in_torch_defaults=False),
    GroupOption("betas", (ADAMW,), (0.9, 0.95), "AdamW's (beta1, beta2)", _betas, keyword="adamw_betas",
                in_torch_defaults=False),
    GroupOption("maximize", BOTH, False, "maximise the objective (the gradient's sign flips)", _boolean),
    GroupOption(ROW_BLOCKS_KEY, (MUON,), None,
                "row blocks orthogonalised as separate matrices: one spec for the group or {param_name: spec}",
                _row_blocks, plan=True, constructor=False),
    GroupOption(TRANSPOSED_KEY, (MUON,), None,
                "weights stored [in, out] (GPT-2's Conv1D): True for the group or {param_name: True}; Muon reads "
                "them as [out, in] (lr adjustment, row statistics, QK-clip rows, row blocks)",
                _transposed, plan=True, constructor=False),
    GroupOption("normuon_beta2", (MUON,), None,
                "None: Muon; a number in [0, 1): NorMuon (arXiv 2510.05491), a per-row second moment "
                "v <- beta2 v + (1 - beta2) mean(O*O, last dim) of the orthogonalised update O (per matrix, "
                "per expert, per row block), O / (sqrt(v) + 1e-8) rescaled to ||O||_F", _normuon_beta2, plan=True,
                optional=True),
    GroupOption("cautious_wd", BOTH, False,
                "cautious weight decay (arXiv 2510.12402): decay only where the parameter and its update "
                "have the same sign, p -= lr * wd * p * [p * update >= 0]", _boolean, optional=True),
    GroupOption("momentum_dtype", (MUON,), None,
                "dtype of the Muon momentum buffer (None: the parameter's; torch.bfloat16 halves its "
                "memory); the arithmetic is in the wider of it and the parameter's dtype",
                _momentum_dtype, plan=True, normalize=dtype_of, optional=True, kept_on_load=True),
)


def options_of(kind: str) -> tuple[GroupOption, ...]:
    """The group options of one kind of group ("muon" or "adamw")."""
    return tuple(o for o in GROUP_OPTIONS if kind in o.kinds)


# torch.optim.Muon's keywords, in its positional order (``Muon(params, lr, weight_decay, ...)``),
# and its one alias: ``adjust_lr_fn`` is our ``adjust_lr`` with None meaning "original".
TORCH_POSITIONAL = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
                    "adjust_lr_fn")
ADJUST_LR_FN_MODES = (None, "original", "match_rms_adamw")


def adjust_lr_from_fn(value: Any, where: str) -> str:
    """torch.optim.Muon's ``adjust_lr_fn`` as our ``adjust_lr``."""
    if not (value is None or isinstance(value, str)) or value not in ADJUST_LR_FN_MODES:
        raise ValueError(f"Muon: `{where}` must be one of {ADJUST_LR_FN_MODES} (torch.optim.Muon's adjust_lr_fn; "
                         f"None means 'original'), got {value!r}")
    return "original" if value is None else value


def resolve_adjust_lr_fn(options: dict, where: str) -> None:
    """Replace torch's ``adjust_lr_fn`` by ``adjust_lr`` in a dict of options (in place)."""
    if "adjust_lr_fn" not in options:
        return
    if "adjust_lr" in options:
        raise ValueError(
            f"Muon: {where or 'the constructor'} sets both `adjust_lr` and `adjust_lr_fn` (torch.optim.Muon's name "
            "for it); pass one: "
            "adjust_lr='original' is adjust_lr_fn=None"
        )
    options["adjust_lr"] = adjust_lr_from_fn(options.pop("adjust_lr_fn"), f"{where} adjust_lr_fn" if where else "adjust_lr_fn")


# ---------------------------------------------------------------------------- derived


def constructor_keywords() -> dict[str, Any]:
    """Every keyword ``Muon.__init__`` takes besides ``params``, with its default (torch's
    positional ones first, in torch's order)."""
    out = {o.ctor_keyword: o.default for o in GROUP_OPTIONS if o.constructor}
    out.update({f.name: f.default for f in fields(MuonSettings)})
    out["adjust_lr_fn"] = None  # torch.optim.Muon's alias of adjust_lr (see resolve_adjust_lr_fn)
    return {**{k: out[k] for k in TORCH_POSITIONAL}, **{k: v for k, v in out.items() if k not in TORCH_POSITIONAL}}


def constructor_signature() -> inspect.Signature:
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("self", positional), inspect.Parameter("params", positional)]
    params += [inspect.Parameter(k, positional if k in TORCH_POSITIONAL else inspect.Parameter.KEYWORD_ONLY,
                                 default=v) for k, v in constructor_keywords().items()]
    return inspect.Signature(params)


def constructor_doc() -> str:
    lines = ["Group options (defaults for every param group that does not set them):"]
    for o in GROUP_OPTIONS:
        if o.constructor:
            lines.append(f"    {o.ctor_keyword}={o.default!r} [{'/'.join(o.kinds)} groups]: {o.doc}")
    lines.append("    adjust_lr_fn: torch.optim.Muon's name for adjust_lr (None: 'original'); not with adjust_lr")
    lines.append("Per-group only:")
    lines += [f"    {o.name} [{'/'.join(o.kinds)} groups]: {o.doc}" for o in GROUP_OPTIONS if not o.constructor]
    lines.append("Optimizer options:")
    lines += [f"    {f.name}={f.default!r}: {f.metadata['declared'].doc}" for f in fields(MuonSettings)]
    lines.append(f"Positional, in torch.optim.Muon's order: params, {', '.join(TORCH_POSITIONAL)}.")
    return "\n".join(lines)


#: A Muon group made from torch-style input (a plain list of tensors, or a group without
#: ``use_muon``): its defaults are torch.optim.Muon's where they differ from ours.
TORCH_STYLE = "muon_torch_style"


def from_constructor(args: Sequence[Any], options: Mapping[str, Any]) -> tuple[MuonSettings, dict[str, dict[str, Any]]]:
    """The validated settings and the group defaults (per kind, and for torch-style Muon groups)
    from ``Muon.__init__``'s arguments after ``params``.

    Positional arguments follow torch.optim.Muon's order (:data:`TORCH_POSITIONAL`); unknown or
    repeated keywords raise TypeError, as Python would for an explicit signature.
    """
    known = constructor_keywords()
    if len(args) > len(TORCH_POSITIONAL):
        raise TypeError(f"Muon.__init__() takes at most {len(TORCH_POSITIONAL) + 1} positional arguments after "
                        f"self ({', '.join(('params',) + TORCH_POSITIONAL)}), got {len(args) + 1}")
    given = dict(zip(TORCH_POSITIONAL, args))
    for k, v in options.items():
        if k not in known:
            raise TypeError(f"Muon.__init__() got an unexpected keyword argument {k!r} (its options: {', '.join(known)})")
        if k in given:
            raise TypeError(f"Muon.__init__() got multiple values for argument {k!r}")
        given[k] = v
    resolve_adjust_lr_fn(given, "")
    values = {**known, **given}
    settings = MuonSettings(**{f.name: values[f.name] for f in fields(MuonSettings)})
    defaults: dict[str, dict[str, Any]] = {kind: {} for kind in (*KINDS, TORCH_STYLE)}
    for o in GROUP_OPTIONS:
        if not o.constructor:
            continue
        value = values[o.ctor_keyword]
        o.check(value, o.ctor_keyword, values)
        if o.normalize is not None:
            value = o.normalize(value)
        for kind in o.kinds:
            defaults[kind][o.name] = value
        if MUON in o.kinds:
            torch_style = o.has_torch_default and o.ctor_keyword not in given
            defaults[TORCH_STYLE][o.name] = o.torch_default if torch_style else value
    return settings, defaults


def torch_defaults(group_defaults: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """What torch's ``Optimizer`` keeps as ``defaults`` (and fills into every group): every
    constructor-set option (Muon groups' value where a name is declared for both kinds)."""
    out: dict[str, Any] = {}
    for o in GROUP_OPTIONS:
        if o.constructor and o.in_torch_defaults and not o.optional and o.name not in out:
            out[o.name] = group_defaults[o.kinds[0]][o.name]
    return out


def kind_of(group: Mapping) -> str:
    return MUON if group["use_muon"] else ADAMW


def fill_group(group: dict, group_defaults: Mapping[str, Mapping[str, Any]], torch_style: bool = False) -> None:
    """Fill the options of the group's kind that it does not set (before torch fills the rest);
    ``torch_style``: a Muon group made from torch-style input takes torch.optim.Muon's defaults."""
    resolve_adjust_lr_fn(group, "a param group")
    kind = TORCH_STYLE if torch_style and group["use_muon"] else kind_of(group)
    for name, value in group_defaults[kind].items():
        group.setdefault(name, value)
    normalize_group(group)
    if group["use_muon"]:
        group.setdefault(ROW_BLOCKS_KEY, None)


def normalize_group(group: dict) -> None:
    """Every option the group holds in its normal form (see ``GroupOption.normalize``); an optional
    option at its default is not held at all (``GroupOption.optional``)."""
    for o in GROUP_OPTIONS:
        if o.name not in group:
            continue
        if o.normalize is not None:
            group[o.name] = o.normalize(group[o.name])
        if o.optional and _is_default(o, group[o.name]):
            del group[o.name]


def _is_default(o: GroupOption, value: Any) -> bool:
    return value is o.default or (type(value) is type(o.default) and value == o.default)


def held_options(kind: str) -> tuple[str, ...]:
    """The options every group of ``kind`` holds (filled in when it is added): the constructor's,
    except the optional ones (:attr:`GroupOption.optional`)."""
    return tuple(o.name for o in options_of(kind) if o.constructor and not o.optional)


def check_group(group: Mapping, where: str, plan: bool = True) -> None:
    """Every option of a (filled) group that applies to its kind, and that every option a group
    always holds is there; ``where`` names the group.  ``plan=False``: only the options the step
    plan does not depend on (a cached plan was built with the others, unchanged: :func:`plan_key`)."""
    for o in options_of(kind_of(group)):
        if not plan and o.plan:
            continue
        if o.name in group:
            _checked(o, group[o.name], f"{where} {o.name}", group)
        elif o.name in held_options(kind_of(group)):
            raise ValueError(f"Muon: {where} has no `{o.name}`, which every {kind_of(group)} group holds; set it "
                             f"(the constructor's default is {o.default!r})")


def _checked(o: GroupOption, value: Any, where: str, group: Mapping) -> None:
    """``o.check``, whatever the value: a check that cannot even read it (a TypeError comparing a
    string with an int) refuses it as ValueError too, the one kind the ranks agree on at a step."""
    try:
        o.check(value, where, group)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - any value a user set in place
        raise ValueError(f"Muon: `{where}` cannot be read ({type(err).__name__}: {err}), got {value!r}") from err


def record(settings: MuonSettings, param_groups: Sequence[Mapping]) -> dict[str, str]:
    """Everything that must be equal on every rank, as text (the agreement's error names the key)."""
    out = {f.name: f.metadata["declared"].show(getattr(settings, f.name)) for f in fields(settings)}
    for i, group in enumerate(param_groups):
        out[f"param_groups[{i}].use_muon"] = repr(group.get("use_muon"))
        for o in GROUP_OPTIONS:
            if o.name in group:
                value = group[o.name] if o.normalize is None else o.normalize(group[o.name])
                if o.optional and _is_default(o, value):
                    continue  # held or not, the same setting
                out[f"param_groups[{i}].{o.name}"] = rank_independent_repr(value)
    return out


def digest(settings: MuonSettings, param_groups: Sequence[Mapping]) -> int:
    return agreement.checksum_text("\n".join(f"{k}={v}" for k, v in record(settings, param_groups).items()))


def plan_key(settings: MuonSettings, param_groups: Sequence[Mapping]) -> tuple:
    """The settings the step plan depends on, by value (see :func:`snapshot`)."""
    optimizer = tuple(getattr(settings, f.name) for f in fields(settings) if f.metadata["declared"].plan)
    groups = tuple((g.get("use_muon"), *(snapshot(g.get(o.name)) for o in GROUP_OPTIONS if o.plan))
                   for g in param_groups)
    return optimizer, groups


def from_legacy(state: Mapping[str, Any]) -> MuonSettings:
    """Settings of an optimizer pickled before they were one record (attributes of the optimizer);
    missing ones take their defaults.  (Its ``ns_eps`` is a Muon-group option now: see
    ``state_layout.upgrade``.)"""
    names = {f.name for f in fields(MuonSettings)}
    return MuonSettings(**{k: v for k, v in state.items() if k in names})
