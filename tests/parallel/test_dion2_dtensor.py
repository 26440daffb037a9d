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

import itertools
import math

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
    # bf16 weights (the arithmetic and the update in bf16), NorDion2 (its v in fp32 beside bf16 rows)
    "bf16_weights": dict(dion2_fraction=0.3, normuon_beta2=0.9, weight_decay=0.1, param_dtype=torch.bfloat16),
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


def _full(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _optimizers(mesh, placements, shapes, options):
    dtype = options.get("param_dtype", torch.float32)
    options = {k: v for k, v in options.items() if k != "param_dtype"}
    dts = [Parameter(make_dtensor(_full(s, i, dtype), mesh, placements)) for i, s in enumerate(shapes)]
    whole = [Parameter(_full(s, i, dtype)) for i, s in enumerate(shapes)]
    names = [f"w{i}" for i in range(len(shapes))]
    make = lambda ps: Muon([{"params": ps, "param_names": names, "use_muon": True, **options}], lr=0.05)  # noqa: E731
    return dts, whole, make(dts), make(whole)


def _as_list(ix) -> list[int]:
    return list(range(ix.start, ix.stop)) if isinstance(ix, slice) else [int(i) for i in ix]


class Recorder:
    """Wraps the DTensor path's ``select_local`` (``parallel/execution/dion2_step.py``) and records,
    per step and parameter, this rank's slice map and which of its local slices were chosen, per
    global matrix, and the owner's whole choice (``broken``: rank 1 swaps one of its chosen slices
    for an unchosen one of the same matrix, its counts unchanged, so the step runs on)."""

    def __init__(self, broken: bool):
        from optimizer.parallel.execution import dion2_step

        self.module, self.broken, self.chosen = dion2_step, broken, []
        self.original = dion2_step.select_local

    def __call__(self, plan, locals_):
        sels = self.original(plan, locals_)
        if self.broken and not self.chosen:
            sels = _swap_one(plan, sels)
        for smap, sel in zip(plan.maps, sels):
            slices = _as_list(smap.slices)
            leads = [tuple(i) for i in itertools.product(*(_as_list(ix) for ix in smap.indices[:-2]))]
            mask = sel.mask.reshape(smap.batch, smap.count).tolist()
            mine = {lead: [slices[c] for c in range(smap.count) if mask[b][c]] for b, lead in enumerate(leads)}
            owner = None if sel.chosen is None else dict(zip(leads, sel.chosen.tolist()))
            self.chosen.append({"dim": smap.dim, "slices": slices, "mine": mine, "owner": owner})
        return sels


def _swap_one(plan, sels):
    from optimizer.parallel.execution.dion2_selection import LocalSelection

    out = list(sels)
    for i, sel in enumerate(sels):
        mask = sel.mask.reshape(plan.maps[i].batch, -1).clone()
        for b in range(mask.shape[0]):
            on, off = mask[b].nonzero().flatten().tolist(), (~mask[b]).nonzero().flatten().tolist()
            if on and off:
                mask[b, on[0]], mask[b, off[0]] = False, True
                out[i] = LocalSelection(mask.reshape(sel.mask.shape), sel.counts, sel.chosen)
                return out
    return out


class RefRecorder:
    """Records single-device ``dion2_rule.choose_slices``: the dim and the chosen indices per matrix."""

    def __init__(self):
        import optimizer.dion2.rule as rule

        self.module, self.original, self.chosen = rule, rule.choose_slices, []

    def __call__(self, buf, fraction, rows_only=False):
        sel = self.original(buf, fraction, rows_only)
        idx = sel.indices.reshape(-1, sel.indices.shape[-1]).tolist()
        leads = list(itertools.product(*(range(n) for n in buf.shape[:-2])))
        self.chosen.append({"dim": sel.dim, "chosen": dict(zip(leads, idx))})
        return sel


class OwnerRecorder:
    """Records the submatrix each owner hands Newton–Schulz (``dion2_step._orthogonalize``'s input),
    with the parameter it belongs to and the global matrices (experts) it holds."""

    def __init__(self):
        from optimizer.parallel.execution import dion2_step

        self.module, self.seen, self.current = dion2_step, [], None
        self.originals = (dion2_step._orthogonalize, dion2_step._PatternStep._owner_stage)

    def __enter__(self):
        orth, stage = self.originals

        def owner_stage(step, ui, u, received):
            smap = u.maps[step.plan.me]
            leads = [tuple(i) for i in itertools.product(*(_as_list(ix) for ix in smap.indices[:-2]))]
            self.current = (step.pattern.params[ui], leads)
            return stage(step, ui, u, received)

        def orthogonalize(fn, x, whole_batch):
            self.seen.append((*self.current, x.clone()))
            return orth(fn, x, whole_batch)

        self.module._orthogonalize, self.module._PatternStep._owner_stage = orthogonalize, owner_stage
        return self

    def __exit__(self, *exc):
        self.module._orthogonalize, self.module._PatternStep._owner_stage = self.originals


def _submatrices_equal(step, seen, accumulated, ref_chosen, options) -> list[tuple]:
    """Each owner's submatrix against the one written here from the whole accumulated momentum
    ``M + G`` (as stored): its chosen slices in ascending global order, fp32, bit for bit."""
    from optimizer.dion2.rule import take_slices

    flags = []
    for i, leads, x in seen:
        if not leads:  # a shard group holding none of a stack's experts
            continue
        chosen, dim = ref_chosen[i]["chosen"], ref_chosen[i]["dim"]
        m = accumulated[i].mT if options.get("muon_transposed") else accumulated[i]
        want = torch.stack([take_slices(m[lead], torch.tensor(chosen[lead]), dim) for lead in leads]).to(x.dtype)
        flags.append((step, i, leads, bool(torch.equal(x.reshape(want.shape), want))))
    return flags


def _run_layout(rank, world, mesh_shape, placement_names, shapes, options, broken):
    mesh = init_device_mesh("cpu", mesh_shape)
    pls = [parse_placement(p) for p in placement_names]
    dts, whole, opt, ref = _optimizers(mesh, pls, shapes, options)
    rec = Recorder(broken and rank == 1)
    ref_rec = RefRecorder()
    out = {"equal": [], "chosen": [], "ref_chosen": [], "submatrix": []}
    for step in range(STEPS):
        grads = [_full(p.shape, 100 * step + i + 50, p.dtype) for i, p in enumerate(whole)]
        for p, w, g in zip(dts, whole, grads):
            p.grad = make_dtensor(g, mesh, pls)
            w.grad = g.clone()
        before = [ref.state[w]["momentum_buffer"] if "momentum_buffer" in ref.state[w] else
                  torch.zeros_like(w, dtype=options.get("momentum_dtype", w.dtype)) for w in whole]
        accumulated = [(b.float() + g).to(b.dtype) for b, g in zip(before, grads)]  # M + G, rounded once as stored
        rec.module.select_local = rec
        try:
            with OwnerRecorder() as owners:
                opt.step()
        finally:
            rec.module.select_local = rec.original
        ref_rec.module.choose_slices = ref_rec
        try:
            ref.step()
        finally:
            ref_rec.module.choose_slices = ref_rec.original
        out["submatrix"] += _submatrices_equal(step, owners.seen, accumulated, ref_rec.chosen[-len(whole):], options)
    for p, w in zip(dts, whole):
        got, want = opt.state[p], ref.state[w]
        pairs = [(full_of(p.detach()), w.detach())] + [(full_of(got[k]), want[k]) for k in sorted(want)]
        out["equal"].append([bool(torch.equal(a, b)) and a.dtype == b.dtype for a, b in pairs])
    out["chosen"], out["ref_chosen"] = rec.chosen, ref_rec.chosen
    return out


def _rank(rank, world, variants, broken=False, names=None):
    global Muon
    from optimizer import Muon

    results = {}
    for name, mesh_shape, placements, shapes in layouts(world):
        if names is not None and name not in names:
            continue
        for variant in variants:
            results[(name, variant)] = _run_layout(rank, world, mesh_shape, placements, shapes, VARIANTS[variant],
                                                   broken)
    return results


def _check(results, world):
    for key in results[0]:
        for rank, res in enumerate(results):
            r = res[key]
            assert all(all(flags) for flags in r["equal"]), (key, rank, r["equal"])
            assert all(flag for *_, flag in r["submatrix"]), (key, rank)  # the owner's submatrix, index by index
            assert len(r["chosen"]) == len(r["ref_chosen"]) == STEPS * len(layout_shapes(world, key[0])), key
            for got, want in zip(r["chosen"], r["ref_chosen"]):  # (b): the single-device step's slices
                assert got["dim"] == want["dim"], (key, rank)
                for lead, mine in got["mine"].items():  # this rank's chosen slices, every matrix it holds
                    assert mine == [g for g in got["slices"] if g in want["chosen"][lead]], (key, rank, lead)
                if got["owner"] is not None:  # the owner's whole choice
                    assert got["owner"] == {lead: want["chosen"][lead] for lead in got["owner"]}, (key, rank)
        covered = {(t, i, lead) for res in results for t, i, leads, _ in res[key]["submatrix"] for lead in leads}
        for t, want in enumerate(results[0][key]["ref_chosen"]):  # an owner orthogonalised every matrix
            assert all((t // len(layout_shapes(world, key[0])), t % len(layout_shapes(world, key[0])), lead) in covered
                       for lead in want["chosen"]), (key, t)
        for t in range(len(results[0][key]["ref_chosen"])):  # together the ranks hold every chosen slice
            want = results[0][key]["ref_chosen"][t]["chosen"]
            for lead, ks in want.items():
                held = {g for res in results for g in res[key]["chosen"][t]["mine"].get(lead, [])}
                assert held == set(ks), (key, t, lead)
            assert all(res[key]["ref_chosen"][t] == results[0][key]["ref_chosen"][t] for res in results)


def layout_shapes(world, name):
    return next(shapes for n, _, _, shapes in layouts(world) if n == name)


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_dion2_equals_single_device(world):
    results = run_ranks(_rank, world, tuple(VARIANTS), timeout=240 + 60 * world)
    _check(results, world)


def test_eight_ranks():
    """8 ranks, kept light: FSDP over 8 (uneven and empty pieces) and FSDP 4 x TP 2, Dion2 and NorDion2."""
    results = run_ranks(_rank, 8, ("dion2", "nordion2"), names=("fsdp_rows", "fsdp_tp"), timeout=600)
    assert set(results[0]) == {(n, v) for n in ("fsdp_rows", "fsdp_tp") for v in ("dion2", "nordion2")}
    _check(results, 8)


def test_a_wrong_slice_on_one_rank_fails():
    results = run_ranks(_rank, 2, ("dion2",), broken=True, timeout=240)
    with pytest.raises(AssertionError):
        _check(results, 2)
    # the break shows in the weights themselves, not only in the recorded indices
    assert any(not all(all(f) for f in res[key]["equal"]) for res in results for key in res)


class WireBytes:
    """Wraps torch's collectives: the bytes this rank sends to other ranks, per collective
    (``all_to_all_single``: its input splits but its own; ``all_gather_into_tensor``: its input to
    each other member; ``all_reduce``/``all_gather``: its input, once)."""

    NAMES = ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_reduce", "all_gather")

    def __enter__(self):
        self.sent = dict.fromkeys(self.NAMES, 0)
        self._orig = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            me = dist.get_rank(group)
            self.sent["all_to_all_single"] += sum(n for j, n in enumerate(input_split_sizes) if j != me) * \
                input.element_size()
            return self._orig["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group=group,
                                                   async_op=async_op)

        def gather_into(name):
            def wrapped(output, input, group=None, async_op=False):
                self.sent[name] += input.numel() * input.element_size() * (dist.get_world_size(group) - 1)
                return self._orig[name](output, input, group=group, async_op=async_op)
            return wrapped

        def once(name):
            def wrapped(*args, **kwargs):
                t = args[1] if name == "all_gather" else args[0]
                self.sent[name] += t.numel() * t.element_size()
                return self._orig[name](*args, **kwargs)
            return wrapped

        for n, f in (("all_to_all_single", a2a), ("all_gather_into_tensor", gather_into("all_gather_into_tensor")),
                     ("all_gather_single", gather_into("all_gather_single")),
                     ("all_reduce", once("all_reduce")), ("all_gather", once("all_gather"))):
            if n in self._orig:
                setattr(dist, n, f)
        return self

    def __exit__(self, *exc):
        for n, f in self._orig.items():
            setattr(dist, n, f)


BYTES_LAYER = [(64, 256), (256, 64), (128, 128)]  # wide (rows chosen), tall (columns), square; long side >= 256
BYTES_LAYOUTS = [("fsdp", (4,), ["S0"]), ("fsdp_tp", (2, 2), ["S0", "S1"]), ("fsdp_tp_strided", (2, 2), ["SS0/2", "S0"]),
                 ("hsdp", (2, 2), ["R", "S0"])]


def _held(full_shape, mesh, pls, dim):
    """The global index along ``dim`` of every entry of this rank's piece (DTensor's own sharding of
    an index tensor), flat."""
    m, n = full_shape
    ix = torch.arange(m if dim == -2 else n, dtype=torch.float64)
    grid = (ix[:, None].expand(m, n) if dim == -2 else ix[None, :].expand(m, n)).contiguous()
    return make_dtensor(grid, mesh, pls).to_local().reshape(-1).long()


def _expected_a2a(shapes, grads, mesh, pls, owners) -> int:
    """The formula: per matrix, 9 bytes per local slice (fp64 partial norm out, uint8 mask back) and
    2 x 4 bytes per chosen local entry (fp32 momentum out, fp32 update back) of every member but the
    owner; the chosen slices from the gradient's L1 norms (the momentum after one step), top k =
    ceil(0.25 s), computed here in float64."""
    total = 0
    for (m, n), g, owner in zip(shapes, grads, owners):
        dim = -2 if m <= n else -1
        norms = g.double().abs().sum(dim=-1 if dim == -2 else -2)
        s = norms.numel()
        chosen = set(torch.sort(norms, descending=True, stable=True).indices[:math.ceil(0.25 * s)].tolist())
        held = _held((m, n), mesh, pls, dim)
        local_slices = len(set(held.tolist())) if held.numel() else 0
        chosen_entries = sum(1 for i in held.tolist() if i in chosen)
        if not owner:
            total += 9 * local_slices + 2 * 4 * chosen_entries
    return total


def _bytes_rank(rank, world):
    from optimizer import Muon
    from optimizer.parallel.execution import dion2_step

    out = {}
    for name, mesh_shape, placements in BYTES_LAYOUTS:
        mesh = init_device_mesh("cpu", mesh_shape)
        pls = [parse_placement(p) for p in placements]
        grads = [_full(s, 10 + i) for i, s in enumerate(BYTES_LAYER)]
        sent = {}
        for kind in ("muon", "dion2"):
            ps = [Parameter(make_dtensor(_full(s, i), mesh, pls)) for i, s in enumerate(BYTES_LAYER)]
            options = {"dion2_fraction": 0.25} if kind == "dion2" else {}
            opt = Muon([{"params": ps, "use_muon": True, **options}], lr=0.05)
            for p, g in zip(ps, grads):
                p.grad = make_dtensor(g, mesh, pls)
            seen, original = [], dion2_step.select_local
            dion2_step.select_local = lambda plan, locals_: seen.append(original(plan, locals_)) or seen[-1]
            try:
                with WireBytes() as wire:
                    opt.step()
            finally:
                dion2_step.select_local = original
            sent[kind] = dict(wire.sent)
            if kind == "dion2":
                owners = [sel.chosen is not None for sel in seen[0]]
                sent["formula"] = _expected_a2a(BYTES_LAYER, grads, mesh, pls, owners)
        out[name] = sent
    return out


def test_bytes_against_muon():
    """One step on 4 ranks, a wide, a tall and a square fp32 matrix (long side 256): the bytes every
    collective sends, summed over the world.  Dion2 at fraction 0.25 sends exactly the formula
    (selection + chosen entries, :func:`_expected_a2a`) on its all-to-alls and nothing else but the
    agreement's all-reduce, which Muon sends too; in all, at most 0.35 x Muon's own parallel step on
    the same parameters and layout, in the same launch (FSDP, FSDP+TP plain and strided, HSDP)."""
    got = run_ranks(_bytes_rank, 4, timeout=240)
    for name, *_ in BYTES_LAYOUTS:
        world = {kind: {c: sum(r[name][kind][c] for r in got) for c in WireBytes.NAMES} for kind in ("muon", "dion2")}
        formula = sum(r[name]["formula"] for r in got)
        d, m = world["dion2"], world["muon"]
        assert d["all_to_all_single"] == formula, (name, d, formula)
        assert d["all_gather_into_tensor"] == d["all_gather_single"] == d["all_gather"] == 0, (name, d)
        assert d["all_reduce"] == m["all_reduce"], (name, d, m)  # the agreement's, the same vector
        ratio = sum(d.values()) / sum(m.values())
        assert ratio <= 0.35, (name, ratio, d, m)


def _mixed_rank(rank, world):
    """A Muon group, a Dion2 group and an AdamW group of DTensors in one optimizer; what Dion2 does
    not build (``ns_split="always"``) and row blocks that do not fit the weight refused for
    DTensors by name; row blocks that fit are taken (``test_dion2_row_blocks_dtensor.py`` steps them)."""
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
    for key, value in (("ns_split", "always"), ("muon_row_blocks", "heads:3"), ("muon_row_blocks", "heads:4")):
        try:
            Muon([{"params": [mixed["dion2"]], "use_muon": True, "dion2_fraction": 0.25, key: value}])
            refusals[(key, value)] = None
        except ValueError as err:
            refusals[(key, value)] = str(err)
    return {"refused ns_split": refusals[("ns_split", "always")] is not None
            and "ns_split" in refusals[("ns_split", "always")] and "Dion2" in refusals[("ns_split", "always")],
            "refused heads:3 on 20 rows": refusals[("muon_row_blocks", "heads:3")] is not None
            and "muon_row_blocks" in refusals[("muon_row_blocks", "heads:3")],
            "took heads:4": refusals[("muon_row_blocks", "heads:4")] is None} | {
            "muon as alone": bool(torch.equal(full_of(mixed["muon"].detach()), full_of(alone["muon"].detach()))),
            "dion2 as whole": bool(torch.equal(full_of(mixed["dion2"].detach()), whole["dion2"].detach())),
            "dion2 momentum": bool(torch.equal(full_of(opt.state[mixed["dion2"]]["momentum_buffer"]),
                                               ref.state[whole["dion2"]]["momentum_buffer"])),
            "dion2 moved": not torch.equal(whole["dion2"].detach(), _full(shapes["dion2"], 1))}


def test_dion2_beside_muon_and_adamw_groups():
    for out in run_ranks(_mixed_rank, 2, timeout=120):
        assert all(out.values()), out


def _groups_rank(rank, world):
    """Dion2 groups with different fractions, NorDion2 beside Dion2 and a Muon group, one optimizer,
    FSDP 2 x TP 2: one selection plan for all (per-parameter fraction and rows), each as alone."""
    from optimizer import Muon

    mesh = init_device_mesh("cpu", (2, 2))
    pls = [parse_placement(p) for p in ["S0", "S1"]]
    shapes = [(6, 20), (20, 6), (12, 12), (16, 16)]
    dts = [Parameter(make_dtensor(_full(s, i), mesh, pls)) for i, s in enumerate(shapes)]
    whole = [Parameter(_full(s, i)) for i, s in enumerate(shapes)]
    make = lambda ps: Muon([{"params": ps[:1], "use_muon": True, "dion2_fraction": 0.25},  # noqa: E731
                            {"params": ps[1:2], "use_muon": True, "dion2_fraction": 0.5, "normuon_beta2": 0.9},
                            {"params": ps[2:3], "use_muon": True},
                            {"params": ps[3:], "use_muon": True, "dion2_fraction": 1.0}], lr=0.05, weight_decay=0.1)
    opt, ref = make(dts), make(whole)
    for step in range(STEPS):
        for i, (p, w) in enumerate(zip(dts, whole)):
            g = _full(w.shape, 100 + i + 10 * step)
            p.grad = make_dtensor(g, mesh, pls)
            w.grad = g.clone()
        opt.step()
        ref.step()
    return [bool(torch.equal(full_of(p.detach()), w.detach())) for p, w in zip(dts, whole)]


def test_groups_with_different_fractions():
    for out in run_ranks(_groups_rank, 4, timeout=240):
        assert out == [True] * 4, out
