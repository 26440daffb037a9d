"""Which implementation runs Newton–Schulz's matrix products: the ``ns_kernels`` option.

* ``"auto"`` (default): the Triton kernels of :mod:`optimizer.kernels` on CUDA GPUs they support
  (NVIDIA, compute capability 8.0+, Triton importable), torch's matmuls everywhere else (on the CPU
  with its symmetric-block shortcut, ``newton_schulz._symmetric_product``).
* ``"torch"``: torch's matmuls everywhere (cuBLAS on CUDA), as before the kernels existed.
* ``"triton"``: the kernels everywhere they can run: CUDA, or CPU tensors under Triton's interpreter
  (``TRITON_INTERPRET=1`` set before anything imports Triton; slow, for tests). Where they cannot
  run, the optimizer refuses the group when it is added and a step before anything changes, with
  the reason (:func:`kernels_problem`).

The two implementations compute the same polynomial in the same order; they differ in rounding
only (the kernels round each product once from an fp32 accumulation and return its lower
triangle mirrored). Every rank of a run holds the same value (the option is agreed like every
other); with ``"auto"``, ranks on the same kind of GPU with the same Triton resolve alike.
"""

from __future__ import annotations

import torch

from .kernels.backend import BACKENDS

# The option's values are the kernel dispatcher's backends, with the same meaning (kernels/backend.py).
NS_KERNELS = BACKENDS


def check_ns_kernels(value) -> str:
    """``value`` if it is one of :data:`NS_KERNELS`, else a ValueError saying what each means."""
    if not isinstance(value, str) or value not in NS_KERNELS:
        raise ValueError(
            f"ns_kernels must be one of {', '.join(map(repr, NS_KERNELS))}, got {value!r} "
            '("auto": the Triton kernels on supported CUDA GPUs, torch elsewhere; "torch": torch\'s matmuls '
            'everywhere; "triton": the kernels, on CPU only under TRITON_INTERPRET=1)'
        )
    return value


def kernels_problem(mode: str, device: torch.device | str, compute_dtype: torch.dtype) -> str | None:
    """Why Newton–Schulz with ``ns_kernels=mode`` cannot run on ``device`` in ``compute_dtype``
    (None: it can). Only ``"triton"`` can fail: ``"auto"`` falls back to torch.

    On a CUDA GPU this also runs the kernels' first-use check (kernels/self_check.py: the products
    in ``compute_dtype`` and the fused elementwise stages, compiled and compared with fp64, once per
    process), for ``"auto"`` as well: the optimizer asks when a group is added, so the check runs
    before any step, outside any compiled region or captured graph, and a kernel that fails it
    makes ``"auto"`` use torch there (with a warning) and ``"triton"`` refuse the group."""
    if check_ns_kernels(mode) == "torch" or (mode == "auto" and torch.device(device).type != "cuda"):
        return None
    from .kernels import unavailable_reason

    reason = (unavailable_reason(device, compute_dtype, kind="products")
              or unavailable_reason(device, kind="elementwise"))
    if reason is None or mode == "auto":
        return None
    return (f"ns_kernels='triton' cannot run Newton–Schulz on {torch.device(device)} in {compute_dtype}: {reason}; "
            "use ns_kernels='auto' (the kernels where they run, torch elsewhere) or 'torch'")


def shape_problem(mode: str, shape: tuple[int, ...]) -> str | None:
    """Why ``ns_kernels=mode`` cannot run the Newton–Schulz products of a parameter of ``shape``
    (its global shape; matrices are the last two dims), or None. Only ``"triton"`` can fail:
    ``"auto"`` runs a product the kernels cannot address on torch (kernels/addressing.py: 32-bit
    offsets inside one matrix)."""
    if check_ns_kernels(mode) != "triton":
        return None
    from .kernels.addressing import newton_schulz_problem

    problem = newton_schulz_problem(tuple(shape))
    if problem is None:
        return None
    return (f"ns_kernels='triton' cannot run Newton–Schulz on its {tuple(shape[-2:])} matrices: {problem}; "
            "use ns_kernels='auto' (torch's matmuls for such matrices) or 'torch'")


def resolve(mode: str, device: torch.device, compute_dtype: torch.dtype) -> str:
    """``"triton"`` or ``"torch"``: what one Newton–Schulz call on ``device`` runs. Raises a
    RuntimeError with :func:`kernels_problem`'s reason if ``"triton"`` was asked for and cannot run."""
    check_ns_kernels(mode)
    if mode == "torch" or (mode == "auto" and torch.device(device).type != "cuda"):
        return "torch"
    from .kernels import backend

    if mode == "auto":
        return backend.resolve("auto", torch.device(device), compute_dtype)
    problem = kernels_problem(mode, device, compute_dtype)
    if problem is not None:
        raise RuntimeError(problem)
    return "triton"
