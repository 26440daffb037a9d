"""One sharded Muon step checked the way a GPU run needs it (run under torchrun).

    torchrun --nproc-per-node N scripts/gpu_check_step.py --device cuda|cpu --out DIR

On every rank, with FSDP+TP-style placements (``_StridedShard`` rows, uneven shapes,
3-D experts, QK-clip on, ``skip_nonfinite`` on) on NCCL and ``cuda:LOCAL_RANK``, or gloo
and the CPU:

1. agreement: after 3 steps every parameter equals single-device Muon fed the same
   gradients (fp32 compute: atol 2e-6; bf16 compute, the CUDA default: 2e-2);
2. host syncs: after warm-up, a step reads device data back exactly as often as the
   agreement alone does (CUDA: ``torch.cuda.set_sync_debug_mode("warn")`` counts; CPU:
   ``optimizer.testing.HostSyncs`` must see exactly the agreement's one ``tolist``);
3. overlap: a profiler trace of one step (written to DIR), and how long all-to-all work
   (NCCL kernels / gloo threads) ran while Newton–Schulz matmuls did.

Prints one JSON line per rank with the results and exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "torch-ext")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from optimizer import Muon, QKClipConfig  # noqa: E402
from optimizer.distributed import agreement  # noqa: E402
from optimizer.testing import HostSyncs, overlap_seconds  # noqa: E402

HEAD_DIM = 8


def _placements(world: int):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if world % 2 == 0 and world > 2:
        tp = 2
        colwise = [_StridedShard(0, split_factor=tp), Shard(0)]
        return (world // tp, tp), colwise, [Shard(0), Shard(1)], [Shard(1), Shard(0)], [Replicate(), Replicate()]
    return (world,), [Shard(0)], [Shard(1)], [Shard(1)], [Replicate()]


def _specs(world: int):
    mesh_shape, colwise, rowwise, experts, replicated = _placements(world)
    specs = []
    for layer in range(2):
        specs += [
            (f"layers.{layer}.attention.wq.weight", (8 * HEAD_DIM, 96), colwise),
            (f"layers.{layer}.attention.wk.weight", (4 * HEAD_DIM, 96), colwise),
            (f"layers.{layer}.attention.wo.weight", (96, 8 * HEAD_DIM), rowwise),
            (f"layers.{layer}.ffn.w1.weight", (250, 96), colwise),  # uneven
            (f"layers.{layer}.ffn.w2.weight", (96, 250), rowwise),
            (f"layers.{layer}.moe.w1", (6, 128, 96), experts),
            (f"layers.{layer}.ffn.gate.weight", (16, 96), replicated),
        ]
    return mesh_shape, specs


def _logits(step: int, layers: int = 2) -> dict:
    g = torch.Generator().manual_seed(step)
    return {layer: torch.rand(8, generator=g) * 3.0 for layer in range(layers)}


def _build(device, mesh, specs, compute_dtype, seed=0):
    from torch.distributed.tensor import Replicate, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(shape, generator=gen) for n, shape, _ in specs}
    named = []
    for n, shape, placements in specs:
        if mesh is None:
            named.append((n, torch.nn.Parameter(full[n].clone().to(device))))
        else:
            dt = distribute_tensor(full[n].to(device), mesh, [Replicate()] * mesh.ndim).redistribute(mesh, placements)
            named.append((n, torch.nn.Parameter(dt)))
    groups = [{"params": [p for _, p in named], "param_names": [n for n, _ in named], "use_muon": True}]
    opt = Muon(groups, lr=0.02, compute_dtype=compute_dtype, skip_nonfinite=True,
               qk_clip=QKClipConfig(head_dim=HEAD_DIM, threshold=1.5))
    return named, opt


def _grads(specs, step):
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(shape, generator=gen) for n, shape, _ in specs}


def _set_grads(named, grads, mesh, device):
    from torch.distributed.tensor import Replicate, distribute_tensor

    for n, p in named:
        g = grads[n].to(device)
        if mesh is not None:
            g = distribute_tensor(g, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, p.placements)
        p.grad = g


def check_agreement(device, mesh, specs, compute_dtype, tol) -> float:
    named, opt = _build(device, mesh, specs, compute_dtype)
    ref_named, ref = _build(device, None, specs, compute_dtype)
    for step in range(3):
        grads = _grads(specs, step)
        logits = {k: v.to(device) for k, v in _logits(step).items()}
        _set_grads(named, grads, mesh, device)
        _set_grads(ref_named, grads, None, device)
        opt.step(qk_logits=logits)
        ref.step(qk_logits=logits)
    worst = 0.0
    for (n, p), (_, q) in zip(named, ref_named):
        worst = max(worst, (p.full_tensor() - q).abs().max().item())
    return worst


def check_syncs(device, mesh, specs, compute_dtype) -> dict:
    named, opt = _build(device, mesh, specs, compute_dtype)
    for step in range(2):  # warm-up: plan, momentum buffers
        _set_grads(named, _grads(specs, step), mesh, device)
        opt.step(qk_logits={k: v.to(device) for k, v in _logits(step).items()})
    _set_grads(named, _grads(specs, 2), mesh, device)
    logits = {k: v.to(device) for k, v in _logits(2).items()}
    if device.type == "cuda":
        torch.cuda.synchronize()

        def count(fn) -> int:
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
            torch.cuda.set_sync_debug_mode(0)
            return sum("synchroniz" in str(w.message) for w in caught)

        in_step = count(lambda: opt.step(qk_logits=logits))
        group = opt._cached_context.agreement_group
        nothing = torch.zeros((), dtype=torch.int64, device=device)
        in_agreement = count(lambda: agreement.agree(["x"], [1], facts=dict(a=0, b=0, c=0, d=nothing, e=nothing),
                                                     device_digest=nothing, group=group, device=device))
        return dict(syncs_in_step=in_step, syncs_in_agreement_alone=in_agreement, ok=in_step == in_agreement)
    with HostSyncs() as syncs:
        opt.step(qk_logits=logits)
    return dict(host_reads=syncs.events, ok=syncs.events == ["tolist"])


def check_overlap(device, mesh, specs, compute_dtype, out: str, rank: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    named, opt = _build(device, mesh, specs, compute_dtype)
    opt.chunk_size = 2  # several chunks, so that there is something to overlap
    opt.lookahead = 1
    for step in range(3):
        _set_grads(named, _grads(specs, step), mesh, device)
        logits = {k: v.to(device) for k, v in _logits(step).items()}
        if step < 2:
            opt.step(qk_logits=logits)
            continue
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            opt.step(qk_logits=logits)
            if device.type == "cuda":
                torch.cuda.synchronize()
    os.makedirs(out, exist_ok=True)
    trace = os.path.join(out, f"step_trace_rank{rank}.json")
    prof.export_chrome_trace(trace)
    comm, compute = [], []
    for e in prof.events():
        span = (e.time_range.start, e.time_range.end)
        name = e.name.lower()
        if device.type == "cuda":
            if e.device_type.name != "CUDA":
                continue
            if "nccl" in name:
                comm.append(span)
            elif any(k in name for k in ("gemm", "sm80", "sm90", "cutlass", "xmma")):
                compute.append(span)
        else:
            if name in ("gloo:all_to_all", "gloo:all_gather", "gloo:allgather"):
                comm.append(span)
            elif name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul"):
                compute.append(span)
    both = overlap_seconds(comm, compute)
    comm_total = overlap_seconds(comm, comm)
    # On CUDA the all-to-alls must run on their stream while matmuls run (two chunks or more).
    # On CPU gloo's threads and the matmuls share two cores with the other ranks: reported only.
    required = device.type == "cuda" and opt.last_step_stats.chunks >= 2
    return dict(trace=trace, comm_us=comm_total, overlapped_us=both, chunks=opt.last_step_stats.chunks,
                ok=both > 0 or not required)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "gpu_check"))
    args = ap.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh_shape, specs = _specs(world)
    mesh = init_device_mesh(args.device, mesh_shape)
    results = dict(rank=rank, world=world, device=str(device), mesh=mesh_shape)
    results["fp32_max_deviation"] = check_agreement(device, mesh, specs, torch.float32, 2e-6)
    results["bf16_max_deviation"] = check_agreement(device, mesh, specs, torch.bfloat16, 2e-2)
    results["syncs"] = check_syncs(device, mesh, specs, None)
    results["overlap"] = check_overlap(device, mesh, specs, None, args.out, rank)
    ok = (results["fp32_max_deviation"] <= 2e-6 and results["bf16_max_deviation"] <= 2e-2
          and results["syncs"]["ok"] and results["overlap"]["ok"])
    results["ok"] = ok
    print(json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    from examples.torchrun_exit import exit_process

    exit_process(main())
