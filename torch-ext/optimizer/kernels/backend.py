"""Where the Triton kernels can run, and which implementation a call gets.

Backends: ``"triton"`` (the kernels; on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``),
``"torch"`` (the plain torch implementations in reference.py, everywhere), ``"auto"`` (Triton
on CUDA GPUs it supports, torch elsewhere; the interpreter is never picked automatically: it is
for tests). Triton is imported lazily, only here and by the kernel modules, so ``import
optimizer`` works without it.
"""

from __future__ import annotations

import importlib
import os
import sys
from functools import lru_cache

import torch

BACKENDS = ("auto", "torch", "triton")

# Operand dtypes the Triton kernels take (tl.dot with fp32 accumulation).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# tl.dot on bf16 needs sm80 (Ampere) or newer; the tile rule (tiles.py) assumes NVIDIA sm80+.
MIN_CAPABILITY = (8, 0)


def check_backend(backend) -> str:
    """``backend`` if it is one of :data:`BACKENDS`, else a ValueError naming them."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r} "
            '("auto": the Triton kernels on supported CUDA GPUs, torch elsewhere; "torch": always '
            'torch; "triton": always the kernels, on CPU under TRITON_INTERPRET=1)'
        )
    return backend


@lru_cache(maxsize=1)
def triton_import_error() -> str | None:
    """None if ``import triton`` works, else why not (cached: one attempt per process)."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except ImportError as error:
        return f"the triton package does not import ({error})"
    return None


def interpreting() -> bool:
    """True if Triton would run kernels under its interpreter (``TRITON_INTERPRET``), which Triton
    reads when a kernel is defined; the kernel modules record it at their import."""
    try:
        from triton import knobs  # Triton >= 3.4 reads its environment through knobs
    except ImportError:
        knobs = None
    runtime = getattr(knobs, "runtime", None)
    if runtime is not None and hasattr(runtime, "interpret"):
        return bool(runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@lru_cache(maxsize=64)
def cuda_properties(index: int) -> tuple[tuple[int, int], int, bool]:
    """(compute capability, SM count, is ROCm) of CUDA device ``index``, cached."""
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count, torch.version.hip is not None


def unavailable_reason(device: torch.device | str, dtype: torch.dtype | None = None,
                       kind: str = "products") -> str | None:
    """None if the Triton kernels (``kind``: "products", or the fused "elementwise" stages) can
    run on ``device`` (and ``dtype``, if given), else why not, in words fit for an error message.
    On a CUDA GPU this includes their first-use check (self_check.py: compiled and compared with
    fp64 once per process, device, kind and dtype; products only once a dtype is given)."""
    device = torch.device(device)
    if dtype is not None and dtype not in KERNEL_DTYPES:
        return f"the kernels take float16, bfloat16 and float32 operands, not {dtype}"
    missing = triton_import_error()
    if missing is not None:
        return missing + " (CUDA builds of torch install it; pip install triton otherwise)"
    if device.type == "cpu":
        if not interpreting():
            return "CPU tensors run the kernels only under Triton's interpreter: set TRITON_INTERPRET=1 before importing triton"
        if _loaded_compiled():
            return (
                "Triton was imported before TRITON_INTERPRET=1 was set, so its functions were defined "
                "for a GPU; set it before anything imports triton (torch._dynamo does)"
            )
        return None
    if device.type != "cuda":
        return f"the kernels run on CUDA GPUs (or CPU under TRITON_INTERPRET=1), not on {device.type}"
    if interpreting():
        return "TRITON_INTERPRET=1 is set, which runs kernels on the CPU; unset it for CUDA tensors"
    capability, _, rocm = cuda_properties(_index(device))
    if rocm:
        return "the kernels' tiles are chosen for NVIDIA GPUs; ROCm is not supported (use the torch backend)"
    if capability < MIN_CAPABILITY:
        return f"the kernels need compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer, got {capability[0]}.{capability[1]}"
    if kind == "products" and dtype is None:
        return None
    from . import self_check

    return self_check.failure(kind, device, dtype)


def available(device: torch.device | str = "cuda", dtype: torch.dtype | None = None, kind: str = "products") -> bool:
    """True if ``backend="triton"`` can run on ``device``: Triton imports and the device is a CUDA
    GPU of compute capability 8.0+ where the kernels passed their first-use check, or the CPU with
    ``TRITON_INTERPRET=1``."""
    return unavailable_reason(device, dtype, kind) is None


def resolve(backend: str, device: torch.device | str, dtype: torch.dtype | None = None,
            kind: str = "products") -> str:
    """``"triton"`` or ``"torch"`` for one call of the ``kind`` kernels (on operands of ``dtype``,
    where the call's kind limits it); raises if ``"triton"`` was asked for and cannot run."""
    check_backend(backend)
    device = torch.device(device)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if device.type != "cuda" or (dtype is not None and dtype not in KERNEL_DTYPES):
            return "torch"
        return "triton" if unavailable_reason(device, dtype, kind) is None else "torch"
    reason = unavailable_reason(device, dtype, kind)
    if reason is not None:
        raise RuntimeError(f"backend='triton' cannot run on {device}: {reason}. Use backend='torch' or 'auto'.")
    return "triton"


def device_key(device: torch.device) -> tuple[tuple[int, int] | None, int]:
    """(capability, SM count) for the tile rule; (None, 1) under the interpreter."""
    if device.type != "cuda":
        return None, 1
    capability, sm_count, _ = cuda_properties(_index(device))
    return capability, sm_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _loaded_compiled() -> bool:
    """True if Triton's library functions (``tl.zeros`` is one) or a kernel module were defined
    for a GPU, i.e. imported before TRITON_INTERPRET was set: the interpreter cannot run them."""
    zeros = getattr(sys.modules.get("triton.language"), "zeros", None)
    if zeros is not None and type(zeros).__name__ == "JITFunction":
        return True
    for name in ("symmetric_kernel", "matmul_add_kernel", "elementwise_kernel"):
        module = sys.modules.get(f"{__package__}.{name}")
        if module is not None and not module.INTERPRETED:
            return True
    return False
