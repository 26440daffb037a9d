"""The fused elementwise stages of a Muon step: checks, where they run, and the calls.

    from optimizer.kernels import elementwise
    elementwise.momentum_nesterov_(buf, grad, x, momentum=0.95, nesterov=True, maximize=False)
    elementwise.apply_update_(param, update, lr=0.02, adjusted_lr=0.1, weight_decay=0.1)

``backend`` as for the products (backend.py): ``"auto"`` the Triton kernels on supported CUDA GPUs,
torch elsewhere; ``"torch"`` the references (elementwise_reference.py); ``"triton"`` the kernels,
also on CPU under ``TRITON_INTERPRET=1``, a RuntimeError saying why where they cannot run. Both
backends compute the same numbers (the references define the kernels' arithmetic). Every operand
is checked before anything is written (a ValueError naming it). docs/kernels.md has the details.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

from . import backend as kernel_backend
from .elementwise_reference import apply_update_reference, decay_factor, momentum_nesterov_reference
from .operands import _overlap

# What the fused stages take: their arithmetic is fp32 (torch's opmath for these); an fp64 step
# keeps the torch formulas (rule/formulas.py), which compute it in fp64.
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_DIMS = 3


def takes(*dtypes: torch.dtype) -> bool:
    """Whether the fused stages take operands of these dtypes."""
    return all(d in FUSED_DTYPES for d in dtypes)


def momentum_nesterov_(
    buf: Tensor,
    grad: Tensor,
    out: Tensor | None,
    momentum: float,
    nesterov: bool,
    maximize: bool = False,
    *,
    update_momentum: bool = True,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> Tensor | None:
    """The momentum and the Nesterov input in one pass over a piece:

        g = -grad if maximize else grad
        buf <- lerp(buf, g, 1 - momentum)             stored in buf's dtype (rounded once)
        out <- lerp(g, buf, momentum)  or  buf        from buf as stored; in ``dtype``, then out's

    ``dtype``: the momentum's arithmetic dtype (default: the wider of buf's and grad's; fp32
    arithmetic either way, a 16-bit one rounds the input once more, where torch forms it).
    ``out=None``: the momentum only. ``update_momentum=False``: buf already holds this step's
    momentum; only ``out`` is formed. Operands: one shape of at most 3 dims, any strides,
    fp16/bf16/fp32, one device; out must not share memory with buf or grad. Returns ``out``.
    """
    _check_momentum(buf, grad, out, momentum, dtype)
    if kernel_backend.resolve(backend, buf.device, kind="elementwise") == "torch":
        return momentum_nesterov_reference(buf, grad, out, momentum, nesterov, maximize,
                                           update_momentum=update_momentum, dtype=dtype)
    return _momentum_nesterov_kernel(buf, grad, out, momentum, nesterov, maximize, update_momentum, dtype)


def momentum_nesterov_on_kernels_(buf: Tensor, grad: Tensor, out: Tensor | None, momentum: float, nesterov: bool,
                                  maximize: bool = False, *, update_momentum: bool = True,
                                  dtype: torch.dtype | None = None) -> Tensor | None:
    """:func:`momentum_nesterov_` on the kernels, for a caller that chose them once already (an
    optimizer group whose ``ns_kernels`` resolved to them): the operands checked, nothing resolved."""
    _check_momentum(buf, grad, out, momentum, dtype)
    return _momentum_nesterov_kernel(buf, grad, out, momentum, nesterov, maximize, update_momentum, dtype)


def _momentum_nesterov_kernel(buf, grad, out, momentum, nesterov, maximize, update_momentum, dtype):
    from .elementwise_kernel import momentum_nesterov_triton

    return momentum_nesterov_triton(buf, grad, out, momentum, nesterov, maximize,
                                    update_momentum=update_momentum, dtype=dtype)


def apply_update_(
    param: Tensor,
    update: Tensor,
    lr: float | Tensor,
    adjusted_lr: float | Tensor,
    weight_decay: float,
    cautious: bool = False,
    *,
    backend: str = "auto",
) -> None:
    """Weight decay and the update in one pass over a piece:

        param <- param (1 - lr wd)  [cautious: param - lr wd param where param * update >= 0]
        param <- param - adjusted_lr * update

    as ``rule.apply_update_`` (decay with the unadjusted ``lr``, the update in its own dtype).
    ``lr`` and ``adjusted_lr`` may be 0-d tensors (schedulers, compiled steps): their factors are
    formed by torch on their device and the kernel loads them (no host read); a CPU tensor for a
    GPU parameter is read on the host, as torch reads a CPU scalar. Operands: one shape of at most
    3 dims, any strides, fp16/bf16/fp32, one device, not sharing memory.
    """
    _check_update(param, update, lr, adjusted_lr, weight_decay)
    if kernel_backend.resolve(backend, param.device, kind="elementwise") == "torch":
        apply_update_reference(param, update, lr, adjusted_lr, weight_decay, cautious)
        return
    _apply_update_kernel(param, update, lr, adjusted_lr, weight_decay, cautious)


def apply_update_on_kernels_(param: Tensor, update: Tensor, lr: float | Tensor, adjusted_lr: float | Tensor,
                             weight_decay: float, cautious: bool = False) -> None:
    """:func:`apply_update_` on the kernels, for a caller that chose them once already (an
    optimizer group whose ``ns_kernels`` resolved to them): the operands checked, nothing resolved."""
    _check_update(param, update, lr, adjusted_lr, weight_decay)
    _apply_update_kernel(param, update, lr, adjusted_lr, weight_decay, cautious)


def _apply_update_kernel(param, update, lr, adjusted_lr, weight_decay, cautious) -> None:
    from .elementwise_kernel import apply_update_triton

    factor = decay_factor(lr, weight_decay, cautious) if weight_decay != 0 else None
    apply_update_triton(param, update, _on(factor, param.device), _on(adjusted_lr, param.device), cautious)


def _on(value, device: torch.device):
    """A 0-d tensor where the kernel can load it, or a float: a CPU tensor for a GPU kernel is read
    on the host (no device synchronisation: it is on the host), as torch reads a CPU scalar."""
    if isinstance(value, Tensor) and value.device != device and value.device.type == "cpu":
        return float(value)
    return value


# ---------------------------------------------------------------------------- checks


def _check_momentum(buf, grad, out, momentum, dtype) -> None:
    name = "momentum_nesterov_"
    _tensor(name, "buf", buf)
    for arg, t in (("grad", grad), ("out", out)):
        if arg == "out" and t is None:
            continue
        _tensor(name, arg, t)
        _like(name, arg, t, "buf", buf)
    _real(name, "momentum", momentum)
    if dtype is not None and dtype not in FUSED_DTYPES:
        raise ValueError(f"{name}: dtype must be one of {_names()}, got {dtype}")
    if _overlap(buf, grad):
        raise ValueError(f"{name}: grad shares memory with buf, which the kernel writes; pass a separate grad")
    if out is not None:
        for arg, t in (("buf", buf), ("grad", grad)):
            if _overlap(out, t):
                raise ValueError(f"{name}: out shares memory with {arg} (their memory ranges overlap); pass a separate out")


def _check_update(param, update, lr, adjusted_lr, weight_decay) -> None:
    name = "apply_update_"
    _tensor(name, "param", param)
    _tensor(name, "update", update)
    _like(name, "update", update, "param", param)
    _real(name, "weight_decay", weight_decay)
    for arg, value in (("lr", lr), ("adjusted_lr", adjusted_lr)):
        if isinstance(value, Tensor):
            if value.ndim != 0 or not value.is_floating_point():
                raise ValueError(f"{name}: {arg} must be a float or a 0-d floating tensor, got a tensor of shape "
                                 f"{tuple(value.shape)} and dtype {value.dtype}")
            if value.device != param.device and value.device.type != "cpu":
                raise ValueError(f"{name}: {arg} is on {value.device}, the parameter on {param.device}")
        else:
            _real(name, arg, value)
    if _overlap(param, update):
        raise ValueError(f"{name}: update shares memory with param, which the kernel writes; pass a separate update")


def _tensor(name: str, arg: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: {arg} must be a tensor, got {type(t).__name__}")
    if t.dtype not in FUSED_DTYPES:
        raise ValueError(f"{name}: {arg} must be one of {_names()}, got {t.dtype} (fp64 steps keep the torch formulas)")
    if t.ndim > MAX_DIMS:
        raise ValueError(f"{name}: {arg} must have at most {MAX_DIMS} dims, got shape {tuple(t.shape)}")


def _like(name: str, arg: str, t: Tensor, ref_arg: str, ref: Tensor) -> None:
    if t.shape != ref.shape:
        raise ValueError(f"{name}: {arg} must have {ref_arg}'s shape {tuple(ref.shape)}, got {tuple(t.shape)}")
    if t.device != ref.device:
        raise ValueError(f"{name}: {arg} is on {t.device}, {ref_arg} on {ref.device}")


def _real(name: str, arg: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name}: {arg} must be a finite real number, got {value!r}")


def _names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in FUSED_DTYPES)
