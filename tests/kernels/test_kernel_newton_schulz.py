"""Newton–Schulz's iteration (optimizer/newton_schulz/iteration.py) on the kernels' products
(products.KernelProducts, as ``ns_kernels="triton"`` resolves them) under Triton's interpreter.

References: the iteration written out here in fp64 (X <- a X + (b A + c A^2) X on the same
normalised input), the polynomial applied to the singular values in fp64, and the same iteration
on torch's products (products.TorchProducts) in the same dtype. "Within 16-bit rounding": the
kernels' distance from the fp64 iteration is at most twice the torch products' own, in the same
dtype (measured: 0.7x to 1.4x for the classic and Gram forms in fp32 and fp16, and bit-identical
results in bf16 at these sizes, where both round one fp32 accumulation per product).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from optimizer.newton_schulz.coefficients import NS_NORM_SAFETY, resolve_ns_coefficients  # noqa: E402
from optimizer.newton_schulz.implementation import ON_TORCH, resolve_implementation  # noqa: E402
from optimizer.newton_schulz.iteration import classic_iterations, gram_iterations, gram_segment_factor  # noqa: E402
from optimizer.newton_schulz.products import TorchProducts  # noqa: E402
from optimizer.newton_schulz.whole import normalised as normalise  # noqa: E402


def on_kernels(X):
    """The products ``ns_kernels="triton"`` gives X's iteration on the CPU (the interpreter)."""
    return resolve_implementation("triton", X.device, (X.dtype,)).products(X, X.dtype)


def on_torch(X):
    return ON_TORCH.products(X, X.dtype)


def normalised(shape, dtype, table, seed=0):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    X = normalise(G, dtype, NS_NORM_SAFETY[table], 1e-7)  # [batch, s, l]
    return X[0] if len(shape) == 2 else X


def fp64_iteration(X, steps):
    X = X.double()
    for a, b, c in steps:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X


def distance(X, reference):
    return ((X.double() - reference).norm() / reference.norm()).item()


def assert_as_accurate_as_torch(kernels_result, torch_result, reference):
    ours, theirs = distance(kernels_result, reference), distance(torch_result, reference)
    assert kernels_result.dtype == torch_result.dtype and kernels_result.shape == torch_result.shape
    assert ours <= 2 * theirs, f"kernels {ours:.3g} from the fp64 iteration, torch {theirs:.3g}"


@pytest.mark.parametrize(
    "dtype, table, shape",
    [
        (torch.float32, "polar_express", (37, 53)),
        (torch.float16, "fixed", (37, 53)),
        (torch.bfloat16, "polar_express", (37, 53)),
        (torch.bfloat16, "fixed", (2, 37, 53)),
    ],
)
def test_classic(dtype, table, shape):
    steps = resolve_ns_coefficients(table, 5)
    X = normalised(shape, dtype, table)
    X0 = X.clone()
    got = classic_iterations(X, steps, on_kernels(X))
    assert torch.equal(X, X0), "the input was modified"
    assert_as_accurate_as_torch(got, classic_iterations(X, steps, on_torch(X)), fp64_iteration(X, steps))
    if dtype == torch.float32:
        # the polynomial on the singular values (NS acts on each separately), in fp64
        s = torch.linalg.svdvals(X.double())
        for a, b, c in steps:
            s = a * s + b * s**3 + c * s**5
        torch.testing.assert_close(torch.linalg.svdvals(got.double()), s.abs().sort(descending=True).values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype, plan", [(torch.float32, (5,)), (torch.float32, (2, 3)), (torch.float16, (1, 2, 2))])
def test_gram(dtype, plan):
    """Gram segments of 2, 3 and 5 steps, and a one-step segment (a classic step) between them."""
    steps = resolve_ns_coefficients("polar_express", 5)
    X = normalised((37, 53), dtype, "polar_express", seed=1)
    got = gram_iterations(X, steps, plan, on_kernels(X))
    assert_as_accurate_as_torch(got, gram_iterations(X, steps, plan, on_torch(X)), fp64_iteration(X, steps))


def test_gram_segment_factor():
    """Q of a 3-step segment against torch's recursion and against the product of the steps'
    q(A_j) = a I + b A_j + c A_j^2 with A_{j+1} = q(A_j) A_j q(A_j), in fp64."""
    segment = resolve_ns_coefficients("fixed", 3)
    X = normalised((2, 37, 53), torch.float32, "fixed", seed=2)
    A = X @ X.mT
    got = gram_segment_factor(A, segment, on_kernels(A))
    A64, Q64 = A.double(), torch.eye(37, dtype=torch.float64)
    for a, b, c in segment:
        q = a * torch.eye(37, dtype=torch.float64) + b * A64 + c * A64 @ A64
        Q64, A64 = Q64 @ q, q @ A64 @ q
    assert_as_accurate_as_torch(got, gram_segment_factor(A, segment, TorchProducts(False)), Q64)
    assert torch.equal(got, got.mT)


def test_buffers_alternate_and_spare_the_input():
    """Each step writes a X + B X into one of two buffers, never the X it reads nor the caller's X:
    the peak of an iteration that allocates per step (input, previous X, new X)."""
    writes = []

    class Recording(TorchProducts):
        def general(self, L, R, C=None, **kwargs):
            writes.append((kwargs["out"].data_ptr(), R.data_ptr()))
            return super().general(L, R, C, **kwargs)

    steps = resolve_ns_coefficients("polar_express", 5)
    X = normalised((37, 53), torch.float32, "polar_express", seed=3)
    X0 = X.clone()
    got = classic_iterations(X, steps, Recording(False))
    assert torch.equal(X, X0)
    targets = [out for out, _ in writes]
    assert len(set(targets)) == 2 and X.data_ptr() not in targets
    assert all(out != read for out, read in writes)
    assert got.data_ptr() == targets[-1]
    torch.testing.assert_close(got, classic_iterations(X, steps, on_kernels(X)), atol=1e-5, rtol=0)


def test_plan_must_cover_the_steps():
    steps = resolve_ns_coefficients("fixed", 5)
    with pytest.raises(ValueError, match="covers 4 steps, not 5"):
        gram_iterations(torch.zeros(3, 4), steps, (2, 2), on_torch(torch.zeros(3, 4)))
