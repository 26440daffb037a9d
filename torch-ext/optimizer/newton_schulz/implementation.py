"""What runs Newton–Schulz's products and the fused elementwise stages around them: the
``ns_kernels`` option, resolved once per value, device and compute dtype into an
:class:`Implementation` the step calls.

* ``"auto"`` (default): the Triton kernels of :mod:`optimizer.kernels` on CUDA GPUs they support
  (NVIDIA, compute capability 8.0+, Triton importable, the first-use check passed), torch's
  matmuls everywhere else (on the CPU with its symmetric-block shortcut, products.py);
* ``"torch"``: torch everywhere (cuBLAS on CUDA);
* ``"triton"``: the kernels everywhere they can run: CUDA, or CPU tensors under Triton's
  interpreter (``TRITON_INTERPRET=1`` set before anything imports Triton; slow, for tests).
  Where they cannot run the optimizer refuses the group when it is added, and a step before
  anything changes, with the reason.

The decision itself is ``kernels/backend.py``'s (``choose``); this module asks it once and keeps
the answer: the optimizer holds an :class:`Implementations` (resolved when a group is added, so
the kernels' first-use check runs before any step, outside any compiled region; looked up when a
step's context is built), and nothing in a step resolves anything. Every rank holds the same
option value (agreed like every other); ranks on the same kind of GPU with the same Triton
resolve ``"auto"`` alike. The two implementations compute the same polynomial in the same order
and differ in rounding only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..kernels import backend as kernel_backend
from ..kernels import environment
from ..kernels.addressing import newton_schulz_problem
from ..kernels.elementwise import MAX_DIMS, takes
from ..tensors import local_view
from .forms import ns_form_dtypes
from .products import KernelProducts, TorchProducts, uses_symmetric_blocks

# The option's values are the kernel dispatcher's backends, with the same meaning.
NS_KERNELS = kernel_backend.BACKENDS


def check_ns_kernels(value) -> str:
    """``value`` if it is one of :data:`NS_KERNELS`, else a ValueError saying what each means."""
    if not isinstance(value, str) or value not in NS_KERNELS:
        raise ValueError(
            f"ns_kernels must be one of {', '.join(map(repr, NS_KERNELS))}, got {value!r} "
            '("auto": the Triton kernels on supported CUDA GPUs, torch elsewhere; "torch": torch\'s matmuls '
            'everywhere; "triton": the kernels, on CPU only under TRITON_INTERPRET=1)'
        )
    return value


@dataclass(frozen=True)
class Implementation:
    """``ns_kernels`` resolved for one device: the compute dtypes whose products run on the
    kernels (``kernel_dtypes``, routed per product by ``kernels.backend.ProductRoute``), whether
    the elementwise stages run fused on the kernels (``fused_stages``), the tile rule's view of
    the device (``device_key``), and, for ``"triton"`` where the kernels cannot run, why
    (``problem``; nothing runs then: the optimizer refuses the group)."""

    ns_kernels: str = "torch"
    kernel_dtypes: frozenset = frozenset()
    fused_stages: bool = False
    device_key: tuple = (None, 1)
    problem: str | None = None
    _torch: tuple = field(default=(TorchProducts(False), TorchProducts(True)), repr=False, compare=False)

    def products(self, X: Tensor, dtype: torch.dtype) -> TorchProducts | KernelProducts:
        """What runs the products of X's iteration in ``dtype`` (X normalised, short side first)."""
        if dtype in self.kernel_dtypes:
            return KernelProducts(kernel_backend.ProductRoute(self.ns_kernels, self.device_key))
        # a branch, not an index: under torch.compile the shape test is a SymBool, which a tuple index refuses
        return self._torch[1] if uses_symmetric_blocks(X) else self._torch[0]

    def fuses(self, *pieces: Tensor) -> bool:
        """Whether a parameter's elementwise stages (momentum, Nesterov input, weight decay and
        update) run on the fused kernels: where they were chosen for the device and the pieces
        (parameter, momentum, gradient) are 16/32-bit floats of at most 3 dims. Elsewhere (fp64,
        more dims) the torch formulas of rule/formulas.py run, unchanged."""
        return (self.fused_stages and takes(*(t.dtype for t in pieces))
                and all(t.ndim <= MAX_DIMS for t in pieces))


ON_TORCH = Implementation()


def resolve_implementation(ns_kernels: str, device: torch.device | str, dtypes, *,
                           stages: bool = True) -> Implementation:
    """``ns_kernels`` on ``device`` for products in each of ``dtypes`` and (``stages``, or
    ``"triton"``) the elementwise stages. On a CUDA GPU this runs the kernels' first-use check
    (kernels/self_check.py, once per process and kind) for ``"auto"`` too: a kernel that fails it
    makes ``"auto"`` use torch there (with a warning) and ``"triton"`` carry a ``problem``."""
    check_ns_kernels(ns_kernels)
    device = torch.device(device)
    if ns_kernels == "torch" or (ns_kernels == "auto" and not kernel_backend.auto_takes_kernels(device)):
        return Implementation(ns_kernels)
    if ns_kernels == "triton":
        for dtype in dtypes:
            reason = (kernel_backend.unavailable_reason(device, dtype, kind="products")
                      or kernel_backend.unavailable_reason(device, kind="elementwise"))
            if reason is not None:
                return Implementation(ns_kernels, problem=(
                    f"ns_kernels='triton' cannot run Newton–Schulz on {device} in {dtype}: {reason}; "
                    "use ns_kernels='auto' (the kernels where they run, torch elsewhere) or 'torch'"))
        return Implementation(ns_kernels, frozenset(dtypes), True, environment.device_key(device))
    kernel_dtypes = frozenset(d for d in dtypes if kernel_backend.choose("auto", device, d)[0] == "triton")
    fused = stages and kernel_backend.choose("auto", device, kind="elementwise")[0] == "triton"
    key = environment.device_key(device) if kernel_dtypes else (None, 1)
    return Implementation(ns_kernels, kernel_dtypes, fused, key)


def implementation_for_call(ns_kernels, device: torch.device, dtype: torch.dtype) -> Implementation:
    """What one call on ``device`` in ``dtype`` runs: ``ns_kernels`` itself when it is an
    :class:`Implementation` (resolved once, by the optimizer), else the option's value resolved
    now for this call's products (a RuntimeError with the reason where ``"triton"`` cannot run)."""
    if isinstance(ns_kernels, Implementation):
        return ns_kernels
    implementation = resolve_implementation(ns_kernels, device, (dtype,), stages=False)
    if implementation.problem is not None:
        raise RuntimeError(implementation.problem)
    return implementation


def shape_problem(ns_kernels: str, shape: tuple[int, ...]) -> str | None:
    """Why ``ns_kernels`` cannot run the Newton–Schulz products of a parameter of ``shape`` (its
    global shape; matrices are the last two dims), or None. Only ``"triton"`` can fail: ``"auto"``
    runs a product the kernels cannot address on torch (kernels/addressing.py)."""
    if check_ns_kernels(ns_kernels) != "triton":
        return None
    problem = newton_schulz_problem(tuple(shape))
    if problem is None:
        return None
    return (f"ns_kernels='triton' cannot run Newton–Schulz on its {tuple(shape[-2:])} matrices: {problem}; "
            "use ns_kernels='auto' (torch's matmuls for such matrices) or 'torch'")


class Implementations:
    """An optimizer's resolutions of ``ns_kernels``, one per (value, device, compute dtype), each
    made the first time it is asked for (when a group is added, or, for a value set in place or
    a parameter moved, when the next step's context is built) and reused after."""

    def __init__(self) -> None:
        self._resolved: dict[tuple, Implementation] = {}

    def get(self, ns_kernels: str, device: torch.device, compute_dtype: torch.dtype | None) -> Implementation:
        """The resolution for products in each form's dtype (``forms.ns_form_dtypes``) and the stages."""
        key = (ns_kernels, torch.device(device), compute_dtype)
        found = self._resolved.get(key)
        if found is None:
            dtypes = tuple(dict.fromkeys(ns_form_dtypes(compute_dtype, key[1]).values()))
            found = self._resolved[key] = resolve_implementation(ns_kernels, key[1], dtypes)
        return found

    def for_param(self, param: Tensor, group: dict, compute_dtype: torch.dtype | None) -> Implementation:
        """The implementation a Muon parameter of ``group`` runs with, where its local piece lives."""
        return self.get(group.get("ns_kernels", "auto"), local_view(param).device, compute_dtype)

    def param_problem(self, name: str, param: Tensor, group: dict, compute_dtype: torch.dtype | None) -> str | None:
        """Why the group's ``ns_kernels`` cannot run this Muon parameter's Newton–Schulz where its
        local piece lives (``"triton"`` without Triton, on a device the kernels do not support,
        kernels that failed their first-use check there, matrices they cannot address), or None."""
        if not group.get("use_muon"):
            return None
        problem = self.for_param(param, group, compute_dtype).problem
        problem = problem or shape_problem(group.get("ns_kernels", "auto"), param.shape)
        return None if problem is None else f"Muon: parameter '{name}': {problem}"
