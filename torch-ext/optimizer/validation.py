"""Checks of what users hand to Muon, with errors that name the culprit and the fix.

Every check here is local to a rank.  ``Muon.step`` collects their messages
first and raises them only after all ranks have agreed (distributed/agreement.py),
so a bad input on one rank fails every rank instead of hanging the others.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .newton_schulz import check_ns_method, resolve_ns_coefficients
from .tensors import is_dtensor

GROUPS_HELP = (
    "Every param group passed to Muon must say whether it is a Muon group: "
    "use `optimizer.get_default_muon_param_groups(model)`, or build groups like "
    "[{'params': matrices, 'use_muon': True}, {'params': others, 'use_muon': False}]."
)
ADJUST_LR_MODES = ("match_rms_adamw", "original", "none", None)
DISTRIBUTED_MODES = ("parallel", "gather")
REPLICA_SPLIT_MODES = ("auto", "always", "never")


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"Muon: `{name}` must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"Muon: `{name}` must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"Muon: `{name}` must be <= {high}, got {value!r}")


def check_optimizer_options(*, eps, compute_dtype, qk_clip, qk_clip_type, distributed_mode, chunk_size,
                            lookahead, replica_split="auto", replica_split_flops_per_byte=None,
                            skip_nonfinite=False) -> None:
    """The optimizer-wide (not per-group) options of ``Muon.__init__``."""
    check_number("eps", eps, low=0.0, low_open=True)
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise ValueError(f"Muon: `compute_dtype` must be a floating torch.dtype or None, got {compute_dtype!r}")
    if qk_clip is not None and not isinstance(qk_clip, qk_clip_type):
        raise ValueError(f"Muon: `qk_clip` must be an optimizer.QKClipConfig or None, got {type(qk_clip).__name__}")
    if distributed_mode not in DISTRIBUTED_MODES:
        raise ValueError(f"Muon: `distributed_mode` must be one of {DISTRIBUTED_MODES}, got {distributed_mode!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"Muon: `chunk_size` must be a positive int or None, got {chunk_size!r}")
    if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
        raise ValueError(f"Muon: `lookahead` must be an int >= 0, got {lookahead!r}")
    if replica_split not in REPLICA_SPLIT_MODES:
        raise ValueError(
            f"Muon: `replica_split` must be one of {REPLICA_SPLIT_MODES}, got {replica_split!r}"
        )
    if replica_split_flops_per_byte is not None:
        check_number("replica_split_flops_per_byte", replica_split_flops_per_byte, low=0.0)
    if not isinstance(skip_nonfinite, bool):
        raise ValueError(f"Muon: `skip_nonfinite` must be True or False, got {skip_nonfinite!r}")


def check_group_options(group: dict, where: str) -> None:
    """A param group's hyper-parameters (``where`` names the group in messages)."""
    lr = group["lr"]
    if torch.is_tensor(lr) and lr.numel() != 1:
        raise ValueError(f"Muon: `{where} lr` must be a number or a one-element tensor, got shape {tuple(lr.shape)}")
    if not torch.is_tensor(lr) or lr.device.type == "cpu":  # a device tensor is not read (no host sync)
        check_number(f"{where} lr", float(lr) if torch.is_tensor(lr) else lr, low=0.0)
    if not isinstance(group.get("maximize", False), bool):
        raise ValueError(f"Muon: `{where} maximize` must be True or False, got {group['maximize']!r}")
    check_number(f"{where} weight_decay", group["weight_decay"], low=0.0)
    if group["use_muon"]:
        check_number(f"{where} momentum", group["momentum"], low=0.0, high=1.0)
        if not isinstance(group["ns_steps"], int) or isinstance(group["ns_steps"], bool) or not (
            1 <= group["ns_steps"] <= 100
        ):
            raise ValueError(f"Muon: `{where} ns_steps` must be an int in [1, 100], got {group['ns_steps']!r}")
        if group["adjust_lr"] not in ADJUST_LR_MODES:
            raise ValueError(
                f"Muon: `{where} adjust_lr` must be one of {ADJUST_LR_MODES}, got {group['adjust_lr']!r}"
            )
        resolve_ns_coefficients(group["ns_coefficients"], group["ns_steps"])  # raises on bad input
        try:
            check_ns_method(group.get("ns_method", "auto"))
        except ValueError as err:
            raise ValueError(f"Muon: `{where} ns_method`: {err}") from None
    else:
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"Muon: `{where} betas` must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            check_number(f"{where} betas[{i}]", b, low=0.0, high=1.0)
            if b == 1.0:
                raise ValueError(f"Muon: `{where} betas[{i}]` must be < 1, got {b!r}")
        check_number(f"{where} eps", group["eps"], low=0.0, low_open=True)


def check_group_params(group: dict, names: list[str]) -> None:
    """Parameters a group cannot hold: complex tensors; non-matrices in a Muon group."""
    for name, p in zip(names, group["params"]):
        if p.is_complex():
            raise ValueError(f"Muon: parameter '{name}' is complex; Muon and its AdamW path support real tensors only")
        if group["use_muon"] and p.dim() < 2:
            raise ValueError(
                f"Muon: parameter '{name}' has shape {tuple(p.shape)} but is in a Muon group; Muon "
                "orthogonalises matrices (2-D, or 3-D expert weights). Put 0-D/1-D parameters "
                "(norms, biases) in a group with use_muon=False."
            )


def param_problem(name: str, param: torch.Tensor) -> str | None:
    """Why this parameter cannot be stepped on this rank, whatever its gradient, or None."""
    if not is_dtensor(param):
        return None
    if param.device_mesh.get_coordinate() is None:
        import torch.distributed as dist

        return (
            f"Muon: parameter '{name}' lives on a DeviceMesh of ranks {param.device_mesh.mesh.flatten().tolist()}, "
            f"which does not include this rank ({dist.get_rank()}); give each rank an optimizer over only the "
            "parameters of meshes it belongs to (e.g. one optimizer per pipeline stage)."
        )
    if any(pl.is_partial() for pl in param.placements):
        return (
            f"Muon: parameter '{name}' has a Partial placement {param.placements}; reduce it "
            "(redistribute to Shard or Replicate) before the optimizer step."
        )
    return None


def gradient_problem(name: str, param: torch.Tensor, grad: torch.Tensor | None, use_muon: bool) -> str | None:
    """Why this parameter's gradient cannot be stepped, or None (checked every step: gradients change)."""
    if grad is None:
        return None
    if grad.is_sparse:
        return f"Muon: parameter '{name}' has a sparse gradient; Muon does not support sparse gradients"
    if not use_muon or not is_dtensor(param):
        return None
    if not is_dtensor(grad):
        return (
            f"Muon: parameter '{name}' is a DTensor but its gradient is a {type(grad).__name__}; "
            "gradients of DTensor parameters must be DTensors on the same mesh."
        )
    same_mesh = grad.device_mesh is param.device_mesh or grad.device_mesh == param.device_mesh
    if grad.placements != param.placements or not same_mesh:
        if any(pl.is_partial() for pl in grad.placements):
            return (
                f"Muon: the gradient of '{name}' has a Partial placement {grad.placements}; reduce it "
                "(redistribute to the parameter's placements) before the optimizer step."
            )
        return (
            f"Muon: the gradient of '{name}' has placements {grad.placements} but the parameter has "
            f"{param.placements}; redistribute the gradient to the parameter's placements first."
        )
    return None
