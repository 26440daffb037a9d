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

Then the optimizer state per parameter for the storage options (fp32 and bf16 momentum, NorMuon's
per-row ``v``), measured from the state tensors themselves, each step's peak against its bound,
and how far a bf16 momentum moves the parameters from an fp32 one after ``--deviation-steps``.
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


# Optimizer state per parameter for Muon's storage options (the same model, the same steps).
STATE_VARIANTS = {
    "Muon, fp32 momentum": {},
    "Muon, bf16 momentum": {"momentum_dtype": "bfloat16"},
    "NorMuon (beta2 0.95), fp32 momentum": {"normuon_beta2": 0.95},
    "NorMuon, bf16 momentum": {"normuon_beta2": 0.95, "momentum_dtype": "bfloat16"},
}


def _measure(mesh, args, shapes, placements, options, seed=0):
    """Two steps of Muon with ``options`` on fresh parameters: the second step's peak extra bytes,
    the plan's bound, and this rank's optimizer state bytes."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from optimizer import Muon
    from optimizer.testing import LiveBytes

    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), mesh, [Replicate()])
                                 .redistribute(mesh, pl)) for s, pl in zip(shapes, placements)]
    opt = Muon([{"params": params, "use_muon": True}], lr=0.02, lookahead=args.lookahead, **options)
    for step in range(2):
        for p, s in zip(params, shapes):
            p.grad = distribute_tensor(torch.randn(s, generator=gen), mesh, [Replicate()]).redistribute(
                mesh, p.placements)
        if step == 0:
            opt.step()  # momentum buffers and the plan exist from here on
            continue
        with LiveBytes() as tracker:
            opt.step()
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    state = sum(local(v).numel() * v.element_size() for st in opt.state.values() for v in st.values()
                if torch.is_tensor(v))
    return opt, tracker.peak, state


def _rank(rank, world, store_path, args, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from optimizer.parallel.planning.plan import ns_workspace

    mesh = init_device_mesh("cpu", (world,))
    shapes = [(256, 256)] * 8 + [(args.experts, 256, 1024)]
    placements = [[Shard(0)]] * 8 + [[Shard(1)]]
    opt, peak, _ = _measure(mesh, args, shapes, placements, {})
    plan = opt._cached_context.plan
    expert = math.prod(shapes[-1]) * 4  # bytes, fp32
    whole = 3 * expert + 4 * ns_workspace(shapes[-1])  # gathered + update + scatter, NS workspace
    result = dict(rank=rank, peak=peak, bound=plan.memory_bound(args.lookahead), chunks=len(plan.chunks),
                  owned=plan.owned, jobs=plan.jobs, peak_chunk=plan.peak_chunk_bytes, whole_expert_owner=whole)
    result["state"] = {}
    for name, options in STATE_VARIANTS.items():
        opt, peak, state = _measure(mesh, args, shapes, placements, options)
        result["state"][name] = dict(state_bytes=state, peak=peak,
                                     bound=opt._cached_context.plan.memory_bound(args.lookahead))
    result["params"] = sum(math.prod(s) for s in shapes)  # global elements of the Muon parameters
    with open(out_path + f".{rank}", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def bf16_momentum_deviation(steps: int, shapes, seed: int = 0) -> dict:
    """One device, the same Gaussian gradients: parameters after ``steps`` steps with a bf16 momentum
    against an fp32 one (max abs difference, and the difference's norm over the fp32 run's total
    change of the parameters)."""
    from optimizer import Muon

    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    out = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = Muon([{"params": params, "use_muon": True}], lr=0.02, weight_decay=0.1, momentum_dtype=dtype)
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g
            opt.step()
        out[name] = [p.detach() for p in params]
    diff = torch.cat([(a - b).flatten() for a, b in zip(out["bf16"], out["fp32"])])
    change = torch.cat([(a - b).flatten() for a, b in zip(out["fp32"], init)])
    return dict(steps=steps, max_abs=diff.abs().max().item(), relative_to_change=(diff.norm() / change.norm()).item(),
                max_abs_change=change.abs().max().item())


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
    ap.add_argument("--deviation-steps", type=int, default=50,
                    help="steps of the bf16-against-fp32 momentum comparison")
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
    params = results[0]["params"]
    lines += ["", f"Optimizer state of the Muon parameters ({params / 1e6:.2f} M elements), summed over the ranks' local "
              "tensors after a step, and each step's peak extra memory against its plan's bound (max over ranks):",
              "", "| optimizer | state bytes per parameter | state MiB (all ranks) | peak / bound |", "|---|---|---|---|"]
    for name in STATE_VARIANTS:
        total = sum(r["state"][name]["state_bytes"] for r in results)
        ratio = max(r["state"][name]["peak"] / r["state"][name]["bound"] for r in results)
        ok &= ratio <= 1.0
        lines.append(f"| {name} | {total / params:.4f} | {total / MiB:.2f} | {ratio:.2f} |")
    dev = bf16_momentum_deviation(args.deviation_steps, [(256, 256)] * 2 + [(min(args.experts, 4), 256, 1024)])
    results[0]["bf16_momentum_deviation"] = dev
    lines += ["", f"bf16 momentum against fp32 after {dev['steps']} steps (one device, lr 0.02, wd 0.1, the same "
              f"Gaussian gradients, 2 x [256, 256] + [{min(args.experts, 4)}, 256, 1024]): max |difference| "
              f"{dev['max_abs']:.2e} (the largest total change of a parameter: {dev['max_abs_change']:.2e}); "
              f"||difference|| / ||total change|| = {dev['relative_to_change']:.2e}"]
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
