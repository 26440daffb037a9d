"""Rank-dependent inputs are agreed before any collective: no hangs, one outcome.

Each test gives ranks different views of the same step (a gradient present on
some ranks only, qk_logits on some ranks only, a bad input on one rank, a NaN
on one rank) and checks that every rank reaches the same outcome quickly.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from dist_cases import build_groups, make_case_tensors, outcome, parse_placement, to_dtensor
from harness import run_ranks
from optimizer import Muon, QKClipConfig

SPECS = [
    ("layers.0.attention.wq.weight", (16, 12), ["S0"]),
    ("layers.0.attention.wk.weight", (8, 12), ["S0"]),
    ("layers.0.ffn.w1.weight", (10, 12), ["S1"]),
]


def _setup(world_size, **kw):
    mesh = init_device_mesh("cpu", (world_size,))
    params, grads = make_case_tensors(SPECS, 1)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
             for n, _, pl in SPECS]
    opt = Muon(build_groups(named), lr=0.02, qk_clip=QKClipConfig(head_dim=4, threshold=1.0), **kw)
    for n, p in named:
        p.grad = to_dtensor(grads[0][n], mesh, p.placements)
    return mesh, named, opt


def _grad_none_on_some_ranks(rank, world_size):
    _, named, opt = _setup(world_size)
    if rank == 1:
        named[2][1].grad = None
    return outcome(opt.step)


def test_grad_none_on_some_ranks_raises_everywhere():
    results = run_ranks(_grad_none_on_some_ranks, 2, timeout=60)
    assert {r[0] for r in results} == {"RuntimeError"}
    assert all("layers.0.ffn.w1.weight" in r[1] and "1 of 2 ranks" in r[1] for r in results)


def _grad_none_everywhere(rank, world_size):
    _, named, opt = _setup(world_size)
    before = named[2][1].full_tensor().clone()
    other_before = named[0][1].full_tensor().clone()
    named[2][1].grad = None
    opt.step()
    return (torch.equal(named[2][1].full_tensor(), before),
            torch.equal(named[0][1].full_tensor(), other_before))


def test_grad_none_on_every_rank_skips_that_parameter():
    for unchanged, other_unchanged in run_ranks(_grad_none_everywhere, 2, timeout=60):
        assert unchanged and not other_unchanged


def _qk_logits_on_some_ranks(rank, world_size):
    _, _, opt = _setup(world_size)
    logits = {0: torch.full((4,), 5.0)} if rank == 0 else None
    return outcome(lambda: opt.step(qk_logits=logits))


def test_qk_logits_on_some_ranks_raises_everywhere():
    results = run_ranks(_qk_logits_on_some_ranks, 2, timeout=60)
    assert {r[0] for r in results} == {"RuntimeError"}
    assert all("qk_logits" in r[1] for r in results)


def _bad_qk_logits_on_one_rank(rank, world_size):
    _, _, opt = _setup(world_size)
    n = 3 if rank == 1 else 4  # wrong number of heads on rank 1
    return outcome(lambda: opt.step(qk_logits={0: torch.full((n,), 5.0)}))


def test_wrong_head_count_on_one_rank_fails_every_rank_without_hang():
    results = run_ranks(_bad_qk_logits_on_one_rank, 2, timeout=60)
    assert results[1][0] == "ValueError" and "qk_logits[0]" in results[1][1] and "4 query heads" in results[1][1]
    assert results[0][0] == "RuntimeError" and "rejected their inputs" in results[0][1]


def _nonfinite_on_one_rank(rank, world_size, skip):
    _, named, opt = _setup(world_size, skip_nonfinite=skip)
    if rank == 0:
        named[0][1].grad._local_tensor[0, 0] = float("nan")
    before = [p.full_tensor().clone() for _, p in named]
    opt.step()
    after = [p.full_tensor() for _, p in named]
    return opt.last_step_skipped, [torch.equal(a, b) for a, b in zip(after, before)], len(opt.state)


def test_skip_nonfinite_skips_on_every_rank():
    for skipped, unchanged, n_state in run_ranks(_nonfinite_on_one_rank, 2, True, timeout=60):
        assert skipped and all(unchanged) and n_state == 0


def test_without_skip_nonfinite_the_step_runs():
    for skipped, unchanged, _ in run_ranks(_nonfinite_on_one_rank, 2, False, timeout=60):
        assert not skipped and not any(unchanged)


def _different_qk_logits(rank, world_size):
    _, named, opt = _setup(world_size)
    before = [p.full_tensor().clone() for _, p in named]
    logits = {0: torch.tensor([5.0, 0.5, 0.5, 0.5 + rank])}  # head 3 differs between ranks
    result = outcome(lambda: opt.step(qk_logits=logits))
    return result, all(torch.equal(p.full_tensor(), b) for (_, p), b in zip(named, before))


def test_different_qk_logits_on_different_ranks_fail_every_rank():
    for (kind, msg), unchanged in run_ranks(_different_qk_logits, 2, timeout=60):
        assert kind == "RuntimeError" and "qk_logits differ between ranks" in msg
        assert unchanged


def _same_qk_logits(rank, world_size):
    _, _, opt = _setup(world_size)
    return outcome(lambda: opt.step(qk_logits={0: torch.tensor([5.0, 0.5, 0.5, 0.5])}))


def test_identical_qk_logits_pass_the_check():
    assert run_ranks(_same_qk_logits, 2, timeout=60) == [("ok", ""), ("ok", "")]
