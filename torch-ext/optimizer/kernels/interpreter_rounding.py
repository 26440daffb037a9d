"""A workaround for two gaps of Triton's interpreter (``TRITON_INTERPRET=1``) with bfloat16,
used by the kernels only under it (constexpr flags, so GPU builds never contain this code).

The interpreter keeps bf16 values as their uint16 bit patterns (numpy has no bf16), and
(1) ``tl.dot`` multiplies those bit patterns (triton-lang/triton#11584: "we just don't support it
yet"), so the kernels convert bf16 tiles to fp32 before the dot, which is exact, and the fp32
dot accumulates in fp32 like the GPU's; (2) its fp32 -> bf16 conversion does not round to nearest
even as the GPU's does (``cvt.rn.bf16.f32``), so the kernels round in integers instead,
:func:`bf16_round_to_nearest_even`. Everything else (indices, masks, epilogues) is the same code
on both.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as error:  # only imported once environment.triton_import_error() said it works
    raise ImportError(f"optimizer.kernels.interpreter_rounding needs Triton: {error}") from error


@triton.jit
def bf16_round_to_nearest_even(x):
    """fp32 -> bf16, rounded to nearest, ties to even, on the bit pattern (finite x): add
    0x7FFF plus the lowest kept bit, then keep the top 16 bits."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
