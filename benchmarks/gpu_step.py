"""Newton–Schulz and full optimizer steps on one GPU, ours against the peers, in one launch.

    python benchmarks/gpu_step.py                          # CUDA: the shapes and models below
    python benchmarks/gpu_step.py --device cpu --tiny      # CI's smoke test: the same code on small sizes
    python benchmarks/gpu_step.py --only ns --out run.json # one part; everything also as JSON

What is timed (medians of ``--repeats`` runs after ``--warmup``; CUDA events on a GPU):

* **matmul rate**: a square bf16 GEMM (fp32 on CPU, where bf16 is emulated) in the same launch:
  every "floor" below is FLOPs at this rate, so a ratio to the floor compares across machines.
* **Newton–Schulz per shape** (5 iterations, the fixed coefficient table): ours for every
  ``ns_kernels`` mode the build offers and every form (``ns_method``), torch.optim.Muon's iteration
  (2-D only) and, when ``dion`` imports, its Triton and torch iterations. Floor: the classic
  iteration's FLOPs ``(4 m² n + 2 m³) · 5`` per matrix (m ≤ n).
* **optimizer steps** on fp32 parameters with random gradients: Llama-3-8B shapes (4 layers),
  Llama-3.2-1B-like shapes (16 layers) and an MoE expert stack. Ours (Muon, NorMuon, bf16 momentum,
  each ``ns_kernels``), torch.optim.Muon (2-D models only) and dion's Muon and NorMuon with its
  Triton kernels (when importable; a benchmark-only dependency from its public repository, put it
  on ``PYTHONPATH``), each with: ms per step, ratio to every peer, ratio to the classic floor,
  peak extra memory during a step (beyond parameters, gradients and the state after warm-up) and
  host synchronisations in a step (``torch.cuda.set_sync_debug_mode``; on CPU none can be seen:
  reported as "n/a").

Every optimizer runs 5 Newton–Schulz iterations in bf16 on CUDA (fp32 on CPU), momentum 0.95 with
Nesterov, the same learning rate and weight decay; each is otherwise at its own defaults (stated in
the output: the coefficient table and lr adjustment differ between them, and cost the same).
Runs on torch >= 2.8 and Triton >= 3.6 (the GPU machines: torch 2.11, Triton 3.6).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "torch-ext"), HERE]

import torch  # noqa: E402

GiB = 2**30
NS_STEPS = 5

# ---------------------------------------------------------------------------- what is measured

# Newton–Schulz shapes (the list): square, short-wide, tall, wide, the largest dense
# matrix of a 70B model, and an expert stack.
NS_SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (8192, 28672), (32, 2048, 7168)]
NS_SHAPES_TINY = [(64, 64), (32, 96), (160, 48), (48, 160), (40, 200), (4, 24, 56)]


def llama_layers(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> list[tuple]:
    shapes = []
    for _ in range(layers):
        shapes += [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden),
                   (hidden, heads * head_dim), (ffn, hidden), (ffn, hidden), (hidden, ffn)]
    return shapes


MODELS = {
    # Llama-3-8B's shapes, 4 of its 32 layers: 28 matrices, 872 M parameters.
    "llama3-8b x4 layers": llama_layers(4, 4096, 32, 8, 128, 14336),
    # Llama-3.2-1B's shapes (hidden 2048, 32/8 heads of 64, ffn 8192), 16 layers: 112 matrices.
    "llama3.2-1b-like x16 layers": llama_layers(16, 2048, 32, 8, 64, 8192),
    # An MoE layer's experts as torchtitan stores them, [E, out, in]: 32 experts of
    # 2048 x 7168 (gate, up) and 7168 x 2048 (down): 1.4 G parameters.
    "moe experts 32x2048x7168": [(32, 2048, 7168), (32, 2048, 7168), (32, 7168, 2048)],
}
MODELS_TINY = {
    "llama3-8b x4 layers": llama_layers(1, 64, 4, 2, 16, 224),
    "llama3.2-1b-like x16 layers": llama_layers(2, 32, 4, 2, 8, 128),
    "moe experts 32x2048x7168": [(4, 32, 112), (4, 32, 112), (4, 112, 32)],
}


def classic_flops(shape) -> int:
    """FLOPs of 5 classic Newton–Schulz iterations (2 per multiply-add), every matrix of a batch."""
    m, n = sorted(shape[-2:])
    return NS_STEPS * math.prod(shape[:-2]) * 2 * (2 * m * m * n + m ** 3)


# ---------------------------------------------------------------------------- timing


class Clock:
    """Wall time of a callable on ``device``: CUDA events around it, else perf_counter."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def once(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def median(self, fn: Callable[[], object], warmup: int, repeats: int) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        return statistics.median(self.once(fn) for _ in range(repeats))


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype, clock: Clock, repeats: int) -> float:
    """FLOP/s of an n x n x n GEMM in ``dtype`` (the best of ``repeats``: the ceiling the floors use)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b, out=out)
    clock.sync()
    best = min(clock.once(lambda: torch.mm(a, b, out=out)) for _ in range(repeats))
    return 2 * n ** 3 / best


# ---------------------------------------------------------------------------- the contenders


def _ours_modes() -> list[str]:
    """The ``ns_kernels`` modes this build of ours offers (["torch"] before the option existed)."""
    from optimizer import settings

    for o in settings.GROUP_OPTIONS:
        if o.name == "ns_kernels":
            return ["auto", "torch", "triton"]
    return ["torch"]


def _triton_usable(device: torch.device) -> bool:
    try:
        from optimizer import kernels
    except ImportError:
        return False
    return kernels.available(device)


def ns_contenders(device: torch.device, dtype: torch.dtype, modes: list[str]) -> dict[str, Callable]:
    """name -> fn(G) computing 5 Newton–Schulz iterations of G (a matrix or a stack) in ``dtype``."""
    from optimizer.newton_schulz import zeropower_via_newtonschulz

    out: dict[str, Callable] = {}
    parameters = inspect.signature(zeropower_via_newtonschulz).parameters
    # the option's parameter, in builds before and after it was named for the option
    option = next((name for name in ("ns_kernels", "kernels") if name in parameters), None)
    for mode in modes:
        if mode == "triton" and not _triton_usable(device):
            continue
        for form in ("auto", "classic", "gram"):
            extra = {option: mode} if option else {}
            out[f"ours {mode}/{form}"] = (lambda G, form=form, extra=extra: zeropower_via_newtonschulz(
                G, ns_steps=NS_STEPS, compute_dtype=dtype, method=form, **extra))
    try:
        import torch.optim._muon as torch_muon

        def torch_ns(G):
            if G.ndim != 2:
                return None  # torch.optim.Muon takes matrices only
            return torch_muon._zeropower_via_newtonschulz(G, (3.4445, -4.7750, 2.0315), NS_STEPS, 1e-7)
        if dtype == torch.bfloat16:  # torch's iteration is bf16 only
            out["torch.optim.Muon"] = torch_ns
    except (ImportError, AttributeError):
        pass
    dion = _dion()
    if dion is not None and device.type == "cuda":
        from dion.newton_schulz_triton import newton_schulz_triton  # type: ignore

        out["dion triton"] = lambda G: newton_schulz_triton(G, epsilon=1e-7)
    return out


def _dion():
    try:
        import dion  # type: ignore
        return dion
    except Exception:  # noqa: BLE001 - any failure to import means "not available"
        return None


@dataclass
class Contender:
    name: str
    build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    matrices_only: bool = False  # refuses 3-D parameters
    note: str = ""


def step_contenders(device: torch.device, modes: list[str]) -> list[Contender]:
    from optimizer import Muon

    lr, wd = 0.02, 0.1
    offered = _ours_modes()
    out = []
    for mode in modes:
        if mode not in offered:
            raise SystemExit(f"--ns-kernels: {mode!r} is not offered by this build (it has {offered})")
        if mode == "triton" and not _triton_usable(device):
            continue
        # the option is passed only where the build declares it (a build from before it runs "torch")
        extra = {"ns_kernels": mode} if len(offered) > 1 else {}
        tag = f" [{mode}]" if len(offered) > 1 else ""
        variants = {"Muon": {}, "NorMuon": {"normuon_beta2": 0.95}, "Muon bf16 momentum": {"momentum_dtype": torch.bfloat16}}
        for name, options in variants.items():
            out.append(Contender(f"ours {name}{tag}", lambda ps, o={**options, **extra}: Muon(
                [{"params": ps, "use_muon": True}], lr=lr, weight_decay=wd, **o)))
    if hasattr(torch.optim, "Muon"):
        out.append(Contender("torch.optim.Muon", lambda ps: torch.optim.Muon(ps, lr=lr, weight_decay=wd),
                             matrices_only=True))
    dion = _dion()
    if dion is not None and device.type == "cuda":
        out.append(Contender("dion Muon (triton)", lambda ps: dion.Muon(
            ps, lr=lr, weight_decay=wd, nesterov=True, use_triton=True)))
        out.append(Contender("dion NorMuon (triton)", lambda ps: dion.NorMuon(
            ps, lr=lr, weight_decay=wd, nesterov=True, use_triton=True)))
    return out


# ---------------------------------------------------------------------------- memory and host syncs


@contextlib.contextmanager
def peak_extra(device: torch.device):
    """``with peak_extra(dev) as m: ...`` then ``m["bytes"]``: the most bytes allocated at once inside
    the block above what was allocated when it started (CUDA allocator stats; a dispatch-mode
    tracker of new storages on CPU)."""
    box = {"bytes": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield box
        torch.cuda.synchronize(device)
        box["bytes"] = torch.cuda.max_memory_allocated(device) - base
        return
    from optimizer.testing import LiveBytes

    with LiveBytes() as live:
        yield box
    box["bytes"] = live.peak


def host_syncs(device: torch.device, fn: Callable[[], object]) -> int | None:
    """Synchronising CUDA calls in ``fn`` (torch.cuda.set_sync_debug_mode's warnings); None on CPU."""
    if device.type != "cuda":
        fn()
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize(device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


# ---------------------------------------------------------------------------- the runs


def run_ns(args, device, dtype, clock, rate) -> list[dict]:
    shapes = NS_SHAPES_TINY if args.tiny else NS_SHAPES
    fns = ns_contenders(device, dtype, args.ns_kernels or _ours_modes())
    rows = []
    for shape in shapes:
        gen = torch.Generator(device="cpu").manual_seed(0)
        G = torch.randn(shape, generator=gen).to(device)
        floor = classic_flops(shape) / rate
        row = {"shape": "x".join(map(str, shape)), "floor_ms": floor * 1e3, "ms": {}}
        for name, fn in fns.items():
            if fn(G) is None:
                continue
            row["ms"][name] = clock.median(lambda: fn(G), args.warmup, args.repeats) * 1e3
        rows.append(row)
        del G
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run_steps(args, device, clock, rate) -> list[dict]:
    models = MODELS_TINY if args.tiny else MODELS
    rows = []
    for model, shapes in models.items():
        if args.models and not any(m in model for m in args.models):
            continue
        floor = sum(classic_flops(s) for s in shapes) / rate
        row = {"model": model, "matrices": len(shapes), "params": sum(math.prod(s) for s in shapes),
               "floor_ms": floor * 1e3, "runs": {}}
        for c in step_contenders(device, args.ns_kernels or _ours_modes()):
            if c.matrices_only and any(len(s) != 2 for s in shapes):
                continue
            row["runs"][c.name] = measure_step(c, shapes, device, clock, args)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    return rows


def measure_step(c: Contender, shapes, device, clock: Clock, args) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    try:
        opt = c.build(params)
        for _ in range(args.warmup):  # the state exists after the first
            opt.step()
        with peak_extra(device) as mem:
            opt.step()
        syncs = host_syncs(device, opt.step)
        ms = clock.median(opt.step, 0, args.repeats) * 1e3
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                    if torch.is_tensor(t))
        out = {"ms": ms, "peak_extra_gib": mem["bytes"] / GiB, "state_gib": state / GiB, "host_syncs": syncs}
    except Exception as err:  # noqa: BLE001 - a peer that cannot run this model is reported, not fatal
        out = {"error": f"{type(err).__name__}: {err}"[:300]}
    del params
    return out


# ---------------------------------------------------------------------------- report


def _fmt(x, digits=2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def _millions(n: int) -> str:
    return f"{n / 1e6:.0f} M" if n >= 1e6 else f"{n:,}"


DEFAULT = "ours auto/auto"  # what a user gets: ns_kernels and ns_method at their defaults


def ns_table(rows: list[dict]) -> str:
    names = sorted({n for r in rows for n in r["ms"]}, key=lambda n: (not n.startswith("ours"), n))
    lines = [_row(["shape", *names, "classic floor"]), _row(["---"] * (len(names) + 2))]
    for r in rows:
        lines.append(_row([r["shape"], *(_fmt(r["ms"].get(n)) for n in names), _fmt(r["floor_ms"])]))
    peers = [n for n in names if not n.startswith("ours")]
    ours = [n for n in names if n.startswith("ours")]
    default = DEFAULT if DEFAULT in ours else "ours torch/auto"
    lines += ["", f"Ratios (lower is better): `{default}` (the defaults) and our fastest mode, to the floor and "
              "to each peer.", ""]
    head = ["shape", "defaults ms", "x floor", *(f"x {p}" for p in peers), "fastest of ours", "ms", "x floor",
            *(f"x {p}" for p in peers)]
    lines += [_row(head), _row(["---"] * len(head))]
    for r in rows:
        ms = r["ms"]
        mine = {n: ms[n] for n in ours if n in ms}
        if default not in ms:
            continue
        fastest = min(mine, key=mine.get)
        cells = [r["shape"]]
        for i, name in enumerate((default, fastest)):
            cells += [f"`{name}`"] if i else []
            cells += [_fmt(ms[name]), _fmt(ms[name] / r["floor_ms"])]
            cells += [_fmt(ms[name] / ms[p]) if p in ms else "–" for p in peers]
        lines.append(_row(cells))
    return "\n".join(lines)


def step_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        runs = r["runs"]
        peers = [n for n in runs if not n.startswith("ours") and "ms" in runs[n]]
        out.append(f"**{r['model']}** ({r['matrices']} tensors, {_millions(r['params'])} fp32 parameters; "
                   f"classic Newton–Schulz floor {r['floor_ms']:.2f} ms)\n")
        head = ["optimizer", "ms", "x floor", *(f"x {p}" for p in peers), "peak extra MiB", "state MiB", "host syncs"]
        out += [_row(head), _row(["---"] * len(head))]
        for name, run in runs.items():
            if "error" in run:
                out.append(_row([name, run["error"], *([""] * (len(head) - 2))]))
                continue
            out.append(_row([name, _fmt(run["ms"], 1), _fmt(run["ms"] / r["floor_ms"]),
                             *(_fmt(run["ms"] / runs[p]["ms"]) for p in peers),
                             _fmt(run["peak_extra_gib"] * 1024, 1), _fmt(run["state_gib"] * 1024, 1),
                             "n/a" if run["host_syncs"] is None else str(run["host_syncs"])]))
        out.append("")
    return "\n".join(out)


def hardware(device: torch.device) -> dict:
    hw = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    try:
        import triton
        hw["triton"] = triton.__version__
    except ImportError:
        hw["triton"] = None
    if device.type == "cuda":
        hw["gpu"] = torch.cuda.get_device_name(device)
        hw["kernels_check"] = kernels_check(device)
    else:
        hw["cpu"] = platform.processor() or platform.machine()
        hw["threads"] = torch.get_num_threads()
    return hw


def kernels_check(device: torch.device) -> dict | str:
    """The kernels' first-use check on this GPU (optimizer/kernels/self_check.py), per kind and
    dtype: "passed" or why not. Where it fails, our "auto" rows ran torch, not the kernels."""
    try:
        from optimizer import kernels
    except ImportError:
        return "no optimizer.kernels in this build"
    out = {}
    for kind, dtype in (("products", torch.bfloat16), ("products", torch.float16), ("products", torch.float32),
                        ("elementwise", None)):
        try:
            reason = kernels.unavailable_reason(device, dtype, kind=kind)
        except TypeError:  # a build before the check existed
            return "no first-use check in this build"
        out[f"{kind} {str(dtype).removeprefix('torch.') if dtype else ''}".strip()] = reason or "passed"
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--tiny", action="store_true", help="small shapes and models (CI's smoke test)")
    p.add_argument("--only", choices=("ns", "steps"), default=None)
    p.add_argument("--models", nargs="*", default=None, help="substrings of model names to run")
    p.add_argument("--ns-kernels", nargs="*", default=None, help="our ns_kernels modes (default: all offered)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None, help="write everything as JSON here")
    p.add_argument("--strict", action="store_true", help="exit 1 if our kernels failed their first-use check here")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    clock = Clock(device)
    rate = matmul_rate(device, 256 if args.tiny else 8192, dtype, clock, max(3, args.repeats))
    result = {"hardware": hardware(device), "matmul_flops": rate, "compute_dtype": str(dtype),
              "dion": _dion() is not None, "ns": [], "steps": []}
    print(f"# gpu_step: {result['hardware']}")
    print(f"matmul {str(dtype).removeprefix('torch.')} {256 if args.tiny else 8192}^3: {rate / 1e12:.2f} TFLOP/s "
          f"(every floor below is at this rate); dion {'found' if result['dion'] else 'not importable: peers without it'}\n")
    if args.only in (None, "ns"):
        result["ns"] = run_ns(args, device, dtype, clock, rate)
        print(f"## Newton–Schulz, {NS_STEPS} iterations, {str(dtype).removeprefix('torch.')}, ms\n")
        print(ns_table(result["ns"]) + "\n")
    if args.only in (None, "steps"):
        result["steps"] = run_steps(args, device, clock, rate)
        print("## Optimizer steps, fp32 parameters, ms\n")
        print(step_table(result["steps"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    failures = kernel_check_failures(result["hardware"])
    if args.strict and failures:
        raise SystemExit(f"gpu_step: our kernels failed their first-use check on {device}: {failures}")
    return result


def kernel_check_failures(hw: dict) -> dict:
    """The kinds and dtypes whose first-use check did not pass (:func:`kernels_check`); none on
    a CPU, where no check runs."""
    check = hw.get("kernels_check")
    if check is None:
        return {}
    if not isinstance(check, dict):
        return {"check": check}
    return {kind: why for kind, why in check.items() if why != "passed"}


if __name__ == "__main__":
    main()
