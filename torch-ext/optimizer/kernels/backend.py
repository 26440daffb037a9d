"""Which implementation runs: the one place that decides, for a call and for an optimizer group.

Backends: ``"triton"`` (the kernels; on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``),
``"torch"`` (the plain torch implementations in reference.py, everywhere), ``"auto"`` (Triton
on CUDA GPUs it supports, torch elsewhere; the interpreter is never picked automatically: it is
for tests). :func:`choose` decides for a device (whether the kernels run there, including their
first-use check, self_check.py); :class:`ProductRoute` then decides per product, from shapes and
strides alone: the ``"auto"`` rules (a symmetric product on the kernels from two tile rows up, a
general one on torch) and the addressing rule (addressing.py). The public functions
(``kernels/__init__.py``, elementwise.py) ask per call; the optimizer asks once per group
(``newton_schulz/implementation.py``) and keeps the answer. Triton is imported lazily, only by
environment.py and the kernel modules, so ``import optimizer`` works without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import environment
from .addressing import product_problem
from .tiles import Tiles, choose_tiles, tile_rows

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


def auto_takes_kernels(device: torch.device) -> bool:
    """Whether ``"auto"`` considers the kernels on ``device`` at all: CUDA devices only."""
    return device.type == "cuda"


def unavailable_reason(device: torch.device | str, dtype: torch.dtype | None = None,
                       kind: str = "products") -> str | None:
    """None if the Triton kernels (``kind``: "products", or the fused "elementwise" stages) can
    run on ``device`` (and ``dtype``, if given), else why not, in words fit for an error message.
    On a CUDA GPU this includes their first-use check (self_check.py: compiled and compared with
    fp64 once per process, device, kind and dtype; products only once a dtype is given)."""
    device = torch.device(device)
    if dtype is not None and dtype not in KERNEL_DTYPES:
        return f"the kernels take float16, bfloat16 and float32 operands, not {dtype}"
    missing = environment.triton_import_error()
    if missing is not None:
        return missing + " (CUDA builds of torch install it; pip install triton otherwise)"
    if device.type == "cpu":
        if not environment.interpreting():
            return "CPU tensors run the kernels only under Triton's interpreter: set TRITON_INTERPRET=1 before importing triton"
        if environment.loaded_compiled():
            return (
                "Triton was imported before TRITON_INTERPRET=1 was set, so its functions were defined "
                "for a GPU; set it before anything imports triton (torch._dynamo does)"
            )
        return None
    if device.type != "cuda":
        return f"the kernels run on CUDA GPUs (or CPU under TRITON_INTERPRET=1), not on {device.type}"
    if environment.interpreting():
        return "TRITON_INTERPRET=1 is set, which runs kernels on the CPU; unset it for CUDA tensors"
    capability, _, rocm = environment.cuda_properties(environment.device_index(device))
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


def choose(backend: str, device: torch.device | str, dtype: torch.dtype | None = None,
           kind: str = "products") -> tuple[str, str | None]:
    """``("triton" or "torch", why "triton" cannot run or None)`` for the ``kind`` kernels on
    ``device`` (operands of ``dtype``, where the kind limits it). ``"auto"`` falls back to torch
    without a reason; ``"triton"`` where the kernels cannot run gives ``("torch", reason)``."""
    check_backend(backend)
    device = torch.device(device)
    if backend == "torch":
        return "torch", None
    if backend == "auto":
        if not auto_takes_kernels(device) or (dtype is not None and dtype not in KERNEL_DTYPES):
            return "torch", None
        return ("triton" if unavailable_reason(device, dtype, kind) is None else "torch"), None
    reason = unavailable_reason(device, dtype, kind)
    return ("torch", reason) if reason is not None else ("triton", None)


def resolve(backend: str, device: torch.device | str, dtype: torch.dtype | None = None,
            kind: str = "products") -> str:
    """``"triton"`` or ``"torch"`` for one call of the ``kind`` kernels (:func:`choose`); raises
    if ``"triton"`` was asked for and cannot run."""
    impl, reason = choose(backend, device, dtype, kind)
    if reason is not None:
        raise RuntimeError(f"backend='triton' cannot run on {torch.device(device)}: {reason}. "
                           "Use backend='torch' or 'auto'.")
    return impl


@dataclass(frozen=True)
class ProductRoute:
    """Where each product goes once the kernels were chosen for a device: the tiles to launch it
    with, or None for torch. ``backend``: ``"auto"`` (symmetric products on the kernels from two
    tile rows up, where the kernels cannot address the operands torch; general products on torch,
    whose cuBLAS fuses the ``beta C`` term already: matmul_add_kernel.py) or ``"triton"`` (every
    product on the kernels, operands they cannot address refused). ``device_key``: the tile rule's
    view of the device (environment.device_key), read once."""

    backend: str
    device_key: tuple[tuple[int, int] | None, int]

    def symmetric(self, L: Tensor, R: Tensor, C: Tensor | None, beta: float, out: Tensor | None) -> Tiles | None:
        """The tiles of ``beta C + alpha L R`` (symmetric), or None: torch."""
        if not self._addressable("symmetric_matmul", L, R, C, beta, out):
            return None
        m, k = L.shape[-2:]
        tiles = choose_tiles("symmetric", L.shape[0] if L.ndim == 3 else 1, m, m, k, L.dtype, *self.device_key)
        if self.backend == "auto" and tile_rows(m, tiles) < 2:  # one tile row: nothing to skip
            return None
        return tiles

    def general(self, L: Tensor, R: Tensor, C: Tensor | None, beta: float, out: Tensor | None) -> Tiles | None:
        """The tiles of ``beta C + alpha L R`` (general), or None: torch."""
        if self.backend == "auto" or not self._addressable("matmul_add", L, R, C, beta, out):
            return None
        m, k = L.shape[-2:]
        return choose_tiles("general", L.shape[0] if L.ndim == 3 else 1, m, R.shape[-1], k, L.dtype,
                            *self.device_key)

    def _addressable(self, name: str, L: Tensor, R: Tensor, C: Tensor | None, beta: float,
                     out: Tensor | None) -> bool:
        """Whether the kernels can address the operands (addressing.product_problem); under
        ``"triton"`` a product they cannot is a ValueError, raised before anything runs."""
        layout = lambda t: None if t is None else (tuple(t.shape), t.stride())  # noqa: E731
        problem = product_problem(layout(L), layout(R), layout(C) if beta != 0 else None, layout(out))
        if problem is None:
            return True
        if self.backend == "triton":
            raise ValueError(f"{name}: backend='triton' cannot run this product: {problem}; use backend='auto' "
                             "(torch's matmul for such operands) or 'torch'")
        return False
