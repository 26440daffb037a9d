"""Shared helpers for multi-rank optimizer tests: build DTensor parameters from
global tensors and compare a distributed run against single-device Muon.

The reference is the same optimizer on plain (unsharded) tensors fed the same
global gradients; single-device Muon is itself checked against
``torch.optim.Muon`` and ``torch.optim.AdamW`` in test_muon_vs_torch.py.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from optimizer import Muon, QKClipConfig
from strided_layouts import full_of, make_dtensor

HEAD_DIM = 4


def parse_placement(text: str):
    """'S0' -> Shard(0), 'R' -> Replicate(), 'SS0/2' -> _StridedShard(0, split_factor=2)."""
    if text == "R":
        return Replicate()
    if text.startswith("SS"):
        dim, sf = text[2:].split("/")
        return _StridedShard(int(dim), split_factor=int(sf))
    if text.startswith("S"):
        return Shard(int(text[1:]))
    raise ValueError(text)


def to_dtensor(global_tensor: torch.Tensor, mesh, placements) -> DTensor:
    """Shard a global tensor the way training does: redistribute from Replicate.

    (distribute_tensor refuses uneven _StridedShard splits in torch 2.13, and
    redistribute matches FSDP2's layout; see optimizer/distributed/placements.py.)
    Where this torch release refuses to redistribute the placements (2.10, 2.11: a _StridedShard
    that encodes no shard order), the local blocks are cut by strided_layouts.cut_local.
    """
    return make_dtensor(global_tensor, mesh, placements)


def make_case_tensors(specs, steps, seed=0):
    """Global params and per-step grads, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    params = {name: torch.randn(shape, generator=g) for name, shape, _ in specs}
    grads = [{name: torch.randn(shape, generator=g) for name, shape, _ in specs} for _ in range(steps)]
    return params, grads


def qk_logits_for(specs, step, threshold):
    """Per-layer per-head max logits with some heads over the threshold."""
    logits = {}
    for name, shape, _ in specs:
        if ".wq." in name:
            layer = int(name.split(".")[1])
            n_heads = shape[0] // HEAD_DIM
            g = torch.Generator().manual_seed(1000 * step + layer)
            logits[layer] = torch.rand(n_heads, generator=g) * 2 * threshold
    return logits


def build_groups(named, muon_group=None):
    """A Muon group of the matrices (with ``muon_group``'s extra keys) and an AdamW group of the rest."""
    muon = [(n, p) for n, p in named if p.dim() >= 2]
    adamw = [(n, p) for n, p in named if p.dim() < 2]
    groups = [{"params": [p for _, p in muon], "param_names": [n for n, _ in muon], "use_muon": True,
               **(muon_group or {})}]
    if adamw:
        groups.append({"params": [p for _, p in adamw], "param_names": [n for n, _ in adamw], "use_muon": False})
    return groups


OPT_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr="match_rms_adamw")


def _has_attention(specs) -> bool:
    # QK-clip refuses a config that matches no weight; cases without q/k run without it.
    return any(".wq." in name for name, _, _ in specs)


def _state_of(opt, named):
    """Every parameter's optimizer state by name and key, full tensors (collective for DTensors)."""
    out = {}
    for n, p in named:
        out[n] = {k: (full_of(v) if isinstance(v, DTensor) else v).detach().clone()
                  for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v) and v.dim() > 0}
    return out


def run_reference(specs, steps, qk, threshold=1.0, seed=0, muon_group=None, with_state=False, **kw):
    """Single-device Muon on plain tensors (and, ``with_state``, its state by name)."""
    qk = qk and _has_attention(specs)
    params, grads = make_case_tensors(specs, steps, seed)
    named = [(n, torch.nn.Parameter(params[n].clone())) for n, _, _ in specs]
    opt = Muon(build_groups(named, muon_group), **{**OPT_KW, **kw},
               qk_clip=QKClipConfig(head_dim=HEAD_DIM, threshold=threshold) if qk else None)
    for s in range(steps):
        for n, p in named:
            p.grad = grads[s][n].clone()
        opt.step(qk_logits=qk_logits_for(specs, s, threshold) if qk else None)
    fulls = {n: p.detach().clone() for n, p in named}
    return (fulls, _state_of(opt, named)) if with_state else fulls


def run_distributed(rank, world_size, mesh_shape, specs, steps, qk, threshold=1.0, seed=0, with_stats=False,
                    muon_group=None, with_state=False, inspect=None, **kw):
    """The same run with DTensor params; returns each param's full tensor (on every rank), with
    ``with_stats`` also the last step's pipeline stats, with ``with_state`` its state's full
    tensors by name, and with ``inspect`` what ``inspect(opt, named, mesh)`` returns."""
    qk = qk and _has_attention(specs)
    mesh = init_device_mesh("cpu", mesh_shape)
    params, grads = make_case_tensors(specs, steps, seed)
    named = []
    for n, _, pl in specs:
        placements = [parse_placement(x) for x in pl]
        named.append((n, torch.nn.Parameter(to_dtensor(params[n], mesh, placements))))
    opt = Muon(build_groups(named, muon_group), **{**OPT_KW, **kw},
               qk_clip=QKClipConfig(head_dim=HEAD_DIM, threshold=threshold) if qk else None)
    for s in range(steps):
        for (n, p), (_, _, pl) in zip(named, specs):
            p.grad = to_dtensor(grads[s][n], mesh, p.placements)
        opt.step(qk_logits=qk_logits_for(specs, s, threshold) if qk else None)
    fulls = {n: full_of(p).detach() for n, p in named}
    out = [fulls]
    if with_stats:
        out.append(opt.last_step_stats)
    if with_state:
        out.append(_state_of(opt, named))
    if inspect is not None:
        out.append(inspect(opt, named, mesh))
    return out[0] if len(out) == 1 else tuple(out)


def owned_matrices_of_one_step(mesh_shape, specs, **kw):
    """Muon on ``specs`` as DTensors (momentum 0.9, ``kw`` its options), stepped once, and every
    matrix (or block) an owner assembled in that step, as ``[(param name, owned unit, tensor)]``:
    what ``parallel/runtime.finish_gather`` returned, recorded around the call."""
    import optimizer.parallel.execution.pipeline as pipeline

    mesh = init_device_mesh("cpu", mesh_shape)
    params, grads = make_case_tensors(specs, 1)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
             for n, _, pl in specs]
    opt = Muon(build_groups(named), lr=0.02, momentum=0.9, **kw)
    for n, p in named:
        p.grad = to_dtensor(grads[0][n], mesh, p.placements)
    seen = []
    finish = pipeline.finish_gather

    def record(flight, stats):
        fulls = finish(flight, stats)
        seen.extend((o, full.clone()) for o, full in zip(flight.chunk.owned, fulls))
        return fulls

    pipeline.finish_gather = record
    try:
        opt.step()
    finally:
        pipeline.finish_gather = finish
    names = [e.name for e in opt._cached_context.muon]
    return [(names[o.param], o, full) for o, full in seen]


def outcome(fn):
    """("ok", "") or (exception type, message): lets a test compare what each rank saw."""
    try:
        fn()
        return "ok", ""
    except Exception as e:  # noqa: BLE001 - every kind of failure is an outcome to compare
        return type(e).__name__, str(e)
