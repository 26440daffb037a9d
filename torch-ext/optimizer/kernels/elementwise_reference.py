"""Plain torch versions of the fused elementwise kernels (elementwise_kernel.py), with their
signatures and their arithmetic, rounding for rounding: they define what the kernels compute and
are the ``"torch"`` backend of ``kernels/elementwise.py`` (which checks the operands first).

The arithmetic is torch's own for these stages (``rule.momentum_``, ``rule.nesterov_input_``,
``rule.apply_update_``), op for op, in fp32 (torch's "opmath" for fp16/bf16/fp32 tensors):

* ``lerp(start, end, w)`` as aten/src/ATen/native/Lerp.h computes it: two formulas chosen by
  ``|w| < 0.5``, ``start + w (end - start)`` or ``end - (end - start)(1 - w)``, each one fused
  multiply-add (the CUDA build contracts them, the CPU kernel calls ``fmadd``), w rounded to fp32;
* the momentum stored in its own dtype (rounded once), and read back as stored for the Nesterov
  input, which is rounded to the momentum's arithmetic dtype and then stored in ``out``'s;
* ``param * (1 - lr wd)`` (or cautious: ``param + (-lr wd) param`` where ``param * update >= 0``,
  the product rounded first for a float lr, one FMA for a tensor lr, as torch's ``addcmul_`` with
  the factor in ``value`` or in the mask computes them) rounded to the parameter's dtype, as
  torch's first in-place pass stores it; then
  ``param + (-adjusted_lr) update`` as one fused multiply-add (torch's ``add_(alpha=...)``).

An fp32 fused multiply-add is computed exactly here (:func:`fma32`: the exact product in fp64,
the sum rounded to odd, then to fp32), so these references do not depend on whether the CPU's
compiler contracted anything.
"""

from __future__ import annotations

import torch
from torch import Tensor

ACC = torch.float32  # the arithmetic dtype of every fused stage (torch's opmath for 16/32-bit floats)


def fma32(a: Tensor | float, b: Tensor | float, c: Tensor | float) -> Tensor:
    """``a * b + c`` rounded once to fp32 (fp32 operands, broadcast).

    ``a * b`` is exact in fp64 (24 + 24 bits); the fp64 sum is rounded to odd (an inexact sum
    whose last bit is even moves one ulp towards the exact value, found by TwoSum), and a value
    rounded to odd with two or more extra bits rounds to nearest exactly as the exact value would.
    """
    a64, b64, c64 = (torch.as_tensor(x, dtype=ACC).double() for x in (a, b, c))
    product = a64 * b64
    total = product + c64
    back = total - product
    error = (product - (total - back)) + (c64 - back)  # TwoSum: total + error == product + c64
    even = (total.view(torch.int64) & 1) == 0
    towards = torch.where(error > 0, torch.inf, -torch.inf).to(torch.float64)
    odd = torch.where((error != 0) & even & torch.isfinite(total), torch.nextafter(total, towards), total)
    return odd.to(ACC)


def lerp32(start: Tensor, end: Tensor, weight: float) -> Tensor:
    """torch's lerp of fp32 tensors with a scalar weight (Lerp.h's two branches, each one FMA)."""
    w = torch.tensor(weight, dtype=ACC)
    diff = end - start
    if abs(w.item()) < 0.5:
        return fma32(diff, w, start)
    return fma32(diff, w - 1, end)


def momentum_nesterov_reference(
    buf: Tensor, grad: Tensor, out: Tensor | None, momentum: float, nesterov: bool, maximize: bool, *,
    update_momentum: bool = True, dtype: torch.dtype | None = None,
) -> Tensor | None:
    """``buf <- lerp(buf, g, 1 - momentum)`` (``g = -grad`` when maximising), stored in buf's
    dtype, then ``out <- lerp(g, buf, momentum)`` (``buf`` without Nesterov) from buf as stored,
    rounded to ``dtype`` (the momentum's arithmetic dtype; default the wider of buf's and grad's)
    and stored in out's. ``update_momentum=False``: buf is this step's already, only ``out`` is
    formed. ``out=None``: only the momentum. Returns ``out``."""
    work = dtype or torch.promote_types(buf.dtype, grad.dtype)
    g = grad.to(ACC)
    if maximize:
        g = -g
    if update_momentum:
        buf.copy_(lerp32(buf.to(ACC), g, 1 - momentum))
    if out is None:
        return None
    b = buf.to(ACC)
    x = lerp32(g, b, momentum) if nesterov else b
    return out.copy_(x.to(work))


def apply_update_reference(
    param: Tensor, update: Tensor, lr: float | Tensor, adjusted_lr: float | Tensor, weight_decay: float,
    cautious: bool = False,
) -> None:
    """``param <- decayed(param) - adjusted_lr * update`` in fp32, the decayed parameter rounded to
    its dtype first (torch's two passes), the update added with one fused multiply-add; the update
    read in its own dtype. Decay (weight decay with the unadjusted ``lr``): ``param * (1 - lr wd)``,
    or, ``cautious``, ``param + (-lr wd) param`` only where ``param * update >= 0``. ``lr`` and
    ``adjusted_lr`` may be 0-d tensors: their factors are formed by :func:`decay_factor` and read
    as fp32."""
    p, u = param.to(ACC), update.to(ACC)
    if weight_decay != 0:
        f = as_fp32(decay_factor(lr, weight_decay, cautious))
        if cautious and isinstance(lr, Tensor):  # torch: addcmul_(p, mask * lr wd, value=-1), one FMA
            p = torch.where(p * u >= 0, fma32(p, f, p), p)
        elif cautious:  # torch: addcmul_(p, mask, value=-lr wd), the product rounded first
            p = torch.where(p * u >= 0, p + f * p, p)
        else:
            p = p * f
        p = p.to(param.dtype).to(ACC)
    param.copy_(fma32(u, -as_fp32(adjusted_lr), p))


def decay_factor(lr: float | Tensor, weight_decay: float, cautious: bool) -> float | Tensor:
    """What weight decay multiplies the parameter by: ``1 - lr wd``, or for cautious decay the term
    added where the mask holds, ``-(lr wd)``; a Python float for a float ``lr`` (fp64, rounded to
    fp32 when used), a 0-d tensor in ``lr``'s dtype on ``lr``'s device for a tensor (formed by torch
    there, as ``rule.apply_update_`` forms it: never read on the host)."""
    if cautious:
        return -(lr * weight_decay)
    return 1 - lr * weight_decay


def as_fp32(value: float | Tensor) -> Tensor:
    """A float (as a CPU tensor) or a 0-d tensor (where it is: never read on the host) in fp32."""
    if isinstance(value, Tensor):
        return value.detach().to(ACC)
    return torch.tensor(value, dtype=ACC)
