"""A step's context: everything that depends only on the parameters, their layouts, which of
them have gradients, and the settings.

Built from the settings and the param groups (never from the optimizer's internals), cached by
``Muon`` and rebuilt only when its key changes (:func:`context_key`).  It holds what every step
reuses: the step plan (``parallel/plan.py``), the descriptions the ranks compare
(``distributed/agreement.py``), QK-clip's static plan and row maps, and each Muon parameter's
row blocks.  Per step it answers three questions:

* :meth:`StepContext.local_facts` — what this rank knows about the step before the ranks
  agree: its problems, QK-clip's values on the device, the facts to sum;
* :meth:`StepContext.verdict` — after the agreement: raise the same error on every rank, or
  say whether every rank skips the step;
* :meth:`StepContext.clip_rows` — QK-clip's scale table and row slots of one parameter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import settings as options
from .checks import gradient_problem, kernels_param_problem, param_problem
from .distributed import agreement, groups
from .distributed.layout import MeshGrid, ParamLayout
from .newton_schulz import default_compute_dtype, newton_schulz_flops, ns_io_dtype
from .parallel.planning.plan import PlanParam, PlanSettings, StepPlan, build_plan
from .parallel.split_newton_schulz import SplitHardware, hardware_for
from .parallel.planning.cut_model import SplitModel, rank_sets
from .qk_clip.plan import QKClipPlan, build_qk_clip_plan
from .qk_clip.step import ClipStep, check_layer_gradients, check_step_logits, compute_clip_step, describe_nonfinite
from .matrix_view import TRANSPOSED_KEY, transposed_for, view_placements, view_shape
from .row_blocks import ROW_BLOCKS_KEY, RowBlocks, resolve_row_blocks, spec_for
from .rule import normuon_on, row_state_dtype, work_dtype
from .settings import MuonSettings
from .tensors import is_dtensor, local_view

# "auto" splits a matrix over replicas when its Newton–Schulz does at least this many
# FLOPs per byte of update shipped to the other replicas: a GPU's bf16 rate over an
# inter-node link (~400 TFLOP/s over ~40 GB/s per GPU), a CPU core's fp32 rate over
# loopback (~50 GFLOP/s over ~1 GB/s).
DEFAULT_REPLICA_FLOPS_PER_BYTE = {"cuda": 1e4, "cpu": 50.0}


@dataclass(frozen=True)
class Entry:
    """One parameter of the optimizer, as a step sees it."""

    name: str
    param: torch.Tensor
    group: int  # index into param_groups
    use_muon: bool
    transposed: bool = False  # stored [in, out]: Muon reads its transpose (matrix_view.py)

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape Muon reads: ``[..., out, in]``."""
        return view_shape(self.param.shape, self.transposed)


def entries_of(param_groups: Sequence[Mapping]) -> list[Entry]:
    """Every parameter with its name (``param_names``, or its position), group and matrix view."""
    out = []
    for gi, group in enumerate(param_groups):
        # as robust as the groups are not: a step refuses bad names and kinds (Muon.group_problems)
        names = group.get("param_names") if isinstance(group.get("param_names"), (list, tuple)) else None
        use_muon = group.get("use_muon") is True
        for i, p in enumerate(group["params"]):
            name = names[i] if names and i < len(names) else f"param_groups[{gi}]['params'][{i}]"
            out.append(Entry(name, p, gi, use_muon, use_muon and transposed_for(group.get(TRANSPOSED_KEY), name)))
    return out


def context_key(settings: MuonSettings, param_groups: Sequence[Mapping]) -> tuple:
    """What a context depends on.  Parameters enter by identity (``id``: the cached context holds
    them, so an id cannot be reused while the key lives) and by what a step reads of them (shape,
    dtype, placements, mesh, gradient and its dtype), settings by value (``settings.plan_key``)."""
    params = []
    for group in param_groups:
        for p in group["params"]:
            g = p.grad
            layout = (id(p.device_mesh), tuple(p.placements)) if is_dtensor(p) else None
            params.append((id(p), tuple(p.shape), p.dtype, layout, g is not None, None if g is None else g.dtype))
    return tuple(params), options.plan_key(settings, param_groups)


class Layouts:
    """One :class:`ParamLayout` per distinct (mesh, shape, placements), shared by the optimizer's
    contexts: the plan caches index math by layout object, and models repeat a few shapes."""

    def __init__(self):
        self._grids: dict[object, MeshGrid] = {}
        self._layouts: dict[tuple, ParamLayout] = {}

    def grid(self, mesh) -> MeshGrid:
        hit = self._grids.get(mesh)
        if hit is None:
            hit = self._grids[mesh] = MeshGrid.of(mesh)
        return hit

    def of(self, p, transposed: bool = False) -> ParamLayout:
        """The layout of ``p`` as Muon reads it (transposed: the DTensor's transpose)."""
        shape = view_shape(p.shape, transposed)
        placements = view_placements(p.placements, p.dim(), transposed)
        key = (p.device_mesh, shape, placements)
        hit = self._layouts.get(key)
        if hit is None:
            hit = self._layouts[key] = ParamLayout(shape, self.grid(p.device_mesh), placements)
        return hit


@dataclass
class LocalFacts:
    """What this rank knows about a step before the ranks agree (named, not positional)."""

    errors: list[str]
    missing_groups: list[tuple[int, ...]]  # process groups the plan needs that no rank created yet
    closure_error: BaseException | None
    qk_logits: Mapping | None
    clip: ClipStep | None
    nonfinite_grads: torch.Tensor
    nonfinite_logits: torch.Tensor
    logits_digest: torch.Tensor

    def summed(self) -> dict[str, int | torch.Tensor]:
        """The facts the ranks sum (the agreement lays them out by name)."""
        return {
            "qk_logits_passed": int(self.qk_logits is not None),
            "rejected_inputs": int(bool(self.errors)),
            "closure_raised": int(self.closure_error is not None),
            "nonfinite_grads": self.nonfinite_grads,
            "nonfinite_logits": self.nonfinite_logits,
            "missing_groups": int(bool(self.missing_groups)),
        }


class StepContext:
    """See the module docstring.  ``errors`` are this rank's problems found while building.
    ``planned=False`` (the groups' options are refused this step): only what the agreement needs (the
    DTensor parameters' descriptions and the group it runs on) is built."""

    def __init__(self, key: tuple, entries: list[Entry], settings: MuonSettings, param_groups: Sequence[Mapping],
                 layouts: Layouts, rank: int, planned: bool = True):
        self.key = key
        self.settings = settings
        self.entries = entries
        self.errors: list[str] = []
        self._describe_dtensors(layouts)
        self.muon = [e for e in entries if e.use_muon and e.param.grad is not None]
        self.muon_groups = [param_groups[e.group] for e in self.muon]
        self.device = local_view(self.muon[0].param).device if self.muon else torch.device("cpu")
        self.row_blocks: list[RowBlocks | None] = [None] * len(self.muon)
        self.qk_plan: QKClipPlan | None = None
        self.plan = StepPlan()
        self._layouts = layouts
        self._rank = rank
        self._clip_index: dict[int, torch.Tensor] = {}
        self.missing_groups: list[tuple[int, ...]] = []
        if not planned:
            return
        self.errors += [problem for e in entries if (problem := param_problem(e.name, e.param))]
        self.errors += [problem for e in entries if (problem := kernels_param_problem(
            e.name, e.param, param_groups[e.group], settings.compute_dtype))]
        if self.errors:
            return
        if settings.qk_clip is not None:
            try:
                self.qk_plan = build_qk_clip_plan(settings.qk_clip, qk_params(entries, param_groups))
            except ValueError as err:
                self.errors.append(str(err))
        plan_params = [self._plan_param(i) for i in range(len(self.muon))]
        self.missing_groups = self._missing_groups(param_groups)
        if not self.errors and not self.missing_groups:
            self._plan(plan_params)

    # ------------------------------------------------------------------ building

    def _describe_dtensors(self, layouts: Layouts) -> None:
        """What the agreement compares across ranks, and the group it runs on."""
        dt = [e for e in self.entries if is_dtensor(e.param)]
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

    def _plan_param(self, i: int) -> PlanParam:
        e, group = self.muon[i], self.muon_groups[i]
        p = e.param
        layout = self._layouts.of(p, e.transposed) if is_dtensor(p) else None
        if layout is not None:
            problem = local_shape_problem(e.name, p, layout, self._rank, e.transposed)
            if problem:
                self.errors.append(problem)
        device = local_view(p).device
        compute = self.settings.compute_dtype or default_compute_dtype(device)
        cost, ns_key = ns_cost(group, self.settings.compute_dtype, device), e.group
        if group.get(ROW_BLOCKS_KEY) is not None:
            try:
                blocks = resolve_row_blocks(spec_for(group[ROW_BLOCKS_KEY], e.name, f"Muon: param_groups[{e.group}]"),
                                            e.name, e.shape)
            except ValueError as err:
                self.errors.append(str(err))
                blocks = None
            if blocks is not None:
                self.row_blocks[i] = blocks
                ns_key = (e.group, e.name)  # its own orthogonalisation: never batched with others
                cost = blocks_cost(blocks, cost)
        work = work_dtype(p, group)
        cuttable = group.get(ROW_BLOCKS_KEY) is None
        return PlanParam(
            name=e.name, shape=e.shape, layout=layout, wire_dtype=wire_dtype(compute, p),
            device=local_view(p).device, ns_key=ns_key, cost=cost,
            mesh=p.device_mesh if layout is not None else None,
            compute_itemsize=compute.itemsize, state_itemsize=work.itemsize,
            row_bytes=row_state_dtype(work).itemsize if normuon_on(group) else 0,
            # a unit with row blocks is orthogonalised whole, block by block (docs/parallel.md: ns_split); a cut
            # NorMuon unit takes its row statistics from the whole matrix (rule.normuon_normalize_split)
            split=split_model(group, self.settings.compute_dtype, local_view(p).device) if cuttable else None,
        )

    def _missing_groups(self, param_groups: Sequence[Mapping]) -> list[tuple[int, ...]]:
        """Rank sets the plan needs a process group for that this process has not created: the
        parameters became DTensors after the optimizer was built (accelerate's FSDP2 swaps them in).
        Every rank then creates them at this step, together (``Muon.step``)."""
        dtensors = [e for e in self.entries if e.use_muon and is_dtensor(e.param) and e.param.dim() >= 2]
        if not dtensors or not dist.is_initialized():
            return []
        union = sorted({r for e in dtensors for r in self._layouts.grid(e.param.device_mesh).ranks})
        layouts = [(self._layouts.of(e.param, e.transposed), e.param.device_mesh) for e in dtensors]
        needed = set(groups.rank_sets_needed(layouts, union)) | set(split_rank_sets(param_groups, self.settings,
                                                                                   self._layouts))
        return [s for s in sorted(needed) if not groups.has_group(s)]

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

    def _plan(self, plan_params: list[PlanParam]) -> None:
        s = self.settings
        flops_per_byte = s.replica_split_flops_per_byte
        if flops_per_byte is None:
            flops_per_byte = DEFAULT_REPLICA_FLOPS_PER_BYTE.get(self.agreement_device.type, 1e4)
        plan_settings = PlanSettings(chunk_size=s.chunk_size, replica_split=s.replica_split,
                                     replica_min_flops_per_byte=flops_per_byte, mode=s.distributed_mode)
        try:
            self.plan = build_plan(plan_params, self._rank, plan_settings, groups.group_for)
        except (RuntimeError, ValueError) as err:  # found on this rank only: agree, then raise
            self.errors.append(f"Muon.step: cannot plan the parallel step on this rank: {err}")

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
        for e in self.entries:
            problem = gradient_problem(e.name, e.param, e.param.grad, e.use_muon)
            if problem:
                errors.append(problem)
        clip = None
        if not errors:
            clip, qk_errors = self._qk_step(qk_logits)
            errors += qk_errors
        nothing = torch.zeros((), dtype=torch.int64)
        grads = [local_view(e.param.grad) for e in self.muon]
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
        skips the step (``skip_nonfinite`` and a non-finite gradient somewhere)."""
        counts, n = outcome.counts, outcome.ranks
        if facts.closure_error is not None:
            raise facts.closure_error
        if counts["closure_raised"]:
            raise RuntimeError(
                f"Muon.step: the closure raised on {counts['closure_raised']} of {n} ranks (their errors say why); "
                "this rank stops too so that no collective hangs."
            )
        if facts.errors:
            raise ValueError("\n".join(facts.errors))
        if counts["rejected_inputs"]:
            raise RuntimeError(
                f"Muon.step: {counts['rejected_inputs']} of {n} ranks rejected their inputs (their errors say why); "
                "this rank stops too so that no collective hangs."
            )
        for name, c in zip(self.dtensor_names, outcome.grad_counts):
            if 0 < c < n:
                raise RuntimeError(
                    f"Muon.step: parameter '{name}' has a gradient on {c} of {n} ranks and None on the "
                    "others. A sharded parameter needs a gradient on every rank: use it in every rank's "
                    "forward, or call zero_grad(set_to_none=False) so unused parameters get zero gradients."
                )
        self._check_logits_agreed(facts, outcome)
        if counts["missing_groups"]:
            raise RuntimeError(
                f"Muon.step: {counts['missing_groups']} of {n} ranks lack process groups the step needs, and they "
                "could not be created here: the optimizer's ranks are not the whole world. Build the optimizer after "
                "the parameters are sharded (its constructor creates them, collectively)."
            )
        return counts["nonfinite_grads"] > 0

    def _check_logits_agreed(self, facts: LocalFacts, outcome: agreement.Outcome) -> None:
        passed, n = outcome.counts["qk_logits_passed"], outcome.ranks
        if 0 < passed < n:
            raise RuntimeError(
                f"Muon.step: qk_logits was passed on {passed} of {n} ranks and None on the others; "
                "pass the same qk_logits on every rank (reduce them over the data-parallel ranks first)."
            )
        if not outcome.same_device_digest:
            raise RuntimeError(
                "Muon.step: qk_logits differ between ranks; every rank must pass the same per-head max "
                "logits (optimizer.max_logits.gather_max_logits max-reduces over data-parallel ranks and "
                "gathers over tensor-parallel ranks)."
            )
        if outcome.counts["nonfinite_logits"]:
            raise ValueError(describe_nonfinite(facts.qk_logits))  # every rank: they all pass the same logits

    def _qk_step(self, qk_logits) -> tuple[ClipStep | None, list[str]]:
        """This step's QK-clip values (on the device, no host read) or the problems with ``qk_logits``."""
        errors = check_step_logits(self.qk_plan, qk_logits, self.device)
        if errors or qk_logits is None or self.qk_plan is None:
            return None, errors
        has_grad = {e.name: e.param.grad is not None for e in self.muon}
        errors, active = check_layer_gradients(self.qk_plan, has_grad)
        if errors:
            return None, errors
        skipped = [layer for layer in self.qk_plan.layers if layer not in active]
        return compute_clip_step(self.qk_plan, qk_logits, self.device, skipped_layers=skipped), []

    def clip_rows(self, i: int, clip: ClipStep | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(scale table, table slot of every local row) when Muon parameter ``i`` is clipped this step."""
        if clip is None:
            return None
        rows = self.qk_plan.weights.get(self.muon[i].name)
        if rows is None:
            return None
        index = self._clip_index.get(i)
        if index is None:  # once per placement
            e = self.muon[i]
            index = self._clip_index[i] = rows.local_index(self._local_rows(e), local_view(e.param).device)
        return clip.table, index

    def _local_rows(self, e: Entry) -> slice | torch.Tensor:
        """Global rows (of the matrix view) of this rank's piece of ``e``."""
        if not is_dtensor(e.param):
            return slice(0, e.shape[0])
        layout = self._layouts.of(e.param, e.transposed)
        return layout.indices(layout.grid.coordinate(self._rank))[0]


def create_process_groups(all_groups: Sequence[Mapping], new_groups: Sequence[Mapping], layouts: Layouts,
                          settings: MuonSettings, only_if_missing: bool = False) -> None:
    """Create, collectively, every process group the parallel step will use for ``new_groups``'
    DTensor matrices (``distributed/groups.py``; split Newton–Schulz's too); ``all_groups``'
    meshes give the optimizer's ranks."""
    dtensors = [p for g in all_groups for p in g["params"] if is_dtensor(p)]
    if not dtensors or not dist.is_initialized():
        return
    union = sorted({r for p in dtensors for r in layouts.grid(p.device_mesh).ranks})
    needed = groups.rank_sets_needed(  # parameters step() refuses need none
        [(layouts.of(p), p.device_mesh) for g in new_groups for p in g["params"]
         if g["use_muon"] and is_dtensor(p) and p.dim() >= 2 and param_problem("", p) is None], union)
    needed = sorted(set(needed) | set(split_rank_sets(new_groups, settings, layouts)))
    if only_if_missing and all(groups.has_group(s) for s in needed):
        return
    groups.create_collectively(needed)


# ---------------------------------------------------------------------------- helpers (pure)


def qk_params(entries: Sequence[Entry], param_groups: Sequence[Mapping]) -> list[tuple[str, tuple[int, ...], bool, int]]:
    """What QK-clip's static plan needs of every parameter: name, global shape, group kind and index."""
    return [(e.name, e.shape, e.use_muon, e.group) for e in entries]


def describe(name: str, p) -> str:
    """A DTensor parameter as the agreement compares it across ranks."""
    return f"'{name}' {tuple(p.shape)} {tuple(p.placements)} on mesh {tuple(p.device_mesh.shape)}"


def ns_cost(group: Mapping, compute_dtype: torch.dtype | None,
            device: torch.device | None = None) -> Callable[[tuple[int, ...]], float]:
    """Newton–Schulz FLOPs of a (sub-)shape, of the form ``ns_method`` picks for it (owners are
    balanced on the work actually done); ``compute_dtype`` as the user set it (None: the device's
    defaults, where the Gram form may run in fp16: ``newton_schulz.ns_form_dtypes``)."""
    steps, method, coefficients = group["ns_steps"], group.get("ns_method", "auto"), group["ns_coefficients"]

    def cost(shape: tuple[int, ...]) -> float:
        return float(newton_schulz_flops(shape, steps, method, compute_dtype, coefficients, device))

    return cost


def split_hardware(device: torch.device) -> SplitHardware:
    """The figures ``ns_split="auto"`` plans with on ``device`` (tests swap in others)."""
    return hardware_for(device)


def split_model(group: Mapping, compute_dtype: torch.dtype | None, device: torch.device) -> SplitModel | None:
    """How a Muon group's matrices may be split over ranks (``ns_split``), or None for "never".
    ``compute_dtype`` as the user set it (None: the device's, per form), so that the split's cost
    model prices the form and dtype the split iteration runs (``choose_ns_form``).
    Weights with row blocks are never split (``_plan_param``): their blocks are orthogonalised
    apart, each with its own lr factor."""
    mode = group.get("ns_split", "auto")
    if mode == "never":
        return None
    return SplitModel.of(mode, split_hardware(device), group["ns_steps"], group.get("ns_method", "auto"),
                         group["ns_coefficients"], compute_dtype)


def split_rank_sets(param_groups: Sequence[Mapping], settings: MuonSettings, layouts: Layouts) -> list[tuple[int, ...]]:
    """Every rank set a split Newton–Schulz of these groups' DTensor matrices may run on
    (``split_plan.rank_sets``): created with the other process groups, collectively, at
    construction and in ``add_param_group``."""
    out: set[tuple[int, ...]] = set()
    for e in entries_of(param_groups):
        group, p = param_groups[e.group], e.param
        if not e.use_muon or group.get(ROW_BLOCKS_KEY) is not None:
            continue  # kept whole (``StepContext``: row blocks are orthogonalised apart)
        if not is_dtensor(p) or p.dim() < 2 or param_problem("", p) is not None:
            continue
        device = local_view(p).device
        model = split_model(group, settings.compute_dtype, device)
        out |= rank_sets(e.shape, layouts.of(p, e.transposed), model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return sorted(s for s in out if 1 < len(s) < world)


def blocks_cost(blocks: RowBlocks, matrix_cost: Callable) -> Callable[[tuple[int, ...]], float]:
    # Newton–Schulz runs per block (of every expert of a 3-D unit): the sum over blocks
    def cost(shape: tuple[int, ...]) -> float:
        matrices = math.prod(shape[:-2])
        return float(matrices * sum(c.count * matrix_cost((c.rows_per_block, shape[-1])) for c in blocks.classes))

    return cost


def wire_dtype(compute: torch.dtype, p) -> torch.dtype:
    """What a sharded update travels as: the Newton–Schulz dtype when narrower, as Newton–Schulz
    reads it (``ns_io_dtype``: bf16 for fp16, whose range a momentum entry may exceed)."""
    return ns_io_dtype(p.dtype, compute) if compute.itemsize < p.dtype.itemsize else p.dtype


def mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def local_shape_problem(name: str, p, layout: ParamLayout, rank: int, transposed: bool = False) -> str | None:
    coord = layout.grid.coordinate(rank)
    if coord is None:
        return None  # param_problem names it
    want = view_shape(layout.local_shape(coord), transposed)  # back to the stored orientation
    got = tuple(local_view(p).shape)
    if got != want:
        return (
            f"Muon: parameter '{name}' has a local shard of shape {got} on this rank, but its placements "
            f"{tuple(p.placements)} on a {tuple(layout.grid.shape)} mesh put a shard of shape {want} here "
            "(torch.chunk semantics). The DTensor was built with a layout its placements do not describe; "
            "build it with distribute_tensor/redistribute or pass the right shape/stride to from_local."
        )
    return None


def count_nonfinite(grads: list[torch.Tensor]) -> torch.Tensor:
    """How many local gradients hold a NaN/Inf, as a 0-d device tensor (no host sync).

    The max-abs norm of finite values is finite in any dtype (an fp16 sum of squares
    would overflow above 65504 and flag finite gradients).
    """
    nonempty = [g for g in grads if g.numel()]
    if not nonempty:
        return torch.zeros((), dtype=torch.int64, device=grads[0].device if grads else "cpu")
    norms = torch._foreach_norm(nonempty, float("inf"))
    return (~torch.isfinite(torch.stack([n.float() for n in norms]))).sum()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


__all__: list[Any] = ["StepContext", "LocalFacts", "Layouts", "context_key", "entries_of"]
