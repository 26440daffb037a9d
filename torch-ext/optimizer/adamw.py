"""The AdamW path for parameters Muon does not handle (norms, biases, embeddings, heads).

We call torch's functional ``torch.optim.adamw.adamw`` rather than re-deriving Adam, so the
numbers are exactly torch.optim.AdamW's. The only choices made here are the implementation
(fused on CUDA, foreach elsewhere) and how tensors are batched: torch's foreach/fused ops
dispatch on DTensor (sharding propagation handles them as pointwise), but one call must not mix
plain tensors with DTensors, or DTensors on different meshes, so we split into such groups.

Two ordinary torch-optimizer habits need a choice of implementation, and we make the one
torch.optim.AdamW makes:

* ``lr`` as a 1-element Tensor (e.g. for schedulers that keep lr on the device): torch's
  foreach kernel takes it only with ``capturable=True``, so eagerly we use the single-tensor
  loop for such batches, as torch's functional API does by default; the fused kernel takes it
  as it is.
* gradients in a narrower dtype than their parameters (bf16 gradients of fp32 parameters, from
  mixed-precision reductions): torch's kernels refuse the mix ("expected dtype float for
  `end`"), so such gradients are upcast to the parameter's dtype first; the moments then live
  in the parameter's dtype, as they would for fp32 gradients.
* cautious weight decay (``cautious_wd``, arXiv 2510.12402): torch's kernels cannot mask their
  decay, so a cautious group with weight decay runs :func:`cautious_adamw_step_` (the same
  arithmetic, written out on each local piece); every other group stays torch's kernel.
* ``torch.compile`` of a step: dynamo traces torch.optim's optimizers with ``capturable=True``
  (torch/_dynamo/variables/optimizer.py sets it on every traced group), because the
  non-capturable foreach path turns the CPU step counts into a stacked tensor of step sizes
  that the traced ``_foreach_addcdiv_`` refuses ("Expected scalars to be on CPU, got meta").
  Under compile we pass ``capturable=True`` the same way; eager steps are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import torch
from torch import Tensor
from torch.optim.adamw import adamw as _torch_adamw

from .tensors import is_dtensor

ADAMW_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def _wants_fused(param: Tensor) -> bool:
    return param.device.type == "cuda" and torch.is_floating_point(param)


def init_adamw_state_(state: MutableMapping, param: Tensor) -> None:
    """Create AdamW's state entries for ``param`` if they are missing (lazy init, as torch does).

    ``step`` is a float32 scalar tensor like torch.optim.AdamW's; it lives on the param's device
    when that is CUDA (the fused kernel wants it there) and on the CPU otherwise. ``exp_avg`` and
    ``exp_avg_sq`` are ``zeros_like(param)``, which keeps a DTensor's mesh and placements.
    """
    if "step" not in state:
        device = param.device if _wants_fused(param) else torch.device("cpu")
        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
    if "exp_avg" not in state:
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    if "exp_avg_sq" not in state:
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def step_as_tensor_(state: MutableMapping, param: Tensor) -> None:
    """A ``step`` loaded as a Python number (older checkpoints; torch.optim.Adam converts it the same
    way when it loads) becomes the 0-d float32 tensor the kernels need, where init puts it."""
    if "step" in state and not torch.is_tensor(state["step"]):
        device = param.device if _wants_fused(param) else torch.device("cpu")
        state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32, device=device)


def _batch_key(t: Tensor):
    # One foreach/fused call per kind of tensor: plain tensors together, DTensors per mesh.
    return ("dtensor", t.device_mesh) if is_dtensor(t) else ("plain", None)


def _check_lr_and_maximize(lr, maximize) -> None:
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"AdamW: a Tensor lr must have one element, got shape {tuple(lr.shape)}")
    if not isinstance(maximize, bool):
        raise ValueError(f"AdamW: maximize must be True or False, got {maximize!r}")


def adamw_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
) -> None:
    """One AdamW step, in place, for parallel lists of params / grads / state.

    Same math as ``torch.optim.AdamW(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
    maximize=maximize)`` (decoupled weight decay ``p *= 1 - lr * wd``, bias-corrected moments;
    ``maximize`` ascends instead of descending); ``state_steps`` are incremented. Tensors may be
    DTensors (a param, its grad and its state must share placements). ``lr`` may be a float or a
    1-element Tensor. By default the fused kernel is used when every tensor of a batch is a CUDA
    float and its steps live on CUDA (see :func:`init_adamw_state_`), the foreach kernels
    otherwise (the single-tensor loop for a Tensor ``lr`` outside ``torch.compile``); pass
    ``foreach``/``fused`` to force one.
    """
    _check_same_lengths(params, grads, exp_avgs, exp_avg_sqs, state_steps)
    _check_lr_and_maximize(lr, maximize)
    tensor_lr = isinstance(lr, Tensor)
    if not params:
        return
    grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(params, grads)]
    beta1, beta2 = betas
    compiling = torch.compiler.is_compiling()

    batches: dict[object, list[int]] = {}
    for i, p in enumerate(params):
        batches.setdefault(_batch_key(p), []).append(i)

    for idx in batches.values():
        ps, steps = [params[i] for i in idx], [state_steps[i] for i in idx]
        use_foreach, use_fused = _implementation(ps, steps, foreach, fused, tensor_lr, compiling)
        _torch_adamw(
            ps, [grads[i] for i in idx], [exp_avgs[i] for i in idx], [exp_avg_sqs[i] for i in idx],
            [],  # max_exp_avg_sqs: amsgrad is off
            steps, foreach=use_foreach, fused=use_fused,
            capturable=compiling and not use_fused,  # what dynamo does to torch.optim's AdamW (module docstring)
            has_complex=any(torch.is_complex(p) for p in ps), amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
            weight_decay=weight_decay, eps=eps, maximize=maximize,
        )


def _check_same_lengths(*lists: Sequence) -> None:
    if len({len(x) for x in lists}) != 1:
        raise ValueError(
            "adamw_step_: params, grads, exp_avgs, exp_avg_sqs and state_steps must have the same "
            f"length, got {[len(x) for x in lists]}"
        )


def _implementation(params, steps, foreach, fused, tensor_lr: bool, compiling: bool) -> tuple[bool, bool]:
    """``(foreach, fused)`` for one batch: as asked, else fused where every tensor is a CUDA float
    with its step on CUDA, foreach elsewhere (the single-tensor loop for an eager Tensor lr)."""
    use_fused = fused
    if use_fused is None:
        use_fused = all(_wants_fused(p) for p in params) and all(s.device.type == "cuda" for s in steps)
    use_foreach = foreach
    if use_foreach is None:
        use_foreach = not use_fused and (compiling or not tensor_lr)
    if use_foreach and tensor_lr and not compiling:
        raise ValueError(
            "AdamW: a Tensor lr with foreach=True needs torch's capturable path, which runs "
            "only under torch.compile or on CUDA; pass foreach=None (the single-tensor loop is "
            "used) or a float lr"
        )
    return use_foreach, use_fused


def cautious_adamw_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    maximize: bool = False,
) -> None:
    """AdamW with cautious weight decay, in place: the moments and the step as torch.optim.AdamW
    computes them, and the decoupled decay ``p -= lr * wd * p`` only where ``p`` and the Adam step
    ``m_hat / (sqrt(v_hat) + eps)`` have the same sign (the step is subtracted, so decay and update
    then pull the same way).  The step's sign is that of ``exp_avg`` (the bias correction and the
    denominator are positive).  Elementwise, so it runs on each DTensor's local piece; no host
    read (the step count and a tensor ``lr`` stay tensors).
    """
    _check_lr_and_maximize(lr, maximize)
    beta1, beta2 = betas
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
        p, g, m, v = (t._local_tensor if is_dtensor(t) else t for t in (p, g, m, v))
        g = g if g.dtype == p.dtype else g.to(p.dtype)
        if maximize:
            g = -g
        step += 1
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        wide = torch.promote_types(p.dtype, torch.float32)
        t = step.to(device=p.device, dtype=wide)
        bias1, bias2_sqrt = 1 - beta1 ** t, (1 - beta2 ** t).sqrt()
        denom = (v.sqrt() / bias2_sqrt).add_(eps)
        lr_t = lr.to(device=p.device, dtype=wide) if isinstance(lr, Tensor) else lr
        keep = 1 - lr_t * weight_decay
        keep = keep if isinstance(keep, Tensor) else p.new_full((), keep, dtype=wide)  # a fill, not a copy
        p.mul_(torch.where(p * m >= 0, keep, p.new_ones((), dtype=wide)))
        step_size = lr_t / bias1
        p.sub_(m / denom * step_size)


def adamw_group_step_(group: Mapping, state: MutableMapping) -> None:
    """One AdamW step for the parameters of ``group`` (a Muon group with ``use_muon=False``).

    Reads ``lr`` (float or 1-element Tensor), ``betas``, ``eps``, ``weight_decay``,
    ``maximize`` and ``cautious_wd`` (False when the group has none) from the group, skips parameters without a
    gradient, and creates missing state in ``state`` (the optimizer's per-parameter state)
    lazily, as torch.optim.AdamW does.
    """
    _check_lr_and_maximize(group["lr"], group.get("maximize", False))
    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return
    states = [state.setdefault(p, {}) for p in params]
    for p, st in zip(params, states):
        init_adamw_state_(st, p)
    cautious = group.get("cautious_wd", False) and group["weight_decay"] != 0
    (cautious_adamw_step_ if cautious else adamw_step_)(
        params,
        [p.grad for p in params],
        [st["exp_avg"] for st in states],
        [st["exp_avg_sq"] for st in states],
        [st["step"] for st in states],
        lr=group["lr"],
        betas=group["betas"],
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        maximize=group.get("maximize", False),
    )
