"""A step's context: the cache of everything that depends only on the parameters, their layouts,
which of them have gradients, and the settings.

Built from the settings and the param groups (never from the optimizer's internals), cached by
``Muon`` and rebuilt only when its key changes (:func:`context_key`).  It holds what every step
reuses: the step plan and each Muon parameter's row blocks (``parallel/planning/``), the DTensor
parameters' descriptions the ranks compare, and QK-clip's head map and row slots
(``qk_clip/``).  Per step it answers three questions, around the step's one all-reduce:

* :meth:`StepContext.local_facts` — what this rank knows before the ranks agree: its problems,
  QK-clip's values on the device, the facts to sum (``agreement.py``);
* :meth:`StepContext.agree` — the all-reduce (``distributed/agreement.py``);
* :meth:`StepContext.verdict` — raise the same error on every rank, or say whether every rank
  skips the step.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Callable

import torch
import torch.distributed as dist

from ..settings import MuonSettings, settings_key
from ..checks import gradient_problem, param_problem
from ..dion2.checks import dion2_errors, is_dion2
from ..distributed import agreement, groups
from ..matrix_view import LayoutCache
from ..named_params import NamedParam
from ..newton_schulz.implementation import Implementation, Implementations
from ..parallel.planning.plan import StepPlan, build_plan
from ..parallel.planning.plan_inputs import plan_input, plan_settings
from ..parallel.planning.process_groups import missing_rank_sets
from ..qk_clip.head_map import HeadMap, build_head_map, qk_params
from ..qk_clip.step import ClipRowSlots, ClipStep, step_clip
from ..row_blocks import RowBlocks
from ..tensors import is_dtensor, local_view
from .agreement import LocalFacts, count_nonfinite, describe, mesh_device, verdict


def context_key(settings: MuonSettings, param_groups: Sequence[Mapping]) -> tuple:
    """What a context depends on.  Parameters enter by identity (``id``: the cached context holds
    them, so an id cannot be reused while the key lives) and by what a step reads of them (shape,
    dtype, placements, mesh, gradient and its dtype), settings by value (``settings.settings_key``)."""
    params = []
    for group in param_groups:
        for p in group["params"]:
            g = p.grad
            layout = (id(p.device_mesh), tuple(p.placements)) if is_dtensor(p) else None
            params.append((id(p), tuple(p.shape), p.dtype, layout, g is not None, None if g is None else g.dtype))
    return tuple(params), settings_key(settings, param_groups)


class StepContext:
    """See the module docstring.  ``errors`` are this rank's problems found while building.
    ``planned=False`` (the groups' options are refused this step): only what the agreement needs (the
    DTensor parameters' descriptions and the group it runs on) is built."""

    def __init__(self, key: tuple, all_params: list[NamedParam], settings: MuonSettings,
                 param_groups: Sequence[Mapping], layouts: LayoutCache, implementations: Implementations, rank: int,
                 planned: bool = True):
        self.key = key
        self.settings = settings
        self.all_params = all_params
        self.errors: list[str] = []
        self._describe_dtensors(layouts)
        stepped = [e for e in all_params if e.use_muon and e.param.grad is not None]
        self.dion2 = [e for e in stepped if is_dion2(param_groups[e.group])]  # dion2/step.py, not the plan
        self.muon = [e for e in stepped if not is_dion2(param_groups[e.group])]
        self.muon_groups = [param_groups[e.group] for e in self.muon]
        first = (self.muon or self.dion2 or [None])[0]
        self.device = local_view(first.param).device if first is not None else torch.device("cpu")
        self.row_blocks: list[RowBlocks | None] = [None] * len(self.muon)
        # what runs each Muon parameter's products and stages (newton_schulz/implementation.py)
        self.implementations: list[Implementation] = []
        self.dion2_implementations: list[Implementation] = []  # the same for each Dion2 parameter
        self.dion2_orthogonalizers: list = []  # their Newton–Schulz, set each step (dion2.step.orthogonalizers)
        self.dion2_row_blocks: list[RowBlocks | None] = [None] * len(self.dion2)
        self.head_map: HeadMap | None = None
        self.plan = StepPlan()
        self._layouts = layouts
        self._rank = rank
        self._clip_slots: ClipRowSlots | None = None
        self.missing_groups: list[tuple[int, ...]] = []
        if not planned:
            return
        self.errors += [problem for e in all_params if (problem := param_problem(e.name, e.param))]
        self.errors += [problem for e in all_params if (problem := implementations.param_problem(
            e.name, e.param, param_groups[e.group], settings.compute_dtype))]
        self.dion2_row_blocks, problems = dion2_errors(self.dion2, param_groups)  # each Dion2 parameter's blocks
        self.errors += problems
        if self.errors:
            return
        self.implementations = [implementations.for_param(e.param, group, settings.compute_dtype)
                                for e, group in zip(self.muon, self.muon_groups)]
        self.dion2_implementations = [implementations.for_param(e.param, param_groups[e.group], settings.compute_dtype)
                                      for e in self.dion2]
        if settings.qk_clip is not None:
            try:
                self.head_map = build_head_map(settings.qk_clip, qk_params(all_params))
                self._clip_slots = ClipRowSlots(self.head_map)
            except ValueError as err:
                self.errors.append(str(err))
        plan_params = []
        for i, (e, group) in enumerate(zip(self.muon, self.muon_groups)):
            plan_param, self.row_blocks[i], problems = plan_input(e, group, settings, layouts, rank)
            plan_params.append(plan_param)
            self.errors += problems
        self.missing_groups = missing_rank_sets(all_params, param_groups, settings, layouts)
        if not self.errors and not self.missing_groups:
            self._plan(plan_params)

    def _describe_dtensors(self, layouts: LayoutCache) -> None:
        """What the agreement compares across ranks, and the group it runs on."""
        dt = [e for e in self.all_params if is_dtensor(e.param)]
        self.dtensor_names = [e.name for e in dt]
        self.described = [describe(e.name, e.param) for e in dt]
        self.has_grad = [int(e.param.grad is not None) for e in dt]
        self.checksums = agreement.parameter_checksums(self.described, self.has_grad)  # once, not per step
        self.agreement_group, self.agreement_device = None, torch.device("cpu")
        if dt and dist.is_initialized():
            meshes = {id(e.param.device_mesh): e.param for e in dt}
            union = sorted({r for p in meshes.values() for r in layouts.grid(p.device_mesh).ranks})
            try:
                self.agreement_group = groups.group_for(union)
            except RuntimeError as err:
                self.errors.append(str(err))
            self.agreement_device = mesh_device(next(iter(meshes.values())).device_mesh)

    def _plan(self, plan_params) -> None:
        try:
            self.plan = build_plan(plan_params, self._rank, plan_settings(self.settings, self.agreement_device.type),
                                   groups.group_for)
        except (RuntimeError, ValueError) as err:  # found on this rank only: agree, then raise
            self.errors.append(f"Muon.step: cannot plan the parallel step on this rank: {err}")

    def create_missing_groups(self, outcome: agreement.Outcome) -> bool:
        """Parameters that became DTensors after construction (accelerate's FSDP2 idiom) may need
        process groups nobody created: every rank creates them now, together, in one order — only
        when every rank of the world takes part in this step and none refused it (else the
        verdict raises the same error everywhere).  True when they were created."""
        counts = outcome.counts
        if counts["rejected_inputs"] or counts["closure_raised"] or outcome.ranks != dist.get_world_size():
            return False
        groups.create_collectively(self.missing_groups)
        return True

    # ------------------------------------------------------------------ per step

    @property
    def muon_params(self) -> list[torch.Tensor]:
        return [e.param for e in self.muon]

    def local_facts(self, qk_logits, closure_error: BaseException | None, skip_nonfinite: bool,
                    option_problems: Sequence[str] = ()) -> LocalFacts:
        """This rank's problems (``option_problems``: the groups' options, ``Muon.group_problems``),
        QK-clip's values and the facts to agree on (nothing changes yet; device facts stay on the
        device)."""
        errors = [*option_problems, *self.errors]
        for e in self.all_params:
            problem = gradient_problem(e.name, e.param, e.param.grad, e.use_muon)
            if problem:
                errors.append(problem)
        clip = None
        if not errors:
            clip, qk_errors = step_clip(self.head_map, qk_logits, self.device,
                                        {e.name: e.param.grad is not None for e in (*self.muon, *self.dion2)})
            errors += qk_errors
        nothing = torch.zeros((), dtype=torch.int64)
        grads = [local_view(e.param.grad) for e in (*self.muon, *self.dion2)]
        return LocalFacts(
            errors=errors, missing_groups=self.missing_groups, closure_error=closure_error, qk_logits=qk_logits,
            clip=clip,
            nonfinite_grads=count_nonfinite(grads) if skip_nonfinite and not errors else nothing,
            nonfinite_logits=clip.nonfinite if clip is not None else nothing,
            logits_digest=agreement.device_checksum({0: clip.flat_logits}) if clip is not None else nothing,
        )

    def agree(self, facts: LocalFacts, settings_digest: int, describe_settings: Callable[[], Mapping[str, str]]):
        """The step's one all-reduce (see ``distributed/agreement.py``)."""
        return agreement.agree(
            self.described, self.has_grad, facts=facts.summed(), settings=settings_digest,
            device_digest=facts.logits_digest, group=self.agreement_group, device=self.agreement_device,
            describe_settings=describe_settings, checksums=self.checksums,
        )

    def verdict(self, facts: LocalFacts, outcome: agreement.Outcome) -> bool:
        """Raise the same error on every rank if any rank cannot step; else whether every rank
        skips the step (``skip_nonfinite`` and a non-finite gradient somewhere; ``step/agreement.py``)."""
        return verdict(facts, outcome, self.dtensor_names)

    def clip_rows(self, i: int, clip: ClipStep | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(scale table, table slot of every local row) when Muon parameter ``i`` is clipped this step."""
        return self._clip_rows(i, self.muon[i], clip)

    def dion2_clip_rows(self, i: int, clip: ClipStep | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The same for Dion2 parameter ``i`` (``dion2/step.py`` scales its rows after its update)."""
        return self._clip_rows(("dion2", i), self.dion2[i], clip)

    def _clip_rows(self, key, e: NamedParam, clip: ClipStep | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if clip is None:
            return None
        local_rows = functools.partial(self._layouts.local_rows, e.param, e.transposed, self._rank)
        return self._clip_slots.rows(key, e.name, clip, local_rows, local_view(e.param).device)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
