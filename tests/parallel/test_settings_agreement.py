"""Settings and shard shapes that differ between ranks: the same clear error everywhere.

Before, a different ``lookahead`` on one rank gave silently wrong parameters, a different
``chunk_size`` or ``compute_dtype`` aborted gloo (mismatched collective sizes), and a
different ``distributed_mode`` hung.  The optimizer's settings and every parameter's
hyper-parameters are now part of the step's agreement, and a local shard whose shape
contradicts its placements is refused on every rank.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from dist_cases import build_groups, make_case_tensors, outcome, parse_placement, to_dtensor
from harness import run_ranks
from optimizer.distributed.agreement import summarise_ranks
from repo import REPO

SPECS = [
    ("layers.0.attention.wq.weight", (16, 12), ["S0"]),
    ("layers.0.ffn.w1.weight", (10, 12), ["S1"]),
    ("layers.0.ffn.w2.weight", (12, 10), ["S0"]),
]

DIFFERENCES = {
    "lookahead": dict(lookahead=2),
    "chunk_size": dict(chunk_size=1),
    "compute_dtype": dict(compute_dtype=torch.bfloat16),
    "distributed_mode": dict(distributed_mode="gather"),
    "replica_split": dict(replica_split="never"),
    "ns_steps": dict(ns_steps=4),
    "lr": dict(lr=0.03),
}


def _differ(rank, world_size, key):
    from optimizer import Muon
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    params, grads = make_case_tensors(SPECS, 1)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
             for n, _, pl in SPECS]
    kw = dict(lr=0.02)
    if rank == world_size - 1:
        kw.update(DIFFERENCES[key])
    opt = Muon(build_groups(named), **kw)
    for n, p in named:
        p.grad = to_dtensor(grads[0][n], mesh, p.placements)
    before = [p.to_local().clone() for _, p in named]
    result = outcome(opt.step)
    unchanged = all(torch.equal(p.to_local(), b) for (_, p), b in zip(named, before)) and not opt.state
    return result, unchanged


@pytest.mark.parametrize("key", sorted(DIFFERENCES))
def test_a_setting_that_differs_on_one_rank_fails_every_rank_the_same_way(key):
    results = run_ranks(_differ, 4, key, timeout=60)
    messages = {msg for (kind, msg), _ in results}
    assert len(messages) == 1, messages  # the same error on every rank
    (kind, msg), _ = results[0]
    assert kind == "RuntimeError" and "settings differ" in msg and key in msg, msg
    assert "ranks 0-2" in msg and "rank 3" in msg, msg
    assert all(unchanged for _, unchanged in results)


def _bad_local_shape(rank, world_size):
    from optimizer import Muon
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.randn(9, 6)
    # Shard(0) of 9 rows over 3 ranks is 3/3/3 (torch.chunk); rank 1 claims 4 rows, a layout
    # the placements do not describe.
    rows = {0: (0, 3), 1: (3, 7), 2: (6, 9)}[rank]
    local = full[rows[0]:rows[1]].clone()
    p = torch.nn.Parameter(DTensor.from_local(local, mesh, [parse_placement("S0")], run_check=False,
                                              shape=full.shape, stride=full.stride()))
    opt = Muon([{"params": [p], "param_names": ["w"], "use_muon": True}], lr=0.02)
    p.grad = DTensor.from_local(torch.randn_like(local), mesh, p.placements, run_check=False,
                                shape=full.shape, stride=full.stride())
    before = p.to_local().clone()
    return outcome(opt.step), torch.equal(p.to_local(), before)


def test_a_local_shard_that_contradicts_its_placements_fails_every_rank():
    results = run_ranks(_bad_local_shape, 3, timeout=60)
    (kind1, msg1), unchanged1 = results[1]
    assert kind1 == "ValueError" and "'w'" in msg1 and "(4, 6)" in msg1 and "(3, 6)" in msg1, msg1
    for r in (0, 2):
        (kind, msg), _ = results[r]
        assert kind == "RuntimeError" and "1 of 3 ranks rejected their inputs" in msg, msg
    assert all(unchanged for _, unchanged in results)


def test_rank_summaries_stay_short_at_any_world_size():
    ranks = list(range(1024))
    values = ["A"] * 512 + ["B"] * 511 + ["C"]
    text = summarise_ranks(values, ranks)
    assert text == "ranks 0-511: A; ranks 512-1022: B; rank 1023: C"
    scattered = summarise_ranks(["X" if r % 2 else "Y" for r in ranks], ranks)
    assert len(scattered) < 300 and "more ranges" in scattered
    many = summarise_ranks([str(r % 7) for r in ranks], ranks)
    assert "3 more values on" in many and many.count(";") == 4


_DIGEST_SCRIPT = r"""
import sys
sys.path.insert(0, "torch-ext")
import torch
from optimizer import Muon, settings

def head_rows(name, shape):  # a callable row-block spec: its repr holds an address
    return [slice(0, 4), slice(4, 8)]

w = torch.nn.Parameter(torch.zeros(8, 6))
opt = Muon([{"params": [w], "param_names": ["wq"], "use_muon": True, "muon_row_blocks": {"wq": head_rows}}])
print(id(head_rows), settings.digest(opt.settings, opt.param_groups))
"""


def test_settings_digest_is_the_same_in_separate_processes():
    """Under torchrun each rank is its own process: a function's repr (its address) differs between
    them, and must not make equal settings look different."""
    import subprocess
    import sys

    root = REPO
    # of this environment only where compiled bytecode is kept (.ci/run's cache: no compiling torch again)
    bytecode = {k: v for k, v in os.environ.items() if k in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    runs = [subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], cwd=root, capture_output=True, text=True,
                           timeout=120, env={"PYTHONHASHSEED": str(seed), "PATH": "", **bytecode})
            for seed in (1, 2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    (addr_a, digest_a), (addr_b, digest_b) = (r.stdout.split() for r in runs)
    assert addr_a != addr_b  # the processes really differ where a plain repr would
    assert digest_a == digest_b
