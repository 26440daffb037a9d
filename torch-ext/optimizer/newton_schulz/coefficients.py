"""The coefficient tables of the Newton–Schulz polynomial ``p(s) = a s + b s^3 + c s^5``: the named
ones, what they do past their end, the norm each was fitted to, and a user's own
(docs/newton_schulz.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Union

Coefficients = tuple[float, float, float]
CoefficientSpec = Union[str, Coefficients, Sequence[Coefficients]]

NS_COEFFICIENTS: dict[str, list[Coefficients]] = {
    # Keller Jordan's Muon (also torch.optim.Muon, Moonlight and Kimi K2): one (a, b, c) for every
    # iteration, maximising the slope at zero; singular values end in about [0.7, 1.2].
    # https://github.com/KellerJordan/Muon/blob/master/muon.py
    "fixed": [(3.4445, -4.7750, 2.0315)],
    # Polar Express (Amsel, Persson, Musco, Gower 2025, https://arxiv.org/abs/2505.16932): a
    # minimax-optimal polynomial per iteration, as published in modded-nanogpt's train_gpt.py
    # ("Computed for num_iters=5, safety_factor=2e-2, cushion=2"); fitted to inputs divided by
    # (1 + 2e-2) ||X||_F (NS_NORM_SAFETY); steps past the table use NS_TAIL.
    "polar_express": [
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ],
}

# Past a named table's end: Polar Express tends to the classic quintic (15/8, -10/8, 3/8), whose
# fixed point at 1 is superattracting (its last entry repeated would settle near 1.035). Tables
# not listed repeat their last entry.
NS_TAIL: dict[str, Coefficients] = {"polar_express": (15 / 8, -10 / 8, 3 / 8)}

# The factor on the Frobenius norm a named table was fitted to (Polar Express grows fast above 1).
NS_NORM_SAFETY: dict[str, float] = {"fixed": 1.0, "polar_express": 1.0 + 2e-2}


def _check_triple(triple, where: str) -> Coefficients:
    try:
        a, b, c = (float(v) for v in triple)
    except (TypeError, ValueError):
        raise ValueError(
            f"ns_coefficients: {where} must be three numbers (a, b, c), got {triple!r}"
        ) from None
    if not all(math.isfinite(v) for v in (a, b, c)):
        raise ValueError(f"ns_coefficients: {where} must be finite, got {(a, b, c)!r}")
    return (a, b, c)


def resolve_ns_coefficients(spec: CoefficientSpec, ns_steps: int) -> list[Coefficients]:
    """Return the ``(a, b, c)`` to use at each of ``ns_steps`` iterations.

    ``spec`` is a name from :data:`NS_COEFFICIENTS` (past the table's end: :data:`NS_TAIL`, or
    the table's last entry), a single ``(a, b, c)`` used at every step, or an explicit list with exactly
    ``ns_steps`` entries.
    """
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be a positive int, got {ns_steps!r}")
    if isinstance(spec, str):
        if spec not in NS_COEFFICIENTS:
            raise ValueError(
                f"ns_coefficients: unknown name {spec!r}; use one of {sorted(NS_COEFFICIENTS)}, "
                "a single (a, b, c) tuple, or a list of ns_steps such tuples"
            )
        table = NS_COEFFICIENTS[spec]
        tail = NS_TAIL.get(spec, table[-1])
        return [table[i] if i < len(table) else tail for i in range(ns_steps)]
    if not isinstance(spec, Sequence) or len(spec) == 0:
        raise ValueError(
            f"ns_coefficients must be a name, an (a, b, c) tuple or a list of them, got {spec!r}"
        )
    if all(isinstance(v, (int, float)) for v in spec):
        return [_check_triple(spec, "the tuple")] * ns_steps
    if len(spec) != ns_steps:
        raise ValueError(
            f"ns_coefficients: a per-iteration list needs exactly ns_steps={ns_steps} entries, "
            f"got {len(spec)}; pass ns_steps={len(spec)} or a list of that length"
        )
    return [_check_triple(t, f"entry {i}") for i, t in enumerate(spec)]


def norm_safety_for(coefficients: CoefficientSpec, norm_safety: float | None) -> float:
    """``norm_safety``, or (None) what the named table was fitted to (1 for a user's own); a
    ValueError unless it is positive."""
    if norm_safety is None:
        norm_safety = NS_NORM_SAFETY.get(coefficients, 1.0) if isinstance(coefficients, str) else 1.0
    if not norm_safety > 0:
        raise ValueError(f"norm_safety must be positive, got {norm_safety!r}")
    return norm_safety
