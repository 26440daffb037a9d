"""The declarations: every optimizer option (:class:`MuonSettings`) and every group option
(:data:`GROUP_OPTIONS`), each once, with its default, its check and what depends on it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..matrix_view import TRANSPOSED_KEY
from ..qk_clip import QKClipConfig
from ..row_blocks import ROW_BLOCKS_KEY
from .checks import (_betas, _boolean, _compute_dtype, _int_at_least, _lr, _momentum_dtype, _non_negative, _normuon_beta2,
                     _ns_coefficients, _ns_kernels, _ns_method, _one_of, _optional_non_negative, _positive, _qk_clip,
                     _row_blocks, _transposed, _unit_interval, check_ef_decay, check_fraction, dtype_of)
from .comparison import _qk_clip_repr, rank_independent_repr

# The kinds of param group.  ``use_muon=True`` groups hold matrices: Muon, or Dion2 when they set
# ``dion2_fraction``; ``use_muon=False`` groups are elementwise: AdamW, or Lion when they set
# ``algorithm="lion"`` (``groups.kind_of``).
MUON, DION2, ADAMW, LION = "muon", "dion2", "adamw", "lion"
KINDS = (MUON, DION2, ADAMW, LION)
MATRIX_KINDS = (MUON, DION2)  # use_muon=True
ELEMENTWISE_KINDS = (ADAMW, LION)  # use_muon=False


@dataclass(frozen=True)
class Declared:
    """What an option's declaration says besides its name and default."""

    doc: str
    check: Callable[[Any, str, Mapping], None]
    shapes_plan: bool = False  # the step plan depends on it: part of the step context's cache key
    show: Callable[[Any], str] = rank_independent_repr  # how ranks compare it


def _option(default: Any, doc: str, check: Callable, *, shapes_plan: bool = False,
            show: Callable = rank_independent_repr):
    return field(default=default, metadata={"declared": Declared(doc, check, shapes_plan, show)})


@dataclass(frozen=True)
class MuonSettings:
    """Muon's optimizer-wide options: one value per optimizer, validated on construction
    (also by ``dataclasses.replace``, which is how an option is changed on a live optimizer)."""

    compute_dtype: torch.dtype | None = _option(
        None, "Newton–Schulz dtype; None: fp32 on CPU (bf16 matmul is ~100x slower there), on CUDA bf16 for "
        "the classic form and fp16 for the Gram form (docs/newton_schulz.md); sharded pieces travel in it when "
        "narrower (bf16 for fp16)", _compute_dtype, shapes_plan=True)
    qk_clip: QKClipConfig | None = _option(
        None, "a QKClipConfig to enable QK-clip (MuonClip), or None", _qk_clip, shapes_plan=True, show=_qk_clip_repr)
    distributed_mode: str = _option(
        "parallel", "'parallel': one owner per matrix, all-to-all; 'gather': every rank gathers every matrix "
        "(the baseline)", _one_of("parallel", "gather"), shapes_plan=True)
    chunk_size: int | None = _option(
        None, "jobs per pipeline chunk (None: the ranks the matrices are spread over)",
        _int_at_least(1, optional=True), shapes_plan=True)
    lookahead: int = _option(1, "chunks gathered ahead of the one being orthogonalised", _int_at_least(0))
    replica_split: str = _option(
        "auto", "matrices held by several replicas (HSDP, replicated DTensors): 'always' orthogonalise each once "
        "in the world, 'never' once per replica, 'auto' per matrix by cost", _one_of("auto", "always", "never"),
        shapes_plan=True)
    replica_split_flops_per_byte: float | None = _option(
        None, "'auto' splits a matrix whose Newton–Schulz does at least this many FLOPs per byte of update "
        "shipped to the other replicas; None: 1e4 on CUDA, 50 on CPU", _optional_non_negative, shapes_plan=True)
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
    shapes_plan: bool = False  # the step plan depends on it: part of the step context's cache key
    keyword: str | None = None  # the constructor keyword setting its default (None: ``name``)
    constructor: bool = True  # False: set per group only, never a constructor keyword
    # In torch's ``defaults`` (which torch fills into every group).  Not "betas": OneCycleLR and
    # CyclicLR cycle ``betas[0]`` of every group when the defaults have it, and Muon groups cycle
    # ``momentum`` instead (AdamW groups follow it as betas[0]: ``muon.follow_momentum_schedule``).
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


ALL = KINDS
MATRIX = MATRIX_KINDS
ADJUST_LR_MODES = ("match_rms_adamw", "original", "spectral_norm", "none", None)
ALGORITHMS = ("adamw", "lion")  # what a use_muon=False group runs

GROUP_OPTIONS: tuple[GroupOption, ...] = (
    GroupOption("lr", ALL, 1e-3, "learning rate (a float or a 1-element tensor)", _lr),
    GroupOption("weight_decay", ALL, 0.1, "decoupled weight decay: p *= 1 - lr * weight_decay", _non_negative),
    GroupOption("momentum", (MUON,), 0.95, "Muon momentum: buf.lerp_(grad, 1 - momentum)", _unit_interval),
    GroupOption("nesterov", (MUON,), True, "orthogonalise grad.lerp(buf, momentum) instead of buf", _boolean),
    GroupOption("ns_steps", MATRIX, 5, "Newton–Schulz iterations", _int_at_least(1, high=100), shapes_plan=True),
    GroupOption("ns_coefficients", MATRIX, "fixed",
                "'fixed' (3.4445, -4.7750, 2.0315), 'polar_express', a triple, or one triple per step",
                _ns_coefficients, shapes_plan=True),
    GroupOption("ns_method", MATRIX, "auto", "'auto' (fewer FLOPs per shape and dtype), 'classic' or 'gram'",
                _ns_method, shapes_plan=True),
    GroupOption("ns_kernels", MATRIX, "auto",
                "what runs Newton–Schulz's products and the fused elementwise stages around them (momentum, "
                "Nesterov input, weight decay with the update, docs/kernels.md): 'auto' the Triton kernels (one "
                "triangle of every symmetric product, fused epilogues, one pass per elementwise stage) on CUDA GPUs "
                "they support and torch elsewhere, 'torch' torch's matmuls and elementwise ops, 'triton' the kernels "
                "(on CPU only under TRITON_INTERPRET=1); a matrix cut by ns_split runs its products on the same choice",
                _ns_kernels, shapes_plan=True, optional=True, kept_on_load=True),
    GroupOption("eps", MATRIX, 1e-7, "Newton–Schulz normalisation epsilon: X / max(||X||_F, eps), in fp32 "
                "(torch.optim.Muon's eps)", _positive),
    GroupOption("ns_split", MATRIX, "auto",
                "Newton–Schulz of one matrix split over several ranks of its shard group: 'auto' where the cost "
                "model says it lowers the busiest rank, 'always' every matrix whose short side has at least as "
                "many rows as the shard group has ranks (over the whole shard group), 'never'",
                _one_of("auto", "never", "always"), shapes_plan=True, optional=True),
    GroupOption("adjust_lr", MATRIX, "match_rms_adamw",
                "'match_rms_adamw': 0.2 sqrt(max(A, B)); 'original': sqrt(max(1, A/B)); 'spectral_norm': sqrt(A/B) "
                "(dion's default for Dion2; no max(1, .)); None: none. "
                "torch-style calls default to 'original', as torch.optim.Muon",
                _one_of(*ADJUST_LR_MODES), torch_default="original", has_torch_default=True),
    GroupOption("eps", (ADAMW,), 1e-8, "AdamW's epsilon", _positive, keyword="adamw_eps", in_torch_defaults=False),
    GroupOption("betas", (ADAMW,), (0.9, 0.95), "AdamW's (beta1, beta2)", _betas, keyword="adamw_betas",
                in_torch_defaults=False),
    GroupOption("betas", (LION,), (0.9, 0.99),
                "Lion's (beta1, beta2): the update sign(beta1 m + (1 - beta1) g), the momentum m <- beta2 m + "
                "(1 - beta2) g", _betas, keyword="lion_betas", in_torch_defaults=False),
    GroupOption("algorithm", ELEMENTWISE_KINDS, "adamw",
                "what a use_muon=False group runs: 'adamw', or 'lion' (Lion as dion's scalar_opts.lion_update: "
                "p <- p (1 - lr wd) - lr sign(beta1 m + (1 - beta1) g); lr never adjusted)",
                _one_of(*ALGORITHMS), constructor=False, optional=True),
    GroupOption("maximize", ALL, False, "maximise the objective (the gradient's sign flips)", _boolean),
    GroupOption(ROW_BLOCKS_KEY, MATRIX, None,
                "row blocks orthogonalised as separate matrices: one spec for the group or {param_name: spec}",
                _row_blocks, shapes_plan=True, constructor=False),
    GroupOption(TRANSPOSED_KEY, MATRIX, None,
                "weights stored [in, out] (GPT-2's Conv1D): True for the group or {param_name: True}; Muon reads "
                "them as [out, in] (lr adjustment, row statistics, QK-clip rows, row blocks)",
                _transposed, shapes_plan=True, constructor=False),
    GroupOption("normuon_beta2", MATRIX, None,
                "None: Muon; a number in [0, 1): NorMuon (arXiv 2510.05491), a per-row second moment "
                "v <- beta2 v + (1 - beta2) mean(O*O, last dim) of the orthogonalised update O (per matrix, "
                "per expert, per row block), O / (sqrt(v) + 1e-8) rescaled to ||O||_F", _normuon_beta2, shapes_plan=True,
                optional=True),
    GroupOption("cautious_wd", ALL, False,
                "cautious weight decay (arXiv 2510.12402): decay only where the parameter and its update "
                "have the same sign, p -= lr * wd * p * [p * update >= 0]", _boolean, optional=True),
    GroupOption("momentum_dtype", MATRIX, None,
                "dtype of the Muon momentum buffer (None: the parameter's; torch.bfloat16 halves its "
                "memory); the arithmetic is in the wider of it and the parameter's dtype",
                _momentum_dtype, shapes_plan=True, normalize=dtype_of, optional=True, kept_on_load=True),
    GroupOption("dion2_fraction", MATRIX, None,
                "None: Muon; a number in (0, 1]: Dion2 (arXiv 2512.16928; NorDion2 with normuon_beta2): the "
                "momentum is the sum m <- m + g, each step orthogonalises only the k = ceil(fraction s) rows or "
                "columns (the shorter side; NorDion2: rows) of largest L1 norm, updates only those, and decays "
                "their momentum by dion2_ef_decay (docs/dion2.md); on DTensors the same slices, chosen exactly, and "
                "only they travel to one owner and back",
                check_fraction, shapes_plan=True, optional=True),
    GroupOption("dion2_ef_decay", (DION2,), 0.95,
                "Dion2's error feedback: the chosen slices' momentum is multiplied by it after each step, the "
                "others keep accumulating", check_ef_decay, optional=True),
)


def options_of(kind: str) -> tuple[GroupOption, ...]:
    """The group options of one kind of group (:data:`KINDS`)."""
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
