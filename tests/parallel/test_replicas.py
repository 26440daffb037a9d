"""Newton–Schulz split over replicas: HSDP, replicated DTensors, replicated experts.

Every case is checked three ways:
- every parameter equals single-device Muon on the same inputs (with QK-clip on and off,
  split over replicas always, by the default rule, and never);
- each owner's assembled matrix equals the global momentum update, element for element
  (Newton–Schulz is permutation-equivariant, so a gather and a scatter that permute rows
  the same wrong way would cancel in the first check);
- Newton–Schulz FLOPs counted by torch's FlopCounterMode on every rank inside ``step()``:
  the busiest rank does about 1/world of the model's work, not 1/shard-group.
"""

from __future__ import annotations

import pytest
import torch

from dist_cases import (build_groups, make_case_tensors, owned_matrices_of_one_step, parse_placement, run_distributed,
                        run_reference, to_dtensor)
from harness import run_ranks

ATOL, RTOL = 2e-6, 1e-5
STEPS = 3
Q, K = (16, 12), (8, 12)

CASES = {
    "hsdp_2x2": ((2, 2), [
        ("layers.0.attention.wq.weight", Q, ["R", "S0"]),
        ("layers.0.attention.wk.weight", K, ["R", "S0"]),
        ("layers.0.attention.wo.weight", (12, 16), ["R", "S1"]),
        ("layers.0.ffn.w1.weight", (9, 6), ["R", "S0"]),  # uneven
        ("layers.0.ffn.w2.weight", (1, 6), ["R", "S0"]),  # one member holds nothing
        ("layers.0.moe.w1", (4, 8, 12), ["R", "S1"]),
        ("layers.0.norm.weight", (12,), ["R", "S0"]),
    ]),
    "replicated_1d": ((4,), [
        ("layers.0.attention.wq.weight", Q, ["R"]),
        ("layers.0.attention.wk.weight", K, ["R"]),
        ("a", (7, 5), ["R"]),
        ("b", (5, 9), ["R"]),
        ("c", (12, 12), ["R"]),
        ("layers.0.moe.w1", (6, 4, 5), ["R"]),  # experts too: split into ranges over the 4 holders
    ]),
    "replicated_2d": ((2, 2), [
        ("layers.0.attention.wq.weight", Q, ["R", "R"]),
        ("layers.0.attention.wk.weight", K, ["R", "R"]),
        ("a", (7, 5), ["R", "R"]),
        ("b", (6, 10), ["R", "R"]),
    ]),
    "replicated_experts": ((2, 2), [
        ("layers.0.moe.w1", (4, 8, 12), ["S0", "R"]),  # experts over dim 0, replicated over dim 1
        ("layers.0.moe.w2", (5, 12, 8), ["R", "S0"]),  # uneven experts
        ("layers.0.moe.w3", (4, 8, 12), ["S0", "S1"]),  # experts and columns: no replicas
        ("a", (7, 5), ["S0", "R"]),
    ]),
    "hsdp_tp_8": ((2, 2, 2), [
        ("layers.0.attention.wq.weight", Q, ["R", "SS0/2", "S0"]),
        ("layers.0.attention.wk.weight", K, ["R", "SS0/2", "S0"]),
        ("layers.0.attention.wo.weight", (12, 16), ["R", "S0", "S1"]),
        ("layers.0.ffn.w1.weight", (9, 6), ["R", "SS0/2", "S0"]),
        ("layers.0.ffn.w3.weight", (3, 6), ["R", "S0", "S0"]),  # members with no rows
        ("layers.0.moe.w1", (4, 8, 12), ["R", "S0", "S1"]),
    ]),
    "replicated_8": ((2, 4), [
        ("layers.0.attention.wq.weight", Q, ["R", "R"]),
        ("layers.0.attention.wk.weight", K, ["R", "R"]),
        ("a", (7, 5), ["R", "S1"]),
        ("b", (6, 10), ["R", "R"]),
    ]),
}


def _world(mesh_shape):
    n = 1
    for s in mesh_shape:
        n *= s
    return n


def _run(rank, world_size, name, split):
    """Without and with QK-clip, in one launch (a launch's first run pays DTensor's cold caches)."""
    mesh_shape, specs = CASES[name]
    return {qk: run_distributed(rank, world_size, mesh_shape, specs, STEPS, qk, replica_split=split)
            for qk in (False, True)}


@pytest.mark.parametrize("split", ["always", "auto", "never"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_equal_to_single_device(name, split):
    mesh_shape, specs = CASES[name]
    per_rank = run_ranks(_run, _world(mesh_shape), name, split, timeout=120)
    for qk in (False, True):
        want = run_reference(specs, STEPS, qk)
        for got in (r[qk] for r in per_rank):
            for n, ref in want.items():
                torch.testing.assert_close(got[n], ref, atol=ATOL, rtol=RTOL,
                                           msg=lambda m: f"{name} qk={qk} split={split} {n}: {m}")


# ----------------------------------------------------------- the owner's matrix


def _assembled(rank, world_size, name, split):
    """Every matrix an owner orthogonalises, next to the global update it must equal."""
    mesh_shape, specs = CASES[name]
    return [(n, o.experts, full) for n, o, full in owned_matrices_of_one_step(mesh_shape, specs, replica_split=split)]


@pytest.mark.parametrize("name, split", [
    ("hsdp_2x2", "always"), ("hsdp_2x2", "never"), ("hsdp_tp_8", "always"), ("hsdp_tp_8", "never"),
    ("replicated_experts", "always"), ("replicated_1d", "always"),  # replicated + never: nothing to gather
])
def test_owners_assemble_exactly_the_global_matrix(name, split):
    mesh_shape, specs = CASES[name]
    _, grads = make_case_tensors(specs, 1)
    covered = set()
    for per_rank in run_ranks(_assembled, _world(mesh_shape), name, split, timeout=120):
        for pname, experts, full in per_rank:
            g = grads[0][pname]
            # first step, Nesterov: buf = 0.1 g, update = g.lerp(buf, 0.9)
            want = g.lerp(g * 0.1, 0.9)
            if experts is not None:
                want = want[experts]
            assert torch.equal(full, want), (name, pname, experts)
            covered.add(pname)
    # every sharded or split matrix was assembled by some owner
    assert covered, name


# ------------------------------------------------------------- FLOPs per rank

FLOP_MODEL = [(f"layers.{i}.w", shape) for i, shape in enumerate(
    [(32, 32)] * 8 + [(32, 64)] * 6 + [(64, 32)] * 6 + [(48, 48)] * 4)]
FLOP_LAYOUTS = {
    "hsdp_2x2": ((2, 2), ["R", "S0"]),
    "replicated_4": ((4,), ["R"]),
    "hsdp_tp_8": ((2, 2, 2), ["R", "SS0/2", "S0"]),
}


def _count_flops(rank, world_size, layout, splits):
    """FLOPs of one step on this rank, per ``replica_split`` (each its own Muon, one launch)."""
    from optimizer import Muon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.flop_counter import FlopCounterMode

    mesh_shape, placement = FLOP_LAYOUTS[layout]
    specs = [(n, shape, placement) for n, shape in FLOP_MODEL]
    mesh = init_device_mesh("cpu", mesh_shape)
    out = {}
    for split in splits:
        params, grads = make_case_tensors(specs, 1)
        named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
                 for n, _, pl in specs]
        opt = Muon(build_groups(named), lr=0.02, replica_split=split)
        for n, p in named:
            p.grad = to_dtensor(grads[0][n], mesh, p.placements)
        with FlopCounterMode(display=False) as counter:
            opt.step()
        out[split] = counter.get_total_flops()
    return out


def _model_flops():
    """The whole model's Newton–Schulz FLOPs, counted on one device by torch."""
    from optimizer import Muon
    from torch.utils.flop_counter import FlopCounterMode

    specs = [(n, shape, None) for n, shape in FLOP_MODEL]
    params, grads = make_case_tensors(specs, 1)
    named = [(n, torch.nn.Parameter(params[n])) for n, _, _ in specs]
    opt = Muon(build_groups(named), lr=0.02)
    for n, p in named:
        p.grad = grads[0][n]
    with FlopCounterMode(display=False) as counter:
        opt.step()
    return counter.get_total_flops()


@pytest.mark.parametrize("layout, world, bound, repeated", [
    ("hsdp_2x2", 4, 0.30, 0.50),
    ("replicated_4", 4, 0.30, 1.00),
    ("hsdp_tp_8", 8, 0.15, 0.25),
])
def test_busiest_rank_does_about_one_world_share(layout, world, bound, repeated):
    total = _model_flops()
    per_rank = run_ranks(_count_flops, world, layout, ("auto", "never"), timeout=120)
    split = [r["auto"] for r in per_rank]
    assert max(split) <= bound * total, (layout, [f / total for f in split])
    assert sum(split) == pytest.approx(total, rel=1e-9)  # nothing done twice anywhere in the world
    # Each replica repeating its work: what the split saves (and proof that this test can fail).
    never = [r["never"] for r in per_rank]
    assert max(never) >= repeated * total * 0.95, (layout, [f / total for f in never])


# ----------------------------------------------------------------- settings


def test_replica_split_option_is_checked():
    from optimizer import Muon

    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="replica_split"):
        Muon([{"params": [p], "use_muon": True}], replica_split="sometimes")
    with pytest.raises(ValueError, match="replica_split_flops_per_byte"):
        Muon([{"params": [p], "use_muon": True}], replica_split_flops_per_byte=-1.0)


def _traffic(rank, world_size):
    mesh_shape, specs = CASES["hsdp_2x2"]
    out = {}
    for split in ("always", "never"):
        _, stats = run_distributed(rank, world_size, mesh_shape, specs, 1, False, with_stats=True, replica_split=split)
        out[split] = stats.bytes_sent, stats.bytes_received, stats.all_gathers
    return out


def test_bytes_sent_equal_bytes_received_over_the_world():
    per_rank = run_ranks(_traffic, 4, timeout=60)
    for split in ("always", "never"):
        results = [r[split] for r in per_rank]
        assert sum(r[0] for r in results) == sum(r[1] for r in results) > 0
        gathers = {r[2] for r in results}
        assert (gathers == {0}) == (split == "never"), (split, gathers)
