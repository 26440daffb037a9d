"""Parallelize the example transformer per a :class:`RunConfig`, with the real APIs.

- ``tp``: ``parallelize_module`` with torchtitan's plans (colwise q/k/v, or the
  fused ``wqkv``, or MLA's ``wq``/``wq_b`` and ``wkv_b`` as in torchtitan's
  deepseek_v3; colwise w1/w3; rowwise o and w2; colwise lm_head), local outputs;
  no sequence parallelism.  The embedding and MLA's low-rank ``wq_a``, ``q_norm``,
  ``wkv_a``, ``kv_norm`` stay replicated over ``tp`` (plain tensors whose
  gradients come out summed over ``tp``, see ``examples.model.MLAttention``).
- ``ep``: the MoE expert weights become DTensors sharded on the expert dim (dim 0)
  over the ``ep`` mesh dim; the rest of the model is replicated over ``ep``
  (ep peers see the same data, like TP peers).  FSDP then shards experts on dim 1
  (``shard_placement_fn``), giving ``(Shard(1), Shard(0))`` on ``(dp_shard, ep)``.
- ``dp_shard`` / ``dp_replicate``: FSDP2 ``fully_shard`` per layer and at the root
  on the 1-D ``dp_shard`` mesh, or the 2-D ``(dp_replicate, dp_shard)`` mesh (HSDP).
- ``[placements]`` (solver mode): every parameter is ``distribute_tensor``-ed per
  the plan.  The forward then runs on full tensors (``full_tensor`` under autograd
  with ``Partial("avg")`` gradient placements), so each parameter's gradient comes
  back reduced over all ranks and redistributed to the plan's placements, and
  every rank is a data-parallel rank.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.func import functional_call

from optimizer.max_logits import mesh_groups

from .config import RunConfig
from .model import Transformer


def build_mesh(cfg: RunConfig, device_type: str = "cpu") -> DeviceMesh | None:
    """The device mesh of a config (dims with degree > 1), or None for one rank."""
    if cfg.world_size == 1:
        return None
    if not dist.is_initialized() or dist.get_world_size() != cfg.world_size:
        got = dist.get_world_size() if dist.is_initialized() else "no process group"
        raise RuntimeError(f"config {cfg.name!r} needs world size {cfg.world_size}, got {got}")
    return init_device_mesh(device_type, cfg.mesh.shape, mesh_dim_names=cfg.mesh.dim_names)


def data_parallel_rank_and_size(mesh: DeviceMesh | None, cfg: RunConfig) -> tuple[int, int]:
    """Which slice of the global batch this rank takes, and how many slices there are."""
    if mesh is None:
        return 0, 1
    if cfg.placements is not None:
        return dist.get_rank(), dist.get_world_size()
    rank, size = 0, 1
    for name in ("dp_replicate", "dp_shard"):
        if name in cfg.mesh.dim_names:
            rank = rank * mesh[name].size() + mesh[name].get_local_rank()
            size *= mesh[name].size()
    return rank, size


def max_logit_groups(
    mesh: DeviceMesh | None, cfg: RunConfig
) -> tuple[dist.ProcessGroup | None, tuple[dist.ProcessGroup, ...]]:
    """``(tp_group, dp_groups)`` for ``collect_qk_logits`` / ``gather_max_logits``.

    Heads are split over ``tp``; the batch over ``dp_replicate`` and ``dp_shard``
    (``ep`` peers see the same data, like ``tp`` peers).  Solver mode computes on full
    tensors: no rank splits heads, and every rank takes its own slice of the batch.
    """
    if mesh is None:
        return None, ()
    if cfg.placements is not None:
        return None, (dist.group.WORLD,)
    return mesh_groups(mesh, tp_dim="tp", dp_dims=("dp_replicate", "dp_shard"))


def parallelize(model: Transformer, mesh: DeviceMesh | None, cfg: RunConfig) -> Transformer:
    """Shard ``model`` in place per ``cfg`` and return it."""
    if mesh is None:
        return model
    if cfg.placements is not None:
        return apply_placement_plan(model, mesh, cfg)
    names = cfg.mesh.dim_names
    if "tp" in names:
        apply_tp(model, mesh["tp"])
    if "ep" in names:
        shard_experts(model, mesh["ep"])
    dp_dims = tuple(d for d in ("dp_replicate", "dp_shard") if d in names)
    if dp_dims:
        apply_fsdp(model, mesh[dp_dims])
    return model


def attention_tp_plan(model: Transformer) -> dict:
    """Column-wise for the weights that make per-head queries, keys and values (whole heads
    per rank), row-wise for ``wo``; per ``ModelArgs.attention``."""
    args = model.args
    if args.attention == "gqa":
        colwise = ("wq", "wk", "wv")
    elif args.attention == "fused_qkv":
        colwise = ("wqkv",)  # "grouped" layout: contiguous rows hold whole key/value groups
    else:  # mla, torchtitan's deepseek_v3 plan; wq_a/q_norm/wkv_a/kv_norm stay replicated
        colwise = ("wq" if args.q_lora_rank == 0 else "wq_b", "wkv_b")
    plan = {f"attention.{name}": ColwiseParallel() for name in colwise}
    plan["attention.wo"] = RowwiseParallel()
    return plan


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    # The embedding stays replicated: under a rowwise-sharded nn.Embedding, torch
    # 2.13 returns a Replicate() gradient for a Shard(0) weight (shapes differ).
    parallelize_module(model, tp_mesh, {"output": ColwiseParallel(output_layouts=Replicate())})
    attention_plan = attention_tp_plan(model)
    for layer in model.layers:
        parallelize_module(
            layer,
            tp_mesh,
            {
                **attention_plan,
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            },
        )
        if model.args.attention == "mla":  # the shared rotary key's gradient: summed over tp
            layer.attention.tp_mesh = tp_mesh


def shard_experts(model: Transformer, ep_mesh: DeviceMesh) -> None:
    """Expert parallelism: each expert weight ``[E, out, in]`` sharded on E over ``ep``."""
    for layer in model.layers:
        experts = layer.moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _fsdp_placement(param: nn.Parameter):
    # Expert weights already split E over ep: FSDP takes another dim, as
    # torchtitan does for experts, so that the two shardings are orthogonal.
    if isinstance(param, DTensor) and param.ndim == 3 and any(p == Shard(0) for p in param.placements):
        return Shard(1)
    return Shard(0)


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh) -> None:
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, shard_placement_fn=_fsdp_placement)
    fully_shard(model, mesh=dp_mesh, shard_placement_fn=_fsdp_placement)


def apply_placement_plan(model: Transformer, mesh: DeviceMesh, cfg: RunConfig) -> Transformer:
    """Solver mode: place each parameter per the plan; run the forward on full tensors."""
    for fqn, param in list(model.named_parameters()):
        placements = cfg.placement_for(fqn)
        if placements is None:  # load_config guarantees coverage; guard direct callers
            raise ValueError(f"parameter {fqn!r} matched by no pattern of the [placements] plan")
        owner_name, _, attr = fqn.rpartition(".")
        owner = model.get_submodule(owner_name)
        sharded = distribute_tensor(param.detach(), mesh, list(placements))
        owner.register_parameter(attr, nn.Parameter(sharded, requires_grad=param.requires_grad))
    model.forward = _FullTensorForward(model)
    return model


class _FullTensorForward:
    """``model.forward`` for solver mode: run the plain forward on materialized params.

    ``full_tensor(grad_placements=Partial("avg"))`` all-gathers each parameter and,
    in backward, treats the local gradient as one term of a mean over ranks, so the
    redistribution back to the plan's placements reduces it (each rank took its own
    slice of the batch).  ``functional_call`` keeps parameter names and modules.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.plain_forward = model.forward  # bound method of the class
        self.active = False

    def __call__(self, *args, **kwargs):
        if self.active:  # the functional_call below re-enters model.__call__
            return self.plain_forward(*args, **kwargs)
        full = {}
        for name, p in self.model.named_parameters():
            if isinstance(p, DTensor):
                p = p.full_tensor(grad_placements=[Partial("avg")] * p.device_mesh.ndim)
            full[name] = p
        self.active = True
        try:
            return functional_call(self.model, full, args, kwargs)
        finally:
            self.active = False
