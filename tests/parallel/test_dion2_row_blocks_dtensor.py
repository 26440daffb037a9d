"""Row blocks (``muon_row_blocks``) of DTensor parameters in Dion2/NorDion2 groups, on forked gloo ranks.

Each block is its own Dion2 matrix on a mesh exactly as on one device (``parallel/execution/
dion2_step.py``: one selection and exchange unit per parameter and block).  Per-head blocks, a
fused QKV (``FusedQKV`` grouped: the q block's rows are not one run), blocks of two shapes in one
weight (one selecting rows, one columns), a callable of non-contiguous blocks and a 3-D expert
stack, on FSDP ``Shard(0)``, TP ``Shard(1)``, interleaved ``_StridedShard``, HSDP, FSDP x TP plain
and strided (2 and 4 ranks), Dion2 (``spectral_norm``), NorDion2 and ``muon_transposed``; against
the same weights held whole (single-device Dion2 with the same row blocks, ``dion2/step.py``'s
plain path, itself checked against the float64 formulas in ``tests/rule/test_dion2_row_blocks.py``),
3 steps with the same gradients:

(a) every weight, momentum and NorDion2 ``v`` (``strided_layouts.full_of``) equals single device,
    bit for bit;
(b) every rank chose, per block, the single-device step's slices (by index within the block),
    and the owner's whole choice is the single-device one;
(c) the piece of each block every rank hands the selection equals, entry by entry, the rows of
    ``M + G`` (written here from the single-device momentum) at the block's rows written in this
    test (not the code's row maps) and the rank's columns;
(d) the bytes of one step's all-to-alls on 4 ranks equal the formula of ``test_dion2_dtensor.py``
    applied per block: 9 bytes per local slice of the block, 8 per chosen local entry, owners excepted.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import Parameter

from dist_cases import parse_placement
from harness import run_ranks
from strided_layouts import full_of, make_dtensor
from test_dion2_dtensor import Recorder, RefRecorder, WireBytes, _as_list, _full


def _even_odd(name, shape):
    """A callable spec: the even rows, then the odd rows (two non-contiguous blocks)."""
    return [torch.arange(0, shape[0], 2), torch.arange(1, shape[0], 2)]


def _runs(*runs):
    return [r for start, stop in runs for r in range(start, stop)]


# name -> (shape [..., out, in], spec, each block's rows, written here)
PARAMS = {
    "heads": ((16, 12), "heads:4", [list(range(i, i + 4)) for i in range(0, 16, 4)]),
    # grouped, 4 q heads, 2 kv heads, head_dim 2: per group q q k v (rows 0-7, 8-15)
    "qkv": ((16, 12), "fused_qkv:4,2,2,grouped", [_runs((0, 4), (8, 12)), _runs((4, 6), (12, 14)),
                                                  _runs((6, 8), (14, 16))]),
    "rows_and_columns": ((24, 12), "blocks:4,20", [list(range(4)), list(range(4, 24))]),  # 4x12 rows, 20x12 columns
    "even_odd": ((12, 8), _even_odd, [list(range(0, 12, 2)), list(range(1, 12, 2))]),
    "experts": ((4, 8, 12), "heads:4", [list(range(4)), list(range(4, 8))]),
}
VARIANTS = {
    "dion2": dict(dion2_fraction=0.5, adjust_lr="spectral_norm", weight_decay=0.1),
    "nordion2": dict(dion2_fraction=0.25, normuon_beta2=0.9, weight_decay=0.1, dion2_ef_decay=0.8),
    "transposed": dict(dion2_fraction=0.3, muon_transposed=True, weight_decay=0.1),
}
STEPS = 3


def layouts(world):
    if world == 2:
        return [("fsdp_rows", (2,), ["S0"]), ("tp_cols", (2,), ["S1"]), ("strided_rows", (2,), ["SS0/2"])]
    return [("fsdp_rows", (4,), ["S0"]), ("hsdp", (2, 2), ["R", "S0"]), ("fsdp_tp", (2, 2), ["S0", "S1"]),
            ("fsdp_tp_strided", (2, 2), ["SS0/2", "S0"])]


def _stored(name, options):
    shape = PARAMS[name][0]
    return (*shape[:-2], shape[-1], shape[-2]) if options.get("muon_transposed") else shape


def _muon(ps, options):
    names = list(PARAMS)
    specs = {n: PARAMS[n][1] for n in names}
    return Muon([{"params": ps, "param_names": names, "use_muon": True, "muon_row_blocks": specs, **options}],
                lr=0.05)


def _units():
    """(parameter position, block rows) of every unit, in the step's order."""
    return [(i, rows) for i, n in enumerate(PARAMS) for rows in PARAMS[n][2]]


class PieceCheck:
    """Wraps ``dion2_step.select_local``: every unit's local piece against ``accumulated`` (the
    ``[out, in]`` views of ``M + G``) at the block's rows written here and the rank's indices."""

    def __init__(self, recorder):
        self.recorder, self.flags, self.accumulated = recorder, [], None

    def __call__(self, plan, locals_):
        for (i, rows), smap, piece in zip(_units(), plan.maps, locals_):
            a = self.accumulated[i]
            for d, ix in enumerate(smap.indices[:-2]):
                a = a.index_select(d, torch.tensor(_as_list(ix), dtype=torch.long))
            positions = _as_list(smap.indices[-2])
            a = a.index_select(-2, torch.tensor([rows[p] for p in positions], dtype=torch.long))
            a = a.index_select(-1, torch.tensor(_as_list(smap.indices[-1]), dtype=torch.long))
            self.flags.append(bool(torch.equal(piece, a.to(piece.dtype))))
        return self.recorder(plan, locals_)


def _step_both(dts, whole, opt, ref, rec, ref_rec, check, grads, options):
    check.accumulated = []
    for w, g in zip(whole, grads):
        before = ref.state[w]["momentum_buffer"] if w in ref.state else torch.zeros_like(w)
        acc = (before.float() + g).to(before.dtype)
        check.accumulated.append(acc.mT if options.get("muon_transposed") else acc)
    rec.module.select_local = check
    try:
        opt.step()
    finally:
        rec.module.select_local = rec.original
    ref_rec.module.choose_slices = ref_rec
    try:
        ref.step()
    finally:
        ref_rec.module.choose_slices = ref_rec.original


def _run_layout(mesh_shape, placement_names, options):
    mesh = init_device_mesh("cpu", mesh_shape)
    pls = [parse_placement(p) for p in placement_names]
    shapes = [_stored(n, options) for n in PARAMS]
    dts = [Parameter(make_dtensor(_full(s, i), mesh, pls)) for i, s in enumerate(shapes)]
    whole = [Parameter(_full(s, i)) for i, s in enumerate(shapes)]
    opt, ref = _muon(dts, options), _muon(whole, options)
    rec, ref_rec = Recorder(False), RefRecorder()
    check = PieceCheck(rec)
    for step in range(STEPS):
        grads = [_full(s, 100 * step + i + 50) for i, s in enumerate(shapes)]
        for p, w, g in zip(dts, whole, grads):
            p.grad, w.grad = make_dtensor(g, mesh, pls), g.clone()
        _step_both(dts, whole, opt, ref, rec, ref_rec, check, grads, options)
    equal = []
    for p, w in zip(dts, whole):
        pairs = [(full_of(p.detach()), w.detach())] + [(full_of(opt.state[p][k]), ref.state[w][k])
                                                       for k in sorted(ref.state[w])]
        equal.append([bool(torch.equal(a, b)) for a, b in pairs])
    return {"equal": equal, "pieces": check.flags, "chosen": rec.chosen, "ref_chosen": ref_rec.chosen}


def _rank(rank, world, variants):
    global Muon
    from optimizer import Muon

    return {(name, v): _run_layout(shape, pls, VARIANTS[v]) for name, shape, pls in layouts(world) for v in variants}


def _check(results):
    units = len(_units())
    for key in results[0]:
        for rank, res in enumerate(results):
            r = res[key]
            assert all(all(flags) for flags in r["equal"]), (key, rank, r["equal"])
            assert len(r["pieces"]) == STEPS * units and all(r["pieces"]), (key, rank, r["pieces"])  # (c)
            assert len(r["chosen"]) == len(r["ref_chosen"]) == STEPS * units, key
            for got, want in zip(r["chosen"], r["ref_chosen"]):  # (b), per block
                assert got["dim"] == want["dim"], (key, rank)
                for lead, mine in got["mine"].items():
                    assert mine == [g for g in got["slices"] if g in want["chosen"][lead]], (key, rank, lead)
                if got["owner"] is not None:
                    assert got["owner"] == {lead: want["chosen"][lead] for lead in got["owner"]}, (key, rank)
        for t, want in enumerate(results[0][key]["ref_chosen"]):  # together the ranks hold every chosen slice
            for lead, ks in want["chosen"].items():
                held = {g for res in results for g in res[key]["chosen"][t]["mine"].get(lead, [])}
                assert held == set(ks), (key, t, lead)


def test_the_blocks_select_both_dims():
    """Not vacuous: the cases hold blocks that select rows and blocks that select columns."""
    dims = {-2 if len(rows) <= PARAMS[n][0][-1] else -1 for n in PARAMS for rows in PARAMS[n][2]}
    assert dims == {-2, -1}


@pytest.mark.parametrize("world", [2, 4])
def test_row_blocks_on_dtensors_equal_single_device(world):
    _check(run_ranks(_rank, world, tuple(VARIANTS), timeout=420))


# --------------------------------------------------------------------------- bytes, per block

BYTES_PARAMS = {"wide": ((64, 256), "heads:16"), "tall": ((256, 64), "blocks:32,224")}  # rows; rows and columns
BYTES_LAYOUTS = [("fsdp", (4,), ["S0"]), ("fsdp_tp", (2, 2), ["S0", "S1"]), ("hsdp", (2, 2), ["R", "S0"]),
                 ("fsdp_tp_strided", (2, 2), ["SS0/2", "S0"])]


def _blocks_of(shape, spec):
    m = shape[0]
    if spec.startswith("heads:"):
        d = int(spec.split(":")[1])
        return [list(range(i, i + d)) for i in range(0, m, d)]
    sizes = [int(x) for x in spec.split(":")[1].split(",")]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [list(range(s, s + n)) for s, n in zip(starts, sizes)]


def _expected_a2a(grads, mesh, pls, owners) -> int:
    """``test_dion2_dtensor._expected_a2a`` per block: the block's own dim, k and norms (the
    momentum after one step is the gradient), the rank's entries of the block from DTensor's own
    sharding of index grids."""
    total, unit = 0, 0
    for (shape, spec), g in zip(BYTES_PARAMS.values(), grads):
        m, n = shape
        rows_held = make_dtensor(torch.arange(m, dtype=torch.float64)[:, None].expand(m, n).contiguous(), mesh,
                                 pls).to_local().reshape(-1).long()
        cols_held = make_dtensor(torch.arange(n, dtype=torch.float64)[None, :].expand(m, n).contiguous(), mesh,
                                 pls).to_local().reshape(-1).long()
        for rows in _blocks_of(shape, spec):
            dim = -2 if len(rows) <= n else -1
            block = g[rows]
            norms = block.double().abs().sum(dim=-1 if dim == -2 else -2)
            chosen = set(torch.sort(norms, descending=True, stable=True).indices[:math.ceil(0.25 * norms.numel())]
                         .tolist())
            where = {r: p for p, r in enumerate(rows)}
            held = [where[r] if dim == -2 else c for r, c in zip(rows_held.tolist(), cols_held.tolist()) if r in where]
            if not owners[unit]:
                total += 9 * len(set(held)) + 8 * sum(1 for i in held if i in chosen)
            unit += 1
    return total


def _bytes_rank(rank, world):
    from optimizer import Muon
    from optimizer.parallel.execution import dion2_step

    out = {}
    for name, mesh_shape, placements in BYTES_LAYOUTS:
        mesh = init_device_mesh("cpu", mesh_shape)
        pls = [parse_placement(p) for p in placements]
        grads = [_full(s, 10 + i) for i, (s, _) in enumerate(BYTES_PARAMS.values())]
        ps = [Parameter(make_dtensor(_full(s, i), mesh, pls)) for i, (s, _) in enumerate(BYTES_PARAMS.values())]
        opt = Muon([{"params": ps, "param_names": list(BYTES_PARAMS), "use_muon": True, "dion2_fraction": 0.25,
                     "muon_row_blocks": {n: spec for n, (_, spec) in BYTES_PARAMS.items()}}], lr=0.05)
        for p, g in zip(ps, grads):
            p.grad = make_dtensor(g, mesh, pls)
        seen, original = [], dion2_step.select_local
        dion2_step.select_local = lambda plan, locals_: seen.append(original(plan, locals_)) or seen[-1]
        try:
            with WireBytes() as wire:
                opt.step()
        finally:
            dion2_step.select_local = original
        owners = [sel.chosen is not None for sel in seen[0]]
        out[name] = {"sent": wire.sent["all_to_all_single"], "formula": _expected_a2a(grads, mesh, pls, owners),
                     "units": len(owners)}
    return out


def test_bytes_follow_the_formula_per_block():
    got = run_ranks(_bytes_rank, 4, timeout=240)
    units = sum(len(_blocks_of(s, spec)) for s, spec in BYTES_PARAMS.values())
    for name, *_ in BYTES_LAYOUTS:
        assert all(r[name]["units"] == units for r in got), name
        sent, formula = sum(r[name]["sent"] for r in got), sum(r[name]["formula"] for r in got)
        assert sent == formula and sent > 0, (name, sent, formula)
