"""Muon: momentum + Newton–Schulz orthogonalisation for matrices, AdamW for the rest.

A drop-in ``torch.optim.Optimizer``.  Param groups say ``use_muon``.  Muon
groups hold matrices: 2-D weights, and 3-D MoE expert weights ``[E, out, in]``
treated as E independent matrices.  AdamW groups hold everything else
(norms, biases, embeddings, the output head).

Parameters may be plain tensors or DTensors with any placements (FSDP2, HSDP,
TP, their combinations, auto-sharding solver plans, ``_StridedShard``, uneven
shards).  A step is:

  1. validate this rank's inputs (nothing changes yet);
  2. agree with every other rank, in one small all-reduce, on everything that
     could differ between ranks (``distributed/agreement.py``);
  3. AdamW for the AdamW groups;
  4. Muon: momentum on every local piece, then the cached step plan
     (``plan.py``) run by the pipeline (``pipeline.py``).

The step plan is rebuilt only when what it depends on changes: which parameters
have gradients, their shapes and placements, and the settings.
"""

from __future__ import annotations

import logging
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch.optim import Optimizer

from . import adamw as _adamw
from . import state_layout
from .distributed import agreement, groups
from .distributed.layout import MeshGrid, ParamLayout
from .muon_math import adjust_lr
from .newton_schulz import default_compute_dtype, newton_schulz_flops, zeropower_via_newtonschulz
from .pipeline import ParamStep, PipelineStats, gather_everything, run_parallel_muon
from .plan import PlanParam, PlanSettings, StepPlan, build_plan
from .qk_clip import QKClipConfig, QKClipReport, config_record, log_report
from .qk_clip_plan import (
    ClipStep,
    build_qk_clip_plan,
    check_layer_gradients,
    check_step_logits,
    compute_clip_step,
    describe_nonfinite,
)
from .row_blocks import ROW_BLOCKS_KEY, check_group_row_blocks, orthogonalize_in_blocks, \
    resolve_row_blocks, spec_for
from .tensors import is_dtensor, local_view
from .validation import (
    GROUPS_HELP,
    check_group_options,
    check_group_params,
    check_optimizer_options,
    gradient_problem,
    param_problem,
)

logger = logging.getLogger(__name__)

# Optimizer-level settings that torch's Optimizer.__getstate__ would drop, with
# the defaults an old pickle gets.
_PICKLED_SETTINGS = dict(
    ns_eps=1e-7,
    compute_dtype=None,
    qk_clip=None,
    distributed_mode="parallel",
    chunk_size=None,
    lookahead=1,
    skip_nonfinite=False,
    replica_split="auto",
    replica_split_flops_per_byte=None,
    adamw_betas=(0.9, 0.95),
)

# "auto" splits a matrix over replicas when its Newton–Schulz does at least this many
# FLOPs per byte of update shipped to the other replicas: a GPU's bf16 rate over an
# inter-node link (~400 TFLOP/s over ~40 GB/s per GPU), a CPU core's fp32 rate over
# loopback (~50 GFLOP/s over ~1 GB/s).
DEFAULT_REPLICA_FLOPS_PER_BYTE = {"cuda": 1e4, "cpu": 50.0}


def _rank_independent_repr(value: Any) -> str:
    """``repr`` without what differs between processes: a function's repr holds its address, which
    differs from rank to rank under torchrun (a callable ``muon_row_blocks`` would then look like a
    setting that differs), so callables are named by module and qualified name."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_rank_independent_repr(v)}" for k, v in value.items()) + "}"
    if callable(value) and not isinstance(value, type) and not dataclasses.is_dataclass(value):
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return f"<callable {getattr(value, '__module__', '?')}.{name}>"
    return repr(value)


class Muon(Optimizer):
    """Muon for matrices and AdamW for everything else, for plain tensors and DTensors.

    Args:
        params: param groups, each with ``use_muon`` (see
            ``get_default_muon_param_groups``); named groups (``param_names``)
            give better error messages and enable QK-clip name matching.
        lr, weight_decay: per group (decoupled weight decay, ``p *= 1 - lr*wd``).
        momentum, nesterov: Muon momentum (torch.optim.Muon semantics).  A
            momentum-cycling scheduler (OneCycleLR/CyclicLR) cycles every group's
            ``momentum``; AdamW groups take it as their ``betas[0]``.
        ns_steps, ns_coefficients: Newton–Schulz iterations and coefficients
            ("fixed" = (3.4445, -4.7750, 2.0315), a table name, a triple, or a
            list of per-iteration triples).
        ns_method: per group; "auto" picks per shape and compute dtype the form
            with fewer FLOPs (the Gram-space iteration for rectangular matrices in
            fp32; the classic one in bf16, where the Gram form's drift needs a
            restart every step), "classic" or "gram" force one.
        adjust_lr: "match_rms_adamw" (0.2*sqrt(max(A,B))), "original"
            (sqrt(max(1, A/B))) or None.
        adamw_betas, adamw_eps: AdamW for the non-Muon groups (``betas``/``eps``
            per group).
        maximize: per group; maximise the objective (the gradient's sign flips).
        eps: Newton–Schulz normalisation epsilon.
        compute_dtype: Newton–Schulz dtype; None picks by device (fp32 on CPU,
            where bf16 matmul is slow; bf16 on CUDA).
        qk_clip: a ``QKClipConfig`` to enable QK-clip (MuonClip), or None.
        distributed_mode: "parallel" (one owner per matrix, all-to-all) or
            "gather" (every rank gathers every matrix; the baseline).
        chunk_size: matrices per pipeline chunk (default: the number of ranks
            the matrices are spread over).
        lookahead: chunks gathered ahead of the one being orthogonalised.
        replica_split: "auto", "always" or "never": whether a matrix held by
            several replicas (HSDP, replicated DTensors) is orthogonalised once in
            the world (by one rank of any replica; the others receive their piece
            of the update by an all-gather on the replica group) or once per
            replica.  "auto" splits matrices whose Newton–Schulz does at least
            ``replica_split_flops_per_byte`` FLOPs per byte of update shipped.
        replica_split_flops_per_byte: the "auto" threshold; None: 1e4 on CUDA
            (bf16 matmul rate over an inter-node link), 50 on CPU.
        skip_nonfinite: when any rank sees a NaN/Inf in a Muon gradient, every
            rank skips the whole step (no state changes) and
            ``last_step_skipped`` is True.  Otherwise non-finite gradients
            propagate into the parameters, as with torch's optimizers.

    With DTensor parameters, building the optimizer (and ``add_param_group`` with
    parameters that need a new process group) is collective over the default
    process group: every rank builds its optimizer at the same point, as with
    ``init_device_mesh``.  ``step()`` never creates process groups.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: Any = "fixed",
        ns_method: str = "auto",
        adjust_lr: str | None = "match_rms_adamw",
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        maximize: bool = False,
        eps: float = 1e-7,
        compute_dtype: torch.dtype | None = None,
        qk_clip: QKClipConfig | None = None,
        distributed_mode: str = "parallel",
        chunk_size: int | None = None,
        lookahead: int = 1,
        replica_split: str = "auto",
        replica_split_flops_per_byte: float | None = None,
        skip_nonfinite: bool = False,
    ):
        check_optimizer_options(
            eps=eps, compute_dtype=compute_dtype, qk_clip=qk_clip, qk_clip_type=QKClipConfig,
            distributed_mode=distributed_mode, chunk_size=chunk_size, lookahead=lookahead,
            replica_split=replica_split, replica_split_flops_per_byte=replica_split_flops_per_byte,
            skip_nonfinite=skip_nonfinite,
        )
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_method=ns_method,
            adjust_lr=adjust_lr,
            eps=adamw_eps,
            maximize=maximize,
        )
        # Not in the defaults: a momentum-cycling scheduler writes "betas" into every group
        # when the defaults have it, and Muon groups cycle "momentum" (see _follow_momentum_schedule).
        self.adamw_betas = tuple(adamw_betas)
        self.ns_eps = eps
        self.compute_dtype = compute_dtype
        self.qk_clip = qk_clip
        self.distributed_mode = distributed_mode
        self.chunk_size = chunk_size
        self.lookahead = lookahead
        self.replica_split = replica_split
        self.replica_split_flops_per_byte = replica_split_flops_per_byte
        self.skip_nonfinite = skip_nonfinite
        #: the last step's QK-clip record (heads clipped and max logit per layer), or None
        self.qk_clip_report: QKClipReport | None = None
        #: True when the last step was skipped (skip_nonfinite and a non-finite gradient)
        self.last_step_skipped = False
        #: timing and traffic of the last step's parallel pipeline
        self.last_step_stats = PipelineStats()
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        # Everything QK-clip needs that names and shapes can tell is checked now, before
        # any state exists (pairs, head counts, one weight per layer and role, Muon groups).
        if qk_clip is not None:
            build_qk_clip_plan(qk_clip, _qk_params(self))
        self._create_process_groups(self.param_groups)

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict) or "use_muon" not in param_group:
            raise ValueError("Muon: a param group has no `use_muon` key. " + GROUPS_HELP)
        if not isinstance(param_group["use_muon"], bool):
            raise ValueError(f"Muon: `use_muon` must be True or False, got {param_group['use_muon']!r}")
        if not param_group["use_muon"]:
            param_group.setdefault("betas", tuple(self.__dict__.get("adamw_betas", (0.9, 0.95))))
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        state_layout.stamp_group(group, self.qk_clip)
        index = len(self.param_groups) - 1
        check_group_options(group, f"param_groups[{index}]")
        names = [self._param_name(index, i) for i in range(len(group["params"]))]
        check_group_params(group, names)
        if group["use_muon"] and group.get(ROW_BLOCKS_KEY) is not None:
            where = f"Muon: param_groups[{index}]"
            check_group_row_blocks(group[ROW_BLOCKS_KEY], names, where)
            for name, p in zip(names, group["params"]):
                resolve_row_blocks(spec_for(group[ROW_BLOCKS_KEY], name, where), name, p.shape)
        if not self.__dict__.get("_building", False):
            self._create_process_groups([group], only_if_missing=True)

    def _param_name(self, group_index: int, i: int) -> str:
        names = self.param_groups[group_index].get("param_names")
        return names[i] if names else f"param_groups[{group_index}]['params'][{i}]"

    def _create_process_groups(self, param_groups: list[dict], only_if_missing: bool = False) -> None:
        """Create, collectively, every process group the parallel step will use (see groups.py)."""
        import torch.distributed as dist

        dtensors = [p for g in self.param_groups for p in g["params"] if is_dtensor(p)]
        if not dtensors or not dist.is_initialized():
            return
        union = sorted({r for p in dtensors for r in _grid(p).ranks})
        layouts = []
        for g in param_groups:
            for p in g["params"]:
                if g["use_muon"] and is_dtensor(p) and p.dim() >= 2 and param_problem("", p) is None:
                    layouts.append((_layout(p), p.device_mesh))  # others are refused by step()
        needed = groups.rank_sets_needed(layouts, union)
        if only_if_missing and all(groups.has_group(s) for s in needed):
            return
        groups.create_collectively(needed)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict, with Muon's layout version and QK-clip settings.

        Every param group carries ``muon_state_version`` and ``qk_clip`` (see
        ``state_layout.py``): torch's distributed checkpoint helpers
        (``get_optimizer_state_dict`` / ``set_optimizer_state_dict``) keep
        only ``state`` and ``param_groups``, so that is where they must live.
        """
        self._stamp_layout()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or torch.distributed.checkpoint).

        The checkpoint is checked before anything changes: its layout version,
        its groups against this optimizer's (count, sizes, ``use_muon``,
        ``param_names``), each parameter's state keys and shapes, and its
        hyperparameters.  Hyperparameters (lr, ...) and the QK-clip settings
        are restored from the checkpoint, as torch's optimizers do; a custom
        ``QKClipConfig.classify`` cannot be saved and is kept from this
        optimizer's config.
        """
        state_layout.check_loadable(self, state_dict)
        for i, group in enumerate(state_dict["param_groups"]):
            check_group_options(group, f"checkpoint param_groups[{i}]")
        qk_clip = state_layout.qk_clip_from_groups(state_dict["param_groups"], self.qk_clip)
        super().load_state_dict(state_dict)
        self.qk_clip = qk_clip
        self._stamp_layout()

    def _stamp_layout(self) -> None:
        for group in self.param_groups:
            state_layout.stamp_group(group, self.qk_clip)

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults/state/param_groups; keep Muon's
        # own settings so that deepcopy and pickling give a working optimizer.
        state = super().__getstate__()
        state.update({k: getattr(self, k) for k in _PICKLED_SETTINGS})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Also called by torch's load_state_dict with only state/param_groups:
        # settings already on the object stay; unpickled ones get defaults
        # when the pickle predates them.
        super().__setstate__(state)
        for key, default in _PICKLED_SETTINGS.items():
            if key not in self.__dict__:
                setattr(self, key, default)
        self.__dict__.setdefault("qk_clip_report", None)
        self.__dict__.setdefault("last_step_skipped", False)
        self.__dict__.setdefault("last_step_stats", PipelineStats())
        self.__dict__.pop("_cached_plan", None)  # rebuilt for this process's parameters

    # -------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, qk_logits: dict[int, torch.Tensor] | None = None):
        """One optimisation step.

        ``qk_logits`` maps a layer index to a 1-D tensor of that layer's
        per-query-head max attention logits; with ``qk_clip`` configured, the
        q/k weights of heads over the threshold are scaled after the update.
        Every rank must pass the same value (or None on every rank).
        """
        loss, closure_error = None, None
        if closure is not None:
            try:
                with torch.enable_grad():
                    loss = closure()
            except Exception as err:  # noqa: BLE001 - re-raised after the ranks agree
                closure_error = err

        # 1. This rank's view of the step; problems are found before anything changes.
        _follow_momentum_schedule(self.param_groups)
        plan = self._current_plan()
        local_errors = list(plan.errors)
        muon_grads = plan.muon_grads
        for name, p, g, use_muon in plan.entries:
            problem = gradient_problem(name, p, g, use_muon)
            if problem:
                local_errors.append(problem)
        clip, qk_errors = plan.qk_step(qk_logits) if not local_errors else (None, [])
        local_errors += qk_errors
        # Device facts, as 0-d int64 tensors summed over ranks with the rest and read once.
        # Every rank sends the same slots whatever it has (a collective's size must match).
        nothing = torch.zeros((), dtype=torch.int64)
        nonfinite = _count_nonfinite(muon_grads) if self.skip_nonfinite and not local_errors else nothing
        qk_nonfinite = clip.nonfinite if clip is not None else nothing
        qk_digest = agreement.device_checksum({0: clip.flat_logits}) if clip is not None else nothing

        # 2. Agree on every rank-dependent fact before any other collective.
        outcome = agreement.agree(
            plan.described,
            plan.has_grad,
            host_flags=[int(qk_logits is not None), int(bool(local_errors)), int(closure_error is not None)],
            device_flags=[nonfinite, qk_nonfinite],
            settings=self._settings_digest(),
            device_digest=qk_digest,
            group=plan.agreement_group,
            device=plan.agreement_device,
            describe_settings=self._settings_record,
            checksums=plan.checksums,
        )
        qk_count, error_count, closure_count = outcome.host_flags
        nonfinite_count, qk_nonfinite_count = outcome.device_flags
        n = outcome.ranks
        if closure_error is not None:
            raise closure_error
        if closure_count:
            raise RuntimeError(
                f"Muon.step: the closure raised on {closure_count} of {n} ranks (their errors say why); this rank "
                "stops too so that no collective hangs."
            )
        if local_errors:
            raise ValueError("\n".join(local_errors))
        if error_count > 0:
            raise RuntimeError(
                f"Muon.step: {error_count} of {n} ranks rejected their inputs (their errors say why); "
                "this rank stops too so that no collective hangs."
            )
        for name, c in zip(plan.dtensor_names, outcome.grad_counts):
            if 0 < c < n:
                raise RuntimeError(
                    f"Muon.step: parameter '{name}' has a gradient on {c} of {n} ranks and None on the "
                    "others. A sharded parameter needs a gradient on every rank: use it in every rank's "
                    "forward, or call zero_grad(set_to_none=False) so unused parameters get zero gradients."
                )
        if 0 < qk_count < n:
            raise RuntimeError(
                f"Muon.step: qk_logits was passed on {qk_count} of {n} ranks and None on the others; "
                "pass the same qk_logits on every rank (reduce them over the data-parallel ranks first)."
            )
        if not outcome.same_device_digest:
            raise RuntimeError(
                "Muon.step: qk_logits differ between ranks; every rank must pass the same per-head max "
                "logits (optimizer.max_logits.gather_max_logits max-reduces over data-parallel ranks and "
                "gathers over tensor-parallel ranks)."
            )
        if qk_nonfinite_count:
            raise ValueError(describe_nonfinite(qk_logits))  # every rank: they all pass the same logits
        self.last_step_skipped = nonfinite_count > 0
        qk_report = clip.report if clip is not None else None
        self.qk_clip_report = None if self.last_step_skipped else qk_report
        if self.last_step_skipped:
            logger.warning(
                "Muon: skipped step: %d of %d ranks saw a non-finite Muon gradient (skip_nonfinite=True)",
                nonfinite_count, n,
            )
            return loss

        if qk_report is not None:
            log_report(qk_report)
        # 3. AdamW, 4. Muon.
        self._adamw_step()
        self._muon_step(plan, clip)
        return loss

    # ------------------------------------------------------------- internals

    def _settings_record(self) -> dict[str, Any]:
        """Everything that must be equal on every rank, as plain values (for the error message)."""
        record: dict[str, Any] = {k: _rank_independent_repr(getattr(self, k)) for k in _PICKLED_SETTINGS if k != "qk_clip"}
        record["qk_clip"] = repr(config_record(self.qk_clip))
        for i, g in enumerate(self.param_groups):
            for key in ("use_muon", "lr", "weight_decay", "momentum", "nesterov", "ns_steps", "ns_coefficients",
                        "ns_method", "adjust_lr", "betas", "eps", "maximize", ROW_BLOCKS_KEY):
                value = g.get(key)
                if torch.is_tensor(value):
                    value = value.item() if value.device.type == "cpu" else "<device tensor>"
                record[f"param_groups[{i}].{key}"] = _rank_independent_repr(value)
        return record

    def _settings_digest(self) -> int:
        return agreement.checksum_text("\n".join(f"{k}={v}" for k, v in self._settings_record().items()))

    def _current_plan(self) -> "_StepView":
        """The cached step view, rebuilt when the parameters with gradients or the settings change."""
        entries = []
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                entries.append((names[i] if names else f"param_groups[{gi}]['params'][{i}]", p, p.grad,
                                group["use_muon"]))
        key = (
            tuple((id(p), g is not None, None if g is None else g.dtype) for _, p, g, _ in entries),
            self.distributed_mode, self.chunk_size, self.compute_dtype, self.replica_split,
            self.replica_split_flops_per_byte,
            tuple((g["use_muon"], g.get("ns_steps"), repr(g.get("ns_coefficients")), g.get("ns_method"),
                   repr(g.get("adjust_lr")), repr(g.get(ROW_BLOCKS_KEY))) for g in self.param_groups),
            repr(config_record(self.qk_clip)), id(self.qk_clip),
        )
        cached = self.__dict__.get("_cached_plan")
        if cached is not None and cached.key == key:
            cached.refresh(entries)
            return cached
        view = _StepView(self, entries, key)
        self._cached_plan = view
        return view

    def _adamw_step(self) -> None:
        for group in self.param_groups:
            if not group["use_muon"]:
                _adamw.adamw_group_step_(group, self.state)

    def _orthogonalizer(self, group: dict) -> Callable[[torch.Tensor], torch.Tensor]:
        def orthogonalize(x: torch.Tensor) -> torch.Tensor:
            # the name (not the resolved table) so NS applies the table's own norm safety factor
            return zeropower_via_newtonschulz(
                x, ns_steps=group["ns_steps"], coefficients=group["ns_coefficients"], eps=self.ns_eps,
                compute_dtype=self.compute_dtype, method=group.get("ns_method", "auto"),
            )

        return orthogonalize

    def _muon_step(self, view: "_StepView", clip: ClipStep | None) -> None:
        """Momentum on every local piece, then the step plan through the pipeline."""
        params = view.muon_params
        self.last_step_stats = PipelineStats(params[0].device if params else None)
        if not params:
            return
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)  # a DTensor keeps p's placements
            bufs.append(local_view(state["momentum_buffer"]))
        grads = [local_view(p.grad) for p in params]
        groups_of = view.muon_groups
        # Momentum, elementwise on local pieces: buf <- momentum*buf + (1-momentum)*grad.
        by_momentum: dict[tuple[float, bool], list[int]] = {}
        for i, group in enumerate(groups_of):
            by_momentum.setdefault((group["momentum"], bool(group.get("maximize", False))), []).append(i)
        signed = list(grads)
        for (momentum, maximize), idx in by_momentum.items():
            gs = [grads[i] if grads[i].dtype == bufs[i].dtype else grads[i].to(bufs[i].dtype) for i in idx]
            if maximize:
                gs = torch._foreach_neg(gs)
            for i, g in zip(idx, gs):
                signed[i] = g
            torch._foreach_lerp_([bufs[i] for i in idx], gs, 1 - momentum)

        orthogonalizers: dict[int, Callable] = {}
        steps = []
        for i, (p, group) in enumerate(zip(params, groups_of)):
            lr, wd = group["lr"], group["weight_decay"]
            ortho = orthogonalizers.setdefault(id(group), self._orthogonalizer(group))
            blocks = view.row_blocks[i]
            if blocks is not None:
                ortho = _in_blocks(ortho, blocks, group["adjust_lr"])
            steps.append(ParamStep(
                param=local_view(p), grad=signed[i], buf=bufs[i], momentum=group["momentum"],
                nesterov=group["nesterov"], lr=lr, adjusted_lr=adjust_lr(lr, p.shape, group["adjust_lr"]),
                weight_decay=wd, orthogonalize=ortho,
                qk_clip=view.clip_rows(i, clip),
            ))
        if self.distributed_mode == "gather":
            gather_everything(view.plan, steps, self.last_step_stats)
        else:
            run_parallel_muon(view.plan, steps, lookahead=self.lookahead, stats=self.last_step_stats)


def _in_blocks(orthogonalize: Callable, blocks, adjust_lr_mode) -> Callable:
    """Orthogonalise each declared row block of a matrix on its own (fused q/k/v, per head)."""

    def orthogonalize_blocks(x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 2:
            return orthogonalize_in_blocks(x, blocks, orthogonalize, adjust_lr_mode=adjust_lr_mode)
        # a batch of this one parameter's matrices (the pipeline batches by parameter)
        flat = x.reshape(-1, *x.shape[-2:])
        out = [orthogonalize_in_blocks(m, blocks, orthogonalize, adjust_lr_mode=adjust_lr_mode) for m in flat]
        return torch.stack(out).view(x.shape)

    return orthogonalize_blocks


def _qk_params(opt: Muon) -> list[tuple[str, tuple[int, ...], bool, int]]:
    return [(n, tuple(p.shape), g["use_muon"], gi) for gi, g in enumerate(opt.param_groups) for n, p in _named(opt, gi)]


def _follow_momentum_schedule(groups: list[dict]) -> None:
    """OneCycleLR/CyclicLR with ``cycle_momentum`` write ``momentum`` into every group (the
    defaults have ``momentum`` and no ``betas``) and mark it with ``max_momentum`` /
    ``base_momentum``: Muon groups follow the schedule as torch.optim.Muon's do, and an AdamW
    group takes it as its ``betas[0]``, as torch.optim.AdamW's would."""
    for group in groups:
        if not group["use_muon"] and "max_momentum" in group and "base_momentum" in group:
            group["betas"] = (float(group["momentum"]), *group["betas"][1:])


def _count_nonfinite(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """How many local gradients hold a NaN/Inf, as a 0-d device tensor (no host sync).

    The max-abs norm of finite values is finite in any dtype (an fp16 sum of squares
    would overflow above 65504 and flag finite gradients).
    """
    nonempty = [g for g in grads if g.numel()]
    if not nonempty:
        return torch.zeros((), dtype=torch.int64, device=grads[0].device if grads else "cpu")
    norms = torch._foreach_norm(nonempty, float("inf"))
    return (~torch.isfinite(torch.stack([n.float() for n in norms]))).sum()


# ---------------------------------------------------------------------------
# The cached view of a step
# ---------------------------------------------------------------------------

_GRIDS: dict[int, tuple[object, MeshGrid]] = {}


def _grid(p) -> MeshGrid:
    mesh = p.device_mesh
    hit = _GRIDS.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        hit = _GRIDS[id(mesh)] = (mesh, MeshGrid.of(mesh))
    return hit[1]


_LAYOUTS: dict[tuple, ParamLayout] = {}


def _layout(p) -> ParamLayout:
    # One object per distinct layout: the plan caches index math by it, and models
    # repeat a few shapes many times.
    key = (id(p.device_mesh), tuple(p.shape), tuple(p.placements))
    hit = _LAYOUTS.get(key)
    if hit is None or hit.grid is not _grid(p):
        hit = _LAYOUTS[key] = ParamLayout(tuple(p.shape), _grid(p), tuple(p.placements))
    return hit


class _StepView:
    """Everything about a step that depends only on which parameters have gradients
    and on the settings: the plan, the agreement's descriptions, QK-clip row maps."""

    def __init__(self, opt: Muon, entries: list, key: tuple):
        import torch.distributed as dist

        self.key = key
        self.entries = entries
        self.errors: list[str] = []
        dt = [(n, p, g) for n, p, g, _ in entries if is_dtensor(p)]
        self.dtensor_names = [n for n, _, _ in dt]
        self.described = [_describe(n, p) for n, p, _ in dt]
        self.has_grad = [int(g is not None) for _, _, g in dt]
        self.checksums = agreement.parameter_checksums(self.described, self.has_grad)  # once, not per step
        self.agreement_group, self.agreement_device = None, torch.device("cpu")
        if dt and dist.is_initialized():
            meshes = {id(p.device_mesh): p for _, p, _ in dt}
            union = sorted({r for p in meshes.values() for r in _grid(p).ranks})
            try:
                self.agreement_group = groups.group_for(union)
            except RuntimeError as err:
                self.errors.append(str(err))
            self.agreement_device = _mesh_device(next(iter(meshes.values())).device_mesh)

        for name, p, _, use_muon in entries:
            problem = param_problem(name, p)
            if problem:
                self.errors.append(problem)
        muon = [(n, p, g, gi) for gi, group in enumerate(opt.param_groups) if group["use_muon"]
                for n, p in _named(opt, gi) if p.grad is not None for g in [p.grad]]
        self.muon_named = [(n, p) for n, p, _, _ in muon]
        self.muon_params = [p for _, p, _, _ in muon]
        self.muon_groups = [opt.param_groups[gi] for _, _, _, gi in muon]
        self.muon_grads = [local_view(g) for _, _, g, _ in muon]
        self._clip_index: dict[int, torch.Tensor] = {}
        self.row_blocks: list = [None] * len(muon)
        self.qk_plan = None
        self.device = local_view(self.muon_params[0]).device if self.muon_params else torch.device("cpu")
        self.plan = StepPlan()
        if self.errors:
            return
        if opt.qk_clip is not None:
            try:
                self.qk_plan = build_qk_clip_plan(opt.qk_clip, _qk_params(opt))
            except ValueError as err:
                self.errors.append(str(err))
        rank = dist.get_rank() if dist.is_initialized() else 0
        plan_params = []
        for i, (n, p, _, gi) in enumerate(muon):
            group = opt.param_groups[gi]
            layout = _layout(p) if is_dtensor(p) else None
            if layout is not None:
                problem = _local_shape_problem(n, p, layout, rank)
                if problem:
                    self.errors.append(problem)
            compute = opt.compute_dtype or default_compute_dtype(local_view(p).device)
            cost = _ns_cost(group, compute)
            ns_key = gi
            if group.get(ROW_BLOCKS_KEY) is not None:
                try:
                    blocks = resolve_row_blocks(spec_for(group[ROW_BLOCKS_KEY], n, f"Muon: param_groups[{gi}]"),
                                                n, p.shape)
                except ValueError as err:
                    self.errors.append(str(err))
                    blocks = None
                if blocks is not None:
                    self.row_blocks[i] = blocks
                    ns_key = (gi, n)  # its own orthogonalisation: never batched with others
                    cost = _blocks_cost(blocks, cost)
            plan_params.append(PlanParam(
                name=n, shape=tuple(p.shape), layout=layout, wire_dtype=_wire_dtype(opt, p),
                device=local_view(p).device, ns_key=ns_key, cost=cost,
                mesh=p.device_mesh if layout is not None else None,
                compute_itemsize=compute.itemsize,
                state_itemsize=p.dtype.itemsize,
            ))
        if self.errors:
            return
        flops_per_byte = opt.replica_split_flops_per_byte
        if flops_per_byte is None:
            flops_per_byte = DEFAULT_REPLICA_FLOPS_PER_BYTE.get(self.agreement_device.type, 1e4)
        settings = PlanSettings(
            chunk_size=opt.chunk_size, replica_split=opt.replica_split,
            replica_min_flops_per_byte=flops_per_byte, mode=opt.distributed_mode,
        )
        try:
            self.plan = build_plan(plan_params, rank, settings, groups.group_for)
        except (RuntimeError, ValueError) as err:  # found on this rank only: agree, then raise
            self.errors.append(f"Muon.step: cannot plan the parallel step on this rank: {err}")

    def refresh(self, entries: list) -> None:
        """Same parameters and settings as when cached: take this step's gradient objects."""
        self.entries = entries
        self.muon_grads = [local_view(p.grad) for p in self.muon_params]

    def qk_step(self, qk_logits) -> tuple[ClipStep | None, list[str]]:
        """This step's QK-clip values (on the device, no host read) or the problems with ``qk_logits``."""
        errors = check_step_logits(self.qk_plan, qk_logits, self.device)
        if errors or qk_logits is None or self.qk_plan is None:
            return None, errors
        has_grad = {n: p.grad is not None for n, p in self.muon_named}
        errors, active = check_layer_gradients(self.qk_plan, has_grad)
        if errors:
            return None, errors
        skipped = [layer for layer in self.qk_plan.layers if layer not in active]
        return compute_clip_step(self.qk_plan, qk_logits, self.device, skipped_layers=skipped), []

    def clip_rows(self, i: int, clip: ClipStep | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(scale table, table slot of every local row) when Muon parameter ``i`` is clipped this step."""
        if clip is None:
            return None
        rows = self.qk_plan.weights.get(self.muon_named[i][0])
        if rows is None:
            return None
        index = self._clip_index.get(i)
        if index is None:  # once per placement
            p = self.muon_params[i]
            index = self._clip_index[i] = rows.local_index(_local_rows(p), local_view(p).device)
        return clip.table, index


def _ns_cost(group: dict, compute_dtype: torch.dtype) -> Callable[[tuple[int, ...]], float]:
    """Newton–Schulz FLOPs of a (sub-)shape, of the form ``ns_method`` picks for it (owners are
    balanced on the work actually done)."""
    steps, method, coefficients = group["ns_steps"], group.get("ns_method", "auto"), group["ns_coefficients"]

    def cost(shape: tuple[int, ...]) -> float:
        return float(newton_schulz_flops(shape, steps, method, compute_dtype, coefficients))

    return cost


def _blocks_cost(blocks, matrix_cost: Callable) -> Callable[[tuple[int, ...]], float]:
    # Newton–Schulz runs per block: the owner's work is the sum over blocks
    def cost(shape: tuple[int, ...]) -> float:
        return float(sum(c.count * matrix_cost((c.rows_per_block, shape[-1])) for c in blocks.classes))

    return cost


def _named(opt: Muon, gi: int):
    group = opt.param_groups[gi]
    names = group.get("param_names")
    for i, p in enumerate(group["params"]):
        yield (names[i] if names else f"param_groups[{gi}]['params'][{i}]"), p


def _local_rows(p) -> slice | torch.Tensor:
    if not is_dtensor(p):
        return slice(0, p.shape[0])
    layout = _layout(p)
    import torch.distributed as dist

    return layout.indices(layout.grid.coordinate(dist.get_rank()))[0]


def _local_shape_problem(name: str, p, layout: ParamLayout, rank: int) -> str | None:
    coord = layout.grid.coordinate(rank)
    if coord is None:
        return None  # param_problem names it
    want = layout.local_shape(coord)
    got = tuple(local_view(p).shape)
    if got != want:
        return (
            f"Muon: parameter '{name}' has a local shard of shape {got} on this rank, but its placements "
            f"{tuple(p.placements)} on a {tuple(layout.grid.shape)} mesh put a shard of shape {want} here "
            "(torch.chunk semantics). The DTensor was built with a layout its placements do not describe; "
            "build it with distribute_tensor/redistribute or pass the right shape/stride to from_local."
        )
    return None


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _wire_dtype(opt: Muon, p) -> torch.dtype:
    """What a sharded update travels as: the Newton–Schulz dtype when narrower."""
    compute = opt.compute_dtype or default_compute_dtype(local_view(p).device)
    return compute if compute.itemsize < p.dtype.itemsize else p.dtype


def _describe(name: str, p) -> str:
    """A DTensor parameter as the agreement compares it across ranks."""
    return f"'{name}' {tuple(p.shape)} {tuple(p.placements)} on mesh {tuple(p.device_mesh.shape)}"


__all__ = ["Muon"]
