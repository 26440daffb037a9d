"""Dion2 and NorDion2 groups of DTensor parameters (``parallel/execution/dion2_step.py``) on forked gloo ranks.

For every layout (FSDP ``Shard(0)``/``Shard(1)``, interleaved ``_StridedShard``, TP under HSDP,
FSDP+TP plain and ``_StridedShard``, 3-D expert stacks sharded on the expert dim, a matrix dim or
both), wide, tall, square, uneven and empty shards, and four variants (Dion2 with
``"spectral_norm"``; NorDion2; bf16 momentum with cautious weight decay; ``muon_transposed``), on
2 and 4 ranks, a Muon of DTensors and a Muon of the same weights held whole (single-device Dion2,
``dion2/step.py``, itself checked against the float64 formulas in ``tests/rule/``) take 3 steps
with the same gradients, and:

(a) every parameter, momentum and NorDion2 ``v``, assembled from the ranks' pieces
    (``strided_layouts.full_of``: DTensor's own ``full_tensor()`` where it reconstructs the
    placements), equals the single-device one bit for bit;
(b) every rank chose the same slices each step, and they are the single-device step's;
(c) the bytes one step moves (counted on ``all_gather_into_tensor``) are the formula
    ``(S - 1) x the largest piece x bytes`` per sharding mesh dim, against Muon's on the same layout.

``test_a_wrong_slice_on_one_rank_fails``: rank 1 replaces one chosen slice; (a) catches it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import Parameter

from dist_cases import parse_placement
from harness import DistributedTestError, run_ranks
from strided_layouts import full_of, make_dtensor

MATRICES = [(6, 20), (20, 6), (12, 12), (7, 13), (13, 7), (3, 10)]  # wide, tall, square, uneven, empty pieces
STACKS = [(3, 6, 10), (3, 10, 6)]
VARIANTS = {
    "dion2": dict(dion2_fraction=0.5, adjust_lr="spectral_norm", weight_decay=0.1),
    "nordion2": dict(dion2_fraction=0.25, normuon_beta2=0.9, weight_decay=0.1, dion2_ef_decay=0.8),
    "bf16_cautious": dict(dion2_fraction=0.3, momentum_dtype=torch.bfloat16, cautious_wd=True, weight_decay=0.2),
    "transposed": dict(dion2_fraction=0.25, muon_transposed=True, weight_decay=0.1),
}
STEPS = 3


def layouts(world: int) -> list[tuple[str, tuple[int, ...], list[str], list]]:
    out = [("fsdp_rows", (world,), ["S0"], MATRICES), ("fsdp_cols", (world,), ["S1"], MATRICES),
           ("strided_interleaved_rows", (world,), ["SS0/2"], MATRICES[:3]),
           ("experts_on_expert_dim", (world,), ["S0"], STACKS), ("experts_on_rows", (world,), ["S1"], STACKS)]
    if world >= 4:
        h = world // 2
        out += [("tp_rows_hsdp", (h, 2), ["R", "S0"], MATRICES), ("tp_cols_hsdp", (h, 2), ["R", "S1"], MATRICES),
                ("fsdp_tp", (h, 2), ["S0", "S1"], MATRICES), ("fsdp_tp_strided", (h, 2), ["SS0/2", "S0"], MATRICES),
                ("experts_fsdp_and_rows", (h, 2), ["S0", "S1"], STACKS)]
    return out


def _full(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(torch.float32)


def _optimizers(mesh, placements, shapes, options):
    dts = [Parameter(make_dtensor(_full(s, i), mesh, placements)) for i, s in enumerate(shapes)]
    whole = [Parameter(_full(s, i)) for i, s in enumerate(shapes)]
    names = [f"w{i}" for i in range(len(shapes))]
    make = lambda ps: Muon([{"params": ps, "param_names": names, "use_muon": True, **options}], lr=0.05)  # noqa: E731
    return dts, whole, make(dts), make(whole)


class Recorder:
    """Records ``dion2_rule.choose_slices``'s indices of the DTensor path (``breaks``: rank 1
    swaps one chosen slice of its first selection for an unchosen one)."""

    def __init__(self, broken: bool):
        from optimizer.parallel.execution import dion2_step

        self.module, self.broken, self.chosen = dion2_step, broken, []
        self.original = dion2_step.dion2_rule.choose_slices

    def __call__(self, buf, fraction, rows_only=False):
        sel = self.original(buf, fraction, rows_only)
        if self.broken and not self.chosen:
            idx = sel.indices.clone()
            free = [i for i in range(buf.shape[sel.dim]) if i not in idx.reshape(-1)[:idx.shape[-1]].tolist()]
            if free:
                idx.reshape(-1, idx.shape[-1])[0, 0] = free[0]
                sel = type(sel)(sel.dim, idx.sort(dim=-1).values)
        self.chosen.append(sel.indices.tolist())
        return sel


def _run_layout(rank, world, mesh_shape, placement_names, shapes, options, broken):
    mesh = init_device_mesh("cpu", mesh_shape)
    pls = [parse_placement(p) for p in placement_names]
    dts, whole, opt, ref = _optimizers(mesh, pls, shapes, options)
    rec = Recorder(broken and rank == 1)
    ref_rec = Recorder(False)
    out = {"equal": [], "chosen": [], "ref_chosen": []}
    for step in range(STEPS):
        grads = [_full(p.shape, 100 * step + i + 50) for i, p in enumerate(whole)]
        for p, w, g in zip(dts, whole, grads):
            p.grad = make_dtensor(g, mesh, pls)
            w.grad = g.clone()
        rec.module.dion2_rule.choose_slices = rec
        try:
            opt.step()
        finally:
            rec.module.dion2_rule.choose_slices = rec.original
        import optimizer.dion2.rule as rule

        rule_original, rule.choose_slices = rule.choose_slices, ref_rec
        try:
            ref.step()
        finally:
            rule.choose_slices = rule_original
    for p, w in zip(dts, whole):
        got, want = opt.state[p], ref.state[w]
        pairs = [(full_of(p.detach()), w.detach())] + [(full_of(got[k]), want[k]) for k in sorted(want)]
        out["equal"].append([bool(torch.equal(a, b)) and a.dtype == b.dtype for a, b in pairs])
    out["chosen"], out["ref_chosen"] = rec.chosen, ref_rec.chosen
    return out


def _rank(rank, world, variants, broken=False):
    global Muon
    from optimizer import Muon

    results = {}
    for name, mesh_shape, placements, shapes in layouts(world):
        for variant in variants:
            results[(name, variant)] = _run_layout(rank, world, mesh_shape, placements, shapes, VARIANTS[variant],
                                                   broken)
    return results


def _check(results, world):
    for key in results[0]:
        for rank, res in enumerate(results):
            r = res[key]
            assert all(all(flags) for flags in r["equal"]), (key, rank, r["equal"])
            assert r["chosen"] == r["ref_chosen"], (key, rank)  # (b): the single-device step's slices
            assert r["chosen"] == results[0][key]["chosen"], (key, rank)  # (b): every rank alike
        assert len(results[0][key]["chosen"]) == STEPS * len(layout_shapes(world, key[0]))


def layout_shapes(world, name):
    return next(shapes for n, _, _, shapes in layouts(world) if n == name)


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_dion2_equals_single_device(world):
    results = run_ranks(_rank, world, tuple(VARIANTS), timeout=240 + 60 * world)
    _check(results, world)


def test_a_wrong_slice_on_one_rank_fails():
    results = run_ranks(_rank, 2, ("dion2",), broken=True, timeout=240)
    with pytest.raises(AssertionError):
        _check(results, 2)
    # the break shows in the weights themselves, not only in the recorded indices
    assert any(not all(all(f) for f in res[key]["equal"]) for res in results for key in res)


def _bytes_rank(rank, world):
    from optimizer import Muon
    from optimizer.parallel.execution import dion2_step

    mesh = init_device_mesh("cpu", (world,))
    pls = [parse_placement("S0")]
    moved = []
    original = dist.all_gather_into_tensor

    def counting(out, inp, group=None, async_op=False):
        moved.append(out.numel() * out.element_size() - inp.numel() * inp.element_size())  # received
        return original(out, inp, group=group, async_op=async_op)

    p = Parameter(make_dtensor(_full((64, 256), 0), mesh, pls))
    opt = Muon([{"params": [p], "use_muon": True}], lr=0.05, dion2_fraction=0.25)
    p.grad = make_dtensor(_full((64, 256), 1), mesh, pls)
    dion2_step.dist.all_gather_into_tensor = counting
    try:
        opt.step()
    finally:
        dion2_step.dist.all_gather_into_tensor = original
    return sum(moved)


def test_bytes_against_muon():
    """Received per rank: ``(S - 1)/S`` of the fp32 momentum; the world total ``(S - 1) P w``
    against Muon's ``2 P w (S - 1) / S``: ``S / 2`` times Muon's (the first version moves more)."""
    for world in (2, 4):
        got = run_ranks(_bytes_rank, world, timeout=120)
        entries, w = 64 * 256, 4
        assert got == [(world - 1) * entries // world * w] * world
        muon_total = 2 * entries * w * (world - 1) / world
        assert sum(got) / muon_total == pytest.approx(world / 2)



def _mixed_rank(rank, world):
    """A Muon group, a Dion2 group and an AdamW group of DTensors in one optimizer; what Dion2 does
    not build (``ns_split="always"``, row blocks) refused for DTensors by name."""
    from optimizer import Muon

    mesh = init_device_mesh("cpu", (world,))
    pls = [parse_placement("S0")]
    shapes = {"muon": (12, 20), "dion2": (20, 12), "adamw": (10,)}
    make = lambda dt: {k: Parameter(make_dtensor(_full(s, i), mesh, pls) if dt else _full(s, i))  # noqa: E731
                       for i, (k, s) in enumerate(shapes.items())}
    mixed, alone, whole = make(True), make(True), make(False)
    groups = lambda ps: [{"params": [ps["muon"]], "use_muon": True},  # noqa: E731
                         {"params": [ps["dion2"]], "use_muon": True, "dion2_fraction": 0.25},
                         {"params": [ps["adamw"]], "use_muon": False}]
    opt = Muon(groups(mixed), lr=0.05, weight_decay=0.1)
    muon_only = Muon([{"params": [alone["muon"]], "use_muon": True}], lr=0.05, weight_decay=0.1)
    ref = Muon(groups(whole), lr=0.05, weight_decay=0.1)
    for step in range(STEPS):
        for i, k in enumerate(shapes):
            g = _full(shapes[k], 100 * step + i + 7)
            mixed[k].grad = make_dtensor(g, mesh, pls)
            alone[k].grad = make_dtensor(g, mesh, pls)
            whole[k].grad = g.clone()
        opt.step()
        muon_only.step()
        ref.step()
    refusals = {}
    for key, value in (("ns_split", "always"), ("muon_row_blocks", "heads:2")):
        try:
            Muon([{"params": [mixed["dion2"]], "use_muon": True, "dion2_fraction": 0.25, key: value}])
            refusals[key] = None
        except ValueError as err:
            refusals[key] = str(err)
    return {"refused " + k: m is not None and k in m and "Dion2" in m for k, m in refusals.items()} | {
            "muon as alone": bool(torch.equal(full_of(mixed["muon"].detach()), full_of(alone["muon"].detach()))),
            "dion2 as whole": bool(torch.equal(full_of(mixed["dion2"].detach()), whole["dion2"].detach())),
            "dion2 momentum": bool(torch.equal(full_of(opt.state[mixed["dion2"]]["momentum_buffer"]),
                                               ref.state[whole["dion2"]]["momentum_buffer"])),
            "dion2 moved": not torch.equal(whole["dion2"].detach(), _full(shapes["dion2"], 1))}


def test_dion2_beside_muon_and_adamw_groups():
    for out in run_ranks(_mixed_rank, 2, timeout=120):
        assert all(out.values()), out
