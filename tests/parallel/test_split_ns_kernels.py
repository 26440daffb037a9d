"""Newton–Schulz of a matrix cut over ranks (``ns_split``: newton_schulz/cut.py) with its
products on the Triton kernels (``ns_kernels="triton"``, run on CPU tensors under Triton's
interpreter: tests/conftest.py sets ``TRITON_INTERPRET=1``), on 3 forked gloo ranks with uneven
block widths.

Cases: classic and Gram forms; B replicated and by rows (13 rows on 3 ranks: 5, 5, 3); the Gram
recursion redundant and by rows; a wide, a tall (transposed by the caller) and a batched (experts)
matrix; fp32, bf16 and fp16 (the Gram form's CUDA dtype, with its own first Gram matrix).
References, all computed here per case:

* the fp64 iteration (the unsplit call in float64, torch's matmuls): the kernels' split is as close
  to it as the torch split and as the unsplit kernels call are (relative Frobenius distance at
  most twice theirs, plus 4 units of the dtype's rounding), the criterion of
  tests/kernels/test_kernel_newton_schulz.py: "equal within the compute dtype's rounding";
* the unsplit kernels call (``zeropower_via_newtonschulz(ns_kernels="triton")``) in 16 bits: within
  the split tolerances test_split_newton_schulz.py documents for the torch split against the
  unsplit call (bf16: max 5e-2, rms 8e-3; fp16: max 1e-2, rms 1.5e-3);
* every replicated ``B = b A + c A^2`` the kernels computed (recorded), element by element against
  that product of its recorded A in fp64, within the bound of one fp32 accumulation and one
  rounding to the dtype (tests/kernels/kernel_bounds.py): the epilogue's coefficients, step by
  step; each Gram segment's Q against the kernels' recursion on its recorded A, bit for bit;
* the launches: the exact number of symmetric and general kernel launches the plan implies
  (counted here from the case's plan, not from the code), none with ``ns_kernels="torch"`` or
  ``"auto"`` on CPU;
* the replicated matrices are bitwise identical on every member.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys

import pytest
import torch

from harness import run_ranks

pytest.importorskip("triton")

# tests/kernels' bounds (that folder is on the path only when its own tests are collected; the
# name "kernels" alone is another installed package's)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
from kernel_bounds import assert_within_rounding  # noqa: E402
from tolerances import unit_roundoff  # noqa: E402

TIMEOUT = 300
K = 3
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# name: (shape, method, b_split, recursion, dtype, coefficients)
CASES = {
    "wide_classic_replicated": ((24, 56), "classic", "replicated", "redundant", F32, "polar_express"),
    "tall_classic_rows": ((40, 13), "classic", "rows", "redundant", F32, "fixed"),
    "wide_gram_redundant": ((16, 72), "gram", "replicated", "redundant", F32, "polar_express"),
    "experts_gram_rows": ((3, 12, 40), "gram", "replicated", "rows", F32, "fixed"),
    "experts_classic_bf16": ((3, 12, 40), "classic", "replicated", "redundant", BF16, "fixed"),
    "wide_classic_rows_bf16": ((13, 56), "classic", "rows", "redundant", BF16, "polar_express"),
    "wide_gram_fp16": ((16, 72), "gram", "replicated", "redundant", F16, "fixed"),
}
STEPS = 5


def uneven_widths(n: int, k: int) -> list[int]:
    """Widths growing as (j+1)^2, every one >= 1."""
    raw = [(j + 1) ** 2 for j in range(k)]
    widths = [max(1, n * r // sum(raw)) for r in raw]
    widths[-1] += n - sum(widths)
    return widths


def block_of(widths, rank):
    start = sum(widths[:rank])
    return slice(start, start + widths[rank])


@contextlib.contextmanager
def counting_launches():
    """Counts the Triton kernel launches of the products (symmetric and general) in this process."""
    from optimizer.kernels import matmul_add_kernel, symmetric_kernel

    counts = {"symmetric": 0, "general": 0}
    originals = {(symmetric_kernel, "symmetric_matmul_triton"): "symmetric",
                 (matmul_add_kernel, "matmul_add_triton"): "general"}

    def counting(fn, key):
        def wrapped(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    saved = {where: getattr(*where) for where in originals}
    for (module, name), key in originals.items():
        setattr(module, name, counting(saved[(module, name)], key))
    try:
        yield counts
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


def expected_launches(shape, k, plan, b_split, recursion) -> dict[str, int]:
    """The launches one call makes, from the plan: a classic step is X X^T and b A + c A^2
    (symmetric) and a X + B X (general), with B by rows: X X^T, then B's rows and a X + B X
    (general); a Gram segment of L steps is X X^T, the recursion's 4L - 3 symmetric products
    (B every step, Q after the first, A q(A) and q(A) A q(A) before the last) and Q X, or by rows
    1 symmetric and 4L - 2 general. A batch of two or more matrices runs as two halves."""
    halves = 2 if len(shape) > 2 and math.prod(shape[:-2]) >= 2 and k > 1 else 1
    sym = gen = 0
    for length in plan:
        if length == 1:
            sym, gen = (sym + 1, gen + 2) if b_split == "rows" else (sym + 2, gen + 1)
        elif recursion == "rows":
            sym, gen = sym + 1, gen + 4 * length - 2
        else:
            sym, gen = sym + 4 * length - 2, gen + 1
    return {"symmetric": halves * sym, "general": halves * gen}


def _case(rank, k, name):
    from optimizer.newton_schulz import zeropower_via_newtonschulz
    from optimizer.newton_schulz.coefficients import resolve_ns_coefficients
    from optimizer.newton_schulz.cut import _split_ns
    from optimizer.newton_schulz.forms import choose_ns_form
    from optimizer.newton_schulz.implementation import resolve_implementation
    from optimizer.newton_schulz.iteration import gram_segment_factor
    from optimizer.newton_schulz.restarts import gram_restart_plan

    shape, method, b_split, recursion, dtype, coef = CASES[name]
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    tall = shape[-2] > shape[-1]
    Gt = G.mT if tall else G
    widths = uneven_widths(Gt.shape[-1], k)
    mine = Gt[..., block_of(widths, rank)].contiguous()

    def split(ns_kernels, record=None):
        return _split_ns(mine, widths, None, STEPS, coef, 1e-7, dtype, None, method, b_split, None, record,
                         recursion, ns_kernels)

    def block(whole):  # this rank's block of an unsplit result, short side first
        whole = whole.mT if tall else whole
        return whole[..., block_of(widths, rank)].double()

    record: list = []
    with counting_launches() as on_kernels:
        split_k = split("triton", record).double()
    with counting_launches() as on_torch:
        split_t = split("torch").double()
    with counting_launches() as on_auto:
        split("auto")
    whole_k = block(zeropower_via_newtonschulz(G, STEPS, coef, compute_dtype=dtype, method=method, ns_kernels="triton"))
    exact = block(zeropower_via_newtonschulz(G.double(), STEPS, coef, compute_dtype=torch.float64, method=method,
                                             ns_kernels="torch"))

    # the replicated products, against fp64 of their recorded inputs (classic steps: A, B per
    # step; Gram segments: A, Q redundantly, A, B per step, the next A's and Q by rows)
    form, run = choose_ns_form(G.shape, STEPS, method, dtype, coef)
    plan = gram_restart_plan(coef, STEPS, run) if form == "gram" else (1,) * STEPS
    steps = resolve_ns_coefficients(coef, STEPS)
    halves = 2 if G.ndim > 2 and math.prod(G.shape[:-2]) >= 2 else 1

    def kernels_factor(A, segment):  # the Gram recursion on the kernels' products, as "triton" runs it
        return gram_segment_factor(A, segment, resolve_implementation("triton", A.device, (A.dtype,)).products(A, A.dtype))

    checked = _check_record(record, plan, steps, halves, b_split, recursion, kernels_factor)

    def ssq(t):
        return t.pow(2).sum().item()

    return {
        "ssq": (ssq(split_k - exact), ssq(split_t - exact), ssq(whole_k - exact), ssq(exact)),
        "vs_whole": ((split_k - whole_k).abs().max().item(), ssq(split_k - whole_k), split_k.numel()),
        "launches": (dict(on_kernels), dict(on_torch), dict(on_auto)),
        "expected": expected_launches(G.shape, k, plan, b_split, recursion),
        "checked": checked,
        "record": hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in record)).hexdigest(),
        "form": (form, run, tuple(plan)),
    }


def _check_record(record, plan, steps, halves, b_split, recursion, kernels_factor) -> tuple[int, list[str]]:
    """Check every B and Q in the record, in the order each half records them (the two halves of a
    batch interleave at their collectives; they hold 2 and 1 matrices here, so a matrix's shape
    says whose it is); returns how many were checked and what failed (each check's message)."""
    kinds: list[tuple[str, int, int]] = []  # (kind, segment's first step, step within it)
    first = 0
    for length in plan:
        if length == 1:
            kinds += [("A", first, 0), ("B" if b_split == "rows" else "B=", first, 0)]
        elif recursion == "rows":
            kinds.append(("A", first, 0))
            for j in range(length):
                kinds.append(("B", first, j))
                if j + 1 < length:
                    kinds.append(("A", first, j + 1))
            kinds.append(("Q", first, length))
        else:
            kinds += [("A", first, 0), ("Q", first, length)]
        first += length
    if len(record) != halves * len(kinds):
        return 0, [f"{len(record)} replicated matrices recorded, the plan implies {halves} x {len(kinds)}"]
    per_half: dict = {}
    for M in record:
        per_half.setdefault(tuple(M.shape[:-2]), []).append(M)
    if len(per_half) != halves:
        return 0, [f"the record holds {len(per_half)} batch shapes, not {halves}"]
    checked, problems = 0, []
    for entries in per_half.values():
        A = None
        for (kind, first, j), M in zip(kinds, entries):
            if kind == "A":
                A = M
            elif kind.startswith("B"):
                a, b, c = steps[first + j]
                # "B=": replicated, one triangle mirrored (exactly symmetric); "B": by rows, gathered
                try:
                    assert_within_rounding(M, A, A, A, alpha=c, beta=b, symmetric=kind == "B=")
                except AssertionError as error:
                    problems.append(f"B of step {first + j}: {error}")
                checked += 1
            else:
                segment = steps[first:first + j]
                if recursion != "rows":  # the kernels' recursion on the recorded A, bit for bit
                    if not torch.equal(M, kernels_factor(A, segment)):
                        problems.append(f"Q of the segment from step {first}: not the kernels' recursion on its A")
                    checked += 1
    return checked, problems


def _run(rank, k):
    return {name: _case(rank, k, name) for name in CASES}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_run, K, timeout=TIMEOUT)


@pytest.mark.parametrize("name", list(CASES))
def test_split_on_the_kernels(results, name):
    shape, method, b_split, recursion, dtype, coef = CASES[name]
    per_rank = [r[name] for r in results]
    # every product ran on the kernels, as many launches as the plan implies; none on torch or
    # "auto" on the CPU
    for r in per_rank:
        on_kernels, on_torch, on_auto = r["launches"]
        assert on_kernels == r["expected"], (name, on_kernels, r["expected"])
        assert on_torch == on_auto == {"symmetric": 0, "general": 0}
        checked, problems = r["checked"]
        assert checked >= 1 and problems == [], (name, problems)
    # the replicated matrices, bitwise identical on every member
    assert len({r["record"] for r in per_rank}) == 1
    # as close to the fp64 iteration as the torch split and the unsplit kernels call
    err_k, err_t, err_whole, norm = (math.sqrt(sum(r["ssq"][i] for r in per_rank)) for i in range(4))
    floor = 4 * unit_roundoff(dtype) * norm
    assert err_k <= 2 * err_t + floor, (name, err_k / norm, err_t / norm)
    assert err_k <= 2 * err_whole + floor, (name, err_k / norm, err_whole / norm)
    # 16 bits: within the split's documented tolerances of the unsplit (kernels) call
    worst = max(r["vs_whole"][0] for r in per_rank)
    rms = math.sqrt(sum(r["vs_whole"][1] for r in per_rank) / sum(r["vs_whole"][2] for r in per_rank))
    if dtype == BF16:
        assert worst <= 5e-2 and rms <= 8e-3, (name, worst, rms)
    elif dtype == F16:
        assert worst <= 1e-2 and rms <= 1.5e-3, (name, worst, rms)


def test_the_cases_cover_both_forms_and_their_splits(results):
    forms = {name: r["form"] for name, r in results[0].items()}
    assert {f[0] for f in forms.values()} == {"classic", "gram"}
    assert forms["wide_gram_fp16"] == ("gram", F16, (2, 2, 1))  # Gram segments and a classic step
    assert forms["experts_gram_rows"][2] == (5,)


def test_triton_where_it_cannot_run_and_a_bad_value_are_refused():
    from optimizer.newton_schulz.cut import split_zeropower_via_newtonschulz

    G = torch.randn(6, 10, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="ns_kernels='triton' cannot run.*float64"):
        split_zeropower_via_newtonschulz(G, [10], None, compute_dtype=torch.float64, ns_kernels="triton")
    with pytest.raises(ValueError, match="ns_kernels must be one of"):
        split_zeropower_via_newtonschulz(G, [10], None, ns_kernels="cuda")


def test_auto_where_the_kernels_run_keeps_cublas_for_the_general_products(monkeypatch):
    """``"auto"`` where the kernels run (a CUDA GPU; pretended here, tests/pretend_gpu.py) gives
    the cut call the products the unsplit call gets: symmetric ones on the kernels from two tile
    rows up (130 rows: three 64-row fp32 tiles; 40 rows: one, so cuBLAS) and ``a X_i + B X_i`` on
    torch (cuBLAS on a GPU); ``"triton"`` runs every product on the kernels. One member (no
    group), the classic form: 2 symmetric and 1 general product a step."""
    from pretend_gpu import pretend_auto_takes_the_kernels

    from optimizer.newton_schulz.cut import split_zeropower_via_newtonschulz

    pretend_auto_takes_the_kernels(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    large, small = torch.randn(130, 200, generator=gen), torch.randn(40, 100, generator=gen)
    launches = {}
    for name, G in (("large", large), ("small", small)):
        for mode in ("auto", "triton", "torch"):
            with counting_launches() as counts:
                split_zeropower_via_newtonschulz(G, [G.shape[1]], None, STEPS, compute_dtype=F32, method="classic",
                                                 ns_kernels=mode)
            launches[name, mode] = dict(counts)
    assert launches == {("large", "auto"): {"symmetric": 2 * STEPS, "general": 0},
                        ("large", "triton"): {"symmetric": 2 * STEPS, "general": STEPS},
                        ("large", "torch"): {"symmetric": 0, "general": 0},
                        ("small", "auto"): {"symmetric": 0, "general": 0},
                        ("small", "triton"): {"symmetric": 2 * STEPS, "general": STEPS},
                        ("small", "torch"): {"symmetric": 0, "general": 0}}
