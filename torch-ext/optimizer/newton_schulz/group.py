"""A group's Newton–Schulz: its options and its resolved implementation, called by the owner's
stage (``rule.OwnerStage``) on whole matrices and on the blocks of a matrix cut over ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .cut import split_zeropower_via_newtonschulz
from .implementation import Implementation
from .whole import zeropower_output_dtype, zeropower_via_newtonschulz


@dataclass(frozen=True)
class NewtonSchulz:
    """How a group's matrices are orthogonalised (``zeropower_via_newtonschulz``'s arguments)."""

    ns_steps: int
    coefficients: object  # a table name (so NS applies the table's own norm safety factor), or triples
    method: str
    eps: float
    compute_dtype: torch.dtype | None
    implementation: Implementation | str = "auto"  # the group's ns_kernels, resolved once (implementation.py)

    def __call__(self, x: Tensor) -> Tensor:
        return zeropower_via_newtonschulz(x, ns_steps=self.ns_steps, coefficients=self.coefficients, eps=self.eps,
                                          compute_dtype=self.compute_dtype, method=self.method,
                                          ns_kernels=self.implementation)

    def output_dtype(self, shape: Sequence[int], input_dtype: torch.dtype, device) -> torch.dtype:
        """What ``self(x)`` returns for ``x`` of ``shape`` and ``input_dtype`` on ``device``."""
        return zeropower_output_dtype(shape, input_dtype, self.ns_steps, self.coefficients, self.compute_dtype,
                                      self.method, device)

    def split(self, x: Tensor, widths: Sequence[int], group) -> Tensor:
        """This rank's column block of ``self(whole)``, the matrix's column blocks (``widths``, in
        group-rank order) spread over ``group`` (``x`` short side first; collective)."""
        return split_zeropower_via_newtonschulz(x, widths, group, ns_steps=self.ns_steps,
                                                coefficients=self.coefficients, eps=self.eps,
                                                compute_dtype=self.compute_dtype, method=self.method,
                                                ns_kernels=self.implementation)
