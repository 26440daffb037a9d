"""Checks of the tensors users hand to Muon, with errors that name the culprit and the fix.

Options are checked where they are declared (``settings/declarations.py``).  Every check here is local to
a rank: ``Muon.step`` collects their messages first and raises them only after all ranks have
agreed (``distributed/agreement.py``), so a bad input on one rank fails every rank instead of
hanging the others.
"""

from __future__ import annotations

import torch

from .dion2.checks import dion2_param_problem
from .tensors import is_dtensor


def param_names_problem(group, where: str) -> str | None:
    """Why a group's ``param_names`` cannot name its parameters (one string per parameter, in
    order), or None; a group may also have no names at all."""
    names = group.get("param_names")
    if names is None:
        return None
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return f"Muon: {where} param_names must be a list of strings, one per parameter, got {names!r}"
    if len(names) != len(group["params"]):
        return (f"Muon: {where} has {len(group['params'])} params but {len(names)} param_names; give one name "
                "per parameter, in the order of params (as model.named_parameters() gives them)")
    return None


def check_group_params(group: dict, names: list[str], where: str = "its group") -> None:
    """Parameters a group cannot hold: complex tensors; non-matrices in a Muon or Dion2 group
    (:func:`dion2_param_problem`)."""
    for name, p in zip(names, group["params"]):
        if p.is_complex():
            raise ValueError(f"Muon: parameter '{name}' is complex; Muon and its AdamW path support real tensors only")
        if group["use_muon"] and group.get("dion2_fraction") is not None:
            problem = dion2_param_problem(name, p, where)
            if problem:
                raise ValueError(problem)
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
