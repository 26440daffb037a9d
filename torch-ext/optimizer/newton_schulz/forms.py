"""Which form of the iteration runs (classic or Gram), in which dtype, and what it costs: pure
functions of (shape, ns_steps, coefficients, method, compute dtype, device type), so every rank
decides alike, and a matrix cut over ranks (cut.py) runs what the whole matrix would
(docs/newton_schulz.md: "The two forms", "Which dtype runs")."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .coefficients import CoefficientSpec, resolve_ns_coefficients
from .flops import plan_flops
from .restarts import fits_fp16, gram_restart_plan

NS_METHODS = ("auto", "classic", "gram")

# FLOPs the Gram form must save before "auto" takes it: its extra, smaller products cost ~100 µs
# on a CPU core (measured: docs/newton_schulz.md).
GRAM_MIN_SAVED_FLOPS = 4_000_000


def check_ns_method(method) -> str:
    """Return ``method`` if it is one of :data:`NS_METHODS`, else raise a ValueError saying which are."""
    if not isinstance(method, str) or method not in NS_METHODS:
        raise ValueError(
            f"ns_method must be one of {', '.join(map(repr, NS_METHODS))}, got {method!r} "
            '("auto" picks the form with fewer FLOPs for each shape and compute dtype; '
            '"classic" and "gram" force one form)'
        )
    return method


def default_compute_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 where tensor cores make it fast (CUDA); fp32 elsewhere (a CPU's bf16 matmul is ~100x
    slower, and fp32 is more accurate). The classic form's dtype when ``compute_dtype`` is None;
    parallel Muon's pieces travel in it (when narrower than the parameter)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def ns_form_dtypes(compute_dtype: torch.dtype | None, device: torch.device | str | None = None) -> dict[str, torch.dtype]:
    """The dtype each form runs in: ``compute_dtype`` for both when it is set (a dtype the user
    chose is never changed); with None, :func:`default_compute_dtype` of ``device`` (None: CPU)
    for the classic form and, where that is 16-bit (CUDA), fp16 for the Gram form (the same
    16-bit rate, 8x finer rounding, which the Gram recursion needs). Pure."""
    if compute_dtype is not None:
        return {"classic": compute_dtype, "gram": compute_dtype}
    classic = default_compute_dtype(device if device is not None else "cpu")
    return {"classic": classic, "gram": torch.float16 if classic.itemsize == 2 else classic}


def ns_io_dtype(input_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """What Newton–Schulz rounds its input to before normalising it, and the dtype it returns: the
    compute dtype, except that an fp16 iteration reads and returns bf16 when its input is wider
    than 16 bits (a 16-bit input stays as it is). Also what parallel Muon's pieces travel as
    (``parallel/planning/plan_inputs.wire_dtype``), so an owner and a single device see the same
    numbers; bf16 keeps fp32's range until normalisation brings every entry into [-1, 1]."""
    if compute_dtype != torch.float16:
        return compute_dtype
    return input_dtype if input_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def choose_ns_form(
    shape: Sequence[int],
    ns_steps: int,
    method: str = "auto",
    compute_dtype: torch.dtype | None = None,
    coefficients: CoefficientSpec = "fixed",
    device: torch.device | str | None = None,
    *,
    symmetric: bool = False,
) -> tuple[str, torch.dtype]:
    """The form (``"classic"`` or ``"gram"``) and the dtype it runs in, for ``shape`` (batch
    included), the user's ``compute_dtype`` (None: the device's defaults, :func:`ns_form_dtypes`;
    ``device`` None: CPU) and the coefficient table.

    ``method`` itself unless it is ``"auto"``, which picks the Gram form when it saves at least
    :data:`GRAM_MIN_SAVED_FLOPS` FLOPs (:func:`newton_schulz_flops`, ``symmetric`` as there):
    exactly when ``max(m, n) > 1.5 min(m, n)`` (any rectangular shape with ``symmetric``) and its
    restart plan has a segment of two or more steps (fp32, fp64 and fp16; never bf16). With
    compute_dtype None on CUDA the Gram form runs in fp16 only for tables whose values fit it with
    room to spare (:func:`~.restarts.ns_value_bound`), else in bf16. Pure: the same answer on every rank.
    """
    check_ns_method(method)
    dtypes = ns_form_dtypes(compute_dtype, device)
    if compute_dtype is None and dtypes["gram"] == torch.float16:
        steps = resolve_ns_coefficients(coefficients, ns_steps)
        if not fits_fp16(steps, gram_restart_plan(steps, ns_steps, torch.float16)):
            dtypes["gram"] = dtypes["classic"]  # not our choice to make when it may overflow
    if method != "auto":
        return method, dtypes[method]
    classic = newton_schulz_flops(shape, ns_steps, "classic", symmetric=symmetric)
    gram = newton_schulz_flops(shape, ns_steps, "gram", dtypes["gram"], coefficients, symmetric=symmetric)
    form = "gram" if classic - gram >= GRAM_MIN_SAVED_FLOPS else "classic"
    return form, dtypes[form]


def choose_ns_method(
    shape: Sequence[int],
    ns_steps: int,
    method: str = "auto",
    dtype: torch.dtype | None = None,
    coefficients: CoefficientSpec = "fixed",
    device: torch.device | str | None = None,
    *,
    symmetric: bool = False,
) -> str:
    """``"classic"`` or ``"gram"``: the form of :func:`choose_ns_form` (``dtype`` is its
    ``compute_dtype``; None with ``device`` None: float32)."""
    return choose_ns_form(shape, ns_steps, method, dtype, coefficients, device, symmetric=symmetric)[0]


def newton_schulz_flops(
    shape: Sequence[int],
    ns_steps: int,
    method: str = "classic",
    dtype: torch.dtype | None = None,
    coefficients: CoefficientSpec = "fixed",
    device: torch.device | str | None = None,
    *,
    symmetric: bool = False,
) -> int:
    """FLOPs of the iteration's matmuls for ``shape`` (:func:`~.flops.plan_flops`): the classic
    form, or the Gram form with the restart plan of the dtype it runs in (:func:`choose_ns_form`
    of ``dtype``, the compute dtype, and ``device``; None, None: float32), or (``"auto"``) the
    form :func:`choose_ns_form` picks with the same ``symmetric``. Nominal counts by default (the
    CPU's symmetric-block shortcut does fewer). Per segment of L >= 2 steps the Gram form saves
    ``2 (L - 1) s^2 (2 l - 3 s)`` (``symmetric``: about ``3 (L - 1) s^2 (l - s)``)."""
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"newton_schulz_flops needs a shape [..., m, n], got {shape}")
    if ns_steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {ns_steps}")
    check_ns_method(method)
    if ns_steps == 0:
        return 0
    if method == "auto":
        method = choose_ns_form(shape, ns_steps, "auto", dtype, coefficients, device, symmetric=symmetric)[0]
    if method == "classic":
        return plan_flops(shape, (1,) * ns_steps, symmetric)
    gram_dtype = choose_ns_form(shape, ns_steps, "gram", dtype, coefficients, device)[1]
    return plan_flops(shape, gram_restart_plan(coefficients, ns_steps, gram_dtype), symmetric)
