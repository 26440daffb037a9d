"""The settings as the ranks compare them before a step (:func:`record`, :func:`digest`) and as
the step context's cache key holds them (:func:`settings_key`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields

from ..distributed import agreement
from .comparison import rank_independent_repr, snapshot
from . import declarations
from .groups import is_default


def record(settings: declarations.MuonSettings, param_groups: Sequence[Mapping]) -> dict[str, str]:
    """Everything that must be equal on every rank, as text (the agreement's error names the key)."""
    out = {f.name: f.metadata["declared"].show(getattr(settings, f.name)) for f in fields(settings)}
    for i, group in enumerate(param_groups):
        out[f"param_groups[{i}].use_muon"] = repr(group.get("use_muon"))
        for o in declarations.GROUP_OPTIONS:
            if o.name in group:
                value = group[o.name] if o.normalize is None else o.normalize(group[o.name])
                if o.optional and is_default(o, value):
                    continue  # held or not, the same setting
                out[f"param_groups[{i}].{o.name}"] = rank_independent_repr(value)
    return out


def digest(settings: declarations.MuonSettings, param_groups: Sequence[Mapping]) -> int:
    return agreement.checksum_text("\n".join(f"{k}={v}" for k, v in record(settings, param_groups).items()))


def settings_key(settings: declarations.MuonSettings, param_groups: Sequence[Mapping]) -> tuple:
    """The settings the step plan depends on (the step context's cache key holds them), by value (see :func:`snapshot`)."""
    optimizer = tuple(getattr(settings, f.name) for f in fields(settings) if f.metadata["declared"].shapes_plan)
    groups = tuple((g.get("use_muon"), *(snapshot(g.get(o.name)) for o in declarations.GROUP_OPTIONS if o.shapes_plan))
                   for g in param_groups)
    return optimizer, groups
