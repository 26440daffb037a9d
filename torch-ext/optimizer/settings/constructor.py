"""What the constructor makes of its arguments: the keywords, signature and docstring of
``Muon.__init__``, the validated settings and the per-kind group defaults."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from . import declarations
from .declarations import KINDS, MATRIX_KINDS, MUON, TORCH_POSITIONAL, resolve_adjust_lr_fn


def constructor_keywords() -> dict[str, Any]:
    """Every keyword ``Muon.__init__`` takes besides ``params``, with its default (torch's
    positional ones first, in torch's order)."""
    out = {o.ctor_keyword: o.default for o in declarations.GROUP_OPTIONS if o.constructor}
    out.update({f.name: f.default for f in fields(declarations.MuonSettings)})
    out["adjust_lr_fn"] = None  # torch.optim.Muon's alias of adjust_lr (see resolve_adjust_lr_fn)
    return {**{k: out[k] for k in TORCH_POSITIONAL}, **{k: v for k, v in out.items() if k not in TORCH_POSITIONAL}}


def constructor_signature() -> inspect.Signature:
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("self", positional), inspect.Parameter("params", positional)]
    params += [inspect.Parameter(k, positional if k in TORCH_POSITIONAL else inspect.Parameter.KEYWORD_ONLY,
                                 default=v) for k, v in constructor_keywords().items()]
    return inspect.Signature(params)


def constructor_doc() -> str:
    lines = ["Group options (defaults for every param group that does not set them):"]
    for o in declarations.GROUP_OPTIONS:
        if o.constructor:
            lines.append(f"    {o.ctor_keyword}={o.default!r} [{'/'.join(o.kinds)} groups]: {o.doc}")
    lines.append("    adjust_lr_fn: torch.optim.Muon's name for adjust_lr (None: 'original'); not with adjust_lr")
    lines.append("Per-group only:")
    lines += [f"    {o.name} [{'/'.join(o.kinds)} groups]: {o.doc}" for o in declarations.GROUP_OPTIONS if not o.constructor]
    lines.append("Optimizer options:")
    lines += [f"    {f.name}={f.default!r}: {f.metadata['declared'].doc}" for f in fields(declarations.MuonSettings)]
    lines.append(f"Positional, in torch.optim.Muon's order: params, {', '.join(TORCH_POSITIONAL)}.")
    return "\n".join(lines)


#: A Muon group made from torch-style input (a plain list of tensors, or a group without
#: ``use_muon``): its defaults are torch.optim.Muon's where they differ from ours.
TORCH_STYLE = "muon_torch_style"


def from_constructor(args: Sequence[Any], options: Mapping[str, Any]) -> tuple[declarations.MuonSettings, dict[str, dict[str, Any]]]:
    """The validated settings and the group defaults (per kind, and for torch-style Muon groups)
    from ``Muon.__init__``'s arguments after ``params``.

    Positional arguments follow torch.optim.Muon's order (:data:`TORCH_POSITIONAL`); unknown or
    repeated keywords raise TypeError, as Python would for an explicit signature.
    """
    known = constructor_keywords()
    if len(args) > len(TORCH_POSITIONAL):
        raise TypeError(f"Muon.__init__() takes at most {len(TORCH_POSITIONAL) + 1} positional arguments after "
                        f"self ({', '.join(('params',) + TORCH_POSITIONAL)}), got {len(args) + 1}")
    given = dict(zip(TORCH_POSITIONAL, args))
    for k, v in options.items():
        if k not in known:
            raise TypeError(f"Muon.__init__() got an unexpected keyword argument {k!r} (its options: {', '.join(known)})")
        if k in given:
            raise TypeError(f"Muon.__init__() got multiple values for argument {k!r}")
        given[k] = v
    resolve_adjust_lr_fn(given, "")
    _refuse_momentum_with_dion2(given)
    values = {**known, **given}
    settings = declarations.MuonSettings(**{f.name: values[f.name] for f in fields(declarations.MuonSettings)})
    defaults: dict[str, dict[str, Any]] = {kind: {} for kind in (*KINDS, TORCH_STYLE)}
    for o in declarations.GROUP_OPTIONS:
        if not o.constructor:
            continue
        value = values[o.ctor_keyword]
        o.check(value, o.ctor_keyword, values)
        if o.normalize is not None:
            value = o.normalize(value)
        for kind in o.kinds:
            defaults[kind][o.name] = value
        if any(kind in o.kinds for kind in MATRIX_KINDS):
            torch_style = o.has_torch_default and o.ctor_keyword not in given
            defaults[TORCH_STYLE][o.name] = o.torch_default if torch_style else value
    return settings, defaults


def _refuse_momentum_with_dion2(given: Mapping[str, Any]) -> None:
    """``momentum``/``nesterov`` passed with ``dion2_fraction``: the groups that take the fraction
    are Dion2 groups, which have no momentum coefficient (``groups.NOT_IN_DION2``)."""
    if given.get("dion2_fraction") is None:
        return
    for key in ("momentum", "nesterov"):
        if key in given:
            raise ValueError(
                f"Muon: `{key}` was passed with dion2_fraction={given['dion2_fraction']!r}, but Dion2 groups have no "
                "momentum coefficient (their momentum is the sum M + G, the chosen slices decayed by dion2_ef_decay). "
                f"Remove `{key}`; Muon groups (dion2_fraction=None in the group) then take the default 0.95/True")


def torch_defaults(group_defaults: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """What torch's ``Optimizer`` keeps as ``defaults`` (and fills into every group): every
    constructor-set option (Muon groups' value where a name is declared for several kinds).  When
    the constructor makes every ``use_muon`` group Dion2 (``dion2_fraction`` set), Muon's own
    options (``momentum``, ``nesterov``) are not among them: schedulers that cycle ``momentum``
    then refuse the optimizer at construction, as they refuse dion's, instead of writing a
    momentum no group has (a Muon group that sets dion2_fraction=None still gets them: its kind's
    defaults)."""
    dion2_everywhere = group_defaults[MUON].get("dion2_fraction") is not None
    out: dict[str, Any] = {}
    for o in declarations.GROUP_OPTIONS:
        if dion2_everywhere and o.kinds == (MUON,):
            continue
        if o.constructor and o.in_torch_defaults and not o.optional and o.name not in out:
            out[o.name] = group_defaults[o.kinds[0]][o.name]
    return out


def from_legacy(state: Mapping[str, Any]) -> declarations.MuonSettings:
    """Settings of an optimizer pickled before they were one record (attributes of the optimizer);
    missing ones take their defaults.  (Its ``ns_eps`` is a Muon-group option now: see
    ``checkpoint.upgrade``.)"""
    names = {f.name for f in fields(declarations.MuonSettings)}
    return declarations.MuonSettings(**{k: v for k, v in state.items() if k in names})
