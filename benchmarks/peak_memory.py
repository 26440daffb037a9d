"""Peak extra memory of one ``Muon.step()`` per rank, against the plan's stated bound.

    python benchmarks/peak_memory.py [--ranks 4] [--experts 64] [--lookahead 1]

A model with one dominant expert weight ``[E, 256, 1024]`` (FSDP ``Shard(1)``: every rank
holds a slice of every expert, so experts must be gathered) next to eight ``256 x 256``
matrices.  Every tensor a step allocates is tracked (a dispatch mode records each new
storage and a weak reference notices when it is freed), so the figure is the real peak
of live bytes above what existed before the step: buffers, assembled matrices,
Newton–Schulz workspace.  The bound is ``StepPlan.memory_bound(lookahead)``:
``lookahead + 2`` chunks of buffers on this rank (one more while replica all-gathers are
in flight).  For comparison, the bytes one owner would hold if the expert weight were
orthogonalised whole (its gathered gradient, the update and Newton–Schulz workspace).
Ranks are forked processes on gloo, one thread each; fp32 on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "torch-ext")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MiB = 2**20


def _rank(rank, world, store_path, args, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from optimizer import Muon
    from optimizer.parallel.plan import ns_workspace
    from optimizer.testing import LiveBytes

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    shapes = [(256, 256)] * 8 + [(args.experts, 256, 1024)]
    placements = [[Shard(0)]] * 8 + [[Shard(1)]]
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), mesh, [Replicate()])
                                 .redistribute(mesh, pl)) for s, pl in zip(shapes, placements)]
    opt = Muon([{"params": params, "use_muon": True}], lr=0.02, lookahead=args.lookahead)
    for step in range(2):
        for p, s in zip(params, shapes):
            p.grad = distribute_tensor(torch.randn(s, generator=gen), mesh, [Replicate()]).redistribute(
                mesh, p.placements)
        if step == 0:
            opt.step()  # momentum buffers and the plan exist from here on
            continue
        with LiveBytes() as tracker:
            opt.step()
    plan = opt._cached_context.plan
    expert = math.prod(shapes[-1]) * 4  # bytes, fp32
    whole = 3 * expert + 4 * ns_workspace(shapes[-1])  # gathered + update + scatter, NS workspace
    result = dict(rank=rank, peak=tracker.peak, bound=plan.memory_bound(args.lookahead), chunks=len(plan.chunks),
                  owned=plan.owned, jobs=plan.jobs, peak_chunk=plan.peak_chunk_bytes, whole_expert_owner=whole)
    with open(out_path + f".{rank}", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run(args) -> list[dict]:
    fd, store = tempfile.mkstemp(prefix="peak_memory_store_")
    os.close(fd)
    os.unlink(store)
    out = tempfile.mktemp(prefix="peak_memory_out_")
    mp.start_processes(_rank, args=(args.ranks, store, args, out), nprocs=args.ranks, start_method="fork")
    results = []
    for r in range(args.ranks):
        with open(out + f".{r}") as f:
            results.append(json.load(f))
        os.unlink(out + f".{r}")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--lookahead", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results"))
    args = ap.parse_args(argv)
    results = run(args)
    lines = [f"peak extra memory of Muon.step(), {args.ranks} gloo ranks, one expert weight [{args.experts}, 256, "
             f"1024] (FSDP Shard(1)) + 8 x [256, 256], lookahead {args.lookahead}, fp32, torch {torch.__version__}",
             "", "| rank | measured peak MiB | bound MiB | measured / bound | chunks | jobs owned | "
             "one owner of the whole expert weight MiB |", "|---|---|---|---|---|---|---|"]
    ok = True
    for r in results:
        ratio = r["peak"] / r["bound"]
        ok &= ratio <= 1.0
        lines.append(f"| {r['rank']} | {r['peak'] / MiB:.2f} | {r['bound'] / MiB:.2f} | {ratio:.2f} | {r['chunks']} | "
                     f"{r['owned']} | {r['whole_expert_owner'] / MiB:.1f} |")
    lines += ["", f"within the bound on every rank: {'yes' if ok else 'NO'}"]
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "peak_memory.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "peak_memory.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
