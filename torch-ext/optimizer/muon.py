"""Muon: momentum + Newton–Schulz orthogonalisation for matrices, AdamW for the rest.

A drop-in ``torch.optim.Optimizer``.  Param groups say ``use_muon``.  Muon groups hold
matrices: 2-D weights, and 3-D MoE expert weights ``[E, out, in]`` treated as E independent
matrices.  AdamW groups hold everything else (norms, biases, embeddings, the output head).

Parameters may be plain tensors or DTensors with any placements (FSDP2, HSDP, TP, their
combinations, auto-sharding solver plans, ``_StridedShard``, uneven shards).  A step is:

  1. this rank's view of the step (``step/context.py``): its problems, QK-clip's values;
  2. one all-reduce in which every rank agrees on everything that could differ between ranks
     (``step/agreement.py``, ``distributed/agreement.py``): then all proceed, skip, or raise the
     same error;
  3. AdamW for the AdamW groups (``adamw.py``);
  4. Muon (``step/muon_update.py``): the update rule (``rule/``) run over the cached step plan
     (``parallel/planning/plan.py``) by the runtime (``parallel/execution/pipeline.py``).

Every option is declared once, in ``settings/declarations.py``; this class only wires them to torch's
``Optimizer`` (groups, state dicts, pickling).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch.optim import Optimizer

from . import settings
from . import checkpoint
from .adamw import adamw_group_step_, step_as_tensor_
from .checks import check_group_params, param_names_problem
from .dion2.checks import dion2_group_problem, dion2_row_blocks, is_dion2
from .dion2.step import dion2_update, orthogonalizers
from .lion import lion_group_step_
from .matrix_view import LayoutCache
from .newton_schulz.implementation import Implementations
from .named_params import named_params
from .parallel.execution.stats import PipelineStats
from .parallel.planning.process_groups import create_process_groups
from .qk_clip import QKClipReport, log_report
from .qk_clip.head_map import build_head_map, qk_params
from .roles import RoleRow, RoleTable, decide_torch_style
from .row_blocks import ROW_BLOCKS_KEY, resolve_row_blocks, spec_for
from .settings import MuonSettings
from .step.context import StepContext, context_key, rank
from .step.muon_update import muon_update

logger = logging.getLogger(__name__)


class Muon(Optimizer):
    """Muon for matrices and AdamW for everything else, for plain tensors and DTensors.

    ``params``: param groups, each with ``use_muon`` (see ``get_default_muon_param_groups``);
    named groups (``param_names``) give better error messages and enable QK-clip's name
    matching.  Every other keyword is an option declared in ``optimizer.settings`` (listed
    below): group options are the defaults of every group that does not set them, optimizer
    options are one value per optimizer (``opt.settings``, also readable and settable as
    attributes: ``opt.lookahead = 2``).

    With DTensor parameters, building the optimizer (and ``add_param_group`` with parameters
    that need a new process group) is collective over the default process group: every rank
    builds its optimizer at the same point, as with ``init_device_mesh``.  ``step()`` creates
    process groups only once, at the first step after the groups' parameters were switched to
    DTensors (accelerate's FSDP2 idiom), on every rank together.
    """

    def __init__(self, params, *args, **kwargs):
        self.settings, self.group_defaults = settings.from_constructor(args, kwargs)
        #: the last step's QK-clip record (heads clipped and max logit per layer), or None
        self.qk_clip_report: QKClipReport | None = None
        #: True when the last step was skipped (skip_nonfinite and a non-finite gradient)
        self.last_step_skipped = False
        #: timing and traffic of the last step's parallel pipeline
        self.last_step_stats = PipelineStats()
        self._layouts = LayoutCache()
        self._implementations = Implementations()  # ns_kernels resolved once per value and device
        self._building = True
        super().__init__(params, settings.torch_defaults(self.group_defaults))
        self._building = False
        # Everything QK-clip needs that names and shapes can tell is checked now, before
        # any state exists (pairs, head counts, one weight per layer and role, Muon groups).
        if self.settings.qk_clip is not None:
            build_head_map(self.settings.qk_clip, qk_params(named_params(self.param_groups)))
        self._create_process_groups(self.param_groups)

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, with every option checked; a refused group (whatever raised)
        leaves the optimizer as it was.  A group without ``use_muon`` (torch-style, as a plain list of
        tensors becomes) is added as up to two groups, both or neither: its matrices to Muon, with
        torch.optim.Muon's defaults, the rest to AdamW (``split_by_kind``:
        ``optimizer.roles.decide_torch_style``)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"Muon.add_param_group: a param group must be a dict, got {type(param_group).__name__}")
        torch_style = "use_muon" not in param_group
        if not torch_style and not isinstance(param_group["use_muon"], bool):
            raise ValueError(f"Muon: `use_muon` must be True or False, got {param_group['use_muon']!r}")
        parts = split_by_kind(param_group) if torch_style else [param_group]
        first = len(self.param_groups)
        try:
            for part in parts:
                settings.fill_group(part, self.group_defaults, torch_style, f"param_groups[{len(self.param_groups)}]")
                super().add_param_group(part)
                settings.strip_torch_defaults(part)
                self._check_group(len(self.param_groups) - 1)
        except BaseException:
            del self.param_groups[first:]  # torch appended the parts it accepted
            raise
        added = self.param_groups[first:]
        for group in added:
            checkpoint.stamp_group(group, self.settings.qk_clip)
        if not self.__dict__.get("_building", False):
            self._create_process_groups(added, only_if_missing=True)

    def _check_group(self, index: int) -> None:
        """Every option of ``param_groups[index]`` and what its parameters allow; raises ValueError
        naming the group and the option (shapes as Muon reads them: ``NamedParam.shape``, the ``[out, in]``
        view of a ``muon_transposed`` weight, as the step resolves them)."""
        group, where = self.param_groups[index], f"param_groups[{index}]"
        problem = param_names_problem(group, where)
        if problem:
            raise ValueError(problem)
        settings.check_group(group, where)
        entries = [e for e in named_params(self.param_groups) if e.group == index]
        check_group_params(group, [e.name for e in entries], where)
        problem = is_dion2(group) and dion2_group_problem(group, where)
        if problem:
            raise ValueError(problem)
        for e in entries:
            problem = self._implementations.param_problem(e.name, e.param, group, self.settings.compute_dtype)
            if problem:
                raise ValueError(f"{problem} ({where} ns_kernels)")
            if group["use_muon"] and group.get(ROW_BLOCKS_KEY) is not None:
                resolve_row_blocks(spec_for(group[ROW_BLOCKS_KEY], e.name, f"Muon: {where}"), e.name, e.shape)
                problem = is_dion2(group) and dion2_row_blocks(e, group, where)[1]
                if problem:
                    raise ValueError(problem)

    def _create_process_groups(self, param_groups: list[dict], only_if_missing: bool = False) -> None:
        create_process_groups(self.param_groups, param_groups, self._layouts, self.settings, only_if_missing)

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, qk_logits: dict[int, torch.Tensor] | None = None):
        """One optimisation step.

        ``qk_logits`` maps a layer key to a 1-D tensor of that layer's per-query-head max
        attention logits; with ``qk_clip`` configured, the q/k weights of heads over the
        threshold are scaled after the update.  Every rank must pass the same value (or None on
        every rank).
        """
        loss, closure_error = None, None
        if closure is not None:
            try:
                with torch.enable_grad():
                    loss = closure()
            except Exception as err:  # noqa: BLE001 - re-raised after the ranks agree
                closure_error = err
        context, clip = self._begin_step(qk_logits, closure_error)
        if context is None:
            return loss
        for group in self.param_groups:
            if not group["use_muon"]:
                (lion_group_step_ if settings.kind_of(group) == settings.LION else adamw_group_step_)(group, self.state)
        dion2_update(context.dion2, [self.param_groups[e.group] for e in context.dion2], context.dion2_orthogonalizers,
                     self.state, row_blocks=context.dion2_row_blocks,
                     clips=[context.dion2_clip_rows(i, clip) for i in range(len(context.dion2))])
        self._record_stats(muon_update(context, self.state, self.settings, clip))
        return loss

    # Everything in a step but the arithmetic runs eagerly, also under ``torch.compile(opt.step)``:
    # it holds the agreement's collective and host read-back (graph breaks anyway), and it sets
    # attributes on the optimizer, which dynamo mishandles after a graph break (in the resumed
    # frame): torch 2.11 raises "Attempted setattr on a user-defined object that does not have an
    # AttributeMutation mutation_type", torch 2.13 silently drops the write (``last_step_skipped``
    # stayed False for a skipped step).  tests/core/test_compile.py checks both on each release.

    @torch.compiler.disable
    def _begin_step(self, qk_logits, closure_error):
        """The ranks agree; then ``(context, QK-clip's step facts)``, or ``(None, None)`` when the
        step is skipped.  Sets ``last_step_skipped`` and ``qk_clip_report``.  Nothing changes before
        the verdict: the groups' options (set in place by a user or a scheduler) are among this rank's
        facts (``group_problems``)."""
        qk_logits = self._logits_for_step(qk_logits)
        context, facts, outcome = self._agree(qk_logits, closure_error)
        if outcome.counts["missing_groups"] and context.create_missing_groups(outcome):
            self.__dict__.pop("_cached_context", None)
            context, facts, outcome = self._agree(qk_logits, closure_error)  # with the new groups
        self.last_step_skipped = context.verdict(facts, outcome)
        if self.last_step_skipped:
            self.qk_clip_report = None
            logger.warning("Muon: skipped step: %d of %d ranks saw a non-finite Muon gradient (skip_nonfinite=True)",
                           outcome.counts["nonfinite_grads"], outcome.ranks)
            return None, None
        follow_momentum_schedule(self.param_groups)
        self.qk_clip_report = facts.clip.report if facts.clip is not None else None
        if self.qk_clip_report is not None:
            log_report(self.qk_clip_report)
        context.dion2_orthogonalizers = orthogonalizers([self.param_groups[e.group] for e in context.dion2],
                                                        context.dion2_implementations, self.settings)
        return context, facts.clip

    @torch.compiler.disable
    def _record_stats(self, stats: PipelineStats) -> None:
        self.last_step_stats = stats

    def _agree(self, qk_logits, closure_error):
        """This rank's view of the step, then the one all-reduce (see ``step/context.py``)."""
        context, problems = self._context()
        facts = context.local_facts(qk_logits, closure_error, self.settings.skip_nonfinite, problems)
        outcome = context.agree(facts, settings.digest(self.settings, self.param_groups),
                                lambda: settings.record(self.settings, self.param_groups))
        return context, facts, outcome

    def set_qk_logits_source(self, source: Callable[[], Any] | None) -> None:
        """Where ``step()`` takes QK-clip's logits when it is called without ``qk_logits`` (as
        Trainer and accelerate call it): ``source() -> {layer: per-query-head max logits} | None``,
        called on every rank at every such step (a recorder such as
        ``optimizer.integrations.huggingface.MaxLogitRecorder``; None returned: no clip this
        step).  ``None`` removes it.  Not pickled with the optimizer: set it again after loading."""
        if source is not None and not callable(source):
            raise ValueError(f"Muon.set_qk_logits_source: expected a callable () -> logits or None, got {source!r}")
        self._qk_logits_source = source

    def _logits_for_step(self, qk_logits):
        """``qk_logits``, else the source's; with QK-clip on and neither, say so (once)."""
        source = self.__dict__.get("_qk_logits_source")
        if qk_logits is None and source is not None:
            return source()
        if qk_logits is None and self.settings.qk_clip is not None and not self.__dict__.get("_warned_no_logits"):
            self._warned_no_logits = True
            logger.warning(NO_LOGITS_WARNING)
        return qk_logits

    def _context(self) -> tuple[StepContext, list[str]]:
        """The cached step context, rebuilt when what it depends on changes (``context_key``), and
        what is wrong with the groups as they are now (``group_problems``: the options a cached
        context was built with are unchanged, so only the others are checked again; a context for
        groups with problems only describes the parameters for the agreement, and is not kept)."""
        key = context_key(self.settings, self.param_groups)
        cached = self.__dict__.get("_cached_context")
        fresh = cached is None or cached.key != key
        problems = group_problems(self.param_groups, plan_options=fresh)
        if fresh:
            cached = StepContext(key, named_params(self.param_groups), self.settings, self.param_groups, self._layouts,
                                 self._implementations, rank(), planned=not problems)
            if not problems:
                self._cached_context = cached
        return cached, problems

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict, in Muon's state layout (``checkpoint/``: every group
        carries the layout version and QK-clip settings; row blocks as plain strings)."""
        self._stamp_layout()
        return checkpoint.with_plain_row_blocks(super().state_dict(), self.param_groups,
                                                  [e.name for e in named_params(self.param_groups)])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`, torch.distributed.checkpoint, or
        ``torch.optim.Muon`` (its momentum carries over).  torch's pre-hooks run first, then
        everything is checked before anything changes (``checkpoint.load``), post-hooks last."""
        qk_clip = checkpoint.load(self, state_dict, lambda checked: Optimizer.load_state_dict(self, checked))
        self.settings = dataclasses.replace(self.settings, qk_clip=qk_clip)
        self._stamp_layout()

    def _stamp_layout(self) -> None:
        for group in self.param_groups:
            checkpoint.stamp_group(group, self.settings.qk_clip)

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults/state/param_groups; keep Muon's own settings
        # so that deepcopy and pickling give a working optimizer.
        state = super().__getstate__()
        state.update(settings=self.settings, group_defaults=self.group_defaults)
        return state  # the qk_logits source (hooks on a model) is not part of it

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Also called by torch's load_state_dict with only state/param_groups: settings already
        # on the object stay.  A pickle from before the settings record holds them as attributes.
        if "settings" not in state and "settings" not in self.__dict__:
            state = dict(state, settings=settings.from_legacy(state), group_defaults=_legacy_group_defaults(state))
            checkpoint.upgrade_pickled_groups(state["param_groups"], state.get("ns_eps", 1e-7))
        super().__setstate__(state)
        for group in self.param_groups:
            if not group["use_muon"]:
                for p in group["params"]:
                    step_as_tensor_(self.state.get(p, {}), p)
        self.__dict__.setdefault("qk_clip_report", None)
        self.__dict__.setdefault("last_step_skipped", False)
        self.__dict__.setdefault("last_step_stats", PipelineStats())
        self.__dict__.setdefault("_layouts", LayoutCache())
        self.__dict__.setdefault("_implementations", Implementations())
        self.__dict__.pop("_cached_context", None)  # rebuilt for this process's parameters


NO_LOGITS_WARNING = (
    "Muon: QK-clip is configured but step() got no qk_logits, so nothing was clipped this step. Pass "
    "step(qk_logits=...) every step, or give the optimizer a source it reads when step() is called without "
    "them: opt.set_qk_logits_source(recorder) (e.g. optimizer.integrations.huggingface.MaxLogitRecorder; "
    "build_muon/MuonFactory set it up)."
)


def group_problems(groups: list[dict], plan_options: bool = True) -> list[str]:
    """Why the groups, as they are now, cannot be stepped (options set in place by a user or a
    scheduler): every option of every group (``settings.check_group``; without ``plan_options``
    only those the step plan does not depend on, a per-group cost), ``use_muon`` and
    ``param_names``; an AdamW group following a momentum schedule is checked with the betas it
    takes from it.  Checked at every step before anything changes, and agreed by the ranks."""
    problems = []
    for i, group in enumerate(groups):
        where = f"param_groups[{i}]"
        if not isinstance(group.get("use_muon"), bool):
            problems.append(f"Muon: {where} `use_muon` must be True or False, got {group.get('use_muon')!r}")
            continue
        problem = param_names_problem(group, where)
        if problem:
            problems.append(problem)
        betas = scheduled_betas(group)
        try:
            settings.check_group(group if betas is None else {**group, "betas": betas}, where, plan_options=plan_options)
        except ValueError as err:
            problems.append(str(err))
    return problems


def scheduled_betas(group: dict) -> tuple | None:
    """OneCycleLR/CyclicLR with ``cycle_momentum`` write ``momentum`` into every group (the
    defaults have ``momentum`` and no ``betas``) and mark it with ``max_momentum`` /
    ``base_momentum``: Muon groups follow the schedule as torch.optim.Muon's do, and an AdamW
    group takes it as its ``betas[0]``, as torch.optim.AdamW's would: those betas, or None."""
    if group["use_muon"] or "max_momentum" not in group or "base_momentum" not in group:
        return None
    if "momentum" not in group or not isinstance(group.get("betas"), (tuple, list)):
        return None  # nothing to follow, or betas to refuse as they are (settings.check_group)
    momentum = group["momentum"]
    if isinstance(momentum, (int, float)) and not isinstance(momentum, bool):
        momentum = float(momentum)
    return (momentum, *group["betas"][1:])


def follow_momentum_schedule(groups: list[dict]) -> None:
    """Every AdamW group following a momentum schedule takes its ``betas`` (``scheduled_betas``)."""
    for group in groups:
        betas = scheduled_betas(group)
        if betas is not None:
            group["betas"] = betas


def split_by_kind(group: dict, log: bool = True) -> list[dict]:
    """A torch-style group (no ``use_muon``) as a Muon group of its matrices and an AdamW group of
    the rest, by ``optimizer.roles.decide_torch_style`` (2-D weights that are not vectors in
    disguise, and 3-D tensors whose name says experts; a 3-D tensor nothing explains goes to AdamW,
    with one warning naming it), each with the options that apply to it: torch's meaning of an
    option wins where ours differs (``eps`` and ``adjust_lr_fn`` are Newton–Schulz's, so they go to
    the Muon group only). The table of where each parameter went is logged at DEBUG level."""
    named, names = _named_params(group)
    decisions = [decide_torch_style(n, p.shape) if isinstance(p, torch.Tensor) else None for n, p in named]
    matrix, elementwise = (_option_names(settings.MATRIX_KINDS), _option_names(settings.ELEMENTWISE_KINDS))
    muon_only = matrix - {o.name for o in settings.GROUP_OPTIONS if o.kinds == settings.ALL}
    adamw_only = elementwise - matrix
    rest = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    parts = []
    for use_muon in (True, False):
        mine = [(n, p) for (n, p), d in zip(named, decisions)
                if (d is not None and d.use_muon) == use_muon or (d is None and not use_muon)]
        if not mine and (parts or not use_muon):
            continue
        drop = adamw_only if use_muon else muon_only | {"eps", "adjust_lr_fn"}
        part = {k: v for k, v in rest.items() if k not in drop}
        part["params"] = [p for _, p in mine] if names is not None or any(n is None for n, _ in mine) else list(mine)
        if names is not None:
            part["param_names"] = [n for n, _ in mine]
        parts.append({**part, "use_muon": use_muon})
    if log:
        _log_torch_style(named, decisions)
    return parts


def _option_names(kinds) -> set[str]:
    return {o.name for kind in kinds for o in settings.options_of(kind)}


def _named_params(group: dict) -> tuple[list[tuple[str | None, Any]], list[str] | None]:
    """``[(name or None, param)]`` of a group given as tensors, ``(name, tensor)`` pairs or with
    ``param_names``; and the ``param_names`` list, if any."""
    params = group.get("params")
    params = [params] if isinstance(params, torch.Tensor) else list(params if params is not None else [])
    if len({isinstance(p, tuple) for p in params}) > 1:
        raise ValueError("all optimizer params should be with/without names. Some param names are missing")
    names = group.get("param_names")
    named = [p if isinstance(p, tuple) else (None if names is None else names[i], p) for i, p in enumerate(params)]
    return named, names


def _log_torch_style(named, decisions) -> None:
    """The once-per-process note, the ambiguous 3-D tensors (a warning), the table (DEBUG)."""
    if not _SPLIT_LOGGED:
        _SPLIT_LOGGED.append(True)
        logger.info(
            "Muon: parameters given without use_muon groups: matrices (2-D weights, and 3-D expert stacks named "
            "so) go to Muon, the rest to AdamW (docs/param_roles.md). optimizer.get_default_muon_param_groups(model) "
            "also sends embeddings, the output head and MoE routers to AdamW, as Muon's authors recommend."
        )
    ambiguous = [f"{n or f'params[{i}]'} {tuple(p.shape)}" for i, ((n, p), d) in enumerate(zip(named, decisions))
                 if d is not None and d.ambiguous]
    if ambiguous:
        logger.warning(
            "Muon: %d 3-D parameter(s) given without use_muon groups went to AdamW: %s. A 3-D tensor is an "
            "[E, out, in] expert stack or an [out, in, k] convolution kernel, and nothing here says which "
            "(docs/param_roles.md). To send expert stacks to Muon, pass named_parameters() (a name with an "
            "'expert' component is an expert stack), an explicit group {'params': [...], 'use_muon': True}, or "
            "optimizer.get_default_muon_param_groups(model), which reads the modules.",
            len(ambiguous), ", ".join(ambiguous))
    if logger.isEnabledFor(logging.DEBUG):
        rows = [RoleRow(n or f"params[{i}]", tuple(p.shape), 0 if d.use_muon else 1, "muon" if d.use_muon else "adamw",
                        d.role, d.rule) for i, ((n, p), d) in enumerate(zip(named, decisions)) if d is not None]
        logger.debug("Muon: where each torch-style parameter went (group 0: Muon, 1: AdamW)\n%s", RoleTable(rows))


_SPLIT_LOGGED: list[bool] = []  # the note above is logged once per process


def _legacy_group_defaults(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Group defaults of an optimizer pickled before the settings record: torch's ``defaults``,
    the AdamW betas and the Newton–Schulz eps it kept as attributes."""
    _, defaults = settings.from_constructor((), {})
    for kind, values in defaults.items():
        for name in values:
            if name in state.get("defaults", {}) and not (name == "eps" and kind != settings.ADAMW):
                values[name] = state["defaults"][name]  # its defaults' eps was AdamW's
    defaults[settings.ADAMW]["betas"] = tuple(state.get("adamw_betas", defaults[settings.ADAMW]["betas"]))
    for kind in (*settings.MATRIX_KINDS, settings.TORCH_STYLE):
        defaults[kind]["eps"] = state.get("ns_eps", defaults[kind]["eps"])
    return defaults


def _setting_property(name: str) -> property:
    """``opt.<name>`` reads ``opt.settings.<name>``; assigning validates and replaces the record."""

    def get(self: Muon):
        return getattr(self.settings, name)

    def set_(self: Muon, value) -> None:
        self.settings = dataclasses.replace(self.settings, **{name: value})

    declared = next(f for f in dataclasses.fields(MuonSettings) if f.name == name).metadata["declared"]
    return property(get, set_, doc=declared.doc)


for _field in dataclasses.fields(MuonSettings):
    setattr(Muon, _field.name, _setting_property(_field.name))
Muon.__init__.__signature__ = settings.constructor_signature()
Muon.__init__.__doc__ = settings.constructor_doc()

__all__ = ["Muon"]
