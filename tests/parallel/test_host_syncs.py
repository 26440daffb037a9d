"""No host synchronisation in a steady-state step, other than the agreement's one read-back.

On an accelerator every ``.item()``, ``bool(tensor)``, ``nonzero``, ``torch.equal``,
``.tolist()`` or copy to the host waits for the device to drain its queue.  This CPU
proxy watches a step: a ``TorchDispatchMode`` records the synchronising aten ops
(``_local_scalar_dense`` is what ``.item()``/``int()``/``float()``/``bool()`` become,
plus ``nonzero``, ``equal``, ``is_nonzero``, and copies to the CPU from another device),
and the Python entry points that read data without dispatching on CPU (``tolist``,
``numpy``, ``cpu``) are wrapped and counted (``optimizer.testing.HostSyncs``).  The one allowed read is the agreement's
``tolist`` of the summed vector.  ``scripts/gpu_check.sh`` runs the same step on CUDA
under ``torch.cuda.set_sync_debug_mode("error")``.

Muon groups only: the AdamW path is torch's own functional AdamW (fused on CUDA: no host
read; with foreach, torch reads its step counters, which live on the CPU by design).
"""

from __future__ import annotations

import pytest
import torch

from dist_cases import HEAD_DIM, build_groups, make_case_tensors, parse_placement, qk_logits_for, to_dtensor
from harness import run_ranks
from optimizer.testing import HostSyncs, overlap_seconds

Q, K = (16, 12), (8, 12)


def _specs(case: str, copies: int):
    base = {
        "fsdp": ((4,), [("layers.{i}.attention.wq.weight", Q, ["S0"]), ("layers.{i}.attention.wk.weight", K, ["S0"]),
                        ("layers.{i}.ffn.w1.weight", (10, 12), ["S1"])]),
        "fsdp_tp": ((2, 2), [("layers.{i}.attention.wq.weight", Q, ["SS0/2", "S0"]),
                             ("layers.{i}.attention.wk.weight", K, ["SS0/2", "S0"]),
                             ("layers.{i}.attention.wo.weight", (12, 16), ["S0", "S1"]),
                             ("layers.{i}.ffn.w1.weight", (9, 6), ["SS0/2", "S0"])]),  # uneven, strided
        "experts": ((4,), [("layers.{i}.moe.w1", (8, 12, 16), ["S1"]), ("layers.{i}.moe.w2", (8, 16, 12), ["S0"]),
                           ("layers.{i}.attention.wq.weight", Q, ["S0"]),
                           ("layers.{i}.attention.wk.weight", K, ["S0"])]),
        "hsdp_split": ((2, 2), [("layers.{i}.attention.wq.weight", Q, ["R", "S0"]),
                                ("layers.{i}.attention.wk.weight", K, ["R", "S0"]),
                                ("layers.{i}.ffn.w1.weight", (7, 5), ["R", "R"])]),
        # experts held whole (Shard(0)), fewer than ranks: moved to the ranks holding none (ns_split "auto")
        "expert_moves": ((4,), [("layers.{i}.moe.w1", (2, 12, 16), ["S0"]), ("layers.{i}.moe.w2", (3, 16, 12), ["S0"]),
                                ("layers.{i}.attention.wq.weight", Q, ["S0"]),
                                ("layers.{i}.attention.wk.weight", K, ["S0"])]),
        # Newton–Schulz split over the shard group (ns_split="always"): wide, tall, experts
        # Dion2: every member holds a piece of every slice (a tall matrix's columns, a wide Shard(1)'s rows)
        "dion2_static": ((4,), [("layers.{i}.attention.wq.weight", Q, ["S0"]), ("layers.{i}.ffn.w1.weight", (10, 12), ["S1"])]),
        # NorDion2 selects rows: static where every member holds a piece of every row (Shard(1))
        "rows_static": ((4,), [("layers.{i}.attention.wq.weight", Q, ["S1"]), ("layers.{i}.ffn.w1.weight", (10, 12), ["S1"])]),
        "ns_split": ((4,), [("layers.{i}.attention.wq.weight", Q, ["S0"]),
                            ("layers.{i}.attention.wk.weight", K, ["S0"]),
                            ("layers.{i}.ffn.w1.weight", (40, 12), ["S0"]), ("layers.{i}.moe.w1", (2, 8, 24), ["S1"])]),
    }[case]
    mesh_shape, templates = base
    return mesh_shape, [(n.format(i=i), shape, pl) for i in range(copies) for n, shape, pl in templates]


VARIANTS = dict(normuon_beta2=0.9, cautious_wd=True, momentum_dtype=torch.bfloat16)


def _watch_step(rank, world_size, case, copies, qk, skip_nonfinite, options=None):
    from optimizer import Muon, QKClipConfig
    from optimizer.parallel.planning import plan_inputs
    from optimizer.parallel.planning.cut_hardware import CPU_GLOO, SplitHardware
    from torch.distributed.device_mesh import init_device_mesh

    if case == "expert_moves":  # moving these tiny experts pays only on a fast link (collectives kept slow: no cut)
        plan_inputs.split_hardware = lambda device: SplitHardware(
            "test: moves free, collectives slow", CPU_GLOO.bf16_flops, CPU_GLOO.fp32_flops, 1e18, 1.0, torch.float32,
            device="cpu")

    mesh_shape, specs = _specs(case, copies)
    mesh = init_device_mesh("cpu", mesh_shape)
    params, grads = make_case_tensors(specs, 2)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
             for n, _, pl in specs]
    opt = Muon(build_groups(named), lr=0.02, skip_nonfinite=skip_nonfinite, replica_split="always",
               qk_clip=QKClipConfig(head_dim=HEAD_DIM, threshold=1.0) if qk else None,
               ns_split="always" if case == "ns_split" else "auto", **(options or {}))
    counts = []
    for s in range(2):
        for n, p in named:
            p.grad = to_dtensor(grads[s][n], mesh, p.placements)
        logits = qk_logits_for(specs, s, 1.0) if qk else None
        if s == 0:
            opt.step(qk_logits=logits)  # warm-up: builds the plan and the momentum buffers
            continue
        with HostSyncs() as syncs:
            opt.step(qk_logits=logits)
        counts.append(syncs.events)
    return counts[0], opt.last_step_stats.chunks, opt.last_step_stats.split_units, opt.last_step_stats.moved_units


@pytest.mark.parametrize("case, qk, skip, options", [
    ("fsdp", True, True, None), ("fsdp_tp", True, False, None), ("experts", True, True, None),
    ("hsdp_split", True, True, None), ("fsdp_tp", False, False, None), ("ns_split", True, True, None),
    # NorMuon (v through the all-to-alls and the replica all-gather), cautious WD, bf16 momentum
    ("fsdp_tp", True, False, VARIANTS), ("experts", True, True, VARIANTS), ("hsdp_split", True, True, VARIANTS),
    # ... and on cut units: the whole matrix's row statistics by all-reduce, never read back
    ("ns_split", True, True, VARIANTS),
    # experts moved to ranks that hold none (their all-to-alls, NorMuon's v in their blocks)
    ("expert_moves", True, True, None), ("expert_moves", True, True, VARIANTS),
], ids=lambda x: "variants" if isinstance(x, dict) else None)
def test_one_host_read_per_step_whatever_the_number_of_parameters(case, qk, skip, options):
    for copies in (1, 3):
        results = run_ranks(_watch_step, 4, case, copies, qk, skip, options, timeout=120)
        for events, chunks, split_units, _ in results:
            assert events == ["tolist"], (case, copies, events)  # the agreement's one read-back
            assert chunks >= 1
            assert (split_units > 0) == (case == "ns_split")
        if case == "expert_moves" and copies == 3:  # 15 experts on 4 ranks held 6, 6, 3, 0: some move
            assert sum(moved for *_, moved in results) > 0


@pytest.mark.parametrize("case, split, options", [
    ("fsdp", True, None), ("fsdp_tp", True, None), ("experts", True, None), ("hsdp_split", True, None),
    ("dion2_static", False, None), ("fsdp_tp", True, dict(normuon_beta2=0.9, cautious_wd=True)),
    ("rows_static", False, dict(normuon_beta2=0.9, momentum_dtype=torch.bfloat16)),
    ("dion2_static", True, dict(normuon_beta2=0.9)),  # NorDion2's rows of the tall Shard(0) matrix are split
], ids=lambda x: "variants" if isinstance(x, dict) else None)
def test_dion2_reads_its_chosen_counts_once_where_a_selection_dim_is_split(case, split, options):
    """Dion2 groups (issue 40, the lead's decision 1): the agreement's read, plus one read of the
    step's chosen counts (all parameters at once) where some matrix's selection dim is split over
    its shard group (wide Shard(0) rows); none more elsewhere; whatever the number of parameters."""
    for copies in (1, 3):
        results = run_ranks(_watch_step, 4, case, copies, False, True, dict(dion2_fraction=0.25, **(options or {})),
                            timeout=120)
        for events, *_ in results:
            assert events == ["tolist"] * (2 if split else 1), (case, copies, events)


def test_the_recorder_sees_what_it_must():
    """The watcher catches each kind of host read (so the test above can fail)."""
    t = torch.arange(4.0)
    with HostSyncs() as syncs:
        t.sum().item()
        bool(t[0])
        t.nonzero()
        torch.equal(t, t)
        t.tolist()
        t.numpy()
    assert syncs.events == ["aten._local_scalar_dense.default"] * 2 + [
        "aten.nonzero.default", "aten.equal.default", "tolist", "numpy"]
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]  # and leaves tensors as they were afterwards


def test_overlap_of_interval_sets():
    assert overlap_seconds([(0, 10)], [(5, 15)]) == 5
    assert overlap_seconds([(0, 2), (4, 6)], [(1, 5)]) == 2
    assert overlap_seconds([(0, 3), (1, 4)], [(2, 10), (3, 5)]) == 2  # unions first: no double counting
    assert overlap_seconds([(0, 1)], [(1, 2)]) == 0
    assert overlap_seconds([], [(0, 1)]) == 0
