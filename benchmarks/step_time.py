"""Optimizer step time on DTensor parameters: parallel Muon against its baselines.

Launch one process per rank (gloo on CPU, NCCL when CUDA is available)::

    torchrun --nproc-per-node 2 benchmarks/step_time.py
    torchrun --nproc-per-node 4 benchmarks/step_time.py --mesh 2,2 --layout strided
    torchrun --nproc-per-node 4 benchmarks/step_time.py --config configs/fsdp_tp.toml
    torchrun --nproc-per-node 4 benchmarks/step_time.py --mesh 2,2 --layout hsdp      # (Replicate, Shard(0))
    torchrun --nproc-per-node 4 benchmarks/step_time.py --layout replicated           # (Replicate(),): DDP-style

In one launch, on the same parameters (a transformer's weight matrices, sharded
FSDP-style ``Shard(0)`` on a 1-D mesh by default) and the same random
gradients, it times ``optimizer.step()`` of

  * parallel   this project's Muon, ``distributed_mode="parallel"`` (matrices held by
               several replicas are split over them, ``replica_split="auto"``);
  * normuon    the same with NorMuon (``normuon_beta2=0.95``): its cost over plain Muon;
  * dion2      the same with Dion2 (``dion2_fraction=0.25``, no momentum coefficient: Muon
               refuses one with Dion2): its cost over plain Muon;
  * cautious   the same with cautious weight decay (``cautious_wd=True``);
  * repeat     the same with ``replica_split="never"``: every replica orthogonalises
               its own copy (the path before the split; only with replicas);
  * whole      the same with ``ns_split="never"``: every matrix orthogonalised whole by one
               owner (only when ``parallel``, whose default ``ns_split="auto"`` may cut a
               matrix over several ranks, cut one: with fewer matrices than ranks);
  * classic    the same with ``ns_method="classic"``: the per-shape choice of the
               Gram-space Newton–Schulz off (where the compute dtype lets auto pick it:
               fp32, i.e. on CPU; only then is this variant run);
  * gather     the same Muon, ``distributed_mode="gather"`` (every rank
               gathers every matrix: the baseline parallel Muon must beat);
  * torch      ``torch.optim.Muon`` on the same DTensors (DTensor dispatch
               does the communication);
  * titan      torchtitan's own distributed Muon (``flex_shard.DistMuon``) when
               torchtitan is installed (it runs on CUDA only; elsewhere the table says
               why it did not run);
  * adamw      ``torch.optim.AdamW``, the floor.

Each step is bracketed by barriers, so a step's time is the slowest rank's.
After warm-up the variants are stepped in turn (a round is one step of each),
so background load hits them alike; ratios are given both of the medians and
as the median of the round-by-round ratios.
Beside each time, the variant's largest deviation from the same optimizer run on one
device on the full tensors (for torchtitan's DistMuon: this project's single-device
Muon with bf16 Newton–Schulz, DistMuon's dtype).
Results: a table with median and spread and ratios to parallel Muon, the
parallel (and gather) step split into stages with the bytes each rank moved,
written to ``bench_results/step_time_<tag>.{json,md}``.

Every rank calls ``torch.set_num_threads(1)`` (``--threads``): ranks model
devices, and with more ranks than cores they would otherwise fight over the
same cores with several BLAS threads each.  With more ranks than cores the
ranks time-share the cores; the output says so.

Only the matrices are optimised (embeddings and norms would go to AdamW in
every variant alike).  No forward/backward: gradients are random DTensors with
the parameters' placements, set once and reused by every step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO / "torch-ext"))

from optimizer import Muon, QKClipConfig  # noqa: E402
from optimizer.testing import torch_muon_newton_schulz as torch_muon_ns_dtype  # noqa: E402
from optimizer.newton_schulz.forms import choose_ns_method, default_compute_dtype, newton_schulz_flops  # noqa: E402

VARIANTS = ("parallel", "normuon", "dion2", "cautious", "whole", "repeat", "classic", "gather", "torch", "titan", "adamw")
# Muon's options per variant of this project's optimizer (the rest are as "parallel").
OWN_VARIANTS = {
    "parallel": {},
    "normuon": {"normuon_beta2": 0.95},
    "dion2": {"dion2_fraction": 0.25},  # no momentum (its momentum is the sum)
    "cautious": {"cautious_wd": True},
    "whole": {},  # ns_split="never" in its group
    "repeat": {"replica_split": "never"},
    "classic": {},  # ns_method="classic" in its group
    "gather": {"distributed_mode": "gather"},
}
VARIANT_LABELS = {
    "parallel": "parallel Muon (this project)",
    "normuon": "parallel NorMuon (beta2 0.95)",
    "dion2": "Dion2 (fraction 0.25)",
    "cautious": "parallel Muon, cautious weight decay",
    "whole": "parallel Muon, every matrix whole on one rank (ns_split never)",
    "repeat": "parallel Muon, replicas repeat the work",
    "classic": "parallel Muon, classic Newton–Schulz only",
    "gather": "gather-everything Muon (this project)",
    "torch": "torch.optim.Muon on DTensors",
    "titan": "torchtitan DistMuon (flex_shard)",
    "adamw": "torch.optim.AdamW (floor)",
}
# Variants Muon refuses a momentum coefficient and QK-clip for (Dion2's momentum is the sum).
NO_MOMENTUM = ("dion2",)
NO_QK_CLIP = ()
STAGES = ("gather", "orthogonalize", "scatter", "exchange", "update", "qk_clip")
LAYOUTS = ("fsdp_tp", "strided", "s0s1", "hsdp", "replicated")
# Same hyper-parameters for every variant (the values do not change the cost).
LR, WEIGHT_DECAY, MOMENTUM = 0.02, 0.1, 0.95
QK_THRESHOLD = 100.0


# ----------------------------------------------------------------- the model


@dataclass(frozen=True)
class MatrixSpec:
    name: str
    shape: tuple[int, int]
    kind: str  # "col": output rows split by TP (q, k, v, w1, w3); "row": input columns (wo, w2)


def transformer_matrices(dim: int, n_layers: int, ffn_dim: int, head_dim: int, n_kv_heads: int) -> list[MatrixSpec]:
    """The weight matrices of a Llama-style decoder (nn.Linear layout [out, in])."""
    if dim % head_dim:
        raise ValueError(f"--dim {dim} must be a multiple of --head-dim {head_dim}")
    kv = n_kv_heads * head_dim
    specs = []
    for i in range(n_layers):
        a, f = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        specs += [
            MatrixSpec(f"{a}.wq.weight", (dim, dim), "col"),
            MatrixSpec(f"{a}.wk.weight", (kv, dim), "col"),
            MatrixSpec(f"{a}.wv.weight", (kv, dim), "col"),
            MatrixSpec(f"{a}.wo.weight", (dim, dim), "row"),
            MatrixSpec(f"{f}.w1.weight", (ffn_dim, dim), "col"),
            MatrixSpec(f"{f}.w3.weight", (ffn_dim, dim), "col"),
            MatrixSpec(f"{f}.w2.weight", (dim, ffn_dim), "row"),
        ]
    return specs


# ------------------------------------------------------------ mesh and layout


def mesh_from_config(path: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Mesh degrees from a config's ``[mesh]`` table (other sections are ignored).

    Dims with degree > 1 form the mesh, in the order dp_replicate, dp_shard, tp
    (the order ``examples/config.py`` uses).
    """
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    mesh = raw.get("mesh", {})
    known = ("dp_replicate", "dp_shard", "ep", "tp")
    unknown = sorted(set(mesh) - set(known))
    if unknown:
        raise ValueError(f"{path}: [mesh] has unknown keys {unknown}; expected some of {known}")
    if mesh.get("ep", 1) > 1:
        raise ValueError(f"{path}: mesh.ep > 1 (expert sharding) does not apply to this dense benchmark model")
    names = tuple(d for d in ("dp_replicate", "dp_shard", "tp") if mesh.get(d, 1) > 1)
    if not names:
        raise ValueError(f"{path}: [mesh] has no degree > 1; a 1-rank run has nothing to distribute")
    return tuple(int(mesh[d]) for d in names), names


def mesh_from_flag(text: str, world_size: int, layout: str = "fsdp_tp") -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``--mesh 4`` (dp_shard) or ``--mesh 2,2`` (dp_shard, tp); default: all ranks on dp_shard.

    ``--layout hsdp`` reads two degrees as (dp_replicate, dp_shard); ``--layout replicated``
    puts every rank on dp_replicate (one degree)."""
    if layout == "replicated":
        return (int(text) if text else world_size,), ("dp_replicate",)
    if not text:
        return (world_size,), ("dp_shard",)
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--mesh must be comma-separated ints like '4' or '2,2', got {text!r}") from None
    if len(shape) == 1:
        return shape, ("dp_shard",)
    if len(shape) == 2:
        return shape, ("dp_replicate", "dp_shard") if layout == "hsdp" else ("dp_shard", "tp")
    raise ValueError(f"--mesh takes 1 or 2 degrees (dp_shard[,tp]), got {text!r}")


def placements_for(kind: str, mesh_names: tuple[str, ...], mesh_shape: tuple[int, ...], layout: str):
    """Placements of one matrix, one per mesh dim.

    Without tp every matrix is FSDP ``Shard(0)`` (HSDP adds ``Replicate()``).
    With tp, ``layout`` picks: "fsdp_tp" is what ``fully_shard`` over a TP
    model produces (colwise weights ``(_StridedShard(0, sf=tp), Shard(0))``,
    rowwise ``(Shard(0), Shard(1))``); "strided" / "s0s1" use one of those two
    for every matrix.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    tp = mesh_shape[mesh_names.index("tp")] if "tp" in mesh_names else 1
    strided = layout == "strided" or (layout == "fsdp_tp" and kind == "col")
    out = []
    for name in mesh_names:
        if name == "dp_replicate":
            out.append(Replicate())
        elif name == "dp_shard":
            out.append(_StridedShard(0, split_factor=tp) if tp > 1 and strided else Shard(0))
        else:  # tp
            out.append(Shard(0) if strided else Shard(1))
    return tuple(out)


# --------------------------------------------------------- the variants


def make_optimizer(variant: str, named: list[tuple[str, torch.nn.Parameter]], head_dim: int, qk_clip: bool):
    params = [p for _, p in named]
    if variant in OWN_VARIANTS:
        groups = [{"params": params, "param_names": [n for n, _ in named], "use_muon": True,
                   "ns_method": "classic" if variant == "classic" else "auto",
                   "ns_split": "never" if variant == "whole" else "auto"}]
        momentum = {} if variant in NO_MOMENTUM else {"momentum": MOMENTUM}
        return Muon(groups, lr=LR, weight_decay=WEIGHT_DECAY, **momentum, **OWN_VARIANTS[variant],
                    qk_clip=QKClipConfig(head_dim=head_dim, threshold=QK_THRESHOLD) if qk_clip else None)
    if variant == "torch":
        return torch.optim.Muon(params, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                                adjust_lr_fn="match_rms_adamw")
    if variant == "titan":
        try:
            from optimizer.integrations.torchtitan import build_torchtitan_dist_muon
        except ImportError as e:
            raise RuntimeError(f"torchtitan is not installed ({e})") from None
        return build_torchtitan_dist_muon(named, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                                          adjust_lr="match_rms_adamw")
    if variant == "adamw":
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    raise ValueError(f"unknown variant {variant!r}; use some of {VARIANTS}")


def qk_logits_for(specs: list[MatrixSpec], head_dim: int) -> dict[int, torch.Tensor]:
    """Per-layer max logits with every other head over the threshold (so clipping does work)."""
    logits = {}
    for s in specs:
        if s.name.endswith(".wq.weight"):
            layer = int(s.name.split(".")[1])
            n_heads = s.shape[0] // head_dim
            logits[layer] = torch.tensor([QK_THRESHOLD * (2.0 if h % 2 else 0.5) for h in range(n_heads)])
    return logits


# --------------------------------------------------------------- measuring


def build_params(specs, mesh, mesh_names, layout, device, seed):
    """Params and grads as DTensors, sharded from identical global tensors on every rank."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    named = []
    for s in specs:
        placements = placements_for(s.kind, mesh_names, tuple(mesh.shape), layout)
        tensors = []
        for _ in range(2):  # param, grad
            full = torch.randn(s.shape, generator=g).to(device)
            # distribute_tensor refuses uneven _StridedShard splits; redistributing
            # from Replicate gives FSDP2's layout (see tests/dist_cases.py).
            tensors.append(distribute_tensor(full, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, placements))
        p = torch.nn.Parameter(tensors[0])
        p.grad = tensors[1]
        named.append((s.name, p))
    return named


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


class VariantRun:
    """One variant's parameters and optimizer, stepped on demand; keeps this rank's times and stats."""

    def __init__(self, variant, specs, mesh, mesh_names, args, device):
        self.variant, self.device = variant, device
        named = build_params(specs, mesh, mesh_names, args.layout, device, args.seed)
        self.named = named
        self.steps_taken = 0
        qk = variant in OWN_VARIANTS and variant not in NO_QK_CLIP and not args.no_qk_clip
        self.opt = make_optimizer(variant, named, args.head_dim, qk)
        self.kwargs = {"qk_logits": qk_logits_for(specs, args.head_dim)} if qk else {}
        self.ns_dtype = resolve_torch_muon_dtype(args.torch_muon_dtype, device) if variant == "torch" else None
        self.times: list[float] = []
        self.stats: list[dict] = []

    def step(self, record: bool) -> None:
        with torch_muon_ns_dtype(self.ns_dtype):
            _sync(self.device)
            t0 = time.perf_counter()
            self.opt.step(**self.kwargs)
            _sync(self.device)
            elapsed = time.perf_counter() - t0
        self.steps_taken += 1
        if not record:
            return
        self.times.append(elapsed)
        if isinstance(self.opt, Muon):
            st = self.opt.last_step_stats
            self.stats.append(dict(seconds=dict(st.seconds), bytes_sent=st.bytes_sent,
                                   bytes_received=st.bytes_received, all_to_alls=st.all_to_alls,
                                   all_gathers=st.all_gathers, chunks=st.chunks, split_units=st.split_units,
                                   split_bytes=st.split_bytes))


def single_device_deviation(run_: "VariantRun", specs, args, device) -> float:
    """Largest |parameter - the same optimizer's on one device| after the same steps (rank 0 calls it).

    The reference runs on the full tensors built from the same seed: this project's Muon for
    parallel/repeat/gather (and, in bf16, for DistMuon), torch.optim.Muon and AdamW for theirs.
    """
    g = torch.Generator().manual_seed(args.seed)
    full, grads = {}, {}
    for s in specs:  # the order build_params draws them in
        full[s.name] = torch.randn(s.shape, generator=g).to(device)
        grads[s.name] = torch.randn(s.shape, generator=g).to(device)
    named = [(s.name, torch.nn.Parameter(full[s.name].clone())) for s in specs]
    for n, p in named:
        p.grad = grads[n]
    v = run_.variant
    if v == "titan":
        params = [p for _, p in named]
        ref = Muon([{"params": params, "use_muon": True}], lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                   compute_dtype=torch.bfloat16)
    else:
        ref = make_optimizer("parallel" if v in ("repeat", "gather") else v, named, args.head_dim,
                             bool(run_.kwargs))  # "classic" has its own: the same form on one device
    with torch_muon_ns_dtype(run_.ns_dtype):
        for _ in range(run_.steps_taken):
            ref.step(**run_.kwargs)
    got = dict(run_.fulls)
    return max((got[n] - p.detach()).abs().max().item() for n, p in named)


def _agree_on_errors(errors: dict[str, str], world_size: int) -> dict[str, str]:
    """Every rank's errors, merged: a variant that failed anywhere is dropped everywhere."""
    gathered = [None] * world_size
    dist.all_gather_object(gathered, errors)
    merged: dict[str, str] = {}
    for g in gathered:
        for v, e in g.items():
            merged.setdefault(v, e)
    return merged


def _describe(e: Exception) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:300]


def measure(variants, specs, mesh, mesh_names, args, device, world_size) -> tuple[dict, dict]:
    """Warm up every variant, then time them interleaved: step k of every variant, then step k+1.

    Interleaving makes the variants share whatever else the machine is doing
    at the time, so their ratios stay fair under drifting background load.
    Returns ({variant: VariantRun}, {variant: error}).
    """
    runs: dict[str, VariantRun] = {}
    failed: dict[str, str] = {}
    for v in variants:
        try:
            run_ = VariantRun(v, specs, mesh, mesh_names, args, device)
            for _ in range(args.warmup):
                run_.step(record=False)
            runs[v] = run_
        except Exception as e:  # noqa: BLE001 - a failing baseline is a result, not a crash
            failed[v] = _describe(e)
        failed = _agree_on_errors(failed, world_size)
        for bad in failed:
            runs.pop(bad, None)
    if "whole" in runs and "parallel" in runs:  # nothing cut: "whole" is "parallel"; drop it
        cut = torch.tensor([runs["parallel"].opt.last_step_stats.split_units])
        dist.all_reduce(cut)
        if not cut.item():
            runs.pop("whole")
            failed["whole"] = "not run: ns_split='auto' cut no matrix here, so it equals parallel Muon"
    for _ in range(args.steps):
        for v, run_ in list(runs.items()):
            try:
                run_.step(record=True)
            except Exception as e:  # noqa: BLE001
                failed[v] = _describe(e)
        failed = _agree_on_errors(failed, world_size)
        for bad in failed:
            runs.pop(bad, None)
    return runs, failed


def resolve_torch_muon_dtype(flag: str, device: torch.device) -> torch.dtype:
    if flag == "auto":
        return default_compute_dtype(device)
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[flag]


def summarize(times: list[float]) -> dict:
    ts = sorted(times)
    q = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) >= 2 else [ts[0]] * 3
    return dict(median_s=statistics.median(ts), p25_s=q[0], p75_s=q[2], min_s=ts[0], max_s=ts[-1], n=len(ts))


def stage_summary(stats: list[dict], step_times: list[float]) -> dict:
    """Median per stage over the timed steps; 'other' is the step's time outside the stages."""
    if not stats:
        return {}
    seconds = {k: statistics.median(s["seconds"][k] for s in stats) for k in STAGES}
    others = [t - sum(s["seconds"].values()) for t, s in zip(step_times, stats)]
    seconds["other"] = statistics.median(others)
    last = stats[-1]
    return dict(seconds=seconds, bytes_sent=last["bytes_sent"], bytes_received=last["bytes_received"],
                all_to_alls=last["all_to_alls"], all_gathers=last["all_gathers"], chunks=last["chunks"],
                split_units=last.get("split_units", 0), split_bytes=last.get("split_bytes", 0),
                step_s=statistics.median(step_times))


def hardware(device: torch.device, world_size: int, threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    cores = os.cpu_count() or 1
    info = dict(cpu=cpu, cpu_cores=cores, torch=torch.__version__, python=platform.python_version(),
                device=str(device), backend=dist.get_backend(), world_size=world_size, threads_per_rank=threads)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["oversubscription"] = round(world_size * threads / cores, 2)
    return info


# --------------------------------------------------------------- reporting


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render_markdown(result: dict) -> str:
    hw, sz = result["hardware"], result["sizes"]
    lines = [f"# Optimizer step time ({result['tag']})", ""]
    over = f", {hw['oversubscription']}x oversubscribed" if hw.get("oversubscription", 0) > 1 else ""
    lines.append(f"- hardware: {hw.get('gpu', hw['cpu'])}; {hw['cpu_cores']} CPU cores; torch {hw['torch']}; "
                 f"backend {hw['backend']}; {hw['threads_per_rank']} thread(s) per rank{over}")
    lines.append(f"- world size {hw['world_size']}, mesh {result['mesh']['names']} = {result['mesh']['shape']}, "
                 f"layout {result['mesh']['layout']}")
    lines.append(f"- model: {sz['matrices']} matrices ({sz['distinct_shapes']}), {sz['params'] / 1e6:.2f} M params, "
                 f"Newton–Schulz {sz['ns_gflop']:.1f} GFLOP per step ({sz['ns_steps']} iterations); "
                 f"{result['warmup']} warm-up + {result['steps']} timed steps")
    lines.append(f"- torch.optim.Muon Newton–Schulz dtype: {result['torch_muon_dtype']}; this project's: "
                 f"{result['compute_dtype']}; QK-clip in this project's steps: {result['qk_clip']}")
    lines += ["", "| optimizer | median s | p25–p75 s | min–max s | vs parallel (medians) | vs parallel (paired) | "
              "max deviation from one device |", "|---|---|---|---|---|---|---|"]
    for v in result["variants"]:
        row = result["results"][v]
        if "error" in row:
            lines.append(f"| {VARIANT_LABELS[v]} | did not run: {row['error']} | | | | | |")
            continue
        t = row["time"]
        ratios = [f"{row[k]:.2f}x" if row.get(k) is not None else "-" for k in ("ratio_to_parallel", "paired_ratio_median")]
        dev = f"{row['max_deviation']:.1e}" if "max_deviation" in row else "-"
        lines.append(f"| {VARIANT_LABELS[v]} | {t['median_s']:.4f} | {t['p25_s']:.4f}–{t['p75_s']:.4f} | "
                     f"{t['min_s']:.4f}–{t['max_s']:.4f} | {ratios[0]} | {ratios[1]} | {dev} |")
    split = result["results"].get("parallel", {})
    classic = result["results"].get("classic", {})
    if "time" in split and "time" in classic:
        lines += ["", f"Newton–Schulz form chosen per shape vs classic only: **{split['time']['median_s'] / classic['time']['median_s']:.2f}x** "
                  f"(medians; paired {1 / classic['paired_ratio_median']:.2f}x); Newton–Schulz "
                  f"{sz['ns_gflop_chosen']:.1f} vs {sz['ns_gflop']:.1f} GFLOP per step."]
    for v in ("normuon", "cautious"):
        row = result["results"].get(v, {})
        if "time" in split and "time" in row:
            same = all(a["all_to_alls"] == b["all_to_alls"] and a["all_gathers"] == b["all_gathers"]
                       for a, b in zip(row["stages_per_rank"], split["stages_per_rank"]))
            extra = sum(a["bytes_sent"] for a in row["stages_per_rank"]) / max(
                1, sum(b["bytes_sent"] for b in split["stages_per_rank"])) - 1
            lines += ["", f"{VARIANT_LABELS[v]} vs parallel Muon: **{row['time']['median_s'] / split['time']['median_s']:.3f}x** "
                      f"(medians; paired {row['paired_ratio_median']:.3f}x); collectives per step "
                      f"{'the same' if same else 'DIFFERENT'} ({row['stages_per_rank'][0]['all_to_alls']} all-to-alls, "
                      f"{row['stages_per_rank'][0]['all_gathers']} all-gathers on rank 0), bytes sent {extra:+.2%}."]
    dion2 = result["results"].get("dion2", {})
    if "time" in split and "time" in dion2:
        lines += ["", f"{VARIANT_LABELS['dion2']} vs parallel Muon: **{dion2['time']['median_s'] / split['time']['median_s']:.3f}x** "
                  f"(medians; paired {dion2['paired_ratio_median']:.3f}x); Muon's step with QK-clip "
                  f"{'on' if result['qk_clip'] else 'off'}, Dion2's too."]
    whole = result["results"].get("whole", {})
    if "time" in split and "time" in whole:
        lines += ["", "Newton–Schulz of a matrix split over ranks (ns_split auto) vs every matrix whole on one rank: "
                  f"**{split['time']['median_s'] / whole['time']['median_s']:.2f}x** "
                  f"(medians; paired {1 / whole['paired_ratio_median']:.2f}x)."]
    for v in ("parallel", "whole"):
        per_rank = result["results"].get(v, {}).get("stages_per_rank")
        if per_rank:
            busiest = max(range(len(per_rank)), key=lambda r: per_rank[r]["seconds"]["orthogonalize"])
            st = per_rank[busiest]
            lines += ["", f"{VARIANT_LABELS[v]}: the busiest rank's Newton–Schulz (orthogonalize stage, rank "
                      f"{busiest}) {st['seconds']['orthogonalize']:.4f} s of a {st['step_s']:.4f} s step "
                      f"({100 * st['seconds']['orthogonalize'] / st['step_s']:.0f}%); blocks of cut matrices per rank "
                      f"{[p['split_units'] for p in per_rank]}, their collectives {_fmt_bytes(st['split_bytes'])} "
                      "sent per rank (modelled)."]
    repeat = result["results"].get("repeat", {})
    if "time" in split and "time" in repeat:
        lines += ["", f"Split over replicas vs replicas repeating the work: **{split['time']['median_s'] / repeat['time']['median_s']:.2f}x** "
                  f"(medians; paired {1 / repeat['paired_ratio_median']:.2f}x)."]
    for v in OWN_VARIANTS:
        per_rank = result["results"].get(v, {}).get("stages_per_rank")
        if not per_rank:
            continue
        if not any(st["all_to_alls"] or st["all_gathers"] or st["bytes_sent"] for st in per_rank) and v == "dion2":
            lines += ["", f"{VARIANT_LABELS[v]}: the step's stats count no collective (its selection and the chosen "
                      "slices' exchange run outside Muon's pipeline, docs/dion2.md); its bytes are counted by "
                      "tests/parallel/test_dion2_dtensor.py, not here."]
            continue
        lines += ["", f"## {VARIANT_LABELS[v]}: stages per rank (median seconds; bytes of the last step)", ""]
        lines.append("| rank | " + " | ".join(STAGES) + " | other | sent | received | all_to_alls | all_gathers |")
        lines.append("|---" * (len(STAGES) + 6) + "|")
        for r, st in enumerate(per_rank):
            secs = " | ".join(f"{st['seconds'][k]:.4f}" for k in (*STAGES, "other"))
            lines.append(f"| {r} | {secs} | {_fmt_bytes(st['bytes_sent'])} | {_fmt_bytes(st['bytes_received'])} | "
                         f"{st['all_to_alls']} | {st['all_gathers']} |")
    lines += ["", "Variants were stepped in turn (one round = one step of each), after warm-up; 'paired' is the "
              "median over rounds of the step time divided by parallel Muon's in the same round.",
              "", "Stage times are wall time on the rank (a wait shows up in the stage that waits); the gather "
              "baseline has no scatter stage. 'other' is the step outside the pipeline (momentum, planning, "
              "the agreement all-reduce)."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- main


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(d) for d in s.lower().split("x")) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes takes ROWSxCOLS[,ROWSxCOLS...], got {text!r}") from None
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"--shapes takes ROWSxCOLS[,ROWSxCOLS...], got {text!r}")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dim", type=int, default=512, help="model width")
    p.add_argument("--ffn-dim", type=int, default=1024, help="feed-forward width")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (7 matrices each)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: dim // head_dim, MHA)")
    p.add_argument("--mesh", default="", help="'N' (dp_shard) or 'DP,TP'; default: a 1-D mesh of all ranks")
    p.add_argument("--shapes", type=_shapes, default=None,
                   help="explicit matrices instead of the transformer, e.g. 2048x2048,2048x2048 (no QK-clip)")
    p.add_argument("--config", default=None, help="take the mesh from this TOML's [mesh] table")
    p.add_argument("--layout", choices=LAYOUTS, default="fsdp_tp", help="placements on a mesh with tp")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--torch-muon-dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="Newton–Schulz dtype of torch.optim.Muon; auto = this project's default for the device "
                        "(fp32 on CPU, bf16 on CUDA); bf16 = torch as shipped")
    p.add_argument("--no-qk-clip", action="store_true", help="leave QK-clip out of this project's steps")
    p.add_argument("--no-check", action="store_true",
                   help="skip comparing every variant with the same optimizer on one device")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(_REPO / "bench_results"), help="directory for the JSON and Markdown")
    p.add_argument("--tag", default=None, help="file name suffix (default: ws<N>_<mesh>_<layout>)")
    args = p.parse_args(argv)
    for name in ("dim", "ffn_dim", "layers", "head_dim", "steps", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    bad = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; use a comma-separated subset of {VARIANTS}")
    return args


def run(args, rank: int, world_size: int, device: torch.device) -> dict | None:
    """The benchmark inside an initialised process group; rank 0 returns (and writes) the result."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(args.threads)
    # DTensor logs a warning per multi-step redistribution (torch.optim.Muon and the gather
    # baseline on 2-D meshes do many); they would bury the table.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if args.config:
        mesh_shape, mesh_names = mesh_from_config(args.config)
    else:
        mesh_shape, mesh_names = mesh_from_flag(args.mesh, world_size, args.layout)
    if math.prod(mesh_shape) != world_size:
        raise SystemExit(f"mesh {mesh_names}={mesh_shape} needs {math.prod(mesh_shape)} ranks but the world size "
                         f"is {world_size}; launch that many ranks or change --mesh/--config")
    mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=mesh_names)
    kv_heads = args.kv_heads or args.dim // args.head_dim
    specs = transformer_matrices(args.dim, args.layers, args.ffn_dim, args.head_dim, kv_heads)
    if args.shapes:  # explicit matrices instead of the transformer (e.g. fewer matrices than ranks)
        specs = [MatrixSpec(f"m{i}.weight", shape, "col") for i, shape in enumerate(args.shapes)]
        args.no_qk_clip = True  # no attention weights to clip
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    if "dp_replicate" not in mesh_names and "repeat" in variants:
        variants.remove("repeat")  # no replicas: the same as parallel
    compute = default_compute_dtype(device)
    if "classic" in variants and all(choose_ns_method(s.shape, 5, "auto", compute) == "classic" for s in specs):
        variants.remove("classic")  # auto picks classic for every shape here (bf16): the same as parallel

    runs, failed = measure(variants, specs, mesh, mesh_names, args, device, world_size)
    if failed.get("whole", "").startswith("not run: ns_split"):
        variants.remove("whole")  # nothing was cut: it would be parallel Muon again
        del failed["whole"]
    for run_ in runs.values():  # collective: every rank takes part, rank 0 keeps the result
        run_.fulls = [(n, p.full_tensor().detach()) for n, p in run_.named]
    results: dict[str, dict] = {}
    for v in variants:
        if v in failed:
            results[v] = {"error": failed[v]}
            continue
        gathered = [None] * world_size
        dist.all_gather_object(gathered, {"times": runs[v].times, "stats": runs[v].stats})
        # Barriers make every rank's step time the slowest rank's; take the max to be safe.
        times = [max(g["times"][i] for g in gathered) for i in range(args.steps)]
        results[v] = {"time": summarize(times), "times_s": times}
        if rank == 0 and not args.no_check:
            results[v]["max_deviation"] = single_device_deviation(runs[v], specs, args, device)
        if gathered[0]["stats"]:
            results[v]["stages_per_rank"] = [stage_summary(g["stats"], g["times"]) for g in gathered]
    if rank != 0:
        return None

    base = results.get("parallel", {}).get("time", {}).get("median_s")
    for v, row in results.items():
        if "time" in row and base:
            row["ratio_to_parallel"] = row["time"]["median_s"] / base
            # Steps of one round ran back to back, so round-by-round ratios cancel slow drifts in load.
            pairs = zip(row["times_s"], results["parallel"]["times_s"])
            row["paired_ratio_median"] = statistics.median(t / b for t, b in pairs)
    shapes = sorted({s.shape for s in specs})
    compute_dtype = default_compute_dtype(device)
    result = dict(
        tag=args.tag or f"ws{world_size}_{'x'.join(map(str, mesh_shape))}_{_layout_name(args.layout, mesh_names)}",
        hardware=hardware(device, world_size, args.threads),
        mesh=dict(names=list(mesh_names), shape=list(mesh_shape), layout=_layout_name(args.layout, mesh_names)),
        sizes=dict(
            matrices=len(specs),
            distinct_shapes=", ".join(f"{sum(s.shape == sh for s in specs)}x{sh[0]}x{sh[1]}" for sh in shapes),
            params=sum(s.shape[0] * s.shape[1] for s in specs),
            ns_steps=5,
            ns_gflop=sum(newton_schulz_flops(s.shape, 5) for s in specs) / 1e9,
            ns_gflop_chosen=sum(newton_schulz_flops(s.shape, 5, "auto", compute_dtype) for s in specs) / 1e9,
            dim=args.dim, ffn_dim=args.ffn_dim, layers=args.layers, head_dim=args.head_dim, kv_heads=kv_heads,
        ),
        warmup=args.warmup,
        steps=args.steps,
        torch_muon_dtype=str(resolve_torch_muon_dtype(args.torch_muon_dtype, device)).replace("torch.", ""),
        compute_dtype=str(compute_dtype).replace("torch.", ""),
        qk_clip=not args.no_qk_clip,
        variants=variants,
        results=results,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"step_time_{result['tag']}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = render_markdown(result)
    (out / f"step_time_{result['tag']}.md").write_text(md)
    print(md, flush=True)
    return result


def _layout_name(layout: str, mesh_names) -> str:
    if "tp" in mesh_names or layout in ("hsdp", "replicated"):
        return layout
    return "hsdp" if "dp_replicate" in mesh_names else "fsdp"


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. `torchrun --nproc-per-node 2 benchmarks/step_time.py`")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        run(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(_REPO))
    from examples.torchrun_exit import exit_process

    exit_process(main())
