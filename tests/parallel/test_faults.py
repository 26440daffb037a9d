"""Bad or unusual input: a clear error or a correct result, on every rank, without a hang.

(Gradients missing on some ranks, qk_logits on some ranks only or with the wrong
head count, and non-finite gradients are in test_agreement.py.)  Every run has a
short timeout, so a hang fails the test instead of stalling the suite.  Correct
results are checked against single-device Muon on plain tensors fed the same
global gradients (dist_cases.run_reference, itself checked against torch.optim).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dist_cases import OPT_KW, build_groups, make_case_tensors, outcome, parse_placement, run_reference, to_dtensor
from harness import run_ranks
from optimizer import Muon
from optimizer.distributed.shard_groups import num_cached_groups

ATOL, RTOL = 2e-6, 1e-5
TIMEOUT = 60


def _fulls(named):
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in named}


def _set_grads(named, grads):
    for n, p in named:
        p.grad = to_dtensor(grads[n], p.device_mesh, p.placements) if isinstance(p, DTensor) else grads[n].clone()


def _assert_close(got, want, what=""):
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what} {name}: {m}")


# ------------------------------------------------ one group, several meshes

MIXED = [
    ("layers.0.attention.wq.weight", (16, 12), ["S0"]),
    ("layers.0.ffn.w1.weight", (10, 12), ["S1", "R"]),
    ("layers.0.ffn.w2.weight", (12, 10), ["R", "S0"]),
    ("layers.0.norm.weight", (12,), ["S0"]),
]


def _mixed_meshes(rank, world_size, steps):
    flat = init_device_mesh("cpu", (2,))
    tall = DeviceMesh("cpu", [[0], [1]])  # (2, 1): the same two ranks, another shape
    wide = DeviceMesh("cpu", [[0, 1]])  # (1, 2)
    params, grads = make_case_tensors(MIXED, steps)
    named = []
    for n, _, pl in MIXED:
        mesh = {1: flat, 2: tall if pl[0] != "R" else wide}[len(pl)]
        named.append((n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl]))))
    opt = Muon(build_groups(named), **OPT_KW)
    assert len({id(p.device_mesh) for _, p in named}) == 3
    for s in range(steps):
        _set_grads(named, grads[s])
        opt.step()
    return _fulls(named)


def test_one_group_on_several_meshes_matches_single_device():
    want = run_reference(MIXED, 2, qk=False)
    for got in run_ranks(_mixed_meshes, 2, 2, timeout=TIMEOUT):
        _assert_close(got, want, "mixed meshes")


def _disjoint_meshes(rank, world_size):
    # Each parameter lives on a one-rank mesh; both are (wrongly) in one optimizer on every rank.
    meshes = [DeviceMesh("cpu", [0]), DeviceMesh("cpu", [1])]
    named = [(f"stage{r}.w", torch.nn.Parameter(to_dtensor(torch.randn(6, 4), meshes[r], [Replicate()])))
             for r in range(2)]
    opt = Muon(build_groups(named), **OPT_KW)
    for _, p in named:
        p.grad = to_dtensor(torch.randn(6, 4), p.device_mesh, p.placements)
    return outcome(opt.step)


def test_parameter_on_a_mesh_without_this_rank_fails_every_rank():
    results = run_ranks(_disjoint_meshes, 2, timeout=TIMEOUT)
    for rank, (kind, msg) in enumerate(results):
        other = 1 - rank
        assert kind == "ValueError", msg
        assert f"'stage{other}.w'" in msg and "does not include this rank" in msg and "one optimizer per" in msg


# ------------------------------------------------------- Partial placements

PARTIAL = [("layers.0.attention.wq.weight", (8, 6), ["S0"]), ("layers.0.norm.weight", (6,), ["S0"])]


def _partial(rank, world_size, where):
    mesh = init_device_mesh("cpu", (2,))
    params, grads = make_case_tensors(PARTIAL, 1)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
             for n, _, pl in PARTIAL]
    if where == "param":  # a parameter whose local tensors are unreduced partial sums
        w = named[0][1]
        named[0] = (named[0][0], torch.nn.Parameter(
            DTensor.from_local(w.full_tensor() / 2, mesh, [Partial()], run_check=False)))
    opt = Muon(build_groups(named), **OPT_KW)
    _set_grads(named[1:], grads[0])
    w_name, w = named[0]
    if where == "grad":
        w.grad = DTensor.from_local(grads[0][w_name] / 2, mesh, [Partial()], run_check=False)
    else:
        w.grad = torch.zeros_like(w)
    before = {n: p.to_local().clone() for n, p in named}
    result = outcome(opt.step)
    unchanged = all(torch.equal(p.to_local(), before[n]) for n, p in named)
    return result, unchanged, len(opt.state)


def test_partial_parameter_is_refused_before_anything_changes():
    for (kind, msg), unchanged, n_state in run_ranks(_partial, 2, "param", timeout=TIMEOUT):
        assert kind == "ValueError" and "'layers.0.attention.wq.weight'" in msg and "Partial" in msg
        assert "redistribute" in msg
        assert unchanged and n_state == 0  # the AdamW parameter was not stepped either


def test_partial_gradient_is_refused_before_anything_changes():
    for (kind, msg), unchanged, n_state in run_ranks(_partial, 2, "grad", timeout=TIMEOUT):
        assert kind == "ValueError" and "gradient of 'layers.0.attention.wq.weight'" in msg and "Partial" in msg
        assert unchanged and n_state == 0


# ------------------------------------- a parameter added after the optimizer

BASE = [("layers.0.attention.wq.weight", (16, 12), ["S0"]), ("layers.0.ffn.w1.weight", (10, 12), ["S1"])]
EXTRA = [("layers.1.ffn.w1.weight", (9, 12), ["S0"]), ("layers.1.norm.weight", (12,), ["S0"])]
STEPS, ADD_AT = 4, 2


def _full(p):
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _run_with_late_params(named_base, named_extra, grads, opt, add_group):
    """Steps 0..STEPS-1; the extra params get gradients throughout and join the optimizer at ADD_AT.

    Returns whether the extra params were left alone while the optimizer did not know them.
    """
    initial = [_full(p) for _, p in named_extra]
    untouched = None
    for s in range(STEPS):
        if s == ADD_AT:
            untouched = all(torch.equal(p0, _full(p)) for p0, (_, p) in zip(initial, named_extra))
            for g in build_groups(named_extra):
                add_group(g)
        _set_grads(named_base + named_extra, grads[s])
        opt.step()
    return untouched


def _late_params_reference():
    params, grads = make_case_tensors(BASE + EXTRA, STEPS)
    base = [(n, torch.nn.Parameter(params[n].clone())) for n, _, _ in BASE]
    extra = [(n, torch.nn.Parameter(params[n].clone())) for n, _, _ in EXTRA]
    opt = Muon(build_groups(base), **OPT_KW)
    assert _run_with_late_params(base, extra, grads, opt, opt.add_param_group)
    return _fulls(base + extra)


def _late_params(rank, world_size, every_rank):
    mesh = init_device_mesh("cpu", (2,))
    params, grads = make_case_tensors(BASE + EXTRA, STEPS)

    def place(specs):
        return [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
                for n, _, pl in specs]

    base, extra = place(BASE), place(EXTRA)
    opt = Muon(build_groups(base), **OPT_KW)

    def add_group(g):
        if every_rank or rank == 0:
            opt.add_param_group(g)

    untouched = []
    result = outcome(lambda: untouched.append(_run_with_late_params(base, extra, grads, opt, add_group)))
    return result, untouched, _fulls(base + extra)


def test_param_group_added_later_on_every_rank_matches_single_device():
    want = _late_params_reference()
    for (kind, msg), untouched, got in run_ranks(_late_params, 2, True, timeout=TIMEOUT):
        assert kind == "ok", msg
        assert untouched == [True]  # not in the optimizer yet: gradients alone change nothing
        _assert_close(got, want, "late param group")


def test_param_group_added_on_one_rank_only_fails_every_rank():
    results = run_ranks(_late_params, 2, False, timeout=TIMEOUT)
    for (kind, msg), _, _ in results:
        assert kind == "RuntimeError", msg
        assert "'layers.1.ffn.w1.weight'" in msg and "rank 1: nothing" in msg
        assert "add_param_group on every rank" in msg


# ------------------------------------------------ two optimizers, one process

SPECS_A = [("a.wq.weight", (16, 12), ["S0"]), ("a.w1.weight", (9, 7), ["S1"]), ("a.norm.weight", (7,), ["S0"])]
SPECS_B = [("b.w1.weight", (12, 10), ["S1", "S0"]), ("b.w2.weight", (6, 9), ["S0", "R"])]
ORDER = "ABAAB"  # interleaved, and A steps twice in a row


def _two_optimizers(rank, world_size):
    mesh_a, mesh_b = init_device_mesh("cpu", (2,)), DeviceMesh("cpu", [[0], [1]])
    runs = {}
    for key, specs, mesh, seed in (("A", SPECS_A, mesh_a, 1), ("B", SPECS_B, mesh_b, 2)):
        params, grads = make_case_tensors(specs, ORDER.count(key), seed=seed)
        named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
                 for n, _, pl in specs]
        runs[key] = (named, grads, Muon(build_groups(named), **OPT_KW), [0])
    groups_after_first = None
    for i, key in enumerate(ORDER):
        named, grads, opt, done = runs[key]
        _set_grads(named, grads[done[0]])
        opt.step()
        done[0] += 1
        if i == 1:
            groups_after_first = num_cached_groups()
    return {k: _fulls(v[0]) for k, v in runs.items()}, groups_after_first, num_cached_groups()


def test_two_muon_instances_in_one_process_each_match_single_device():
    want_a = run_reference(SPECS_A, ORDER.count("A"), qk=False, seed=1)
    want_b = run_reference(SPECS_B, ORDER.count("B"), qk=False, seed=2)
    for got, groups_first, groups_last in run_ranks(_two_optimizers, 2, timeout=TIMEOUT):
        _assert_close(got["A"], want_a, "optimizer A")
        _assert_close(got["B"], want_b, "optimizer B")
        assert groups_first == groups_last


# ----------------------------------------------------- many small matrices


def _many(n):
    return [(f"blocks.{i}.w", (4 + i % 3, 5 + i % 2)) for i in range(n)]


def _count_groups():
    try:  # every process group this process knows (private, so optional)
        from torch.distributed.distributed_c10d import _world

        return len(_world.pg_map)
    except Exception:  # noqa: BLE001
        return -1


def _block(full, coord):
    # (Shard(0), Shard(1)) on a (2, 2) mesh, by DTensor's definition: torch.chunk rows over
    # mesh dim 0, then columns over mesh dim 1 (built directly: 2,000 redistributes are slow).
    return full.chunk(2, dim=0)[coord[0]].chunk(2, dim=1)[coord[1]].contiguous()


def _many_matrices(rank, world_size, sizes, steps):
    mesh = init_device_mesh("cpu", (2, 2))
    coord = mesh.get_coordinate()
    placements = [Shard(0), Shard(1)]

    def shard(full):
        return DTensor.from_local(_block(full, coord), mesh, placements, run_check=False,
                                  shape=full.shape, stride=full.stride())

    out = {}
    for n in sizes:
        specs = [(name, shape, None) for name, shape in _many(n)]
        params, grads = make_case_tensors(specs, steps, seed=n)
        named = [(name, torch.nn.Parameter(shard(params[name]))) for name, _, _ in specs]
        opt = Muon(build_groups(named), chunk_size=64, **OPT_KW)
        counts = [(num_cached_groups(), _count_groups())]  # after construction: nothing more may come
        for s in range(steps):
            for name, p in named:
                if p.grad is None:
                    p.grad = shard(grads[s][name])
                else:  # same placements every step: refill the local block
                    p.grad.to_local().copy_(_block(grads[s][name], coord))
            opt.step()
            counts.append((num_cached_groups(), _count_groups()))
        out[n] = (counts, {name: p.to_local().clone() for name, p in named}, coord)
    return out


def test_two_thousand_small_matrices_with_a_fixed_number_of_process_groups():
    sizes, steps = (20, 2000), 2
    results = run_ranks(_many_matrices, 4, sizes, steps, timeout=150)
    for n in sizes:
        specs = [(name, shape, None) for name, shape in _many(n)]
        want = run_reference(specs, steps, qk=False, seed=n, chunk_size=64)
        for out in results:
            _, local, coord = out[n]
            _assert_close(local, {k: _block(v, coord) for k, v in want.items()}, f"{n} matrices")
    for out in results:
        counts = [c for n in sizes for c in out[n][0]]
        # The (Shard(0), Shard(1)) shard group spans both mesh dims, i.e. the whole world:
        # WORLD serves, no group is created; none per parameter or per step (and no other
        # process groups either).
        assert counts[0][0] == 0
        assert len(set(counts)) == 1, counts
