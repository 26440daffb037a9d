"""The momentum and the Nesterov input in one pass (issue 28): where the elementwise stages are
fused (``ns_kernels="triton"``, here under Triton's interpreter), ``MatrixStep.input_into``
updates a piece's momentum in the pass that forms its Newton–Schulz input, and
``MatrixStep.finish_momentum`` updates whatever the runtime never formed.

References, none of them the code under test's order:

* **the bookkeeping** (``momentum_progress.py``) against a counter of every element: for the
  regions the runtime asks for (whole pieces, expert ranges, cut units' row or column blocks,
  boxes, repeats, overlaps, empty ones, some never asked for) and for random sequences, every
  element is updated exactly once, a fused region has none of it updated before, a region read
  without an update has all of it updated before; and one step's stages over such sequences
  against the two-pass order, bit for bit;
* **the old two-pass order** (:func:`old_order`: the momentum kernel over every fused piece
  first, exactly the call ``update.matrix_steps`` made before, then every input formed from the
  updated buffer): the new order gives the same weights, momentum and NorMuon state **bit for
  bit**, on single-device odd shapes (2-D, tall, 3-D experts, transposed, row blocks, bf16
  weights, bf16 momentum, maximize, nesterov off, NorMuon, cautious decay) and on forked gloo
  ranks (FSDP, FSDP+TP with ``_StridedShard``, HSDP with the replica split, experts, ns_split,
  ns_split of expert ranges with NorMuon, the gather baseline, moved experts), each rank comparing
  its own pieces. Newton–Schulz's products run on torch in both orders (:func:`products_on_torch`):
  the order of the elementwise stages is what differs;
* **exactly once, counted**: a step with a zero gradient and momentum 0.5 halves every buffer
  entry exactly (``lerp(b, 0, 0.5) = 0.5 b`` in one FMA, exact in fp32 and bf16): an entry updated
  twice is quartered, one missed is unchanged; checked on every rank's pieces of every parameter;
* **one pass where one pass can be**: the momentum kernel's launches are recorded; on a single
  device every piece takes exactly one launch per step, momentum and input together.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from dist_cases import OPT_KW, build_groups, make_case_tensors, parse_placement, to_dtensor
from harness import run_ranks

pytest.importorskip("triton")

STEPS = 2
HALF = 0.5  # the final step's momentum: lerp(b, 0, 1 - 0.5) = 0.5 b exactly


# ---------------------------------------------------------------------------- the bookkeeping


def _play(shape, regions):
    """Claim ``regions`` in order, then finish, against a counter of every element's updates."""
    from optimizer.momentum_progress import MomentumProgress

    progress = MomentumProgress(shape)
    counts = torch.zeros(shape, dtype=torch.int64)
    fused = 0
    for region in regions:
        catch_up, fuse = progress.claim(region)
        for part in catch_up:
            counts[part] += 1
        if fuse:
            assert (counts[region] == 0).all(), (region, "fused where some of it was already updated")
            counts[region] += 1
            fused += 1
        else:
            assert (counts[region] == 1).all(), (region, "formed from a buffer not updated yet")
        assert (counts <= 1).all(), (region, "an element updated twice")
    for part in progress.finish():
        counts[part] += 1
    assert (counts == 1).all(), f"elements updated {counts.unique().tolist()} times"
    assert progress.finish() == [] and progress.claim(()) == ([], False)  # done stays done
    return fused


S = slice
REGION_CASES = {
    # (shape, regions, how many of them are fused): what the runtime asks for
    "whole": ((6, 5), [()], 1),
    "whole_twice": ((6, 5), [(), ()], 1),
    "never_formed": ((6, 5), [], 0),
    "expert_ranges": ((5, 3, 4), [(S(0, 2),), (S(2, 5),)], 2),
    "expert_ranges_out_of_order": ((5, 3, 4), [(S(3, 5),), (S(0, 1),), (S(1, 3),)], 3),
    "some_experts_never": ((5, 3, 4), [(S(1, 3),)], 1),
    "rows_of_a_cut_unit": ((8, 6), [(S(0, 3),), (S(3, 8),)], 2),
    "columns_of_a_cut_unit": ((8, 6), [(S(None), S(0, 4)), (S(None), S(4, 6))], 2),
    "expert_rows_whole_experts": ((3, 8, 6), [(S(None), S(0, 5)), (S(None), S(5, 8))], 2),
    "an_expert_range_then_the_rest": ((4, 3, 2), [(S(0, 1),), ()], 1),
    "a_region_twice": ((8, 6), [(S(2, 5),), (S(2, 5),), (S(3, 4),)], 1),
    "overlap": ((8, 6), [(S(0, 4),), (S(2, 6),)], 1),
    "box": ((4, 8, 6), [(S(0, 2), S(0, 3))], 0),
    "box_after_a_slab": ((4, 8, 6), [(S(0, 2),), (S(2, 4), S(0, 3))], 1),
    "another_dim": ((8, 6), [(S(0, 4),), (S(None), S(0, 2))], 1),
    "strided": ((8, 6), [(S(0, 8, 2),)], 0),
    "empty": ((8, 6), [(S(3, 3),), ()], 1),
    "empty_piece": ((0, 6), [()], 0),
    "full_slices": ((8, 6), [(S(0, 8), S(None))], 1),
}


@pytest.mark.parametrize("case", list(REGION_CASES))
def test_every_element_is_updated_exactly_once(case):
    shape, regions, fused = REGION_CASES[case]
    assert _play(shape, regions) == fused


def _random_region(rng: random.Random, shape):
    """A slab along some dim, a box, the whole piece, or an empty region."""
    kind = rng.choice(["slab", "slab", "slab", "box", "whole", "empty"])
    if kind == "whole":
        return ()
    if kind == "empty":
        return (S(1, 1),)

    def span(n):
        a = rng.randrange(n)
        return S(a, rng.randrange(a + 1, n + 1))

    if kind == "slab":
        d = rng.randrange(len(shape))
        return (S(None),) * d + (span(shape[d]),)
    return tuple(span(n) for n in shape)


def test_random_region_sequences():
    rng = random.Random(0)
    for _ in range(400):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.choice([2, 3])))
        _play(shape, [_random_region(rng, shape) for _ in range(rng.randint(0, 5))])


# ---------------------------------------------------------------------------- one step's stages

STAGE_SEQUENCES = {
    "whole": [()],
    "expert_ranges_one_never": [(S(2, 4),), (S(0, 1),)],
    "rows_then_box_then_again": [(S(None), S(0, 4)), (S(1, 3), S(4, 9)), (S(None), S(0, 4))],
    "overlapping_rows": [(S(None), S(0, 5)), (S(None), S(3, 9))],
    "box_first": [(S(0, 2), S(None), S(1, 6))],
    "part_then_whole": [(S(3, 4),), ()],
    "nothing": [],
}


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("buf_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sequence", list(STAGE_SEQUENCES))
def test_a_step_forms_every_region_from_this_steps_momentum(sequence, buf_dtype, layout):
    """``MatrixStep.input_into`` over any sequence of regions, then ``finish_momentum``: each input
    equals the one formed from the momentum updated first (the two-pass order, the same kernels),
    bit for bit, and the momentum ends updated exactly once."""
    from optimizer.kernels import elementwise
    from optimizer.momentum_progress import MomentumProgress
    from optimizer.rule import MatrixStep

    shape, mu = (4, 9, 7), 0.9
    gen = torch.Generator().manual_seed(0)

    def piece(dtype):
        if layout == "transposed":  # a strided view, as muon_transposed weights are read
            return torch.randn(shape[0], shape[2], shape[1], generator=gen).to(dtype).mT
        return torch.randn(shape, generator=gen).to(dtype)

    buf, grad = piece(buf_dtype), piece(torch.float32)
    want_buf = buf.clone()
    elementwise.momentum_nesterov_(want_buf, grad, None, mu, True, True, dtype=torch.float32, backend="triton")
    step = MatrixStep(param=torch.zeros(shape), grad=grad, buf=buf, momentum=mu, nesterov=True, lr=0.0,
                      adjusted_lr=0.0, weight_decay=0.0, orthogonalize=None, fused=True, maximize=True,
                      pending=MomentumProgress(shape))
    for region in STAGE_SEQUENCES[sequence]:
        out = torch.empty(buf[region].shape, dtype=torch.bfloat16)
        step.input_into(out, region)
        want = torch.empty_like(out)
        elementwise.momentum_nesterov_(want_buf[region], grad[region], want, mu, True, True, update_momentum=False,
                                       dtype=torch.float32, backend="triton")
        assert torch.equal(out, want), (sequence, region)
    step.finish_momentum()
    step.finish_momentum()  # a second call changes nothing
    assert torch.equal(buf, want_buf)


# ---------------------------------------------------------------------------- the orders, recorded


@contextlib.contextmanager
def old_order():
    """The order before issue 28: ``matrix_steps`` runs the momentum kernel over every fused piece
    (the same call, arguments and backend it made then), and every input is formed afterwards from
    the updated buffer, with nothing left pending."""
    import optimizer.step.muon_update as update
    from optimizer.kernels import elementwise

    real = update.matrix_steps

    def two_passes(*args, **kwargs):
        steps = real(*args, **kwargs)
        for s in steps:
            if s.fused:
                elementwise.momentum_nesterov_(s.buf, s.grad, None, s.momentum, s.nesterov, s.maximize,
                                               dtype=s.input_dtype, backend="triton")
                s.pending = None
        return steps

    update.matrix_steps = two_passes
    try:
        yield
    finally:
        update.matrix_steps = real


@contextlib.contextmanager
def products_on_torch():
    """Newton–Schulz's products on torch's matmuls whatever ``ns_kernels`` says, whole matrices and
    cut ones (the interpreter runs them ~50x slower, and they are the same in both orders: their
    kernels are tested in test_symmetric_kernel.py, tests/parallel/test_ns_kernels.py and
    test_split_ns_kernels.py); the elementwise stages stay on the fused kernels."""
    from optimizer.newton_schulz import group

    names = ("zeropower_via_newtonschulz", "split_zeropower_via_newtonschulz")
    real = {name: getattr(group, name) for name in names}

    def on_torch(fn):
        return lambda *args, **kwargs: fn(*args, **{**kwargs, "ns_kernels": "torch"})

    for name in names:
        setattr(group, name, on_torch(real[name]))
    try:
        yield
    finally:
        for name in names:
            setattr(group, name, real[name])


@contextlib.contextmanager
def recording():
    """Records each launch of the momentum kernel as "fused" (momentum and input), "momentum"
    (alone) or "input" (alone), and each region claim's outcome."""
    from optimizer.kernels import elementwise_kernel
    from optimizer.momentum_progress import MomentumProgress

    launches, claims = [], []
    launch, claim = elementwise_kernel.momentum_nesterov_triton, MomentumProgress.claim

    def recorded_launch(buf, grad, out, *args, update_momentum=True, **kwargs):
        launches.append("momentum" if out is None else "fused" if update_momentum else "input")
        return launch(buf, grad, out, *args, update_momentum=update_momentum, **kwargs)

    def recorded_claim(self, region):
        catch_up, fuse = claim(self, region)
        whole = all(s == S(None) or s.indices(n) == (0, n, 1) for s, n in zip(region, self.shape))
        claims.append("catch_up" if catch_up else ("fused_" if fuse else "read_") + ("whole" if whole else "part"))
        return catch_up, fuse

    elementwise_kernel.momentum_nesterov_triton = recorded_launch
    MomentumProgress.claim = recorded_claim
    try:
        yield launches, claims
    finally:
        elementwise_kernel.momentum_nesterov_triton = launch
        MomentumProgress.claim = claim


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(opt, named):
    """This rank's pieces of every weight and every state tensor, by name."""
    out = {}
    for n, p in named:
        out[n] = _local(p.detach()).clone()
        for key, v in opt.state.get(p, {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                out[f"{n}.{key}"] = _local(v).clone()
    return out


def _steps_then_half(opt, named, grads_of, steps):
    """``steps`` steps, then one with zero gradients and momentum 0.5. Returns the state after the
    steps, and every momentum piece before and after the last step."""
    for s in range(steps):
        for n, p in named:
            p.grad = grads_of(s, n, p)
        opt.step()
    state = _snapshot(opt, named)
    for group in opt.param_groups:
        if group["use_muon"]:
            group["momentum"] = HALF
    muon = [(n, p) for n, p in named if p.dim() >= 2]
    before = {n: _local(opt.state[p]["momentum_buffer"]).clone() for n, p in muon}
    for n, p in named:
        p.grad = torch.zeros_like(p)
    opt.step()
    after = {n: _local(opt.state[p]["momentum_buffer"]).clone() for n, p in muon}
    return state, before, after


def _assert_halved(before, after, where):
    for n in before:
        b, a = before[n], after[n]
        assert b.numel() == 0 or b.abs().max() > 0, (where, n, "zero after steps with random gradients: never updated (and a zero buffer proves nothing)")
        if not torch.equal(a, b * HALF):
            seen = "quartered (updated twice)" if torch.equal(a, b * HALF * HALF) else (
                "unchanged (not updated)" if torch.equal(a, b) else "partly updated")
            raise AssertionError(f"{where} {n}: momentum {seen}, not halved exactly once")


def _assert_bitwise(new, old, where):
    assert new.keys() == old.keys()
    for k in new:
        assert new[k].dtype == old[k].dtype and torch.equal(new[k], old[k]), (
            where, k, (new[k].double() - old[k].double()).abs().max())


# ---------------------------------------------------------------------------- single device

SHAPES = {"wide": (24, 40), "tall": (41, 19), "experts": (3, 16, 24), "tall_experts": (2, 21, 9)}
VARIANTS = {
    "plain": ({}, {}),
    "maximize_no_nesterov": ({"maximize": True, "nesterov": False}, {}),
    "bf16_momentum_normuon_cautious": ({"momentum_dtype": torch.bfloat16, "normuon_beta2": 0.9,
                                        "cautious_wd": True}, {}),
    # strided pieces (a transposed view) and a unit orthogonalised in blocks
    "transposed_row_blocks": ({}, {"muon_transposed": {"tall": True}, "muon_row_blocks": {"wide": "blocks:8,16"}}),
    "bf16_weights": ({"dtype": torch.bfloat16}, {}),
}


def _single(variant, order):
    from optimizer import Muon

    options, group = dict(VARIANTS[variant][0]), VARIANTS[variant][1]
    dtype = options.pop("dtype", torch.float32)
    gen = torch.Generator().manual_seed(0)
    named = [(n, torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))) for n, s in SHAPES.items()]
    grads = [{n: torch.randn(s, generator=gen).to(dtype) for n, s in SHAPES.items()} for _ in range(STEPS)]
    opt = Muon([{"params": [p for _, p in named], "param_names": [n for n, _ in named], "use_muon": True, **group}],
               lr=0.02, weight_decay=0.1, ns_kernels="triton", **options)
    with (old_order() if order == "old" else contextlib.nullcontext()), products_on_torch(), \
            recording() as (launches, claims):
        result = _steps_then_half(opt, named, lambda s, n, p: grads[s][n].clone(), STEPS)
    return result, launches, claims


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_single_device_equals_the_two_pass_order_bitwise(variant):
    (new, before, after), launches, claims = _single(variant, "new")
    (old, *_), old_launches, _ = _single(variant, "old")
    _assert_halved(before, after, variant)
    _assert_bitwise(new, old, variant)
    # one launch per piece and step, momentum and input together; the old order took two
    assert launches == ["fused"] * (len(SHAPES) * (STEPS + 1)), launches
    assert claims == ["fused_whole"] * len(launches)
    assert sorted(set(old_launches)) == ["input", "momentum"] and len(old_launches) == 2 * len(launches)


def test_the_torch_formulas_keep_their_order():
    """``ns_kernels="torch"``: nothing pending, the momentum kernel never runs."""
    import optimizer.step.muon_update as update
    from optimizer import Muon

    w = torch.nn.Parameter(torch.randn(8, 12))
    opt = Muon([w], lr=0.02, ns_kernels="torch")
    real, seen = update.matrix_steps, []

    def watch(*args, **kwargs):
        steps = real(*args, **kwargs)
        seen.extend((s.fused, s.pending) for s in steps)
        return steps

    update.matrix_steps = watch
    try:
        with recording() as (launches, _):
            w.grad = torch.randn(8, 12)
            opt.step()
    finally:
        update.matrix_steps = real
    assert seen == [(False, None)] and launches == []


# ---------------------------------------------------------------------------- forked gloo ranks

Q, K = (16, 12), (8, 12)
CASES = {
    "fsdp": ((2,), [("layers.0.attention.wq.weight", Q, ["S0"]), ("w1", (10, 13), ["S0"]),
                    ("w2", (13, 10), ["S1"]), ("w3", (1, 12), ["S0"]),  # rank 1 holds none of w3
                    ("norm", (12,), ["S0"])], {}),
    "fsdp_tp": ((2, 2), [("layers.0.attention.wq.weight", Q, ["SS0/2", "S0"]), ("w1", (9, 6), ["SS0/2", "S0"]),
                         ("w2", (6, 9), ["S0", "S1"])],
                {"muon_group": {"normuon_beta2": 0.9, "momentum_dtype": torch.bfloat16, "maximize": True}}),
    "hsdp_replica_split": ((2, 2), [("layers.0.attention.wq.weight", Q, ["R", "S0"]), ("w1", (7, 5), ["R", "S0"]),
                                    ("w2", (12, 20), ["R", "S1"]), ("moe.w1", (3, 8, 6), ["R", "S0"])],
                           {"replica_split": "always"}),
    "experts": ((2, 2), [("moe.w1", (4, 8, 12), ["S0", "S1"]), ("moe.w2", (4, 12, 8), ["S0", "R"]),
                         ("moe.w3", (3, 9, 6), ["S0", "S2"])], {"muon_group": {"normuon_beta2": 0.9}}),
    "ns_split": ((4,), [("layers.0.attention.wq.weight", Q, ["S0"]), ("w1", (40, 12), ["S0"]),
                        ("moe.w1", (2, 8, 24), ["S1"])], {"muon_group": {"ns_split": "always", "nesterov": False}}),
    "gather": ((2, 2), [("layers.0.attention.wq.weight", Q, ["SS0/2", "S0"]), ("w2", (12, 20), ["R", "S1"]),
                        ("moe.w1", (4, 8, 12), ["S0", "S1"])], {"distributed_mode": "gather"}),
    # expert stacks cut into ranges of experts, each range cut over both ranks by ns_split and sent
    # block by block (NorMuon's rows ride along): boxes, a range of experts and some of their rows,
    # the one region the bookkeeping cannot fuse (a momentum pass first, then only read)
    "experts_ns_split_normuon": ((2,), [("moe.w1", (6, 16, 40), ["S1"]), ("moe.w2", (5, 40, 16), ["S2"])],
                                 {"muon_group": {"ns_split": "always", "normuon_beta2": 0.9}}),
    # 15 experts on 4 ranks held 6, 6, 3, 0: moved whole to the rank holding none
    "moved_experts": ((4,), [(f"layers.{i}.moe.{w}", s, ["S0"]) for i in range(3)
                             for w, s in (("w1", (2, 12, 16)), ("w2", (3, 16, 12)))], {"moves": True}),
}


def _rank(rank, world_size, name):
    from optimizer import Muon
    from optimizer.parallel.planning import plan_inputs
    from optimizer.parallel.planning.cut_hardware import CPU_GLOO, SplitHardware
    from torch.distributed.device_mesh import init_device_mesh

    mesh_shape, specs, extra = CASES[name]
    extra = dict(extra)
    if extra.pop("moves", False):  # moving these tiny experts pays only on a fast link (as test_host_syncs.py)
        plan_inputs.split_hardware = lambda device: SplitHardware(
            "test: moves free, collectives slow", CPU_GLOO.bf16_flops, CPU_GLOO.fp32_flops, 1e18, 1.0,
            torch.float32, device="cpu")
    group = {**extra.pop("muon_group", {}), "ns_kernels": "triton"}
    mesh = init_device_mesh("cpu", mesh_shape)
    out = {}
    for order in ("new", "old"):
        params, grads = make_case_tensors(specs, STEPS)
        named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
                 for n, _, pl in specs]
        opt = Muon(build_groups(named, group), **{**OPT_KW, **extra})
        with (old_order() if order == "old" else contextlib.nullcontext()), products_on_torch(), \
                recording() as (launches, claims):
            result = _steps_then_half(opt, named, lambda s, n, p: to_dtensor(grads[s][n], mesh, p.placements), STEPS)
        stats = opt.last_step_stats
        out[order] = (result, launches, claims, stats.moved_units, stats.split_units)
    return out


# what each case must exercise (the claims' outcomes and the launches seen on some rank): whole
# pieces fused, parts of pieces fused (expert ranges, cut units' blocks), parts brought up to date
# and then only read (boxes), the finish pass (pieces this rank never formed)
EXERCISES = {
    "fsdp": {"fused_whole"},
    "fsdp_tp": {"fused_whole"},
    "hsdp_replica_split": {"fused_whole", "fused_part", "momentum"},
    "experts": {"fused_whole", "fused_part", "momentum"},
    "ns_split": {"fused_whole", "fused_part", "split"},
    "gather": {"fused_whole"},
    "experts_ns_split_normuon": {"fused_part", "catch_up", "read_part", "split"},
    "moved_experts": {"fused_whole", "moved"},
}


@pytest.mark.parametrize("name", list(CASES))
def test_parallel_equals_the_two_pass_order_bitwise(name):
    mesh_shape, _, _ = CASES[name]
    world = 1
    for n in mesh_shape:
        world *= n
    results = run_ranks(_rank, world, name, timeout=300)
    seen = set()
    for rank, out in enumerate(results):
        (new, before, after), launches, claims, moved, split = out["new"]
        (old, old_before, old_after), *_ = out["old"]
        _assert_halved(before, after, f"{name} rank {rank}")
        _assert_halved(old_before, old_after, f"{name} rank {rank} (old order)")
        _assert_bitwise(new, old, f"{name} rank {rank}")
        # every input formed in one launch: with its momentum where the claim fused, alone where not
        assert launches.count("fused") == sum(c.startswith("fused_") for c in claims), (name, rank)
        assert launches.count("input") == sum(not c.startswith("fused_") for c in claims), (name, rank)
        seen |= set(claims) | set(launches) | ({"moved"} if moved else set()) | ({"split"} if split else set())
    assert EXERCISES[name] <= seen, (name, sorted(seen))
