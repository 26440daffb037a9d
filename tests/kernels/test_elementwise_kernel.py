"""The fused elementwise kernels (optimizer/kernels/elementwise_kernel.py), run under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1), three ways:

* against the formulas written in fp64, per element, within the bound of the fp32 roundings the
  formula allows and the storage dtypes' (kernel_bounds.py: ``lerp_fp64``, ``momentum_fp64``,
  ``nesterov_input_fp64``, ``apply_update_fp64``, each rounding counted there);
* against the ``"torch"`` backend, the references that define the kernels' arithmetic
  (elementwise_reference.py): bit for bit, contiguous and strided. Both sides run the same
  operations in the same order on every CPU: the kernel's ``tl.fma`` rounds once (a compiled FMA,
  or the interpreter's C ``fma``), and the reference forms each FMA exactly in fp64 (``fma32``) and
  otherwise runs one correctly rounded torch operation at a time, which no vector width or
  contraction changes (checked under ``ATEN_CPU_CAPABILITY=default``, ``avx2`` and ``avx512``);
* against the torch formulas of the optimizer (``rule.momentum_``, ``rule.nesterov_input_``,
  ``rule.apply_update_``): both within their bounds of the same fp64 formula, hence of each
  other. Not bit for bit: torch's CPU kernels contract ``a * b + c`` into one FMA only where ATen
  runs its AVX2/AVX-512 code on whole vectors, and round twice in its ``default`` code (another
  CPU, ``ATEN_CPU_CAPABILITY=default``), on a tail or on a strided piece; its bf16 ops may round
  their scalars to bf16. The bounds allow both, for torch only where it needs them (its scalars in
  the tensor's dtype).

Layouts: contiguous, transposed (``muon_transposed``), a region of a 3-D stack (strided on two
dims), bf16 momentum and gradients, fp32/bf16 outputs, maximize, nesterov False, cautious decay,
0-d tensor learning rates, weight decay 0.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_bounds import apply_update_fp64, assert_within, momentum_fp64, nesterov_input_fp64  # noqa: E402
from optimizer import rule  # noqa: E402
from optimizer.kernels import elementwise  # noqa: E402

U32 = torch.finfo(torch.float32).eps / 2
F32, BF16 = torch.float32, torch.bfloat16


def u(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _layout(kind: str, shape, dtype, gen):
    """A tensor of ``shape`` laid out as ``kind``: contiguous, transposed (stored [n, m]), or a
    region of a larger 3-D stack (strided in its batch and row dims)."""
    if kind == "contiguous":
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if kind == "transposed":
        return torch.randn(shape[::-1], generator=gen, dtype=torch.float64).to(dtype).mT
    if kind == "region":
        big = torch.randn((2 * shape[0], shape[1] + 3, shape[2] + 5), generator=gen, dtype=torch.float64).to(dtype)
        return big[::2, 1:1 + shape[1], 2:2 + shape[2]]
    raise AssertionError(kind)


SHAPES = {"contiguous": (37, 53), "transposed": (29, 41), "region": (3, 17, 23)}


def _same_layout(t):
    """A copy of ``t`` with ``t``'s strides (``clone`` would make a region dense)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)


def _signed(grad, maximize):
    return -grad.double() if maximize else grad.double()


# ---------------------------------------------------------------------------- momentum and input


@pytest.mark.parametrize("layout", list(SHAPES))
@pytest.mark.parametrize("buf_dtype,grad_dtype,out_dtype",
                         [(F32, F32, F32), (F32, F32, BF16), (BF16, F32, BF16), (F32, BF16, F32), (BF16, BF16, BF16)])
@pytest.mark.parametrize("momentum,nesterov,maximize", [(0.95, True, False), (0.3, True, True), (0.95, False, True)])
def test_momentum_and_input_against_fp64_and_the_reference(layout, buf_dtype, grad_dtype, out_dtype, momentum,
                                                           nesterov, maximize):
    gen = _gen(1)
    shape = SHAPES[layout]
    buf, grad = _layout(layout, shape, buf_dtype, gen), _layout(layout, shape, grad_dtype, gen)
    out = _layout(layout, shape, out_dtype, gen)  # strided like the others, its values overwritten
    work = torch.promote_types(buf_dtype, grad_dtype)
    g64 = _signed(grad, maximize)

    kbuf, kout = _same_layout(buf), _same_layout(out)
    assert kbuf.stride() == buf.stride() and (layout == "contiguous") == kbuf.is_contiguous()
    elementwise.momentum_nesterov_(kbuf, grad, kout, momentum, nesterov, maximize, dtype=work, backend="triton")

    # fp64: B = lerp(B, g, 1 - mu) stored in buf's dtype; X = lerp(g, B as stored, mu) (or B)
    assert_within(kbuf, *momentum_fp64(buf, g64, momentum, buf_dtype), "momentum")
    assert_within(kout, *nesterov_input_fp64(g64, kbuf, momentum, nesterov, work, out_dtype), "input")

    # the references (the "torch" backend) bit for bit
    rbuf, rout = _same_layout(buf), _same_layout(out)
    elementwise.momentum_nesterov_(rbuf, grad, rout, momentum, nesterov, maximize, dtype=work, backend="torch")
    assert torch.equal(kbuf, rbuf) and torch.equal(kout, rout)


@pytest.mark.parametrize("buf_dtype,grad_dtype,out_dtype",
                         [(F32, F32, F32), (F32, F32, BF16), (BF16, F32, F32), (BF16, F32, BF16), (F32, BF16, BF16),
                          (BF16, BF16, BF16)])
@pytest.mark.parametrize("momentum,nesterov,maximize", [(0.95, True, False), (0.3, True, True), (0.9, False, True)])
def test_momentum_and_input_agree_with_the_torch_formulas(buf_dtype, grad_dtype, out_dtype, momentum, nesterov,
                                                          maximize):
    """``rule.momentum_`` then ``rule.nesterov_input_`` (the optimizer's torch path) and the momentum
    kernel then the input kernel (how the optimizer calls them), on the same operands: each within
    its rounding bound of the fp64 formula, hence of each other. Pieces of 64k entries (torch's
    vector code on every entry where it has one) and of 1961 (a scalar tail)."""
    gen = _gen(2)
    work = torch.promote_types(buf_dtype, grad_dtype)
    for shape in ((64, 48), (2, 32, 40), (37, 53)):
        buf = torch.randn(shape, generator=gen).to(buf_dtype)
        grad = torch.randn(shape, generator=gen).to(grad_dtype)
        g64 = _signed(grad, maximize)
        tbuf, kbuf = buf.clone(), buf.clone()
        signed = rule.momentum_([tbuf], [grad], momentum, maximize, [work])[0]
        tout = torch.empty(shape, dtype=out_dtype)
        rule.nesterov_input_(tout, signed, tbuf, momentum, nesterov)
        kout = torch.empty(shape, dtype=out_dtype)
        elementwise.momentum_nesterov_(kbuf, grad, None, momentum, nesterov, maximize, dtype=work, backend="triton")
        elementwise.momentum_nesterov_(kbuf, grad, kout, momentum, nesterov, maximize, update_momentum=False,
                                       dtype=work, backend="triton")
        # the momentum: the kernel with fp32 scalars, torch's with its arithmetic dtype's
        want, kernel_bound = momentum_fp64(buf, g64, momentum, buf_dtype)
        _, torch_bound = momentum_fp64(buf, g64, momentum, buf_dtype, scalar_dtype=work)
        assert_within(kbuf, want, kernel_bound, f"kernel momentum {shape}")
        assert_within(tbuf, want, torch_bound, f"torch momentum {shape}")
        # the input, each from its momentum as stored; the exact input moves by at most
        # mu (Nesterov) or 1 times the difference of the two momenta
        kwant, kbound = nesterov_input_fp64(g64, kbuf, momentum, nesterov, work, out_dtype)
        twant, tbound = nesterov_input_fp64(g64, tbuf, momentum, nesterov, work, out_dtype, scalar_dtype=work)
        assert_within(kout, kwant, kbound, f"kernel input {shape}")
        assert_within(tout, twant, tbound, f"torch input {shape}")
        spread = (momentum if nesterov else 1.0) * (kbuf.double() - tbuf.double()).abs()
        assert_within(kout, tout.double(), kbound + tbound + spread, f"kernel against torch input {shape}")


def test_momentum_alone_and_input_alone():
    """``out=None`` updates the momentum only; ``update_momentum=False`` leaves buf as it was, bit
    for bit, and forms the input from it."""
    gen = _gen(3)
    buf, grad = torch.randn(40, 24, generator=gen), torch.randn(40, 24, generator=gen)
    kbuf, rbuf = buf.clone(), buf.clone()
    assert elementwise.momentum_nesterov_(kbuf, grad, None, 0.9, True, backend="triton") is None
    elementwise.momentum_nesterov_(rbuf, grad, None, 0.9, True, backend="torch")
    assert torch.equal(kbuf, rbuf)
    assert_within(kbuf, *momentum_fp64(buf, grad.double(), 0.9, F32), "momentum")
    stepped = kbuf.clone()
    out, rout = torch.empty(40, 24), torch.empty(40, 24)
    elementwise.momentum_nesterov_(kbuf, grad, out, 0.9, True, update_momentum=False, backend="triton")
    elementwise.momentum_nesterov_(rbuf, grad, rout, 0.9, True, update_momentum=False, backend="torch")
    assert torch.equal(kbuf, stepped)  # not updated twice
    assert torch.equal(out, rout)
    assert_within(out, *nesterov_input_fp64(grad.double(), stepped, 0.9, True, F32, F32), "input")


# ---------------------------------------------------------------------------- weight decay and update


@pytest.mark.parametrize("layout", list(SHAPES))
@pytest.mark.parametrize("param_dtype,update_dtype", [(F32, F32), (F32, BF16), (BF16, BF16), (BF16, F32)])
@pytest.mark.parametrize("cautious", [False, True])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_apply_update_against_fp64_and_the_reference(layout, param_dtype, update_dtype, cautious, tensor_lr):
    gen = _gen(4)
    shape = SHAPES[layout]
    param, update = _layout(layout, shape, param_dtype, gen), _layout(layout, shape, update_dtype, gen)
    lr_value, wd = 0.02, 0.1
    alr_value = lr_value * 0.2 * 53 ** 0.5
    lr = torch.tensor(lr_value) if tensor_lr else lr_value
    alr = torch.tensor(alr_value) if tensor_lr else alr_value
    kp = _same_layout(param)
    assert (layout == "contiguous") == kp.is_contiguous()
    elementwise.apply_update_(kp, update, lr, alr, wd, cautious, backend="triton")

    # fp64 from the values the step was given (a tensor lr's are its fp32 values)
    assert_within(kp, *apply_update_fp64(param, update, float(lr), float(alr), wd, cautious), "parameter")

    rp = _same_layout(param)
    elementwise.apply_update_(rp, update, lr, alr, wd, cautious, backend="torch")
    assert torch.equal(kp, rp)


@pytest.mark.parametrize("param_dtype,update_dtype", [(F32, F32), (F32, BF16), (BF16, BF16)])
@pytest.mark.parametrize("cautious", [False, True])
@pytest.mark.parametrize("tensor_lr", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_apply_update_agrees_with_the_torch_formula(param_dtype, update_dtype, cautious, tensor_lr, wd):
    """``rule.apply_update_`` (the optimizer's torch path) and the kernel on the same operands: each
    within its rounding bound of the fp64 formula (torch's with scalars in the parameter's dtype),
    hence of each other; a vectorised piece and one with a tail."""
    gen = _gen(5)
    for shape in ((64, 40), (37, 53)):
        param = torch.randn(shape, generator=gen).to(param_dtype)
        update = torch.randn(shape, generator=gen).to(update_dtype)
        lr = torch.tensor(0.02) if tensor_lr else 0.02
        alr = lr * 1.3
        tp, kp = param.clone(), param.clone()
        rule.apply_update_(tp, update, lr, alr, wd, cautious)
        elementwise.apply_update_(kp, update, lr, alr, wd, cautious, backend="triton")
        want, kernel_bound = apply_update_fp64(param, update, float(lr), float(lr) * 1.3, wd, cautious)
        _, torch_bound = apply_update_fp64(param, update, float(lr), float(lr) * 1.3, wd, cautious,
                                           scalar_dtype=param_dtype)
        assert_within(kp, want, kernel_bound, f"kernel {shape}")
        assert_within(tp, want, torch_bound, f"torch {shape}")
        assert_within(kp, tp.double(), kernel_bound + torch_bound, f"kernel against torch {shape}")


def test_tensor_lr_equals_float_lr():
    """A 0-d learning rate (read by the kernel on the device) gives the float's result: bitwise,
    but for cautious decay, where torch's tensor-lr formula (one FMA, ``addcmul_`` with the factor
    in the mask) and float-lr formula (the product rounded first) differ by one rounding of
    ``lr wd p``, and the kernel follows each."""
    gen = _gen(6)
    param, update = torch.randn(33, 65, generator=gen), torch.randn(33, 65, generator=gen).to(BF16)
    for cautious in (False, True):
        a, b = param.clone(), param.clone()
        elementwise.apply_update_(a, update, 0.02, 0.05, 0.1, cautious, backend="triton")
        elementwise.apply_update_(b, update, torch.tensor(0.02), torch.tensor(0.05), 0.1, cautious, backend="triton")
        if cautious:
            # the decayed values differ by at most one rounding of it, and each result by one more
            assert ((a.double() - b.double()).abs() <= 4 * U32 * (param.double().abs() + a.double().abs())).all()
        else:
            assert torch.equal(a, b)
        assert not torch.equal(a, param)


def test_cautious_decays_only_where_param_and_update_agree():
    """Entries with ``p * u < 0`` keep ``p - alr u`` exactly (no decay); the others are decayed."""
    p = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.0, 3.0]])
    upd = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, 0.0]])
    k = p.clone()
    elementwise.apply_update_(k, upd, 0.5, 0.25, 0.2, cautious=True, backend="triton")  # decay factor 0.9
    want = torch.tensor([[0.9 - 0.25, -1.0 - 0.25, 2.0 + 0.25, -1.8 + 0.25, 0.0 - 0.25, 2.7]], dtype=torch.float64)
    torch.testing.assert_close(k.double(), want, atol=4 * U32 * 3, rtol=0)


# ---------------------------------------------------------------------------- checks


@pytest.mark.parametrize("call,message", [
    (lambda p, u: elementwise.apply_update_(p, u[:, :-1], 0.1, 0.1, 0.1, backend="triton"), "update must have"),
    (lambda p, u: elementwise.apply_update_(p, p.mT if p.shape[0] == p.shape[1] else p, 0.1, 0.1, 0.1,
                                            backend="triton"), "shares memory"),
    (lambda p, u: elementwise.apply_update_(p, u, torch.ones(2), 0.1, 0.1, backend="triton"), "lr must be"),
    (lambda p, u: elementwise.apply_update_(p, u, 0.1, float("nan"), 0.1, backend="triton"), "adjusted_lr"),
    (lambda p, u: elementwise.apply_update_(p.double(), u.double(), 0.1, 0.1, 0.1, backend="triton"), "param must be"),
    (lambda p, u: elementwise.momentum_nesterov_(p, u, p[:], 0.9, True, backend="triton"), "out shares memory"),
    (lambda p, u: elementwise.momentum_nesterov_(p, u.reshape(1, 1, 1, -1), None, 0.9, True, backend="triton"),
     "grad must have at most"),
    (lambda p, u: elementwise.momentum_nesterov_(p, u, None, 0.9, True, backend="gpu"), "backend must be"),
])
def test_bad_operands_are_refused_before_anything_is_written(call, message):
    p, u_ = torch.randn(8, 8), torch.randn(8, 8)
    p0 = p.clone()
    with pytest.raises(ValueError, match=message):
        call(p, u_)
    assert torch.equal(p, p0)
