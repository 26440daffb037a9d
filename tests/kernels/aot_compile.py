"""Compile every Triton kernel ahead of time for GPUs this machine does not have.

``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", cc, 32))``
runs Triton's whole pipeline down to a cubin (ptxas ships in the triton wheel) without a GPU. What
it compiles is derived from the launchers themselves: each launcher (symmetric_kernel.py,
matmul_add_kernel.py, elementwise_kernel.py) is called on meta tensors (shapes, strides and data
pointers, no memory) with every tile configuration the rule can pick on the target
(``self_check.candidates``), its kernel launch is recorded instead of run, and Triton's own binder
turns the recorded arguments into the specialisation a real launch would compile (argument types,
16-byte alignment and divisibility hints, strides of 1 made constants, 64-bit integers past 2^31).
Each distinct specialisation is compiled once per target and checked:

* it compiles (a Triton or ptxas error fails it);
* its shared memory is within what a block may use on that GPU (``tiles.SHARED_MEMORY``);
* it was launched with ``enable_fp_fusion=False``, and a 16-bit product's epilogue has no FMA;
* an fp32 product has fp32 FMAs and no tf32 instruction (``input_precision="ieee"``).

Registers and spills (cuobjdump's stack bytes) are reported, not checked. sm80, sm90 and sm100
get every layout; sm86, sm89 and sm120 the products' largest layouts (:data:`EXTRA_TARGET_LAYOUTS`).
``CONTROLS`` are breaks the checks must catch (test_aot_compile.py runs them).

Needs Triton's compiler, not its interpreter: run in a process without ``TRITON_INTERPRET=1``
(tests/kernels/test_aot_compile.py starts one; tests/conftest.py sets it for every other test).

    python tests/kernels/aot_compile.py 80 90 100                  # a table per target, exit 1 on a problem
    python tests/kernels/aot_compile.py --scope products 86 89 120
    python tests/kernels/aot_compile.py --scope "BLOCK 48" 80       # a control: must report problems
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context

if os.environ.get("TRITON_INTERPRET", "0") == "1":  # Triton decides when a kernel is defined
    raise RuntimeError("aot_compile needs Triton's compiler: run it without TRITON_INTERPRET=1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "torch-ext"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from optimizer.kernels import elementwise_kernel, matmul_add_kernel, symmetric_kernel  # noqa: E402
from optimizer.kernels.self_check import candidates  # noqa: E402
from optimizer.kernels.tiles import SHARED_MEMORY, Tiles  # noqa: E402

KERNELS = (
    symmetric_kernel._symmetric_matmul_kernel,
    matmul_add_kernel._matmul_add_kernel,
    elementwise_kernel._momentum_nesterov_kernel,
    elementwise_kernel._apply_update_kernel,
)
PRODUCT_KERNELS = ("_symmetric_matmul_kernel", "_matmul_add_kernel")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
PRODUCT_DTYPES = (F16, BF16, F32)


@dataclass
class Launch:
    """One recorded kernel launch: what the launcher passed, and where it came from."""

    name: str
    kernel: object
    args: tuple
    kwargs: dict


@contextmanager
def recording(into: list[Launch], name: str):
    """Kernel launches made inside are appended to ``into`` instead of run."""
    saved = {k: k.__dict__.get("run") for k in KERNELS}

    def recorder(kernel):
        def run(*args, grid, warmup, **kwargs):
            into.append(Launch(name, kernel, args, kwargs))
        return run

    for k in KERNELS:
        k.run = recorder(k)
    try:
        yield
    finally:
        for k, run in saved.items():
            if run is None:
                del k.run
            else:
                k.run = run


# ---------------------------------------------------------------------------- the launches


def _meta(shape, dtype, offset=0, transposed=False):
    """A meta tensor of ``shape`` (its last two dims swapped in memory if ``transposed``),
    starting ``offset`` elements into its storage: a data pointer 16-byte aligned unless offset."""
    store = (*shape[:-2], shape[-1], shape[-2]) if transposed else tuple(shape)
    size = 1
    for s in store:
        size *= s
    base = torch.empty(size + offset, dtype=dtype, device="meta")[offset:].view(store)
    return base.mT if transposed else base


# (name, batch, m, k, element offset): sizes that divide 16 or not, K even for every K tile or
# not, 16-byte aligned data pointers or not, 1 (a constant to Triton) where it can occur
PRODUCT_LAYOUTS = (
    ("aligned", 2, 256, 256, 0),
    ("ragged", 2, 261, 71, 0),
    ("ragged m, even K", 2, 261, 128, 0),
    ("aligned m, ragged K", 2, 256, 80, 0),
    ("unaligned", 2, 256, 256, 1),
    ("matrix", None, 256, 256, 0),
    ("one row", 2, 1, 71, 0),
    ("k = 1", 2, 71, 1, 0),
)
# The targets beyond sm80/sm90/sm100 (the same code paths, other shared memory and ptxas targets):
# the layout with the most shared memory (aligned: every operand stage through cp.async) and the
# one with the most registers (ragged).
EXTRA_TARGET_LAYOUTS = ("aligned", "ragged")


def product_launches(capability: tuple[int, int], layouts=PRODUCT_LAYOUTS, dtypes=PRODUCT_DTYPES,
                     tiles_list: list[Tiles] | None = None) -> Iterator[Launch]:
    """Every product call of the Newton–Schulz iterations (newton_schulz/iteration.py and cut.py,
    on the kernels), in every dtype, tile the rule can pick on ``capability``
    (``tiles_list`` instead, if given) and layout."""
    sym, gen = symmetric_kernel.symmetric_matmul_triton, matmul_add_kernel.matmul_add_triton
    for dtype in dtypes:
        for tiles in tiles_list or candidates(dtype, capability):
            for layout, batch, m, k, offset in layouts:
                def t(rows, cols, transposed=False, dt=dtype):
                    return _meta(((batch,) if batch else ()) + (rows, cols), dt, offset, transposed)

                X, A, Y = t(m, k), t(m, m), t(m, k, transposed=True)
                calls = {
                    "X X^T into fp32": lambda: sym(X, X.mT, out=t(m, m, dt=F32), tiles=tiles),
                    "X X^T": lambda: sym(X, X.mT, tiles=tiles),
                    "b A + c A A": lambda: sym(A, A, A, alpha=2.0, beta=-4.0, out=t(m, m), tiles=tiles),
                    "a X + B X": lambda: gen(A, X, X, beta=3.0, out=t(m, k), tiles=tiles),
                    "Q X": lambda: gen(A, X, tiles=tiles),
                    "a Y + B Y, Y transposed": lambda: gen(A, Y, Y, beta=3.0, out=t(m, k), tiles=tiles),
                }
                for call, launch in calls.items():
                    found: list[Launch] = []
                    with recording(found, f"{call} {_dtype(dtype)} {_tiles(tiles)} {layout}"):
                        launch()
                    yield from found


def elementwise_launches() -> Iterator[Launch]:
    """Every elementwise stage the optimizer calls (rule.MatrixStep): each dtype combination with
    the usual flags, and each flag changed alone, on every layout the launcher distinguishes."""
    layouts = (  # (name, shape, element offset, every other column)
        ("flat", (37, 70), 0, False),
        ("strided 3-D", (3, 37, 70), 0, True),
        ("unaligned", (37, 64), 1, False),
        ("flat, 2^31 entries", (1 << 16, 1 << 15), 0, False),
        ("strided, 2^31 entries", (2, 1 << 15, 1 << 15), 0, True),
    )
    for layout, shape, offset, strided in layouts:
        def t(dtype):
            wide = (*shape[:-1], 2 * shape[-1]) if strided else shape
            x = _meta(wide, dtype, offset)
            return x[..., ::2] if strided else x

        for name, launch in _elementwise_calls(t):
            found: list[Launch] = []
            with recording(found, f"{name} {layout}"):
                launch()
            yield from found


def _elementwise_calls(t: Callable) -> Iterator[tuple[str, Callable]]:
    momentum, update = elementwise_kernel.momentum_nesterov_triton, elementwise_kernel.apply_update_triton
    for buf in (F32, BF16):
        for grad in (F32, BF16, F16):
            for out in (BF16, F16, F32):
                yield (f"momentum+input buf {_dtype(buf)} grad {_dtype(grad)} out {_dtype(out)}",
                       lambda b=buf, g=grad, o=out: momentum(t(b), t(g), t(o), 0.95, True, False))
    flags = {
        "momentum alone": dict(out=None),
        "input alone": dict(update_momentum=False),
        "no Nesterov": dict(nesterov=False),
        "maximize": dict(maximize=True),
        "momentum 0.3": dict(momentum_=0.3),
        "momentum 0.5": dict(momentum_=0.5),
        "through bf16": dict(dtype=BF16, out=F32),
        "through fp16": dict(dtype=F16, out=F32),
    }
    for name, changed in flags.items():
        def call(changed=changed):
            o = changed.get("out", BF16)
            momentum(t(F32), t(BF16), t(o) if o is not None else None, changed.get("momentum_", 0.95),
                     changed.get("nesterov", True), changed.get("maximize", False),
                     update_momentum=changed.get("update_momentum", True), dtype=changed.get("dtype"))
        yield f"momentum+input {name}", call
    for param in (F32, BF16, F16):
        for u in (F32, BF16, F16):
            yield (f"update param {_dtype(param)} update {_dtype(u)}",
                   lambda p=param, u=u: update(t(p), t(u), 0.998, 0.1, False))
    scalar = lambda: _meta((), F32)  # noqa: E731  a 0-d device tensor
    for name, (factor, lr, cautious) in {
        "no decay": (lambda: None, lambda: 0.1, False),
        "cautious": (lambda: -0.002, lambda: 0.1, True),
        "tensor lr": (scalar, scalar, False),
        "cautious, tensor lr": (scalar, scalar, True),
    }.items():
        yield f"update {name}", lambda f=factor, a=lr, c=cautious: update(t(F32), t(BF16), f(), a(), c)


def _dtype(dtype: torch.dtype) -> str:
    return {F16: "fp16", BF16: "bf16", F32: "fp32"}[dtype]


def _tiles(tiles: Tiles) -> str:
    return f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k}/{tiles.num_warps}w/{tiles.num_stages}s"


# ---------------------------------------------------------------------------- compiling


@dataclass
class Specialisation:
    """One launch as Triton compiles it for one target: what ``JITFunction.run`` would pass to
    ``triton.compile`` (its binder and ``_pack_args``, without a driver)."""

    name: str
    kernel: object
    capability: int
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    def key(self) -> tuple:
        return (self.kernel.__name__, self.capability, *(repr(sorted(d.items())) for d in (
            self.signature, self.constexprs, self.attrs, self.options)))


def specialise(launch: Launch, capability: int) -> Specialisation:
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs, debug=launch.kwargs.get("debug", kernel.debug) or triton.knobs.runtime.debug)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return Specialisation(launch.name, kernel, capability, signature, constexprs, attrs, options.__dict__)


@dataclass
class Compiled:
    """What compiling one specialisation for one target gave, and what is wrong with it."""

    name: str
    kernel: str
    capability: int
    cpu_seconds: float = 0.0
    error: str | None = None
    int64_args: list[str] = field(default_factory=list)  # integers past int32: Triton passes them as i64
    shared: int = 0
    registers: int | None = None
    stack: int | None = None  # bytes of local memory per thread: register spills
    problems: list[str] = field(default_factory=list)


def compile_one(spec: Specialisation) -> Compiled:
    """Compile ``spec`` to a cubin and check it; a compile error is a finding, not raised."""
    start = _cpu_seconds()
    result = Compiled(spec.name, spec.kernel.__name__, spec.capability,
                      int64_args=[name for name, kind in spec.signature.items() if kind == "i64"])
    try:
        compiled = triton.compile(ASTSource(spec.kernel, spec.signature, spec.constexprs, spec.attrs),
                                  target=GPUTarget("cuda", spec.capability, 32), options=spec.options)
    except Exception as error:  # noqa: BLE001 - any compile failure is what this looks for
        result.error = f"{type(error).__name__}: {str(error).strip()[:2000]}"
        result.problems = [f"does not compile: {result.error}"]
    else:
        result.shared = int(compiled.metadata.shared)
        if REPORT_RESOURCES:
            result.registers, result.stack = _resources(compiled.asm["cubin"])
        result.problems = problems(spec, result.shared, compiled.asm["ptx"])
    result.cpu_seconds = _cpu_seconds() - start
    return result


def problems(spec: Specialisation, shared: int, ptx: str) -> list[str]:
    """What is wrong with a compiled specialisation, in words (empty: nothing)."""
    found = []
    limit = SHARED_MEMORY.get(divmod(spec.capability, 10))
    if limit is None:
        found.append(f"no shared-memory limit known for sm{spec.capability} (tiles.SHARED_MEMORY)")
    elif shared > limit:
        found.append(f"uses {shared:,} B of shared memory; a block gets {limit:,} B on sm{spec.capability}")
    if spec.options.get("enable_fp_fusion") is not False:
        found.append("launched without enable_fp_fusion=False: its rounding is left to Triton's default")
    if spec.kernel.__name__ in PRODUCT_KERNELS:
        fma = re.search(r"\bfma\.rn\.f32(x2)?\b", ptx) is not None  # sm100 also packs two: f32x2
        if spec.signature["L"] == "*fp32":
            if "tf32" in ptx:
                found.append("an fp32 product compiled to tf32 instructions (input_precision='ieee' expected)")
            elif not fma:
                found.append("an fp32 product without fp32 FMAs")
        elif fma:
            found.append("a 16-bit product's epilogue contracted into FMAs (enable_fp_fusion=False expected)")
    return found


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers per thread, stack bytes: the spills) from ``cuobjdump --dump-resource-usage``,
    which ships beside ptxas in the triton wheel; (None, None) where it cannot say."""
    try:
        tool = triton.knobs.nvidia.cuobjdump.path
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                  timeout=60).stdout
    except (AttributeError, OSError, subprocess.SubprocessError):
        return None, None
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return (int(found[1]), int(found[2])) if found else (None, None)


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas): a cost the load of a shared
    machine does not inflate, as wall time would."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


# ---------------------------------------------------------------------------- what is compiled


def launches(capability: int, scope: str) -> list[Launch]:
    """``"full"``: every product layout and every elementwise stage; ``"products"``: the products
    in :data:`EXTRA_TARGET_LAYOUTS`; else one of :data:`CONTROLS`."""
    cap = divmod(capability, 10)
    if scope == "full":
        return [*product_launches(cap), *elementwise_launches()]
    if scope == "products":
        return list(product_launches(cap, [x for x in PRODUCT_LAYOUTS if x[0] in EXTRA_TARGET_LAYOUTS]))
    return CONTROLS[scope](cap)


def _retuned(found: list[Launch], **kwargs) -> list[Launch]:
    return [replace(launch, kwargs={**launch.kwargs, **kwargs}) for launch in found]


# Breaks the checks must catch, each on the aligned layout: a tile too large for sm80's shared
# memory, a BLOCK that is not a power of two, an fp32 product on tf32, an epilogue contracted.
CONTROLS: dict[str, Callable[[tuple[int, int]], list[Launch]]] = {
    "tile 256x256x128": lambda cap: list(product_launches(cap, PRODUCT_LAYOUTS[:1], (BF16,),
                                                          [Tiles(256, 256, 128, num_warps=8, num_stages=4)])),
    "BLOCK 48": lambda cap: list(product_launches(cap, PRODUCT_LAYOUTS[:1], (BF16,),
                                                  [Tiles(48, 48, 64, num_warps=4, num_stages=3)])),
    "fp32 on tf32": lambda cap: _retuned(list(product_launches(cap, PRODUCT_LAYOUTS[:1], (F32,))),
                                         INPUT_PRECISION="tf32"),
    "fp fusion on": lambda cap: _retuned(list(product_launches(cap, PRODUCT_LAYOUTS[:1], (BF16,))),
                                         enable_fp_fusion=True),
}


def specialisations(capability: int, scope: str = "full") -> list[Specialisation]:
    """Every distinct specialisation the launches produce for sm``capability``, in order."""
    seen: dict[tuple, Specialisation] = {}
    for launch in launches(capability, scope):
        spec = specialise(launch, capability)
        seen.setdefault(spec.key(), spec)
    return list(seen.values())


def compile_all(specs: list[Specialisation], jobs: int = 1) -> list[Compiled]:
    """:func:`compile_one` of each, in ``jobs`` forked processes."""
    if jobs <= 1 or len(specs) <= 1:
        return [compile_one(s) for s in specs]
    global _SPECS
    _SPECS = specs  # inherited by the forked workers
    with ProcessPoolExecutor(jobs, mp_context=get_context("fork")) as pool:
        return list(pool.map(_compile_index, range(len(specs)), chunksize=4))


_SPECS: list[Specialisation] = []
# Registers and stack from cuobjdump: one process per specialisation, cached or not (--no-resources).
REPORT_RESOURCES = True


def _compile_index(i: int) -> Compiled:
    return compile_one(_SPECS[i])


def summary(results: list[Compiled]) -> str:
    """Per kernel: specialisations, CPU seconds, and the most shared memory, registers and stack."""
    lines = [f"  {'kernel':<26} {'cases':>5} {'cpu s':>6} {'shared B':>9} {'regs':>4} {'stack B':>7}"]
    for kernel in sorted({r.kernel for r in results}):
        mine = [r for r in results if r.kernel == kernel and r.error is None]
        peak = lambda attr: max((getattr(r, attr) or 0 for r in mine), default=0)  # noqa: E731
        lines.append(f"  {kernel:<26} {len(mine):>5} {sum(r.cpu_seconds for r in mine):>6.1f} "
                     f"{peak('shared'):>9,} {peak('registers'):>4} {peak('stack'):>7}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Compile every Triton kernel for GPUs this machine lacks.")
    parser.add_argument("capabilities", nargs="*", type=int, default=[80, 90, 100])
    parser.add_argument("--scope", default="full", choices=("full", "products", *CONTROLS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--resources", action=argparse.BooleanOptionalAction, default=True,
                        help="registers and spills from cuobjdump (default; not checked, only reported)")
    args = parser.parse_args(argv)
    global REPORT_RESOURCES
    REPORT_RESOURCES = args.resources
    results = []
    for capability in args.capabilities:
        start = time.perf_counter()
        mine = compile_all(specialisations(capability, args.scope), args.jobs)
        results += mine
        print(f"sm{capability} ({args.scope}): {len(mine)} specialisations, {time.perf_counter() - start:.1f} s wall, "
              f"{sum(r.cpu_seconds for r in mine):.1f} s CPU (Triton {triton.__version__}, {args.jobs} jobs)")
        print(summary(mine))
        for r in mine:
            if r.problems:
                print(f"  PROBLEM {r.name}: {'; '.join(r.problems)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
