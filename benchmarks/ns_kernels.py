"""The Newton–Schulz kernels (optimizer.kernels) against cuBLAS, per product, per tile, per shape.

    python benchmarks/ns_kernels.py                                  # CUDA, bf16, issue 28's shapes
    python benchmarks/ns_kernels.py --shapes 4096x14336 --repeats 20
    python benchmarks/ns_kernels.py --device cpu --tiny              # smoke test: Triton's interpreter

For each shape ([batch x] m x n, s = min(m, n), l = max), in one launch and one dtype (bf16 by
default), the median time of:

  * ``X X^T``       cuBLAS ``matmul(X, X.mT)`` against the symmetric kernel (``syrk``);
  * ``bA + cAA``    cuBLAS ``baddbmm(A, A, A)`` against the symmetric kernel;
  * ``aX + BX``     cuBLAS ``baddbmm(X, B, X, beta=a)`` against the general kernel (``matmul_add``),
                    which the "auto" backend leaves to cuBLAS;

each kernel with every candidate tile of ``tiles.CUDA_CANDIDATES`` (``*``: the one the rule picks),
and its largest difference from cuBLAS's result relative to the result's largest entry (a
compiled-kernel correctness check: the tests run the kernels under the interpreter only). Then 5
classic Newton–Schulz steps (``newton_schulz.iteration.classic_iterations``) on torch's products
against the products ``ns_kernels="auto"`` and ``"triton"`` resolve to, and the
classic FLOP floor at the bf16 matmul rate measured in the same launch (8192^3). Ratios < 1 mean
the kernels are faster.

Then the elementwise stages around Newton–Schulz (``kernels/elementwise.py``) on each shape as an
fp32 weight with fp32 momentum and gradient and a bf16 update/input: torch's formulas
(``rule.momentum_``, ``rule.nesterov_input_``, each alone and together as a step runs them,
``rule.apply_update_``, plain and cautious) against the fused kernels (the momentum and the input
together: one pass), each stage's median time, the bytes it moves by the model of docs/kernels.md
(per entry) and the bandwidth that implies. Results: ``bench_results/ns_kernels_<tag>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
DEFAULT_SHAPES = "4096x4096,1024x4096,14336x4096,4096x14336,8192x28672,32x2048x7168"
TINY_SHAPES = "37x53,2x40x72"
STEPS = [(3.4445, -4.7750, 2.0315)] * 5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None, help=f"comma-separated [batch x] m x n (default: {DEFAULT_SHAPES})")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu (under the interpreter)")
    p.add_argument("--tiny", action="store_true", help=f"shapes {TINY_SHAPES}, one repeat (the smoke test)")
    p.add_argument("--out", default=str(_REPO / "bench_results"))
    p.add_argument("--tag", default=None, help="file name suffix (default: the device type)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device_type = args.device or ("cuda" if _cuda_available() else "cpu")
    if device_type == "cpu":
        # the kernels run on CPU tensors only under the interpreter, which Triton must see first
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    sys.path.insert(0, str(_REPO / "torch-ext"))
    from optimizer import kernels
    from optimizer.kernels.environment import device_key
    from optimizer.kernels.tiles import CUDA_CANDIDATES, INTERPRETER_TILES, choose_tiles
    from optimizer.newton_schulz.forms import newton_schulz_flops
    from optimizer.newton_schulz.implementation import ON_TORCH, resolve_implementation
    from optimizer.newton_schulz.iteration import classic_iterations

    device = torch.device(device_type)
    reason = kernels.unavailable_reason(device)
    if reason is not None:
        raise SystemExit(f"the kernels cannot run on {device}: {reason}")
    dtype = getattr(torch, args.dtype)
    tiny = args.tiny or device.type == "cpu"
    shapes = [tuple(int(d) for d in s.split("x")) for s in (args.shapes or (TINY_SHAPES if tiny else DEFAULT_SHAPES)).split(",")]
    repeats, warmup = (1, 0) if tiny else (args.repeats, args.warmup)
    candidates = {"interpreter": INTERPRETER_TILES} if device.type == "cpu" else CUDA_CANDIDATES
    from optimizer.kernels.matmul_add_kernel import matmul_add_triton
    from optimizer.kernels.symmetric_kernel import symmetric_matmul_triton

    def timed(fn):
        return _median_ms(fn, device, repeats, warmup)

    rate = _matmul_rate(device, dtype, 64 if tiny else 8192, timed)
    rows = []
    for shape in shapes:
        torch.manual_seed(0)
        G = torch.randn(*shape, device=device)
        X = (G / torch.linalg.matrix_norm(G, keepdim=True)).to(dtype)
        if X.shape[-2] > X.shape[-1]:
            X = X.mT.contiguous()
        batch = X.shape[0] if X.ndim == 3 else 1
        s, l = X.shape[-2:]
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=-4.775, alpha=2.0315) if A.ndim == 3 else torch.addmm(A, A, A, beta=-4.775, alpha=2.0315)
        addmm = torch.baddbmm if X.ndim == 3 else torch.addmm
        products = {
            "X X^T": ("symmetric", lambda: X @ X.mT, lambda t: symmetric_matmul_triton(X, X.mT, tiles=t), (s, s, l)),
            "bA + cAA": ("symmetric", lambda: addmm(A, A, A, beta=-4.775, alpha=2.0315),
                         lambda t: symmetric_matmul_triton(A, A, A, alpha=2.0315, beta=-4.775, tiles=t), (s, s, s)),
            "aX + BX": ("general", lambda: addmm(X, B, X, beta=3.4445),
                        lambda t: matmul_add_triton(B, X, X, beta=3.4445, tiles=t), (s, l, s)),
        }
        row = {"shape": "x".join(map(str, shape)), "products": {}}
        for name, (kind, cublas, kernel, (m, n, k)) in products.items():
            chosen = choose_tiles(kind, batch, m, n, k, dtype, *device_key(device))
            expected = cublas()
            entry = {"cublas_ms": timed(cublas), "tiles": {}}
            for label, tiles in candidates.items():
                if kind == "symmetric" and tiles.block_m != tiles.block_n:
                    continue
                got = kernel(tiles)
                diff = ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
                ms = timed(lambda: kernel(tiles))
                entry["tiles"][label + ("*" if tiles == chosen else "")] = {"ms": ms, "ratio": ms / entry["cublas_ms"], "max_rel_diff": diff}
            row["products"][name] = entry
        floor_ms = newton_schulz_flops(X.shape, len(STEPS)) / rate / 1e6  # rate in GFLOP/s
        row["ns_torch_ms"] = timed(lambda: classic_iterations(X, STEPS, ON_TORCH.products(X, dtype)))
        for backend in ("auto", "triton"):
            products = resolve_implementation(backend, device, (dtype,)).products(X, dtype)
            row[f"ns_kernels_{backend}_ms"] = timed(lambda: classic_iterations(X, STEPS, products))
        row["floor_ms"] = floor_ms
        row["elementwise"] = _elementwise_stages(shape, device, timed)
        rows.append(row)

    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()}), Triton interpreter",
        "torch": torch.__version__, "triton": _triton_version(), "dtype": args.dtype,
        "matmul_tflops": rate / 1e3, "repeats": repeats, "rows": rows,
    }
    _write(result, Path(args.out), args.tag or device.type)
    return result


# Bytes per entry each stage moves (fp32 weight, momentum and gradient; bf16 input and update):
# reads plus writes of every pass, as docs/kernels.md counts them.
ELEMENTWISE_BYTES = {
    "momentum": {"torch": 12, "fused": 12},            # lerp_(buf, g): read g, buf; write buf
    "nesterov input": {"torch": 10, "fused": 10},      # lerp(g, buf, out=bf16): read g, buf; write x
    # what a step runs (MatrixStep.input_into): the two above | one pass, read g, buf; write buf, x
    "momentum + nesterov input": {"torch": 22, "fused": 14},
    "decay + update": {"torch": 18, "fused": 10},      # mul_ (8), add_ (10) | read p, u; write p
    "cautious decay + update": {"torch": 44, "fused": 10},  # mask (10), ge_ (8), addcmul_ (16), add_ (10)
}


def _elementwise_stages(shape, device, timed) -> dict:
    """Each elementwise stage on a weight of ``shape``: torch's formulas and the fused kernel."""
    import torch

    from optimizer import rule
    from optimizer.kernels import elementwise

    gen = torch.Generator(device=device).manual_seed(0)
    p, buf, g = (torch.randn(shape, device=device, generator=gen) for _ in range(3))
    u = torch.randn(shape, device=device, generator=gen).to(torch.bfloat16)
    x = torch.empty(shape, device=device, dtype=torch.bfloat16)
    lr, alr, wd = 0.02, 0.02 * 0.2 * max(shape[-2:]) ** 0.5, 0.1
    calls = {
        "momentum": (lambda: rule.momentum_([buf], [g], 0.95),
                     lambda: elementwise.momentum_nesterov_(buf, g, None, 0.95, True, backend="triton")),
        "nesterov input": (lambda: rule.nesterov_input_(x, g, buf, 0.95, True),
                           lambda: elementwise.momentum_nesterov_(buf, g, x, 0.95, True, update_momentum=False,
                                                                  backend="triton")),
        "momentum + nesterov input": (
            lambda: (rule.momentum_([buf], [g], 0.95), rule.nesterov_input_(x, g, buf, 0.95, True)),
            lambda: elementwise.momentum_nesterov_(buf, g, x, 0.95, True, backend="triton")),
        "decay + update": (lambda: rule.apply_update_(p, u, lr, alr, wd),
                           lambda: elementwise.apply_update_(p, u, lr, alr, wd, backend="triton")),
        "cautious decay + update": (lambda: rule.apply_update_(p, u, lr, alr, wd, True),
                                    lambda: elementwise.apply_update_(p, u, lr, alr, wd, True, backend="triton")),
    }
    n = p.numel()
    out = {}
    for stage, (torch_fn, fused_fn) in calls.items():
        entry = {}
        for label, fn in (("torch", torch_fn), ("fused", fused_fn)):
            ms = timed(fn)
            nbytes = ELEMENTWISE_BYTES[stage][label] * n
            entry[label] = {"ms": ms, "bytes": nbytes, "gb_per_s": nbytes / ms / 1e6}
        entry["ratio"] = entry["fused"]["ms"] / entry["torch"]["ms"]
        out[stage] = entry
    return out


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _triton_version() -> str:
    import triton

    return triton.__version__


def _median_ms(fn, device, repeats, warmup) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _matmul_rate(device, dtype, n, timed) -> float:
    """GFLOP/s of an n^3 matmul in ``dtype`` (fp32 on CPU, where bf16 matmul is not what is measured)."""
    import torch

    rate_dtype = dtype if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=rate_dtype)
    return 2 * n**3 / timed(lambda: a @ a) / 1e6


def _write(result: dict, out: Path, tag: str) -> None:
    lines = [
        f"# Newton–Schulz kernels against cuBLAS: {result['device']}",
        "",
        f"torch {result['torch']}, Triton {result['triton']}, {result['dtype']}, median of {result['repeats']}, "
        f"matmul rate {result['matmul_tflops']:.3g} TFLOP/s. Ratio = kernel / cuBLAS (< 1: kernel faster); "
        "`*` the tile the rule picks; diff = max |kernel - cuBLAS| / max |cuBLAS|.",
        "",
        "| shape | product | cuBLAS ms | tile: ms (ratio, diff) |",
        "|---|---|---|---|",
    ]
    for row in result["rows"]:
        for name, entry in row["products"].items():
            tiles = ", ".join(f"{label}: {t['ms']:.3f} ({t['ratio']:.2f}, {t['max_rel_diff']:.1e})" for label, t in entry["tiles"].items())
            lines.append(f"| {row['shape']} | {name} | {entry['cublas_ms']:.3f} | {tiles} |")
    lines += ["", "| shape | NS torch ms | kernels auto ms (ratio) | kernels triton ms (ratio) | floor ms |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        base = row["ns_torch_ms"]
        lines.append(
            f"| {row['shape']} | {base:.3f} | {row['ns_kernels_auto_ms']:.3f} ({row['ns_kernels_auto_ms'] / base:.2f}) "
            f"| {row['ns_kernels_triton_ms']:.3f} ({row['ns_kernels_triton_ms'] / base:.2f}) | {row['floor_ms']:.3f} |"
        )
    lines += ["", "Elementwise stages (fp32 weight, momentum, gradient; bf16 input and update): bytes per entry "
              "by the model, ms, GB/s implied; ratio = fused / torch.", "",
              "| shape | stage | torch B/entry, ms (GB/s) | fused B/entry, ms (GB/s) | ratio |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        n = max(1, row["elementwise"]["momentum"]["torch"]["bytes"] // 12)
        for stage, e in row["elementwise"].items():
            t, f = e["torch"], e["fused"]
            lines.append(f"| {row['shape']} | {stage} | {t['bytes'] // n}, {t['ms']:.3f} ({t['gb_per_s']:.0f}) "
                         f"| {f['bytes'] // n}, {f['ms']:.3f} ({f['gb_per_s']:.0f}) | {e['ratio']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ns_kernels_{tag}.md").write_text(text)
    (out / f"ns_kernels_{tag}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
