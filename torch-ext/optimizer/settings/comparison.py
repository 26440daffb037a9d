"""How one option value is compared: as text across ranks (:func:`rank_independent_repr`), by value
in the step context's cache key (:func:`snapshot`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ..qk_clip import QKClipConfig, config_record


def rank_independent_repr(value: Any) -> str:
    """``repr`` without what differs between processes: a function's repr holds its address, which
    differs from rank to rank under torchrun (a callable ``muon_row_blocks`` would then look like a
    setting that differs), so callables are named by module and qualified name.  A device tensor
    (``lr`` kept on the GPU) is not read: that would synchronise the host."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {rank_independent_repr(v)}" for k, v in value.items()) + "}"
    if torch.is_tensor(value):
        if value.device.type != "cpu":
            return "<device tensor>"
        return repr(value.item()) if value.numel() == 1 else f"<tensor of shape {tuple(value.shape)}>"
    if callable(value) and not isinstance(value, type) and not dataclasses.is_dataclass(value):
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return f"<callable {getattr(value, '__module__', '?')}.{name}>"
    return repr(value)


def _qk_clip_repr(value: QKClipConfig | None) -> str:
    return repr(config_record(value))


def snapshot(value: Any) -> Any:
    """A value as a cache key holds it: containers copied (so that mutating a group's dict in
    place is seen), everything else compared with ``==`` (callables and configs by identity or
    their own equality)."""
    if isinstance(value, Mapping):
        return tuple((k, snapshot(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(snapshot(v) for v in value)
    return value
