"""Lion for ``algorithm="lion"`` groups (``use_muon=False``), as dion's ``scalar_opts.lion_update`` defines it.

Lion (Chen et al., arXiv 2302.06675), for one group's parameters:

    U <- sign(beta1 M + (1 - beta1) G)        the update: every entry -1, 0 or +1 (sign(0) = 0)
    M <- beta2 M + (1 - beta2) G              the momentum, after the update is read
    W <- W (1 - lr wd) - lr U                 decoupled weight decay; lr is never adjusted

``maximize`` negates ``G`` first; ``cautious_wd`` decays only where ``W U >= 0`` (dion's mask
``min(sign(W U) + 1, 1)``; ``rule.apply_update_``).  The momentum is stored as the parameter
(``exp_avg``, created at zero), and ``G`` is read in its dtype, as dion reads it.  Elementwise,
so a DTensor parameter is stepped on its local piece with no communication, and a 1-element
tensor ``lr`` is used as a tensor (never read on the host).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import torch
from torch import Tensor

from .rule import apply_update_
from .tensors import local_view

LION_STATE_KEYS = ("exp_avg",)


def lion_step_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], *, lr: float | Tensor,
               betas: tuple[float, float], weight_decay: float, maximize: bool = False,
               cautious: bool = False) -> None:
    """One Lion step, in place, for parallel lists of local tensors (see the module docstring)."""
    beta1, beta2 = betas
    for p, g, m in zip(params, grads, exp_avgs):
        g = g.to(m.dtype)
        if maximize:
            g = -g
        update = torch.lerp(m, g, 1 - beta1).sign_()
        m.lerp_(g, 1 - beta2)
        apply_update_(p, update, lr, lr, weight_decay, cautious)


def lion_group_step_(group: Mapping, state: MutableMapping) -> None:
    """One Lion step for the parameters of ``group`` that have a gradient, creating their
    ``exp_avg`` (zeros like the parameter: a DTensor keeps its placements) on first use."""
    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return
    bufs = []
    for p in params:
        entry = state.setdefault(p, {})
        if "exp_avg" not in entry:
            entry["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        bufs.append(local_view(entry["exp_avg"]))
    lion_step_([local_view(p) for p in params], [local_view(p.grad) for p in params], bufs, lr=group["lr"],
               betas=tuple(group["betas"]), weight_decay=group["weight_decay"],
               maximize=bool(group.get("maximize", False)), cautious=bool(group.get("cautious_wd", False)))
