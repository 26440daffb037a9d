"""torchtitan's own distributed Muon (``flex_shard.DistMuon``), built on given DTensors for comparisons.

benchmarks/step_time.py times it beside this package's Muon on the same parameters.
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...tensors import is_dtensor
try:
    from torchtitan.distributed.flex_shard import BucketConfig, ComputeLayout, Owned, build_dist_muon
except ImportError as err:  # pragma: no cover - exercised only where torchtitan is missing
    raise ImportError(
        "optimizer.integrations.torchtitan_dist_muon needs torchtitan 0.3 (pip install torchtitan==0.3.0, with torch "
        f"kept as a constraint). ({err})"
    ) from err

def dist_muon_compute_layouts(named_params: Sequence[tuple[str, Tensor]]) -> dict[str, Any]:
    """The compute layout torchtitan's DistMuon needs per parameter, chosen like its Kimi recipe.

    2-D weights: ``Owned()`` (one owner rank orthogonalises the whole matrix) on every mesh axis
    the weight is sharded over; 3-D expert stacks ``[E, out, in]``: ``Shard(0)`` (whole experts
    per rank). DistMuon does not support ``_StridedShard`` (torchtitan TODO #3353: TP with
    FSDP), so such parameters are refused here.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    layouts = {}
    for name, p in named_params:
        if not is_dtensor(p) or p.device_mesh.mesh_dim_names is None:
            raise ValueError(f"torchtitan's DistMuon needs DTensors on a mesh with named axes; '{name}' is not one")
        if any(isinstance(pl, _StridedShard) for pl in p.placements):
            raise ValueError(
                f"torchtitan's DistMuon does not support _StridedShard ('{name}' has {tuple(p.placements)}, "
                "from TP combined with FSDP)"
            )
        if p.ndim not in (2, 3):
            raise ValueError(f"torchtitan's DistMuon handles 2-D and 3-D weights; '{name}' has shape {tuple(p.shape)}")
        sharded_axes = [ax for ax, pl in zip(p.device_mesh.mesh_dim_names, p.placements) if pl.is_shard()]
        if p.ndim == 3:
            spec = {ax: Shard(0) for ax in sharded_axes}
        else:
            spec = {ax: Owned() for ax in sharded_axes}
        layouts[name] = ComputeLayout(shardings_by_mesh_axis=spec or {p.device_mesh.mesh_dim_names[0]: Replicate()})
    return layouts


def build_torchtitan_dist_muon(
    named_params: Sequence[tuple[str, Tensor]],
    *,
    lr: float,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    adjust_lr: str = "match_rms_adamw",
) -> torch.optim.Optimizer:
    """torchtitan's own distributed Muon (``torchtitan.distributed.flex_shard.DistMuon``) on ``named_params``.

    For comparisons (benchmarks/step_time.py): the same hyperparameters as ``optimizer.Muon``
    with ``ns_coefficients="fixed"``. DistMuon runs only with one CUDA device per process and
    bf16 Newton–Schulz; on other devices this raises RuntimeError before building anything.
    """
    devices = {(p.to_local() if is_dtensor(p) else p).device.type for _, p in named_params}
    if devices != {"cuda"}:
        raise RuntimeError(
            f"torchtitan's DistMuon runs only on CUDA (one device per process); these parameters are on {sorted(devices)}"
        )
    if adjust_lr not in ("match_rms_adamw", "original"):
        raise ValueError(f"adjust_lr must be 'match_rms_adamw' or 'original' for DistMuon, got {adjust_lr!r}")
    layouts = dist_muon_compute_layouts(named_params)
    # A bucket must resolve to one transport group: one bucket per set of mesh axes sharded over.
    buckets: dict[tuple[str, ...], list[str]] = {}
    for name, _ in named_params:
        buckets.setdefault(tuple(layouts[name].shardings_by_mesh_axis), []).append(glob.escape(name))
    return build_dist_muon(
        [{"params": [p for _, p in named_params], "param_names": [n for n, _ in named_params]}],
        compute_sharding_by_fqn=layouts,
        bucket_configs=tuple(BucketConfig(patterns=tuple(names), name="-".join(axes)) for axes, names in buckets.items()),
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr,
    )
