"""Muon: momentum + Newton–Schulz orthogonalisation for matrices, AdamW for the rest.

A drop-in ``torch.optim.Optimizer``.  Param groups say ``use_muon``.  Muon groups hold
matrices: 2-D weights, and 3-D MoE expert weights ``[E, out, in]`` treated as E independent
matrices.  AdamW groups hold everything else (norms, biases, embeddings, the output head).

Parameters may be plain tensors or DTensors with any placements (FSDP2, HSDP, TP, their
combinations, auto-sharding solver plans, ``_StridedShard``, uneven shards).  A step is:

  1. this rank's view of the step (``step_context.py``): its problems, QK-clip's values;
  2. one all-reduce in which every rank agrees on everything that could differ between ranks
     (``distributed/agreement.py``): then all proceed, skip, or raise the same error;
  3. AdamW for the AdamW groups (``adamw.py``);
  4. Muon (``update.py``): the update rule (``rule.py``) run over the cached step plan
     (``parallel/plan.py``) by the runtime (``parallel/runtime.py``).

Every option is declared once, in ``settings.py``; this class only wires them to torch's
``Optimizer`` (groups, state dicts, pickling).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch.optim import Optimizer

from . import settings as options
from . import state_layout
from .adamw import adamw_group_step_
from .checks import GROUPS_HELP, check_group_params, param_problem
from .distributed import groups
from .parallel.stats import PipelineStats
from .qk_clip import QKClipReport, log_report
from .qk_clip.plan import build_qk_clip_plan
from .row_blocks import ROW_BLOCKS_KEY, resolve_row_blocks, spec_for
from .settings import MuonSettings
from .step_context import Layouts, StepContext, context_key, entries_of, qk_params, rank, split_rank_sets
from .tensors import is_dtensor
from .update import muon_update

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
    builds its optimizer at the same point, as with ``init_device_mesh``.  ``step()`` never
    creates process groups.
    """

    def __init__(self, params, **kwargs):
        self.settings, self.group_defaults = options.from_constructor(kwargs)
        #: the last step's QK-clip record (heads clipped and max logit per layer), or None
        self.qk_clip_report: QKClipReport | None = None
        #: True when the last step was skipped (skip_nonfinite and a non-finite gradient)
        self.last_step_skipped = False
        #: timing and traffic of the last step's parallel pipeline
        self.last_step_stats = PipelineStats()
        self._layouts = Layouts()
        self._building = True
        super().__init__(params, options.torch_defaults(self.group_defaults))
        self._building = False
        # Everything QK-clip needs that names and shapes can tell is checked now, before
        # any state exists (pairs, head counts, one weight per layer and role, Muon groups).
        if self.settings.qk_clip is not None:
            build_qk_clip_plan(self.settings.qk_clip, qk_params(entries_of(self.param_groups), self.param_groups))
        self._create_process_groups(self.param_groups)

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, with every option checked; a refused group leaves the
        optimizer as it was."""
        if not isinstance(param_group, dict) or "use_muon" not in param_group:
            raise ValueError("Muon: a param group has no `use_muon` key. " + GROUPS_HELP)
        if not isinstance(param_group["use_muon"], bool):
            raise ValueError(f"Muon: `use_muon` must be True or False, got {param_group['use_muon']!r}")
        options.fill_group(param_group, self.group_defaults)
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            self._check_group(index)
        except ValueError:
            self.param_groups.pop()
            raise
        state_layout.stamp_group(self.param_groups[index], self.settings.qk_clip)
        if not self.__dict__.get("_building", False):
            self._create_process_groups([self.param_groups[index]], only_if_missing=True)

    def _check_group(self, index: int) -> None:
        group = self.param_groups[index]
        options.check_group(group, f"param_groups[{index}]")
        names = [e.name for e in entries_of(self.param_groups) if e.group == index]
        check_group_params(group, names)
        if group["use_muon"] and group.get(ROW_BLOCKS_KEY) is not None:
            for name, p in zip(names, group["params"]):
                resolve_row_blocks(spec_for(group[ROW_BLOCKS_KEY], name, f"Muon: param_groups[{index}]"), name, p.shape)

    def _create_process_groups(self, param_groups: list[dict], only_if_missing: bool = False) -> None:
        """Create, collectively, every process group the parallel step will use (see groups.py)."""
        import torch.distributed as dist

        dtensors = [p for g in self.param_groups for p in g["params"] if is_dtensor(p)]
        if not dtensors or not dist.is_initialized():
            return
        union = sorted({r for p in dtensors for r in self._layouts.grid(p.device_mesh).ranks})
        layouts = [(self._layouts.of(p), p.device_mesh) for g in param_groups for p in g["params"]
                   if g["use_muon"] and is_dtensor(p) and p.dim() >= 2 and param_problem("", p) is None]
        needed = groups.rank_sets_needed(layouts, union)  # (others are refused by step())
        needed = sorted(set(needed) | set(split_rank_sets(param_groups, self.settings, self._layouts)))  # ns_split
        if only_if_missing and all(groups.has_group(s) for s in needed):
            return
        groups.create_collectively(needed)

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
        self._follow_momentum()
        qk_logits = self._logits_for_step(qk_logits)
        context = self._context()
        facts = context.local_facts(qk_logits, closure_error, self.settings.skip_nonfinite)
        outcome = context.agree(facts, options.digest(self.settings, self.param_groups),
                                lambda: options.record(self.settings, self.param_groups))
        self.last_step_skipped = context.verdict(facts, outcome)
        if self.last_step_skipped:
            self.qk_clip_report = None
            logger.warning("Muon: skipped step: %d of %d ranks saw a non-finite Muon gradient (skip_nonfinite=True)",
                           outcome.counts["nonfinite_grads"], outcome.ranks)
            return loss
        self.qk_clip_report = facts.clip.report if facts.clip is not None else None
        if self.qk_clip_report is not None:
            log_report(self.qk_clip_report)
        for group in self.param_groups:
            if not group["use_muon"]:
                adamw_group_step_(group, self.state)
        self.last_step_stats = muon_update(context, self.state, self.settings, facts.clip)
        return loss

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
            logger.warning(
                "Muon: QK-clip is configured but step() got no qk_logits, so nothing was clipped this step. Pass "
                "step(qk_logits=...) every step, or give the optimizer a source it reads when step() is called "
                "without them: opt.set_qk_logits_source(recorder) (e.g. optimizer.integrations.huggingface."
                "MaxLogitRecorder; build_muon/MuonFactory set it up)."
            )
        return qk_logits

    def _context(self) -> StepContext:
        """The cached step context, rebuilt when what it depends on changes (``context_key``)."""
        key = context_key(self.settings, self.param_groups)
        cached = self.__dict__.get("_cached_context")
        if cached is None or cached.key != key:
            cached = self._cached_context = StepContext(
                key, entries_of(self.param_groups), self.settings, self.param_groups, self._layouts, rank())
        return cached

    def _follow_momentum(self) -> None:
        """OneCycleLR/CyclicLR with ``cycle_momentum`` write ``momentum`` into every group (the
        defaults have ``momentum`` and no ``betas``) and mark it with ``max_momentum`` /
        ``base_momentum``: Muon groups follow the schedule as torch.optim.Muon's do, and an AdamW
        group takes it as its ``betas[0]``, as torch.optim.AdamW's would."""
        for group in self.param_groups:
            if not group["use_muon"] and "max_momentum" in group and "base_momentum" in group:
                group["betas"] = (float(group["momentum"]), *group["betas"][1:])

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict; every param group also carries Muon's state layout
        version and QK-clip settings (``state_layout.py``: torch.distributed.checkpoint keeps
        only ``state`` and ``param_groups``, so that is where they must live)."""
        self._stamp_layout()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or torch.distributed.checkpoint).

        The checkpoint is checked before anything changes: its layout version, its groups against
        this optimizer's (count, sizes, ``use_muon``, ``param_names``, row blocks), each
        parameter's state keys and shapes, and its options.  Group options and the QK-clip
        settings are restored from the checkpoint, as torch's optimizers do; a custom
        ``QKClipConfig.classify`` cannot be saved and is kept from this optimizer's config.
        """
        state_layout.check_loadable(self, state_dict)
        for i, group in enumerate(state_dict["param_groups"]):
            options.check_group(group, f"checkpoint param_groups[{i}]")
        qk_clip = state_layout.qk_clip_from_groups(state_dict["param_groups"], self.settings.qk_clip)
        super().load_state_dict(state_dict)
        self.settings = dataclasses.replace(self.settings, qk_clip=qk_clip)
        self._stamp_layout()

    def _stamp_layout(self) -> None:
        for group in self.param_groups:
            state_layout.stamp_group(group, self.settings.qk_clip)

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
            state = dict(state, settings=options.from_legacy(state), group_defaults=_legacy_group_defaults(state))
        super().__setstate__(state)
        self.__dict__.setdefault("qk_clip_report", None)
        self.__dict__.setdefault("last_step_skipped", False)
        self.__dict__.setdefault("last_step_stats", PipelineStats())
        self.__dict__.setdefault("_layouts", Layouts())
        self.__dict__.pop("_cached_context", None)  # rebuilt for this process's parameters


def _legacy_group_defaults(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per-kind group defaults of an optimizer pickled before the settings record: torch's
    ``defaults`` and the AdamW betas it kept as an attribute."""
    _, defaults = options.from_constructor({})
    for kind, values in defaults.items():
        for name in values:
            if name in state.get("defaults", {}):
                values[name] = state["defaults"][name]
    defaults[options.ADAMW]["betas"] = tuple(state.get("adamw_betas", defaults[options.ADAMW]["betas"]))
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
Muon.__init__.__signature__ = options.constructor_signature()
Muon.__init__.__doc__ = options.constructor_doc()

__all__ = ["Muon"]
