"""The multi-rank harness fails fast and says where: errors from every rank, and hangs."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from harness import DistributedTestError, run_ranks


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_results_come_back_per_rank():
    assert run_ranks(_sum_of_ranks, 3, timeout=30) == [3.0, 3.0, 3.0]


def _one_rank_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait here forever


def test_an_error_on_one_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"(?s)--- rank 1 ---.*rank one is broken"):
        run_ranks(_one_rank_raises, 2, timeout=120)
    assert time.monotonic() - start < 60


def _one_rank_hangs(rank, world_size):
    if rank == 0:
        time.sleep(600)


def test_a_hang_is_reported_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"did not finish within 8s"):
        run_ranks(_one_rank_hangs, 2, timeout=8)
    assert time.monotonic() - start < 30
