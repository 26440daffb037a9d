"""The reference for loading old checkpoints: the same tensors put into today's optimizer by hand.

A checkpoint written by an older release, on another machine, cannot be checked against the
parameters that release reached next: fp32 matmuls round differently on another CPU (see
``tolerances.py``).  Instead the test builds, here and now, the optimizer that loading should
produce: today's ``Muon`` constructed with the options the old run used, its per-parameter state
assigned directly from the checkpoint's tensors (no ``load_state_dict``, no upgrade code).  The
loaded optimizer must then hold exactly the same groups and state, and the two must continue
bit for bit: same machine, same code, same order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.distributed.tensor import DTensor


def params_in_order(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters in the order a state dict numbers them (group by group)."""
    return [p for g in opt.param_groups for p in g["params"]]


def set_state_by_hand(opt: torch.optim.Optimizer, state: Mapping[int, Mapping[str, torch.Tensor]],
                      place: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
    """``opt.state[p] = copy of state[i]`` for the i-th parameter; ``place(t, p)`` makes a state
    tensor the parameter's kind (e.g. a DTensor with its placements; default: a clone)."""
    place = place or (lambda t, p: t.clone())
    params = params_in_order(opt)
    assert sorted(state) == list(range(len(params))), (sorted(state), len(params))
    for i, p in enumerate(params):
        opt.state[p] = {k: place(v, p) if torch.is_tensor(v) and v.dim() > 0 else (v.clone() if torch.is_tensor(v) else v)
                        for k, v in state[i].items()}


def _local(t):
    return (t.to_local(), tuple(t.placements)) if isinstance(t, DTensor) else (t, None)


def assert_same_optimizer(got: torch.optim.Optimizer, want: torch.optim.Optimizer) -> None:
    """Equal state dicts: every group entry, and every state tensor bit for bit (its local piece
    and placements, for a DTensor)."""
    g_sd, w_sd = got.state_dict(), want.state_dict()
    assert len(g_sd["param_groups"]) == len(w_sd["param_groups"])
    for i, (g, w) in enumerate(zip(g_sd["param_groups"], w_sd["param_groups"])):
        differ = {k: (g.get(k), w.get(k)) for k in set(g) | set(w) if g.get(k) != w.get(k)}
        assert not differ, f"param_groups[{i}] (got, want): {differ}"
    assert sorted(g_sd["state"]) == sorted(w_sd["state"])
    for i in w_sd["state"]:
        g, w = g_sd["state"][i], w_sd["state"][i]
        assert sorted(g) == sorted(w), (i, sorted(g), sorted(w))
        for k in w:
            (gl, gp), (wl, wp) = _local(g[k]), _local(w[k])
            assert gp == wp and gl.dtype == wl.dtype and torch.equal(gl, wl), f"state[{i}][{k!r}]"

