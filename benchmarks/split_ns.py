"""Split Newton-Schulz: one matrix on one rank against the same matrix split over K ranks.

    python benchmarks/split_ns.py --ranks 2 --shape 2048x4096        # forked gloo ranks
    torchrun --nproc-per-node 2 benchmarks/split_ns.py --shape 2048x4096
    python benchmarks/split_ns.py --calibrate                        # this machine's CPU_GLOO figures

In one launch, every rank builds the same matrix (fp32, seeded); then, repeat by repeat:

  * unsplit   rank 0 alone runs ``zeropower_via_newtonschulz`` on the whole matrix (the other
              ranks wait at a barrier);
  * split     every rank runs ``split_zeropower_via_newtonschulz`` on its column block
              (``column_blocks``; a tall matrix is transposed first); its time is the slowest
              rank's, from a common barrier.

Printed: medians and minima of both, the speed-up (unsplit / split), the CPU time each used (process
time of the busiest rank: on a machine shared with other jobs, wall time above CPU time is time
spent waiting for a core, or in the collectives), the cost model's times for
k = 1 and k = K on ``CPU_GLOO`` (or ``CUDA_NVLINK`` on CUDA), the form and B-split used, and the
split result's largest deviation from the unsplit one. CPU, gloo, ``--threads`` (default 1)
BLAS threads per rank: a rank stands for one device; more ranks than cores oversubscribe them
(4 ranks on this 2-core machine get half a core each, which the cost model does not know).

``--calibrate`` measures what ``CPU_GLOO`` records: fp32 (and bf16) matmul FLOP/s on one
thread, and the all-reduce latency (8 bytes) and bus bandwidth (1-64 MiB) between 2 forked gloo
ranks over loopback.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO / "torch-ext"))

from optimizer.newton_schulz import zeropower_via_newtonschulz  # noqa: E402
from optimizer.newton_schulz.cut import split_zeropower_via_newtonschulz  # noqa: E402
from optimizer.parallel.planning.cut_cost import choose_b_split, column_blocks, split_ns_cost  # noqa: E402
from optimizer.parallel.planning.cut_hardware import hardware_for  # noqa: E402


def _parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.lower().split("x"))


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bench_rank(rank: int, world: int, args) -> dict | None:
    torch.set_num_threads(args.threads)
    shape = _parse_shape(args.shape)
    g = torch.Generator().manual_seed(0)
    G = torch.randn(shape, generator=g)
    tall = shape[-2] > shape[-1]
    Gt = G.mT if tall else G  # short side first
    blocks = column_blocks(Gt.shape[-1], world)
    widths = [b.stop - b.start for b in blocks]
    mine = Gt[..., blocks[rank]].contiguous()
    kw = dict(ns_steps=args.steps, coefficients=args.coefficients, compute_dtype=torch.float32, method=args.method)

    def unsplit():
        return zeropower_via_newtonschulz(G, **kw)

    def split():
        return split_zeropower_via_newtonschulz(mine, widths, None, b_split=args.b_split, **kw)

    # warm-up, and the deviation
    ref = unsplit()
    out = split()
    ref_t = ref.mT if tall else ref
    dev = torch.tensor([(out - ref_t[..., blocks[rank]]).abs().max().item()], dtype=torch.float64)
    dist.all_reduce(dev, op=dist.ReduceOp.MAX)
    t_unsplit, t_split, cpu_unsplit, cpu_split = [], [], [], []
    for _ in range(args.repeats):
        dist.barrier()
        if rank == 0:
            c0, t0 = time.process_time(), time.perf_counter()
            unsplit()
            t_unsplit.append(time.perf_counter() - t0)
            cpu_unsplit.append(time.process_time() - c0)
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        split()
        t_split.append(_slowest(time.perf_counter() - t0))
        cpu_split.append(_slowest(time.process_time() - c0))
    if rank != 0:
        return None
    hw = hardware_for("cpu")
    one = split_ns_cost(shape, 1, args.steps, args.method, torch.float32, args.coefficients, hardware=hw)
    many = split_ns_cost(shape, world, args.steps, args.method, torch.float32, args.coefficients, args.b_split, hw)
    return dict(
        shape=shape, ranks=world, threads=args.threads, steps=args.steps, coefficients=args.coefficients,
        form=many.form, b_split=many.b_split if args.b_split == "auto" else args.b_split,
        auto_b_split=choose_b_split(shape, world, torch.float32, hw),
        unsplit=(statistics.median(t_unsplit), min(t_unsplit)), split=(statistics.median(t_split), min(t_split)),
        cpu=(statistics.median(cpu_unsplit), statistics.median(cpu_split)),
        load=os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"),
        model=(one.time_s, many.time_s), model_bytes=many.bytes_per_rank, model_collectives=many.collectives,
        hardware=hw.name, deviation=float(dev), cores=os.cpu_count(),
    )


def report(r: dict) -> str:
    (um, un), (sm, sn) = r["unsplit"], r["split"]
    m1, mk = r["model"]
    lines = [
        f"shape {'x'.join(map(str, r['shape']))}, {r['steps']} steps, {r['coefficients']}, fp32, form {r['form']}, "
        f"B {r['b_split']} (auto: {r['auto_b_split']}); {r['ranks']} ranks x {r['threads']} thread(s) on {r['cores']} cores"
        + (" (oversubscribed)" if r["ranks"] * r["threads"] > (r["cores"] or 1) else ""),
        f"  unsplit, 1 rank : median {um * 1e3:9.1f} ms   min {un * 1e3:9.1f} ms   model {m1 * 1e3:9.1f} ms",
        f"  split, {r['ranks']} ranks : median {sm * 1e3:9.1f} ms   min {sn * 1e3:9.1f} ms   model {mk * 1e3:9.1f} ms "
        f"({r['model_collectives']} collectives, {r['model_bytes'] / 2**20:.1f} MiB sent per rank)",
        f"  speed-up unsplit/split: {um / sm:.2f}x of medians, {un / sn:.2f}x of minima; model {m1 / mk:.2f}x",
        f"  CPU seconds (process time, median; busiest rank): unsplit {r['cpu'][0]:.2f} s, split {r['cpu'][1]:.2f} s "
        f"per rank ({r['cpu'][0] / r['cpu'][1]:.2f}x); load average at the end {r['load']:.1f}",
        f"  max |split - unsplit| = {r['deviation']:.2e}",
        f"  hardware model: {r['hardware']}",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- calibration


def calibrate_rank(rank: int, world: int, args) -> dict | None:
    torch.set_num_threads(1)
    out = {}
    if rank == 0:  # FLOP/s on one thread (the other rank idles at the barrier below)
        for dtype, n, reps in ((torch.float32, 1024, 7), (torch.bfloat16, 256, 3)):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            a @ b
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                a @ b
                ts.append(time.perf_counter() - t0)
            out[str(dtype)] = 2 * n**3 / statistics.median(ts)
    dist.barrier()
    x = torch.zeros(2)  # 8 bytes
    for _ in range(20):
        dist.all_reduce(x)
    ts = []
    for _ in range(200):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        ts.append(time.perf_counter() - t0)
    out["latency"] = statistics.median(ts)
    out["bus_bw"] = {}
    for mib in (1, 4, 16, 64):
        x = torch.zeros(mib * 2**18)
        dist.all_reduce(x)
        ts = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            ts.append(_slowest(time.perf_counter() - t0))
        out["bus_bw"][mib] = 2 * (world - 1) / world * mib * 2**20 / statistics.median(ts)
    return out if rank == 0 else None


def calibrate_report(r: dict) -> str:
    bw = ", ".join(f"{m} MiB {v / 1e9:.2f} GB/s" for m, v in r["bus_bw"].items())
    return (
        f"fp32 matmul 1024^3, 1 thread: {r['torch.float32'] / 1e9:.1f} GFLOP/s; bf16 256^3: {r['torch.bfloat16'] / 1e9:.2f} GFLOP/s\n"
        f"gloo all-reduce, 2 ranks: latency (8 bytes) {r['latency'] * 1e6:.0f} us; bus bandwidth {bw}"
    )


# ----------------------------------------------------------------------------- launch


def _forked(rank, world, store_path, fn, args, queue):
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        res = fn(rank, world, args)
        dist.barrier()
        if rank == 0:
            queue.put(res)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="2048x4096", help="[batch x] m x n (default 2048x4096)")
    p.add_argument("--ranks", type=int, default=2, help="forked ranks (ignored under torchrun)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--coefficients", default="fixed")
    p.add_argument("--method", default="auto", choices=["auto", "classic", "gram"])
    p.add_argument("--b-split", default="auto", choices=["auto", "replicated", "rows"])
    p.add_argument("--calibrate", action="store_true")
    args = p.parse_args(argv)
    fn = calibrate_rank if args.calibrate else bench_rank
    show = calibrate_report if args.calibrate else report
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
        res = fn(dist.get_rank(), dist.get_world_size(), args)
        dist.barrier()
        dist.destroy_process_group()
        if res is not None:
            print(show(res))
        return res
    world = 2 if args.calibrate else args.ranks
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    fd, store_path = tempfile.mkstemp(prefix="split_ns_store_")
    os.close(fd)
    os.unlink(store_path)
    procs = [ctx.Process(target=_forked, args=(r, world, store_path, fn, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    res = queue.get(timeout=3600)
    for proc in procs:
        proc.join()
    print(show(res))
    return res


if __name__ == "__main__":
    main()
