"""How each option's value is checked: ``check(value, where, context)`` raises ValueError naming
``where`` (the option's keyword, or ``param_groups[i] <name>``); ``context`` holds the option's
siblings (the group, or the constructor's keywords) for the few checks that need them."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..matrix_view import TRANSPOSED_KEY, check_transposed
from ..newton_schulz.coefficients import resolve_ns_coefficients
from ..newton_schulz.forms import check_ns_method
from ..newton_schulz.implementation import check_ns_kernels
from ..qk_clip import QKClipConfig
from ..row_blocks import ROW_BLOCKS_KEY, check_group_row_blocks


def check_number(where: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"Muon: `{where}` must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"Muon: `{where}` must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"Muon: `{where}` must be <= {high}, got {value!r}")


def _non_negative(value, where, context) -> None:
    check_number(where, value, low=0.0)


def _positive(value, where, context) -> None:
    check_number(where, value, low=0.0, low_open=True)


def _unit_interval(value, where, context) -> None:
    check_number(where, value, low=0.0, high=1.0)


def _optional_non_negative(value, where, context) -> None:
    if value is not None:
        check_number(where, value, low=0.0)


def _boolean(value, where, context) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"Muon: `{where}` must be True or False, got {value!r}")


def _one_of(*choices) -> Callable:
    def check(value, where, context) -> None:
        if not isinstance(value, (str, type(None))) or value not in choices:
            raise ValueError(f"Muon: `{where}` must be one of {choices}, got {value!r}")

    return check


def _int_at_least(low: int, *, optional: bool = False, high: int | None = None) -> Callable:
    def check(value, where, context) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ValueError(f"Muon: `{where}` must be an int {span}{' or None' if optional else ''}, got {value!r}")

    return check


def _lr(value, where, context) -> None:
    if torch.is_tensor(value) and value.numel() != 1:
        raise ValueError(f"Muon: `{where}` must be a number or a one-element tensor, got shape {tuple(value.shape)}")
    if not torch.is_tensor(value) or value.device.type == "cpu":  # a device tensor is not read (no host sync)
        check_number(where, float(value) if torch.is_tensor(value) else value, low=0.0)


def _betas(value, where, context) -> None:
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise ValueError(f"Muon: `{where}` must be a pair (beta1, beta2), got {value!r}")
    for i, b in enumerate(value):
        check_number(f"{where}[{i}]", b, low=0.0, high=1.0)
        if b == 1.0:
            raise ValueError(f"Muon: `{where}[{i}]` must be < 1, got {b!r}")


def _ns_coefficients(value, where, context) -> None:
    try:
        resolve_ns_coefficients(value, context.get("ns_steps", 5))
    except ValueError as err:
        raise ValueError(f"Muon: `{where}`: {err}") from None


def _ns_method(value, where, context) -> None:
    try:
        check_ns_method(value)
    except ValueError as err:
        raise ValueError(f"Muon: `{where}`: {err}") from None


def _ns_kernels(value, where, context) -> None:
    try:
        check_ns_kernels(value)
    except ValueError as err:
        raise ValueError(f"Muon: `{where}`: {err}") from None


def _row_blocks(value, where, context) -> None:
    group = where.removesuffix(ROW_BLOCKS_KEY).rstrip()  # its messages name the key themselves
    check_group_row_blocks(value, context.get("param_names") or [], f"Muon: {group}")


def _transposed(value, where, context) -> None:
    group = where.removesuffix(TRANSPOSED_KEY).rstrip()
    check_transposed(value, context.get("param_names") or [], f"Muon: {group}")


def _compute_dtype(value, where, context) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"Muon: `{where}` must be a floating torch.dtype or None, got {value!r}")


def dtype_of(value: Any) -> Any:
    """A dtype given as a ``torch.dtype`` or by name (``"bfloat16"``, ``"torch.bfloat16"``) as the
    ``torch.dtype``; any other value as it is (for the check to refuse)."""
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    return value


def _momentum_dtype(value, where, context) -> None:
    dtype = dtype_of(value)
    if value is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"Muon: `{where}` must be a floating torch.dtype (or its name, e.g. 'bfloat16') or None, "
                         f"got {value!r}")


def _normuon_beta2(value, where, context) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"Muon: `{where}` must be None (Muon) or a number in [0, 1) (NorMuon's beta2), got {value!r}")


def check_fraction(value, where: str, context=None) -> None:
    """``dion2_fraction`` / dion's ``fraction``: None (Muon) or a number in (0, 1]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"Muon: `{where}` must be None (Muon) or a number in (0, 1] (the fraction of each "
                         f"matrix's rows or columns Dion2 orthogonalises), got {value!r}")


def check_ef_decay(value, where: str, context=None) -> None:
    """``dion2_ef_decay`` / dion's ``ef_decay`` (NorDion2's ``mu``): a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"Muon: `{where}` must be a finite number >= 0 (the factor on the chosen slices' "
                         f"momentum after each step), got {value!r}")


def _qk_clip(value, where, context) -> None:
    if value is not None and not isinstance(value, QKClipConfig):
        raise ValueError(f"Muon: `{where}` must be an optimizer.QKClipConfig or None, got {type(value).__name__}")
