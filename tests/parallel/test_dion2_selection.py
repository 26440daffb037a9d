"""Dion2's distributed exact selection (``parallel/execution/dion2_selection.py``) on forked gloo ranks.

For every layout (FSDP ``Shard(0)``/``Shard(1)``, TP, FSDP+TP with ``_StridedShard`` decodable and
interleaved, HSDP, uneven and empty shards, 3-D expert stacks sharded on the expert dim, on a matrix
dim, or both), wide, tall and square matrices, fractions 0.25, 0.5 and 1, Dion2 and NorDion2 (rows
only), and momenta with exact ties (zero slices, copied slices), on 2, 4 and 8 ranks:

(a) every local slice's global index is what ``full_tensor()`` shows: the local piece equals the
    full tensor's slice at that index, element by element (distinct random values);
(b) every rank's mask equals the single-device selection of ``full_tensor()`` computed here from
    the formulas (``dion2_reference``: exact L1 norms by ``math.fsum``, larger first, equal norms
    lower index first), per expert; the owner's chosen indices too; the counts (one host read
    where a selection dim is split, none elsewhere; the selection itself reads nothing);
(d) the bytes the selection's ``all_to_all_single`` move (counted by wrapping torch's function)
    equal the formula ``9 bytes x (the members' local slices - the owner's)`` per unit, against
    the full matrices' bytes.

(c) ``test_breaks_are_caught``: a perturbed partial norm on one rank, a wrong index map on one
rank, and the opposite tie rule each make these checks fail.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dion2_reference as ref
from dist_cases import parse_placement
from harness import DistributedTestError, run_ranks
from strided_layouts import full_of, make_dtensor
from tolerances import gamma

MATRICES = [(6, 20), (20, 6), (12, 12), (7, 13), (13, 7), (3, 10), (10, 3)]  # wide, tall, square, uneven, empty
STACKS = [(3, 6, 10), (3, 10, 6), (5, 7, 7)]
FRACTIONS = (0.25, 0.5, 1.0)
KINDS = ("random", "zeros", "copies")


def layouts(world: int) -> list[tuple[str, tuple[int, ...], list[str], list]]:
    """(name, mesh shape, placements, shapes) of every layout tried on ``world`` ranks."""
    out = [("fsdp_rows", (world,), ["S0"], MATRICES), ("fsdp_cols", (world,), ["S1"], MATRICES),
           ("strided_interleaved_rows", (world,), ["SS0/2"], MATRICES),
           ("strided_interleaved_cols", (world,), ["SS1/2"], MATRICES[:3]),
           ("experts_on_expert_dim", (world,), ["S0"], STACKS), ("experts_on_rows", (world,), ["S1"], STACKS),
           ("experts_on_cols", (world,), ["S2"], STACKS)]
    if world >= 4:
        h = world // 2
        out += [("tp_rows_hsdp", (h, 2), ["R", "S0"], MATRICES), ("tp_cols_hsdp", (h, 2), ["R", "S1"], MATRICES),
                ("fsdp_tp", (h, 2), ["S0", "S1"], MATRICES), ("fsdp_tp_strided", (h, 2), ["SS0/2", "S0"], MATRICES),
                ("experts_fsdp_and_rows", (h, 2), ["S0", "S1"], STACKS),
                ("experts_strided_rows", (h, 2), ["SS1/2", "S1"], STACKS)]
    if world == 8:
        out += [("hsdp_fsdp_tp_strided", (2, 2, 2), ["R", "SS0/2", "S0"], MATRICES),
                ("hsdp_fsdp_tp", (2, 2, 2), ["R", "S0", "S1"], MATRICES[:3] + STACKS[:1])]
    return out


def make_full(shape, kind: str, seed: int, dim_of) -> torch.Tensor:
    """A global momentum, the same on every rank.  ``zeros``: most slices zero (ties among them
    decide at fraction 0.5); ``copies``: most slices one vector (ties among copies decide)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64).to(torch.float32)
    if kind == "random":
        return t
    dim = dim_of(shape)
    s = shape[dim]
    moved = t.movedim(dim, -1)  # [..., other, s]: slice i is moved[..., i]
    if kind == "zeros":
        moved[..., s // 4:] = 0
    else:
        moved[..., 1:] = moved[..., :1]
        moved[..., s // 3] *= 0.5
    return moved.movedim(-1, dim).contiguous()


def reference_norms(full: torch.Tensor, rows_only: bool) -> tuple[int, list[list[float]]]:
    """The selection dim and, per matrix of the stack (row-major), the exact L1 norms of its
    slices (``math.fsum``), from the formulas."""
    dim = ref.selection_dim(full.shape, rows_only)
    m, n = full.shape[-2:]
    return dim, [ref.slice_norms(mat, dim) for mat in full.double().reshape(-1, m, n)]


def reference_chosen(norms: tuple[int, list[list[float]]], shape, fraction: float) -> tuple[int, list[list[int]]]:
    """The dim and, per matrix, the chosen global indices (larger norm first, equal norms lower
    index first); refuses inputs whose k-th and (k+1)-th norms are near-tied but not equal."""
    dim, per_matrix = norms
    k = ref.chosen_count(fraction, shape[dim])
    chosen = []
    for mat_norms in per_matrix:
        ranked = sorted(mat_norms, reverse=True)
        if 0 < k < len(ranked) and ranked[k - 1] != ranked[k]:
            bound = 4 * gamma(max(shape[-2:]), torch.float64) * ranked[k - 1]
            assert ranked[k - 1] - ranked[k] > bound, "near-tie"
        chosen.append(ref.choose(mat_norms, k))
    return dim, chosen


def _as_list(ix) -> list[int]:
    return list(range(ix.start, ix.stop)) if isinstance(ix, slice) else [int(v) for v in ix]


def check_indices(local: torch.Tensor, full: torch.Tensor, smap, where: str) -> None:
    """(a): local slice t is the full tensor's slice ``smap.slices[t]`` (over the indices the rank
    holds of the other dims), element by element."""
    lead = [_as_list(ix) for ix in smap.indices[:-2]]
    other = _as_list(smap.indices[-1 if smap.dim == -2 else -2])
    mats = full.reshape(math.prod(full.shape[:-2]), *full.shape[-2:])
    flat_lead = _flat_leading(lead, full.shape[:-2])
    loc = local.reshape(math.prod(local.shape[:-2]), *local.shape[-2:])
    for b, e in enumerate(flat_lead):
        for t, g in enumerate(_as_list(smap.slices)):
            want = mats[e][g][other] if smap.dim == -2 else mats[e][:, g][other]
            got = loc[b][t] if smap.dim == -2 else loc[b][:, t]
            assert torch.equal(got, want), f"{where}: local slice {t} is not the full tensor's slice {g} (matrix {e})"


def _flat_leading(lead: list[list[int]], shape) -> list[int]:
    """Row-major flat index of every local leading coordinate (one per local matrix)."""
    if not lead:
        return [0]
    flat = [0]
    for ix, size in zip(lead, shape):
        flat = [f * size + i for f in flat for i in ix]
    return flat


def check_selection(sel, smap, full, fraction, norms, where: str) -> list[int]:
    """(b): the rank's mask, counts and (on the owner) chosen indices against the reference
    (``norms``: :func:`reference_norms` of ``full``).  Returns the expected count per local matrix."""
    dim, chosen = reference_chosen(norms, full.shape, fraction)
    assert smap.dim == dim, f"{where}: selection dim {smap.dim}, the global shape says {dim}"
    lead = [_as_list(ix) for ix in smap.indices[:-2]]
    flat_lead = _flat_leading(lead, full.shape[:-2])
    slices = _as_list(smap.slices)
    want = torch.tensor([[g in set(chosen[e]) for g in slices] for e in flat_lead],
                        dtype=torch.bool).reshape(len(flat_lead), len(slices))
    got = sel.mask.reshape(len(flat_lead), len(slices))
    assert torch.equal(got, want), f"{where}: chosen set differs from single-device Dion2's\n{got}\n{want}"
    assert torch.equal(sel.counts.reshape(-1), want.sum(-1)), f"{where}: counts differ"
    if sel.chosen is not None:  # the owner: every chosen global index, per local matrix
        want_idx = torch.tensor([chosen[e] for e in flat_lead], dtype=torch.long).reshape(sel.chosen.shape)
        assert torch.equal(sel.chosen, want_idx), f"{where}: the owner's chosen indices differ"
    return want.sum(-1).tolist()


class A2ABytes:
    """Wraps ``dist.all_to_all_single``: the bytes this rank sends to other ranks (its own split
    excluded), counted from the call's arguments."""

    def __enter__(self):
        self.sent, self.calls, self._orig = 0, 0, dist.all_to_all_single

        def wrapped(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            me = dist.get_rank(group)
            self.sent += sum(n for j, n in enumerate(input_split_sizes) if j != me) * input.element_size()
            self.calls += 1
            return self._orig(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = wrapped
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig


def expected_bytes(momenta, sel_plan, owner_rank) -> int:
    """(d), world total: per unit, 8 bytes (fp64 partial) + 1 byte (mask) for each local slice of
    each local matrix of every member but the owner, in every shard group.  The members' local
    slice counts come from DTensor's local shapes (all-gathered, one collective), not from the plan."""
    mine = torch.zeros(len(momenta), 2, dtype=torch.long)
    for i, m in enumerate(momenta):
        local = m.to_local()
        dim = sel_plan.maps[i].dim  # checked against the global shape in check_selection
        mine[i, 0] = math.prod(local.shape[:-2]) * local.shape[dim]
        mine[i, 1] = int(owner_rank(i) == dist.get_rank())
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return 9 * sum(int(t[i, 0]) for t in every for i in range(len(momenta)) if not t[i, 1])


def run_layout(name, mesh_shape, placements, shapes, breaks=()):
    """Every shape and kind of one layout, every fraction, Dion2 and NorDion2; returns the world's
    selection bytes and the full matrices' fp32 bytes per (fraction, rows_only)."""
    from optimizer.parallel.execution.dion2_selection import plan_selection, read_counts, select_slices, unit_of
    from optimizer.testing import HostSyncs

    mesh = init_device_mesh("cpu", mesh_shape)
    pls = [parse_placement(p) for p in placements]
    fulls, momenta = [], []
    for si, shape in enumerate(shapes):
        for ki, kind in enumerate(KINDS):
            full = make_full(shape, kind, 100 * si + ki, lambda sh: ref.selection_dim(sh))
            fulls.append(full)
            momenta.append(make_dtensor(full, mesh, pls))
    seen = [full_of(m) for m in momenta]  # what DTensor reconstructs: the ground truth of (a)
    figures = {}
    for rows_only in (False, True):
        norms = [reference_norms(full, rows_only) for full in fulls]
        for fraction in FRACTIONS:
            plan = plan_selection(momenta, fraction, rows_only)
            with A2ABytes() as wire, HostSyncs() as syncs:
                sels = select_slices(plan, momenta)
            assert syncs.events == [], f"{name}: the selection read the host: {syncs.events}"
            with HostSyncs() as syncs:
                counts = read_counts(plan, sels)
            split = any(unit_of(plan, i).split for i in range(len(momenta)))
            assert len(syncs.events) == (1 if split else 0), f"{name}: counts read {syncs.events}, split={split}"
            for i, (m, full, sel) in enumerate(zip(momenta, seen, sels)):
                where = f"{name} {tuple(full.shape)} {KINDS[i % 3]} fraction={fraction} rows_only={rows_only}"
                assert torch.equal(full, fulls[i]), f"{where}: full_tensor() is not the tensor sharded"
                if fraction == FRACTIONS[0]:  # the maps depend on the dim, not on the fraction
                    check_indices(m.to_local(), full, plan.maps[i], where)
                assert counts[i] == check_selection(sel, plan.maps[i], full, fraction, norms[i], where)
            figures[(fraction, rows_only)] = _bytes(name, momenta, plan, wire, unit_of)
    return figures


def _bytes(name, momenta, plan, wire, unit_of) -> tuple[int, int]:
    """(d): the world's counted selection bytes equal the formula and the plan's own figure."""
    def owner_rank(i):
        u = unit_of(plan, i)
        pattern = next(p for p in plan.patterns if i in p.params)
        return dist.get_process_group_ranks(pattern.group)[u.owner] if pattern.group is not None else dist.get_rank()

    measured = torch.tensor([wire.sent, plan.wire_bytes()], dtype=torch.long)
    dist.all_reduce(measured)
    want = expected_bytes(momenta, plan, owner_rank)
    assert measured[0] == want, f"{name}: the selection moved {int(measured[0])} bytes, the formula says {want}"
    assert measured[1] == want, f"{name}: the plan's wire_bytes {int(measured[1])} != {want}"
    return want, sum(4 * m.numel() for m in momenta)


def _rank(rank, world, names, breaks=()):
    _install_breaks(rank, breaks)
    out = {}
    for name, mesh_shape, placements, shapes in layouts(world):
        if name in names:
            out[name] = run_layout(name, mesh_shape, placements, shapes)
    return out


GROUPS = {
    "1d": ["fsdp_rows", "fsdp_cols", "strided_interleaved_rows", "strided_interleaved_cols"],
    "experts": ["experts_on_expert_dim", "experts_on_rows", "experts_on_cols", "experts_fsdp_and_rows",
                "experts_strided_rows"],
    "2d": ["tp_rows_hsdp", "tp_cols_hsdp", "fsdp_tp", "fsdp_tp_strided", "hsdp_fsdp_tp_strided", "hsdp_fsdp_tp"],
}


# 2-D and 3-D meshes need 4 ranks or more: 2 ranks run the 1-D meshes (matrices and stacks)
RUNS = [(w, g) for w in (2, 4, 8) for g in sorted(GROUPS) if any(n in GROUPS[g] for n, *_ in layouts(w))]


@pytest.mark.parametrize("world,group", RUNS)
def test_selection_matches_single_device(world, group):
    names = [n for n, *_ in layouts(world) if n in GROUPS[group]]
    results = run_ranks(_rank, world, names, timeout=120 + 40 * world)
    assert all(r == results[0] for r in results), "ranks disagree about the bytes"
    assert set(results[0]) == set(names)


def _install_breaks(rank: int, breaks) -> None:
    """(c): deliberate faults on rank 1 only, each of which the checks above must catch."""
    if rank != 1 or not breaks:
        return
    from optimizer.parallel.execution import dion2_selection as ex
    from optimizer.parallel.planning import dion2_selection as pl

    if "partial" in breaks:  # one partial norm per matrix perturbed: its slice looks heavier
        orig_norms = ex.partial_slice_norms

        def perturbed(piece, dim):
            out = orig_norms(piece, dim)
            if out.shape[-1]:
                out[..., -1] += 1e3
            return out
        ex.partial_slice_norms = perturbed
    if "index" in breaks:  # the index map of the matrix dims reversed
        orig_indices = pl.local_indices

        def reversed_(*args):
            ix = list(orig_indices(*args))
            for d in (-2, -1):
                ix[d] = torch.tensor(_as_list(ix[d])[::-1], dtype=torch.long)
            return tuple(ix)
        pl.local_indices = reversed_
    if "ties" in breaks:  # equal norms: the higher index first
        orig_choose = ex.choose

        def higher_first(norms, k):
            s = norms.shape[-1]
            return torch.sort(s - 1 - orig_choose(norms.flip(-1), k), dim=-1).values
        ex.choose = higher_first


BREAKS = {"partial": "chosen set differs", "index": "is not the full tensor's slice", "ties": "chosen set differs"}


@pytest.mark.parametrize("fault", sorted(BREAKS))
def test_breaks_are_caught(fault):
    names = ["fsdp_rows", "fsdp_cols", "fsdp_tp_strided"]
    with pytest.raises(DistributedTestError, match=BREAKS[fault]):
        run_ranks(_rank, 4, names, breaks=(fault,), timeout=200)


def _refusals(rank, world):
    from optimizer.parallel.execution.dion2_selection import plan_selection, select_slices

    mesh = init_device_mesh("cpu", (world,))
    good = make_dtensor(torch.randn(8, 12), mesh, [parse_placement("S0")])
    out = []
    vector = make_dtensor(torch.randn(8), mesh, [parse_placement("S0")])
    cases = [([good.to_local()], 0.5, TypeError), ([vector], 0.5, ValueError), ([good], 0.0, ValueError),
             ([good], 1.5, ValueError), ([good], None, ValueError)]
    for momenta, fraction, kind in cases:
        try:
            plan_selection(momenta, fraction)
        except kind as err:
            out.append(str(err))
    plan = plan_selection([good], 0.5)
    try:
        select_slices(plan, [make_dtensor(torch.randn(8, 12), mesh, [parse_placement("S1")])])
    except ValueError as err:
        out.append(str(err))
    return out


def test_bad_input_refused_alike_on_every_rank():
    results = run_ranks(_refusals, 2, timeout=60)
    assert results[0] == results[1] and len(results[0]) == 6
    wants = ["momenta[0] is a Tensor, not a DTensor", "momenta[0]` has shape (8,)", "orthogonalises), got 0.0",
             "orthogonalises), got 1.5", "`fraction` is None",
             "momenta[0] is (8, 12) (Shard(dim=1),), planned as (8, 12) (Shard(dim=0),)"]
    for got, want in zip(results[0], wants):
        assert want in got, (got, want)


def _layer_bytes(rank, world):
    from optimizer.parallel.execution.dion2_selection import plan_selection, select_slices

    out = {}
    for name, mesh_shape, placements in [("fsdp_rows", (4,), ["S0"]), ("fsdp_tp_strided", (2, 2), ["SS0/2", "S0"]),
                                         ("hsdp", (2, 2), ["R", "S0"])]:
        mesh = init_device_mesh("cpu", mesh_shape)
        momenta = [make_dtensor(torch.randn(s, generator=torch.Generator().manual_seed(i)), mesh,
                                [parse_placement(p) for p in placements]) for i, s in enumerate(LAYER)]
        plan = plan_selection(momenta, 0.25)
        with A2ABytes() as wire:
            select_slices(plan, momenta)
        sent = torch.tensor([wire.sent])
        dist.all_reduce(sent)
        out[name] = int(sent)
    return out


LAYER = [(64, 256), (256, 64), (128, 128)]  # wide (rows), tall (columns), square


def test_selection_bytes_against_the_matrices():
    """(d) on 4 ranks: the world's selection bytes per step are the closed form 9 s c R (S-1)/S
    (c members hold a piece of each slice, R replicas each select, S members per shard group), a
    small fraction of the matrices' bytes and of Muon's gather + scatter of them (fp32 wire)."""
    got = run_ranks(_layer_bytes, 4, timeout=120)[0]
    matrix = sum(4 * m * n for m, n in LAYER)  # fp32
    # (s, c) per matrix: wide rows split (c = 1), tall columns each held in pieces by every member
    closed = {"fsdp_rows": sum(9 * s * c * 3 // 4 for s, c in [(64, 1), (64, 4), (128, 1)]),
              "fsdp_tp_strided": sum(9 * s * c * 3 // 4 for s, c in [(64, 1), (64, 4), (128, 1)]),
              "hsdp": 2 * sum(9 * s * c * 1 // 2 for s, c in [(64, 1), (64, 2), (128, 1)])}
    assert got == closed
    muon = {"fsdp_rows": 2 * matrix * 3 / 4, "fsdp_tp_strided": 2 * matrix * 3 / 4, "hsdp": 2 * 2 * matrix / 2}
    for name, n in got.items():  # 3,024 bytes of 196,608 (0.015; 0.010 of Muon's); hsdp 2,880 (0.015; 0.007)
        assert n / matrix < 0.016 and n / muon[name] < 0.011, (name, n, matrix)
