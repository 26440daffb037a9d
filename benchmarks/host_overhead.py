"""Host time of one ``Muon.step()`` at world sizes up to 1,024, on a fake process group.

    python benchmarks/host_overhead.py [--worlds 8 64 256 1024] [--params 200 2000] [--steps 5]

At scale Newton–Schulz for a whole model takes tens of milliseconds on GPUs, so the
optimizer's Python bookkeeping must not grow with the number of ranks.  This runs one
rank of a large world in this process: ``torch.testing``'s fake process group makes
every collective a no-op (buffers are left as they are), so what is timed is the host
work of a step: validation, the agreement, the plan (cached after the first step),
packing, assembling and cutting pieces, and the updates.  Newton–Schulz is made
negligible by small matrices (64 x 64; an owner orthogonalises at most a few).

Layouts: FSDP ``(Shard(0),)`` on a 1-D mesh of the world, and FSDP+TP on a
``(world/8, 8)`` mesh: colwise ``(_StridedShard(0, sf=8), Shard(0))`` and rowwise
``(Shard(0), Shard(1))`` matrices, half each.  One thread.  Prints ms per step, µs per
parameter and the ratio to the smallest world, per layout and parameter count;
writes ``bench_results/host_overhead.{json,md}``.

``--split free``: plan ``ns_split="auto"`` with free communication, so that wherever there are
fewer matrices than ranks (200 at world 256 and 1024) they are cut over 2-8 ranks: the host work
of cut units (their pieces, and the split iteration's calls, whose collectives the fake group
skips) is timed too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "torch-ext")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from optimizer import Muon  # noqa: E402
from optimizer.distributed.placements import local_indices, numel_of_indices  # noqa: E402

DIM = 64
TARGET_RATIO = 1.5
TARGET_MS_200_AT_1024 = 60.0


def _layouts(world: int) -> dict:
    return {
        "fsdp": ((world,), [[Shard(0)]]),
        "fsdp_tp": ((world // 8, 8), [[_StridedShard(0, split_factor=8), Shard(0)], [Shard(0), Shard(1)]]),
    }


def _local(shape, mesh, placements):
    """This rank's piece, shaped as the placement index math says (the data does not matter)."""
    indices = local_indices(shape, tuple(mesh.shape), placements, mesh.get_coordinate())
    block = tuple(len(range(i.start, i.stop)) if isinstance(i, slice) else int(i.numel()) for i in indices)
    assert numel_of_indices(indices) == torch.Size(block).numel()
    return torch.randn(block)


def _dtensor(mesh, placements):
    shape = (DIM, DIM)
    return DTensor.from_local(_local(shape, mesh, placements), mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=(DIM, 1))


def _as_if_every_rank_agreed(all_reduce):
    """The fake group's all-reduce moves no data, so the step's agreement would see one
    rank's facts where it expects their sum over the world.  Every simulated rank holds
    the same parameters and settings, so the sum is world x this rank's vector."""

    def summed(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = all_reduce(tensor, op=op, group=group, async_op=async_op)
        if op == dist.ReduceOp.SUM:
            tensor.mul_(dist.get_world_size(group))
        return work

    return summed


def measure(world: int, layout: str, num_params: int, steps: int, rank: int = 0) -> dict:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    mesh_shape, placement_kinds = _layouts(world)[layout]
    mesh = init_device_mesh("cpu", mesh_shape)
    params = [torch.nn.Parameter(_dtensor(mesh, placement_kinds[i % len(placement_kinds)]))
              for i in range(num_params)]
    grads = [_dtensor(mesh, p.placements) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    t0 = time.perf_counter()
    opt = Muon([{"params": params, "use_muon": True}], lr=0.02)
    groups_made = len(__import__("optimizer.distributed.groups", fromlist=["x"]).CREATION_LOG)
    construct = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt.step()  # builds and caches the step plan
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    stats = opt.last_step_stats
    dist.destroy_process_group()
    return dict(world=world, layout=layout, params=num_params, ms=ms, us_per_param=ms * 1e3 / num_params,
                first_step_ms=first * 1e3, construct_ms=construct * 1e3, chunks=stats.chunks,
                owned=stats.owned, min_ms=min(times) * 1e3, split_units=stats.split_units, groups=groups_made)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--params", type=int, nargs="+", default=[200, 2000])
    ap.add_argument("--layouts", nargs="+", default=["fsdp", "fsdp_tp"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--split", choices=("auto", "free"), default="auto",
                    help="ns_split's figures: the device's (64x64 matrices stay whole), or free communication")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.all_reduce = _as_if_every_rank_agreed(dist.all_reduce)
    if args.split == "free":
        from optimizer.parallel.planning import plan_inputs
        from optimizer.parallel.planning.cut_hardware import SplitHardware

        free = SplitHardware("free communication", 1e12, 1e12, 1e18, 0.0, torch.float32)
        plan_inputs.split_hardware = lambda device: free
    results = []
    for layout in args.layouts:
        for n in args.params:
            for world in args.worlds:
                r = measure(world, layout, n, args.steps)
                results.append(r)
    base = {(r["layout"], r["params"]): r["ms"] for r in results if r["world"] == min(args.worlds)}
    lines = [
        f"host time of Muon.step(), one rank of a fake process group; {DIM}x{DIM} matrices; "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread",
        "",
        "| layout | params | world | ms/step | µs/param | vs world "
        f"{min(args.worlds)} | first step ms | chunks | owned | cut blocks owned | groups made |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        r["ratio"] = r["ms"] / base[(r["layout"], r["params"])]
        lines.append(f"| {r['layout']} | {r['params']} | {r['world']} | {r['ms']:.1f} | {r['us_per_param']:.0f} | "
                     f"{r['ratio']:.2f}x | {r['first_step_ms']:.0f} | {r['chunks']} | {r['owned']} | "
                     f"{r['split_units']} | {r['groups']} |")
    checks = []
    for r in results:
        if r["world"] == max(args.worlds):
            checks.append(f"{r['layout']}, {r['params']} params: world {r['world']} / world {min(args.worlds)} = "
                          f"{r['ratio']:.2f}x (target <= {TARGET_RATIO}x): {'met' if r['ratio'] <= TARGET_RATIO else 'NOT met'}")
        if r["world"] == 1024 and r["params"] == 200:
            checks.append(f"{r['layout']}, 200 params at world 1024: {r['ms']:.1f} ms (target < "
                          f"{TARGET_MS_200_AT_1024:.0f} ms): {'met' if r['ms'] < TARGET_MS_200_AT_1024 else 'NOT met'}")
    text = "\n".join(lines + [""] + checks)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "host_overhead.md"), "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
