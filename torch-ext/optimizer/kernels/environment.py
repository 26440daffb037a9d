"""What this process and its devices offer the Triton kernels: whether Triton imports, whether it
runs kernels under its interpreter, a CUDA device's capability. A leaf: it imports nothing of the
package, so the kernel modules and the decision (backend.py) both read it without a cycle.
"""

from __future__ import annotations

import importlib
import os
import sys
from functools import lru_cache

import torch

# The kernel modules, which record at their import whether Triton defined them for the interpreter.
KERNEL_MODULES = ("symmetric_kernel", "matmul_add_kernel", "elementwise_kernel")


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


def loaded_compiled() -> bool:
    """True if Triton's library functions (``tl.zeros`` is one) or a kernel module were defined
    for a GPU, i.e. imported before TRITON_INTERPRET was set: the interpreter cannot run them."""
    zeros = getattr(sys.modules.get("triton.language"), "zeros", None)
    if zeros is not None and type(zeros).__name__ == "JITFunction":
        return True
    for name in KERNEL_MODULES:
        module = sys.modules.get(f"{__package__}.{name}")
        if module is not None and not module.INTERPRETED:
            return True
    return False


@lru_cache(maxsize=64)
def cuda_properties(index: int) -> tuple[tuple[int, int], int, bool]:
    """(compute capability, SM count, is ROCm) of CUDA device ``index``, cached."""
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count, torch.version.hip is not None


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_key(device: torch.device) -> tuple[tuple[int, int] | None, int]:
    """(capability, SM count) for the tile rule; (None, 1) under the interpreter."""
    if device.type != "cuda":
        return None, 1
    capability, sm_count, _ = cuda_properties(device_index(device))
    return capability, sm_count
