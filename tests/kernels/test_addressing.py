"""Sizes the product kernels cannot address (optimizer/kernels/addressing.py): their in-matrix
offsets are int32, so ``"auto"`` runs such products on torch and ``"triton"`` refuses them, in the
dispatcher and, for a parameter, when its group is added. The rule is a function of shapes and
strides: tested on both sides of 2^31 with no memory (meta tensors, shape tuples), the dispatcher
and Newton–Schulz with the limit lowered to sizes a CPU runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from optimizer import Muon, kernels
from optimizer.kernels import addressing
from optimizer.kernels.addressing import newton_schulz_problem, overlaps_itself, product_problem
from optimizer.newton_schulz.implementation import shape_problem

INT32_MAX = 2**31 - 1


def int32_offset(index: tuple[int, int], strides: tuple[int, int]) -> int:
    """The offset the kernels form for element ``index``: row x row stride + column x column
    stride with int32 indices, each product and the sum wrapping in int32 unless a stride is past
    int32 (Triton then passes it as int64), as the kernels' code does."""
    def integer(stride):
        return np.int32(stride) if stride <= INT32_MAX else np.int64(stride)

    with np.errstate(over="ignore"):
        i, j = np.array(index, dtype=np.int64).astype(np.int32)  # a column index past int32 wraps too
        return int(i * integer(strides[0]) + j * integer(strides[1]))


def contiguous(*shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    return tuple(shape), tuple(strides)


def zeros(m, n):
    """An [m, n] operand whose offsets are all 0 (strides 0): only the other operands matter."""
    return (m, n), (0, 0)


# Matrices on both sides of the boundary: the last element's offset is 2^31 - 1 (addressable) or
# 2^31 (not), contiguous, padded rows and column-major.
BOUNDARY = [
    ("contiguous, 2 x 2^30", contiguous(2, 2**30), True),
    ("contiguous, 2 x (2^30 + 1)", contiguous(2, 2**30 + 1), False),
    ("contiguous, 1 x 2^31", contiguous(1, 2**31), True),
    ("contiguous, 1 x (2^31 + 1)", contiguous(1, 2**31 + 1), False),
    ("padded rows", ((32768, 1000), (65536, 1)), True),  # 32767 * 65536 + 999 < 2^31
    ("padded rows, one more", ((32769, 1000), (65536, 1)), False),
    ("column-major", ((46341, 46340), (1, 46341)), True),  # 46340 + 46339 * 46341 < 2^31
    ("column-major, one more column", ((46341, 46342), (1, 46341)), False),
]


@pytest.mark.parametrize("name,layout,addressable", BOUNDARY, ids=[b[0] for b in BOUNDARY])
def test_the_rule_refuses_exactly_the_matrices_whose_int32_offsets_wrap(name, layout, addressable):
    (m, n), strides = layout
    last = (m - 1) * strides[0] + (n - 1) * strides[1]  # the exact offset of the last element
    assert (last <= INT32_MAX) == addressable, "the case is on the side of the boundary its name says"
    wraps = int32_offset((m - 1, n - 1), strides) != last
    assert wraps == (not addressable)
    # as each operand of a product: L [m, n] times R [n, 1]; L [1, m] times R [m, n]; C and out [m, n]
    for L, R, C, out, operand in (
        (layout, zeros(n, 1), None, None, "L"),
        (zeros(1, m), layout, None, None, "R"),
        (zeros(m, 2), zeros(2, n), layout, None, "C"),
        (zeros(m, 2), zeros(2, n), None, layout, "out"),
    ):
        problem = product_problem(L, R, C, out)
        assert (problem is None) == addressable, (operand, problem)
        if problem is not None:
            assert problem.startswith(operand + " "), problem


def test_a_batch_offset_is_not_limited():
    """The batch offset is 64-bit in both kernels: 4 matrices of 2^30 entries each are fine."""
    X = ((4, 2, 2**29), (2**30, 2**29, 1))
    assert product_problem(X, ((4, 2**29, 2), (2**30, 2, 1)), None, None) is None


def test_the_output_is_the_launchers_when_none_is_given():
    """out=None: the launcher allocates [m, n] contiguous, whose extent is checked too."""
    L, R = contiguous(2**16, 1), contiguous(1, 2**15)  # m x n = 2^31 entries
    assert product_problem(L, R, None, None) is None
    assert "out (65536, 32769)" in product_problem(L, contiguous(1, 2**15 + 1), None, None)


@pytest.mark.parametrize("shape,strides,overlaps", [
    ((3, 4, 5), (20, 5, 1), False),
    ((3, 4, 5), (0, 5, 1), True),  # a batch expanded from one matrix
    ((4, 5), (1, 4), False),  # column-major
    ((4, 5), (2, 1), True),  # rows that overlap
    ((1, 4, 5), (0, 5, 1), False),  # a batch of one: nothing shares memory
    ((4, 5, 2), (10, 1, 5), False),  # interleaved but disjoint
])
def test_an_output_whose_elements_share_memory(shape, strides, overlaps):
    # independent oracle: every element's offset, and whether two coincide
    offsets = [sum(i * s for i, s in zip(index, strides)) for index in np.ndindex(*shape)]
    assert (len(set(offsets)) < len(offsets)) == overlaps
    assert overlaps_itself(shape, strides) == overlaps
    L, R = contiguous(*shape[:-1], 3), contiguous(*shape[:-2], 3, shape[-1])
    problem = product_problem(L, R, None, (shape, strides))
    assert (problem is not None) == overlaps
    if overlaps:
        assert problem.startswith("out ") and "share memory" in problem


@pytest.mark.parametrize("shape,addressable", [
    ((32768, 65536), True),  # 2^31 entries: the last offset is 2^31 - 1
    ((65536, 32768), True),  # tall: the same matrices, transposed
    ((32768, 65537), False),
    ((4, 32768, 65536), True),  # experts: 64-bit batch offsets
    ((4, 65537, 32768), False),
    ((1, 2**31), True),
    ((2**31 + 1, 1), False),
])
def test_newton_schulz_problem_of_a_parameter_shape(shape, addressable):
    assert (newton_schulz_problem(shape) is None) == addressable
    problem = shape_problem("triton", shape)
    assert (problem is None) == addressable
    if problem:
        assert "ns_kernels='triton'" in problem and "'auto'" in problem
    assert shape_problem("auto", shape) is None and shape_problem("torch", shape) is None


def test_triton_refuses_such_a_parameter_when_its_group_is_added():
    """Named, before the group is added; "auto" takes it (its products run on torch)."""
    huge = torch.nn.Parameter(torch.zeros(1, 1).expand(32768, 65537))  # on the CPU, where the interpreter runs "triton"
    fine = torch.nn.Parameter(torch.empty(4, 4))
    opt = Muon([{"params": [fine], "use_muon": True}], lr=0.02, ns_kernels="torch")
    with pytest.raises(ValueError, match=r"parameter '.*'.*ns_kernels='triton'.*\(32768, 65537\).*param_groups\[1\]"):
        opt.add_param_group({"params": [huge], "use_muon": True, "ns_kernels": "triton"})
    assert len(opt.param_groups) == 1


# ---------------------------------------------------------------------------- the dispatcher and Newton–Schulz


@pytest.fixture
def limit(monkeypatch):
    """Lower the kernels' offset limit to ``value`` so that the dispatcher's and the optimizer's
    decisions can be watched on CPU-sized operands."""
    def lower(value):
        monkeypatch.setattr(addressing, "MAX_OFFSET", value)
        addressing.newton_schulz_problem.cache_clear()
    yield lower
    addressing.newton_schulz_problem.cache_clear()


def _count_launches(monkeypatch):
    pytest.importorskip("triton")
    from optimizer.kernels import matmul_add_kernel, symmetric_kernel

    launches = []
    for module, name in ((symmetric_kernel, "symmetric_matmul_triton"), (matmul_add_kernel, "matmul_add_triton")):
        real = getattr(module, name)

        def counted(*args, real=real, name=name, **kwargs):
            launches.append(name)
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return launches


def test_the_dispatcher_routes_auto_to_torch_and_refuses_triton(monkeypatch, limit):
    from pretend_gpu import pretend_auto_takes_the_kernels

    pretend_auto_takes_the_kernels(monkeypatch)
    launches = _count_launches(monkeypatch)
    X = torch.randn(70, 40, generator=torch.Generator().manual_seed(0))
    # X X^T: the output [70, 70] has the largest offset, 4899 (70 rows: two tile rows on an H100)
    limit(70 * 70 - 1)
    kernels.syrk(X, backend="triton")  # at the limit: the kernel
    kernels.syrk(X)  # "auto"
    assert launches == ["symmetric_matmul_triton"] * 2
    limit(70 * 70 - 2)
    launches.clear()
    assert torch.equal(kernels.syrk(X), kernels.syrk(X, backend="torch"))  # past it: "auto" is torch
    with pytest.raises(ValueError, match=r"symmetric_matmul: backend='triton' cannot run this product: out "
                                         r"\(70, 70\) .* spans 4,899 elements .* past the kernels' 32-bit"):
        kernels.syrk(X, backend="triton")
    assert launches == []
    # Xᵀ X: L = Xᵀ [40, 70] strides (1, 40) and R = X [70, 40] reach 2799, the output [40, 40] less
    limit(70 * 40 - 1)
    kernels.matmul_add(X.mT, X, backend="triton")
    assert launches == ["matmul_add_triton"]
    limit(70 * 40 - 2)
    with pytest.raises(ValueError, match=r"matmul_add: backend='triton' cannot run this product: L \(40, 70\)"):
        kernels.matmul_add(X.mT, X, backend="triton")
    assert launches == ["matmul_add_triton"]


def test_an_output_that_overlaps_itself_is_not_given_to_the_kernels(monkeypatch):
    from pretend_gpu import pretend_auto_takes_the_kernels

    pretend_auto_takes_the_kernels(monkeypatch)
    launches = _count_launches(monkeypatch)
    X = torch.randn(2, 70, 40)
    out = torch.zeros(70, 70).expand(2, 70, 70)  # batch stride 0
    with pytest.raises(ValueError, match="out .* share memory"):
        kernels.syrk(X, out=out, backend="triton")
    assert launches == [] and torch.equal(out, torch.zeros(2, 70, 70))


@pytest.mark.parametrize("shape", [(40, 70), (70, 40), (3, 40, 70)])
def test_newton_schulz_problem_is_exactly_what_the_iteration_passes(monkeypatch, limit, shape):
    """The group-time prediction and the calls Newton–Schulz makes agree on both sides of the
    limit: at the largest offset of the parameter's matrices every product runs on the kernels,
    one below it "triton" is refused by the prediction and by a product of the iteration."""
    from optimizer.newton_schulz import zeropower_via_newtonschulz

    G = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    largest = shape[-1] * shape[-2] - 1
    limit(largest)
    assert shape_problem("triton", shape) is None
    for method in ("classic", "gram"):
        zeropower_via_newtonschulz(G, ns_steps=5, compute_dtype=torch.float32, method=method, ns_kernels="triton")
    limit(largest - 1)
    assert shape_problem("triton", shape) is not None
    for method in ("classic", "gram"):
        with pytest.raises(ValueError, match="cannot run this product"):
            zeropower_via_newtonschulz(G, ns_steps=5, compute_dtype=torch.float32, method=method, ns_kernels="triton")
