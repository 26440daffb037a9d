"""A param group's options: filled from the defaults of its kind, normalised, checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..row_blocks import ROW_BLOCKS_KEY
from .constructor import TORCH_STYLE
from . import declarations
from .declarations import ADAMW, DION2, LION, MUON, GroupOption, options_of, resolve_adjust_lr_fn

# What a Dion2 group never holds: its momentum is the sum M + G, with no coefficient and no
# Nesterov look-ahead (dion2/rule.py).  torch fills them into every group from the optimizer's
# defaults; ``strip_torch_defaults`` takes them out again.
NOT_IN_DION2 = ("momentum", "nesterov")


def kind_of(group: Mapping, defaults: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """The kind of a group (``declarations.KINDS``): ``use_muon`` groups are Dion2 when they have a
    ``dion2_fraction`` (their own, else, with ``defaults``, the constructor's), else Muon; the
    others Lion when ``algorithm="lion"``, else AdamW."""
    if group["use_muon"]:
        fraction = group["dion2_fraction"] if "dion2_fraction" in group else (
            (defaults or {}).get(MUON, {}).get("dion2_fraction"))
        return DION2 if fraction is not None else MUON
    return LION if group.get("algorithm") == "lion" else ADAMW


KIND_NAMES = {MUON: "Muon", DION2: "Dion2", ADAMW: "AdamW", LION: "Lion"}


def fill_group(group: dict, group_defaults: Mapping[str, Mapping[str, Any]], torch_style: bool = False,
               where: str = "a param group") -> None:
    """Fill the options of the group's kind that it does not set (before torch fills the rest);
    ``torch_style``: a Muon group made from torch-style input takes torch.optim.Muon's defaults.
    Refuses (ValueError) what the group's kind cannot hold (:func:`foreign_problem`)."""
    resolve_adjust_lr_fn(group, where)
    kind = kind_of(group, group_defaults)
    problem = foreign_problem(group, kind, where)
    if problem:
        raise ValueError(problem)
    mine = {o.name for o in options_of(kind)}
    source = TORCH_STYLE if torch_style and group["use_muon"] else kind
    for name, value in group_defaults[source].items():
        if name in mine:
            group.setdefault(name, value)
    normalize_group(group)
    if group["use_muon"]:
        group.setdefault(ROW_BLOCKS_KEY, None)


def foreign_problem(group: Mapping, kind: str, where: str, at_step: bool = False) -> str | None:
    """Why a group holds an option its kind does not have, or None.  Only the options of the new
    kinds are looked at (a Muon or AdamW group holds torch's defaults of every kind, as it always
    has): ``momentum``/``nesterov`` in a Dion2 group (set in the group, or later in place: a
    scheduler cycling momentum), ``dion2_ef_decay`` outside one, ``algorithm`` in a ``use_muon``
    group, and AdamW's ``eps`` in a Lion group."""
    if kind == DION2:
        held = [k for k in NOT_IN_DION2 if k in group]
        if held and at_step:
            return (f"Muon: {where} is a Dion2 group (dion2_fraction={group.get('dion2_fraction')!r}) but holds "
                    f"`{held[0]}`, set in place since it was added (a OneCycleLR/CyclicLR with cycle_momentum=True "
                    f"writes it into every group): a Dion2 group has no momentum coefficient (its momentum is the "
                    f"sum M + G, the chosen slices decayed by dion2_ef_decay). Pass cycle_momentum=False to the "
                    f"scheduler, or delete the key from the group")
        if held:
            return (f"Muon: {where} sets `{held[0]}` but is a Dion2 group (dion2_fraction="
                    f"{group.get('dion2_fraction', 'the constructor default')!r}): a Dion2 group has no momentum "
                    f"coefficient (its momentum is the sum M + G, the chosen slices decayed by dion2_ef_decay). "
                    f"Remove `{held[0]}`, or set dion2_fraction=None for Muon")
        return None
    if "dion2_ef_decay" in group:
        return (f"Muon: {where} sets `dion2_ef_decay` but is a {KIND_NAMES[kind]} group: it applies to Dion2 groups "
                "only; set dion2_fraction too (use_muon=True), or remove it")
    if group.get("use_muon") and "algorithm" in group:
        return (f"Muon: {where} sets `algorithm`={group['algorithm']!r} but has use_muon=True: `algorithm` says what "
                "a use_muon=False group runs ('adamw' or 'lion'); a use_muon group is Muon, or Dion2 with "
                "dion2_fraction")
    if kind == LION and "eps" in group and not at_step:
        return f"Muon: {where} sets `eps` but is a Lion group (algorithm='lion'): Lion has no epsilon; remove it"
    return None


def strip_torch_defaults(group: dict) -> None:
    """Take out of a Dion2 group what torch filled in from the optimizer's defaults (``momentum``,
    ``nesterov``: :data:`NOT_IN_DION2`), right after torch's ``add_param_group``."""
    if kind_of(group) == DION2:
        for key in NOT_IN_DION2:
            group.pop(key, None)


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
    kind = kind_of(group)
    problem = foreign_problem(group, kind, where, at_step=True)
    if problem:
        raise ValueError(problem)
    for o in options_of(kind):
        if not plan_options and o.shapes_plan:
            continue
        if o.name in group:
            _checked(o, group[o.name], f"{where} {o.name}", group)
        elif o.name in held_options(kind):
            raise ValueError(f"Muon: {where} has no `{o.name}`, which every {kind} group holds; set it "
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
