"""Train the example transformer with distributed Muon, checked against single-device Muon.

    torchrun --nproc-per-node N examples/train.py --config configs/<name>.toml [--steps K]
        [--no-qk-clip] [--distributed-mode parallel|gather] [--check] [--tolerance T]
        [--device cpu|cuda] [--compute-dtype fp32|bf16] [--summary-out PATH]
        [--normuon-beta2 B] [--cautious-wd] [--momentum-dtype fp32|bf16] [--weight-decay WD]
    python examples/train.py [--config configs/base.toml]        # 1-rank configs, no torchrun

``--device cuda``: NCCL, each rank on ``cuda:LOCAL_RANK`` (the model, the data
and the lockstep reference); ``cpu`` (default): gloo.  ``--compute-dtype``: the
Newton–Schulz dtype of both the distributed optimizer and the reference.
``--normuon-beta2``, ``--cautious-wd``, ``--momentum-dtype``: Muon's variants
(NorMuon, cautious weight decay, the momentum's storage dtype), for both;
``--weight-decay`` overrides ``[train] weight_decay`` (the configs train without).

Every rank builds the same model from the config's seed and parallelizes it per
the config.  Each step takes a deterministic global batch (``[data] source``: the
synthetic permutation task, or the standard-library text corpus of
``examples/data.py``), every data-parallel rank its own slice of it.

Lockstep reference: rank 0 also holds an unsharded copy of the initial model and
its own optimizer on plain tensors.  Each checked step it receives the
distributed model's full gradients and the same ``qk_logits`` and steps with
them, so the parameter deviation isolates the distributed optimizer (sharding,
gathering, orthogonalizing, scattering, QK-clip on shards) from the parallel
forward's floating-point noise.  This script checks every step;
``examples/main_job.py`` runs two :class:`Run` objects (Muon and AdamW) by turns
and checks only the Muon run's first ``check_steps``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if __package__ in (None, ""):  # run as a script: make `examples` and `optimizer` importable
    _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [_ROOT, os.path.join(_ROOT, "torch-ext")]

from optimizer import Muon  # noqa: E402
from optimizer.settings import KIND_NAMES, kind_of  # noqa: E402

from examples import data  # noqa: E402
from examples.config import ConfigError, RunConfig, load_config  # noqa: E402
from examples.model import build_model, collect_qk_logits  # noqa: E402
from examples.muon_setup import muon_param_groups, qk_clip_config  # noqa: E402
from examples.parallelize import (  # noqa: E402
    build_mesh,
    data_parallel_rank_and_size,
    max_logit_groups,
    parallelize,
)

# fp32: the optimizer's result on shards must match the single-device one up to
# reduction-order noise (measured: exactly 0 on CPU).
DEFAULT_TOLERANCE = 1e-5
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# bf16 Newton–Schulz, per checked step.  Both sides orthogonalise the same momentum in
# bf16, so they can differ only where the distributed run batches matrices or orders a
# reduction differently (on CPU they measure exactly 0).  Measured (CPU, the configs'
# Muon matrices, tests/end_to_end/test_train_flags.py): reordering the columns of a bf16 Newton–Schulz
# input (the reduction dim of G G^T) moves an output element by up to 7.8e-3 (a few bf16
# ulps); times each matrix's adjusted lr that is at most 2.6e-4 of a parameter per step
# (20 Gaussian inputs per shape).  Such differences add up at most linearly over the
# steps: the reference is fed the distributed run's gradients and qk_logits, so they
# never feed back.
BF16_TOLERANCE_PER_STEP = 5e-4


def tolerance_for(compute_dtype: torch.dtype | None, checked_steps: int) -> float:
    """The ``--check`` tolerance for a Newton–Schulz compute dtype (None: fp32): 1e-5 in fp32,
    ``BF16_TOLERANCE_PER_STEP`` per checked step in bf16."""
    if compute_dtype == torch.bfloat16:
        return BF16_TOLERANCE_PER_STEP * max(checked_steps, 1)
    return DEFAULT_TOLERANCE


# AdamW's moment decay rates and epsilon, shared by the AdamW-only baseline and
# the AdamW groups inside Muon (its defaults), so the two runs differ only where
# Muon differs.
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8
# The cosine schedule decays to this fraction of the peak learning rate.
COSINE_FLOOR = 0.1
OPTIMIZERS = ("muon", "normuon", "dion2", "adamw")
# NorMuon's beta2 in the examples ("normuon" runs): dion's default (and the paper's).
NORMUON_BETA2 = 0.95
# Dion2's fraction in the examples ("dion2" runs): the paper's headline setting (Muon's loss at 0.25).
DION2_FRACTION = 0.25
# The keywords each Muon-family optimizer adds to Muon's (the rest, adjust_lr included, is Muon's).
VARIANT_OPTIONS = {"muon": {}, "normuon": {"normuon_beta2": NORMUON_BETA2},
                   "dion2": {"dion2_fraction": DION2_FRACTION}, "adamw": {}}


def synthetic_batch(cfg: RunConfig, step: int) -> torch.Tensor:
    """The synthetic global batch of ``step`` (see :func:`examples.data.synthetic_batch`)."""
    return data.synthetic_batch(cfg.model.vocab_size, cfg.train.batch_size, cfg.train.seq_len,
                                cfg.train.seed, step)


def global_batch(cfg: RunConfig, step: int) -> torch.Tensor:
    """``[batch_size, seq_len + 1]`` tokens of ``step``, the same on every rank."""
    if cfg.data.source == "stdlib":
        return data.train_batch(data.load_stdlib_corpus(), cfg.train.batch_size, cfg.train.seq_len,
                                cfg.train.seed, step)
    return synthetic_batch(cfg, step)


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Factor on the peak learning rate at 0-based ``step``: linear warmup, then
    constant or a cosine from 1 down to ``COSINE_FLOOR`` at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
    progress = (step - warmup_steps) / max(total_steps - 1 - warmup_steps, 1)
    return COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(model, cfg: RunConfig, use_qk_clip: bool, distributed_mode: str,
                   compute_dtype: torch.dtype | None = None, muon_options: dict | None = None) -> Muon:
    """Muon for the matrices (row blocks per ``[muon]``), AdamW (inside Muon) for the rest,
    at ``cfg.train.lr``; QK-clip for the config's attention; Newton–Schulz in
    ``compute_dtype`` (None: fp32); ``muon_options``: more of Muon's keywords (the variants:
    ``normuon_beta2``, ``cautious_wd``, ``momentum_dtype``, ``dion2_fraction``).  Dion2 has no
    momentum coefficient (its momentum is the sum, Muon refuses one): ``[train] momentum`` goes
    to Muon only."""
    options = muon_options or {}
    momentum = {} if options.get("dion2_fraction") is not None else {"momentum": cfg.train.momentum}
    return Muon(
        muon_param_groups(model, cfg),
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        **momentum,
        adamw_betas=ADAMW_BETAS,
        adamw_eps=ADAMW_EPS,
        qk_clip=qk_clip_config(cfg) if use_qk_clip else None,
        distributed_mode=distributed_mode,
        compute_dtype=compute_dtype or torch.float32,
        **options,
    )


def make_adamw(model, cfg: RunConfig) -> torch.optim.AdamW:
    """The baseline: torch's AdamW on every parameter at ``cfg.train.lr``, with the
    weight decay Muon applies (to all of its groups) and Muon's AdamW settings."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=ADAMW_BETAS, eps=ADAMW_EPS,
                             weight_decay=cfg.train.weight_decay)


def _step(opt: torch.optim.Optimizer, qk_logits) -> None:
    if isinstance(opt, Muon):
        opt.step(qk_logits=qk_logits)
    else:
        opt.step()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(
    cfg: RunConfig,
    steps: int | None = None,
    use_qk_clip: bool | None = None,
    distributed_mode: str = "parallel",
    log=print,
    *,
    optimizer: str = "muon",
    check_steps: int | None = None,
    label: str | None = None,
    device: torch.device | str = "cpu",
    compute_dtype: torch.dtype | None = None,
    muon_options: dict | None = None,
) -> dict:
    """Run the training loop on this rank; returns the summary (same on every rank).

    The arguments are :class:`Run`'s.  Collective: with a process group, every
    rank of the config's world must call it.
    """
    run = Run(cfg, steps, use_qk_clip, distributed_mode, log, optimizer=optimizer,
              check_steps=check_steps, label=label, device=device, compute_dtype=compute_dtype,
              muon_options=muon_options)
    while not run.done:
        run.step()
    return run.summary()


class Run:
    """One training run on this rank, advanced a step at a time by :meth:`step`
    (so that two runs can take turns on a shared machine and see the same load).

    ``optimizer``: "muon" (:func:`make_optimizer`), "normuon" (the same with
    ``normuon_beta2=NORMUON_BETA2``), "dion2" (the same with ``dion2_fraction=DION2_FRACTION``;
    no QK-clip: Muon refuses it with Dion2 groups) or "adamw" (:func:`make_adamw`, no QK-clip), all at
    ``cfg.train.lr`` with the config's schedule over ``steps``; ``muon_options``: more of
    Muon's keywords (the variants) for the Muon family.
    ``check_steps``: how many first steps run the lockstep reference (None: all);
    the deviation is measured after the last checked step.  Validation loss is
    measured before the first step, every ``cfg.train.eval_every`` steps and after
    the last.  Step times cover forward, backward and the optimizer step (not the
    reference, validation or logging) and are averaged over ranks.  ``device``: where
    the model, the data and the reference live (the process group must suit it: gloo
    for CPU, NCCL for CUDA); ``compute_dtype``: Muon's Newton–Schulz dtype (None: fp32).

    Collective: every method is, with a process group.
    """

    def __init__(self, cfg: RunConfig, steps: int | None = None, use_qk_clip: bool | None = None,
                 distributed_mode: str = "parallel", log=print, *, optimizer: str = "muon",
                 check_steps: int | None = None, label: str | None = None,
                 device: torch.device | str = "cpu", compute_dtype: torch.dtype | None = None,
                 muon_options: dict | None = None):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        self.cfg = cfg
        self.steps = cfg.train.steps if steps is None else steps
        self.use_qk_clip = cfg.qk_clip.enabled if use_qk_clip is None else use_qk_clip
        if optimizer == "adamw" and self.use_qk_clip:
            raise ValueError("QK-clip is part of Muon; train the AdamW baseline with use_qk_clip=False")
        self.check_steps = self.steps if check_steps is None else min(check_steps, self.steps)
        self.optimizer, self.distributed_mode = optimizer, distributed_mode
        self.label, self.log = label or optimizer, log
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.device, self.compute_dtype = torch.device(device), compute_dtype
        self.muon_options = {**VARIANT_OPTIONS[optimizer], **(muon_options or {})}
        if optimizer == "adamw" and self.muon_options:
            raise ValueError(f"Muon's options {sorted(self.muon_options)} do not apply to the AdamW baseline")

        mesh = build_mesh(cfg, self.device.type)
        # Built on the CPU (the seeded init is the same everywhere), then moved.
        self.model = parallelize(build_model(cfg.model, cfg.train.seed).to(self.device), mesh, cfg)
        self.opt = self._make_optimizer(self.model)
        self.schedule = self._make_schedule(self.opt)
        self.dp_rank, self.dp_size = data_parallel_rank_and_size(mesh, cfg)
        self.tp_group, self.dp_groups = max_logit_groups(mesh, cfg)
        self.reference = (LockstepReference(cfg, self._make_optimizer, self._make_schedule, self.rank, self.device)
                          if self.check_steps > 0 else None)
        self.deviations: dict[str, float] = {}
        self.val_tokens = None
        if cfg.train.eval_every:
            self.val_tokens = data.val_batch(data.load_stdlib_corpus(), cfg.data.val_sequences,
                                             cfg.train.seq_len).to(self.device)

        self.tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
        self.losses, self.step_times, self.clipped, self.max_logits, self.evals = [], [], [], [], []
        self.elapsed = 0.0
        self._log_from = 0  # first step of the current log window
        if self.val_tokens is not None:
            self._evaluate()

    def _make_optimizer(self, model):
        # module-level names looked up at call time, so that tests can wrap make_optimizer
        if self.optimizer != "adamw":
            args = (model, self.cfg, self.use_qk_clip, self.distributed_mode, self.compute_dtype)
            # the variants' keywords only when there are some (callers may wrap make_optimizer)
            return make_optimizer(*args, muon_options=self.muon_options) if self.muon_options else make_optimizer(*args)
        return make_adamw(model, self.cfg)

    def _make_schedule(self, opt):
        t = self.cfg.train
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_multiplier(s, self.steps, t.warmup_steps, t.schedule))

    @property
    def done(self) -> bool:
        return len(self.losses) >= self.steps

    def step(self) -> None:
        """One training step, then validation and a log line when due."""
        step = len(self.losses)
        per_rank = self.cfg.train.batch_size // self.dp_size
        batch = global_batch(self.cfg, step)[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        batch = batch.to(self.device)
        self._sync()
        start = time.perf_counter()
        loss = self.model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        qk_logits = self._qk_logits() if self.use_qk_clip else None
        self._sync()
        fwd_bwd = time.perf_counter() - start

        full_grads = self.reference.gather_grads(self.model) if self.reference is not None else None
        self._sync()
        start = time.perf_counter()
        _step(self.opt, qk_logits)
        self.opt.zero_grad(set_to_none=True)
        self.schedule.step()
        self._sync()
        step_time = fwd_bwd + time.perf_counter() - start
        if self.reference is not None:
            self.reference.step(full_grads, qk_logits)
            if step + 1 == self.check_steps:
                self.deviations = parameter_deviations(self.model, self.reference.params, self.rank, self.world)
                self.reference = None  # the rest of the run is not checked

        # The global loss: mean over data-parallel slices (tp/ep peers hold equal
        # copies); the step time: mean over ranks.
        stats = torch.tensor([loss.item(), step_time], dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(stats)
            stats /= self.world
        self.losses.append(stats[0].item())
        self.step_times.append(stats[1].item())
        self.elapsed += self.step_times[-1]
        report = getattr(self.opt, "qk_clip_report", None)  # None when QK-clip is off
        self.clipped.append(report.total_clipped if report is not None else 0)
        if report is not None:
            self.max_logits.append(report.overall_max_logit)
        else:  # recorded for comparison: how large logits grow without QK-clip
            logits = self._qk_logits()
            self.max_logits.append(max(v.max().item() for v in logits.values()))

        n = step + 1
        if self.val_tokens is not None and (n % self.cfg.train.eval_every == 0 or n == self.steps):
            self._evaluate()
        if n % self.cfg.train.log_every == 0 or n == self.steps:
            self._log_line()

    def _sync(self) -> None:
        """Wait for the GPU's queued work, so that host clocks time it (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _qk_logits(self) -> dict[int, torch.Tensor]:
        return collect_qk_logits(self.model, tp_group=self.tp_group, dp_groups=self.dp_groups)

    def _evaluate(self) -> None:
        self.evals.append({"step": len(self.losses), "elapsed_s": self.elapsed,
                           "val_loss": evaluate(self.model, self.val_tokens, self.dp_rank, self.dp_size, self.world)})

    def _log_line(self) -> None:
        n, window = len(self.losses), self.step_times[self._log_from:]
        mean_time = sum(window) / len(window)
        val = f"  val {self.evals[-1]['val_loss']:.4f}" if self.evals and self.evals[-1]["step"] == n else ""
        qk = f"  heads clipped {sum(self.clipped[self._log_from:]):3d}" if self.use_qk_clip else ""
        qk += f"  max QK logit {self.max_logits[-1]:5.1f}"
        if self.rank == 0:
            self.log(f"{self.label:>6} step {n:4d}/{self.steps}  loss {self.losses[-1]:.4f}{val}  "
                     f"{self.tokens_per_step / mean_time:8.0f} tok/s  {mean_time * 1e3:6.1f} ms/step{qk}")
        self._log_from = n

    def summary(self) -> dict:
        """Everything measured so far (the same on every rank)."""
        worst = max(self.deviations, key=self.deviations.get) if self.deviations else None
        losses, cfg = self.losses, self.cfg
        summary = {
            "config": cfg.name,
            "label": self.label,
            "optimizer": self.optimizer,
            "lr": cfg.train.lr,
            "world_size": self.world,
            "mesh": dict(zip(cfg.mesh.dim_names, cfg.mesh.shape)),
            "steps": self.steps,
            "tokens_per_step": self.tokens_per_step,
            "qk_clip": self.use_qk_clip,
            "distributed_mode": self.distributed_mode,
            "device": self.device.type,
            "compute_dtype": str(self.compute_dtype or torch.float32).removeprefix("torch."),
            "muon_options": {k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v
                             for k, v in self.muon_options.items()},
            "muon_group_options": cfg.muon.group_options(),
            # what the optimizer's groups are (Muon, Dion2, AdamW, Lion): a config option that did not
            # reach the optimizer shows here
            "group_kinds": sorted({KIND_NAMES[kind_of(g)] for g in self.opt.param_groups if "use_muon" in g}),
            "weight_decay": cfg.train.weight_decay,
            "losses": losses,
            "first_loss": losses[0] if losses else math.nan,
            "last_loss": losses[-1] if losses else math.nan,
            "evals": self.evals,
            "heads_clipped": self.clipped,
            "max_qk_logit": self.max_logits,
            "step_times_s": self.step_times,
            "mean_step_time_s": sum(self.step_times) / max(len(self.step_times), 1),
            "check_steps": self.check_steps,
            "max_param_deviation": self.deviations[worst] if worst is not None else None,
            "worst_param": worst,
            "param_deviation": self.deviations,
        }
        if cfg.data.source == "stdlib":
            summary["corpus"] = data.load_stdlib_corpus().fingerprint
        return summary


class LockstepReference:
    """Rank 0's single-device copy of the run: the same initial model, optimizer
    and schedule on plain tensors, stepped with the distributed model's full
    gradients (and the same ``qk_logits``), so that it differs from the
    distributed run only in the optimizer's distributed arithmetic."""

    def __init__(self, cfg: RunConfig, make_opt, make_schedule, rank: int, device: torch.device | str = "cpu"):
        self.params: dict[str, torch.Tensor] = {}
        self.opt = self.schedule = None
        if rank == 0:
            model = build_model(cfg.model, cfg.train.seed).to(device)
            self.params = dict(model.named_parameters())
            self.opt = make_opt(model)
            self.schedule = make_schedule(self.opt)

    @staticmethod
    def gather_grads(model) -> dict[str, torch.Tensor]:
        """Full gradients by name.  Collective: every rank calls it (only rank 0 keeps them)."""
        return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}

    def step(self, full_grads: dict[str, torch.Tensor], qk_logits) -> None:
        if self.opt is None:
            return
        for n, g in full_grads.items():
            self.params[n].grad = g.clone()
        _step(self.opt, qk_logits)
        self.opt.zero_grad(set_to_none=True)
        self.schedule.step()


@torch.no_grad()
def evaluate(model, val_tokens: torch.Tensor, dp_rank: int, dp_size: int, world: int) -> float:
    """Mean next-token loss over the validation windows (this rank takes its
    slice; the mean over ranks equals the mean over all windows)."""
    per_rank = val_tokens.shape[0] // dp_size
    mine = val_tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    loss = model(mine[:, :-1], mine[:, 1:]).double()
    if world > 1:
        dist.all_reduce(loss)
        loss /= world
    return loss.item()


def parameter_deviations(model, ref_params: dict, rank: int, world: int) -> dict[str, float]:
    """Max abs difference of every parameter from rank 0's reference, max over ranks.

    The reference is broadcast so that each rank also checks its own copy of
    parameters that are plain tensors (replicated over tp/ep): replicas that
    drifted apart show up here too.
    """
    out = {}
    for name, p in model.named_parameters():
        full = _full(p.detach())
        ref = ref_params[name].detach().clone() if rank == 0 else torch.empty_like(full)
        if world > 1:
            dist.broadcast(ref, src=0)
        dev = (full - ref).abs().max() if full.numel() else torch.zeros((), device=full.device)
        if world > 1:
            dist.all_reduce(dev, op=dist.ReduceOp.MAX)
        out[name] = dev.item()
    return out


def check(summary: dict, tolerance: float, require_reference: bool = True) -> list[str]:
    """Reasons a run failed its acceptance check (empty when it passed).

    The deviation from the single-device reference must be within ``tolerance``
    (a run without checked steps fails when ``require_reference``), the training
    loss must have fallen from the first step to the last, and so must the
    validation loss when there is one.
    """
    problems = []
    if summary["check_steps"] == 0:
        if require_reference:
            problems.append("no step was checked against the single-device reference (check_steps = 0)")
    elif not summary["max_param_deviation"] <= tolerance:
        problems.append(f"parameter {summary['worst_param']} deviates from the single-device run by "
                        f"{summary['max_param_deviation']:.3e} > tolerance {tolerance:.1e}")
    if not summary["last_loss"] < summary["first_loss"]:
        problems.append(f"loss did not fall: first {summary['first_loss']:.4f}, last {summary['last_loss']:.4f}")
    evals = summary.get("evals") or []
    if len(evals) >= 2 and not evals[-1]["val_loss"] < evals[0]["val_loss"]:
        problems.append(f"validation loss did not fall: step {evals[0]['step']} {evals[0]['val_loss']:.4f}, "
                        f"step {evals[-1]['step']} {evals[-1]['val_loss']:.4f}")
    return [f"{summary.get('label', summary['config'])}: {p}" for p in problems]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                     "configs", "base.toml"),
                    help="path to a configs/*.toml file (default: configs/base.toml, 1 process)")
    ap.add_argument("--steps", type=int, default=None, help="override [train] steps")
    ap.add_argument("--no-qk-clip", action="store_true", help="disable QK-clip even if the config enables it")
    ap.add_argument("--distributed-mode", default="parallel", choices=("parallel", "gather"))
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the deviation exceeds --tolerance or the loss did not fall")
    ap.add_argument("--tolerance", type=float, default=None,
                    help=f"largest allowed |param - single-device| (default: {DEFAULT_TOLERANCE:g} with fp32, "
                         f"{BF16_TOLERANCE_PER_STEP:g} per checked step with bf16 Newton–Schulz)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu (gloo) or cuda (NCCL, cuda:LOCAL_RANK per rank)")
    ap.add_argument("--compute-dtype", default="fp32", choices=tuple(COMPUTE_DTYPES),
                    help="Newton–Schulz dtype of the distributed optimizer and of the single-device reference")
    ap.add_argument("--summary-out", default=None, help="write a JSON summary here (rank 0)")
    ap.add_argument("--normuon-beta2", type=float, default=None, help="NorMuon with this beta2 (Muon's normuon_beta2)")
    ap.add_argument("--cautious-wd", action="store_true", help="cautious weight decay (Muon's cautious_wd)")
    ap.add_argument("--momentum-dtype", default=None, choices=tuple(COMPUTE_DTYPES),
                    help="the Muon momentum's storage dtype (Muon's momentum_dtype; default: the parameter's)")
    ap.add_argument("--weight-decay", type=float, default=None, help="override [train] weight_decay")
    return ap.parse_args(argv)


def muon_options_from(args: argparse.Namespace) -> dict:
    """Muon's variant keywords from the command line (only those given)."""
    out = {}
    if args.normuon_beta2 is not None:
        out["normuon_beta2"] = args.normuon_beta2
    if args.cautious_wd:
        out["cautious_wd"] = True
    if args.momentum_dtype is not None:
        out["momentum_dtype"] = COMPUTE_DTYPES[args.momentum_dtype]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # Gathering (_StridedShard, Shard) parameters warns about sequential all-gathers.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    if args.steps is not None and args.steps < 1:
        print(f"error: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    if args.tolerance is not None and not args.tolerance >= 0:
        print(f"error: --tolerance must be >= 0, got {args.tolerance}", file=sys.stderr)
        return 2
    compute_dtype = COMPUTE_DTYPES[args.compute_dtype]
    launched = "WORLD_SIZE" in os.environ  # torchrun
    world = int(os.environ["WORLD_SIZE"]) if launched else 1
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() <= local_rank:
            print(f"error: --device cuda needs a CUDA device for local rank {local_rank}, "
                  f"found {torch.cuda.device_count()}; use --device cpu or fewer processes per node",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    try:
        cfg = load_config(args.config, world_size=world)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.weight_decay is not None:
        if not args.weight_decay >= 0:
            print(f"error: --weight-decay must be >= 0, got {args.weight_decay}", file=sys.stderr)
            return 2
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, weight_decay=args.weight_decay))
    try:
        muon_options = muon_options_from(args)
        if muon_options:  # a bad value is refused before any process starts training
            Muon([{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "use_muon": True}], **muon_options)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # A launcher that runs several cases in one launch (examples/train_cases.py) made the group
    # already: the case runs in it and leaves it for the next.
    owns_group = launched and not dist.is_initialized()
    if owns_group:
        if args.device == "cuda":
            dist.init_process_group("nccl", timeout=timedelta(minutes=5), device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    try:
        rank = dist.get_rank() if launched else 0
        summary = train(
            cfg,
            steps=args.steps,
            use_qk_clip=False if args.no_qk_clip else None,
            distributed_mode=args.distributed_mode,
            device=device,
            compute_dtype=compute_dtype,
            muon_options=muon_options,
        )
        tolerance = tolerance_for(compute_dtype, summary["check_steps"]) if args.tolerance is None else args.tolerance
        problems = check(summary, tolerance)
        summary["tolerance"] = tolerance
        summary["passed"] = not problems
        if rank == 0:
            print(f"{cfg.name} on {world} x {args.device}, Newton–Schulz {args.compute_dtype}: "
                  f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}; "
                  f"max |param - single-device| = {summary['max_param_deviation']:.3e} "
                  f"({summary['worst_param']}, tolerance {tolerance:g}); "
                  f"total heads clipped {sum(summary['heads_clipped'])}")
            for p in problems:
                print(f"CHECK FAILED: {p}")
            if args.summary_out:
                with open(args.summary_out, "w") as f:
                    json.dump(summary, f, indent=2)
        if launched:
            # Tear down together: a rank destroying its gloo groups while a peer
            # still works in them can abort that peer ("terminate called ...").
            dist.barrier()
    finally:
        if owns_group:
            dist.destroy_process_group()
    return 1 if (args.check and problems) else 0


if __name__ == "__main__":
    from examples.torchrun_exit import exit_process

    exit_process(main())
