"""A param group's options: filled from the defaults of its kind, normalised, checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..row_blocks import ROW_BLOCKS_KEY
from .constructor import TORCH_STYLE
from . import declarations
from .declarations import ADAMW, MUON, GroupOption, options_of, resolve_adjust_lr_fn


def kind_of(group: Mapping) -> str:
    return MUON if group["use_muon"] else ADAMW


def fill_group(group: dict, group_defaults: Mapping[str, Mapping[str, Any]], torch_style: bool = False) -> None:
    """Fill the options of the group's kind that it does not set (before torch fills the rest);
    ``torch_style``: a Muon group made from torch-style input takes torch.optim.Muon's defaults."""
    resolve_adjust_lr_fn(group, "a param group")
    kind = TORCH_STYLE if torch_style and group["use_muon"] else kind_of(group)
    for name, value in group_defaults[kind].items():
        group.setdefault(name, value)
    normalize_group(group)
    if group["use_muon"]:
        group.setdefault(ROW_BLOCKS_KEY, None)


def normalize_group(group: dict) -> None:
    """Every option the group holds in its normal form (see ``GroupOption.normalize``); an optional
    option at its default is not held at all (``GroupOption.optional``)."""
    for o in declarations.GROUP_OPTIONS:
        if o.name not in group:
            continue
        if o.normalize is not None:
            group[o.name] = o.normalize(group[o.name])
        if o.optional and is_default(o, group[o.name]):
            del group[o.name]


def is_default(o: GroupOption, value: Any) -> bool:
    return value is o.default or (type(value) is type(o.default) and value == o.default)


def held_options(kind: str) -> tuple[str, ...]:
    """The options every group of ``kind`` holds (filled in when it is added): the constructor's,
    except the optional ones (:attr:`GroupOption.optional`)."""
    return tuple(o.name for o in options_of(kind) if o.constructor and not o.optional)


def check_group(group: Mapping, where: str, plan_options: bool = True) -> None:
    """Every option of a (filled) group that applies to its kind, and that every option a group
    always holds is there; ``where`` names the group.  ``plan_options=False``: only the options the step
    plan does not depend on (a cached plan was built with the others, unchanged: :func:`~.records.settings_key`)."""
    for o in options_of(kind_of(group)):
        if not plan_options and o.shapes_plan:
            continue
        if o.name in group:
            _checked(o, group[o.name], f"{where} {o.name}", group)
        elif o.name in held_options(kind_of(group)):
            raise ValueError(f"Muon: {where} has no `{o.name}`, which every {kind_of(group)} group holds; set it "
                             f"(the constructor's default is {o.default!r})")


def _checked(o: GroupOption, value: Any, where: str, group: Mapping) -> None:
    """``o.check``, whatever the value: a check that cannot even read it (a TypeError comparing a
    string with an int) refuses it as ValueError too, the one kind the ranks agree on at a step."""
    try:
        o.check(value, where, group)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - any value a user set in place
        raise ValueError(f"Muon: `{where}` cannot be read ({type(err).__name__}: {err}), got {value!r}") from err
