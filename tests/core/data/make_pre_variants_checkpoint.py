"""Write ``tests/core/data/pre_variants/``: checkpoints written by Muon before NorMuon, cautious
weight decay and ``momentum_dtype`` existed (commit 49fa963, layout version 1), and what that
Muon computed when it continued from them (a record: another CPU rounds fp32 matmuls differently,
so it is not compared).  ``tests/core/test_checkpoint_variants.py`` loads them with today's Muon
and requires the optimizer and the continuation of the same tensors put into today's Muon by hand
(tests/state_by_hand.py), bit for bit.

    git archive 49fa963 torch-ext | tar -x -C /tmp/pre_variants
    python tests/core/data/make_pre_variants_checkpoint.py /tmp/pre_variants/torch-ext

* ``plain.pt``: one device; ``{"params", "optimizer"}`` after K steps (``optimizer.state_dict()``)
  and ``"continued"``, the parameters after steps K..N-1 of the same run.
* ``dcp/``: a torch.distributed.checkpoint of two ranks (``"model"``, ``"optim"`` through
  ``get_model_state_dict`` / ``get_optimizer_state_dict``) after K steps, and ``dcp_continued.pt``,
  the full parameters after steps K..N-1 of that run.
"""

from __future__ import annotations

import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "pre_variants")
K, N = 2, 4
SHAPES = {"w": (8, 6), "e": (2, 6, 4), "b": (6,)}
PLACEMENTS = {"w": "S0", "e": "S1", "b": "S0"}  # FSDP rows, experts' rows, a bias


def tensors(seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(N)]
    return params, grads


class Net:
    """A module holding the three parameters (built lazily: torch is imported in the ranks)."""

    @staticmethod
    def build(params):
        import torch

        net = torch.nn.Module()
        for n, p in params.items():
            net.register_parameter(n, torch.nn.Parameter(p))
        return net


def muon(net):
    from optimizer import Muon

    named = list(net.named_parameters())
    groups = [{"params": [p for n, p in named if p.dim() >= 2], "param_names": [n for n, p in named if p.dim() >= 2],
               "use_muon": True},
              {"params": [p for n, p in named if p.dim() < 2], "param_names": [n for n, p in named if p.dim() < 2],
               "use_muon": False}]
    return Muon(groups, lr=0.02, weight_decay=0.1)


def train(net, opt, grads, steps, to_grad=lambda n, g, p: g):
    for s in steps:
        for n, p in net.named_parameters():
            p.grad = to_grad(n, grads[s][n], p)
        opt.step()


def plain():
    import torch

    params, grads = tensors()
    net = Net.build({n: t.clone() for n, t in params.items()})
    opt = muon(net)
    train(net, opt, grads, range(K))
    saved = {"params": {n: p.detach().clone() for n, p in net.named_parameters()},
             "optimizer": copy.deepcopy(opt.state_dict())}  # its tensors are the live state: copy before going on
    train(net, opt, grads, range(K, N))
    saved["continued"] = {n: p.detach().clone() for n, p in net.named_parameters()}
    torch.save(saved, os.path.join(OUT, "plain.pt"))


def ranks(rank, world_size, path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from dist_cases import parse_placement, to_dtensor

    mesh = init_device_mesh("cpu", (world_size,))
    params, grads = tensors()
    net = Net.build({n: to_dtensor(t, mesh, [parse_placement(PLACEMENTS[n])]) for n, t in params.items()})
    opt = muon(net)
    as_dtensor = lambda n, g, p: to_dtensor(g, mesh, p.placements)  # noqa: E731
    train(net, opt, grads, range(K), as_dtensor)
    dcp.save({"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)},
             checkpoint_id=os.path.join(path, "dcp"))
    train(net, opt, grads, range(K, N), as_dtensor)
    fulls = {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}
    if rank == 0:
        torch.save(fulls, os.path.join(path, "dcp_continued.pt"))


def main(old_package: str) -> int:
    root = os.path.dirname(os.path.dirname(HERE))  # tests/
    sys.path[:0] = [old_package, root]
    import optimizer

    assert os.path.abspath(optimizer.__file__).startswith(os.path.abspath(old_package)), optimizer.__file__
    os.makedirs(OUT, exist_ok=True)
    plain()
    from harness import run_ranks

    run_ranks(ranks, 2, OUT, timeout=120)
    print(f"wrote {OUT} with {optimizer.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
