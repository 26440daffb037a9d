"""The checks that keep a checkpoint from loading wrong: layout version, groups, names, row blocks,
every parameter's state (keys, shapes, placements), QK-clip settings; all before anything changes."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..lion import LION_STATE_KEYS
from ..matrix_view import TRANSPOSED_KEY, row_state_layout, transposed_for
from ..qk_clip import QKClipConfig, config_from_record
from ..row_blocks import ROW_BLOCKS_KEY, from_checkpoint, row_blocks_mismatch
from ..rule import normuon_on
from ..tensors import is_dtensor
from .layout import (ADAMW_STATE_KEYS_SET, LAYOUT_VERSION, MUON_STATE_KEYS, NORMUON_STATE_KEYS, QK_CLIP_KEY, ROW_STATE_KEY,
                     VERSION_KEY, OLD_QK_KEYS, qk_clip_record)
from .names import canonical_keys, canonical_name, names_mismatch

logger = logging.getLogger("optimizer.muon")

_FRESH_START = (
    "To resume anyway, load only the model weights and let the optimizer start from fresh state, "
    "or load this checkpoint with the Muon release that wrote it."
)
_RESHARD_HINT = (
    "A plain state_dict() only loads into the same layout; to load across shardings or world sizes "
    "use torch.distributed.checkpoint (get_optimizer_state_dict / set_optimizer_state_dict with "
    "dcp.save / dcp.load)."
)


def _normalised(record: Mapping) -> dict[str, Any]:
    out = dict(record)
    for k in ("q_patterns", "k_patterns", "qkv_patterns", "fused_qkv", "mla"):  # saved tuples may load as lists
        out[k] = tuple(out.get(k) or ())
    return out


def _group_label(group: Mapping, index: int) -> str:
    names = group.get("param_names") or group.get("params") or []
    shown = ", ".join(f"'{n}'" for n in list(names)[:3])
    more = ", ..." if len(names) > 3 else ""
    return f"param_groups[{index}] ({shown}{more})" if shown else f"param_groups[{index}]"


def check_loadable(opt: torch.optim.Optimizer, state_dict: Any) -> None:
    """Raise ValueError, before anything is loaded, if ``state_dict`` cannot be loaded into ``opt``.

    Checks the layout version, that the groups match (count, sizes, ``use_muon``,
    ``param_names``, row blocks) and every parameter's state (keys, shapes, and DTensor-ness and
    placements, which a plain state dict cannot change).
    """
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(
            "Muon.load_state_dict: expected a dict with 'state' and 'param_groups' (from Muon.state_dict() "
            f"or get_optimizer_state_dict), got {type(state_dict).__name__}"
            + (f" with keys {sorted(map(str, state_dict))}" if isinstance(state_dict, Mapping) else "")
        )
    saved_groups = list(state_dict["param_groups"])
    _check_versions(saved_groups)
    owners = _check_groups(saved_groups, opt.param_groups)
    for pid, entry in state_dict["state"].items():
        if pid in owners:  # entries of no parameter are kept as they are, as torch keeps them
            _check_param_state(entry, *owners[pid])


def _check_versions(saved_groups: list[Mapping]) -> None:
    for gi, group in enumerate(saved_groups):
        version = group.get(VERSION_KEY)
        if version is None:
            raise ValueError(
                f"Muon.load_state_dict: the checkpoint's {_group_label(group, gi)} has no '{VERSION_KEY}': "
                "it was written by a Muon from before the state layout was versioned, or by another "
                "optimizer, and its state may not mean what this Muon expects. " + _FRESH_START
            )
        if version != LAYOUT_VERSION:
            raise ValueError(
                f"Muon.load_state_dict: the checkpoint's {_group_label(group, gi)} has state layout version "
                f"{version!r}, but this Muon reads version {LAYOUT_VERSION}. " + _FRESH_START
            )


LION_STATE_KEYS_SET = frozenset(LION_STATE_KEYS)


def _check_groups(saved_groups: list[Mapping], live_groups: list[Mapping]) -> dict[Any, tuple]:
    """The groups match; returns ``{saved param id: (live param, name, use_muon, normuon, transposed)}``."""
    if len(saved_groups) != len(live_groups):
        raise ValueError(
            f"Muon.load_state_dict: the checkpoint has {len(saved_groups)} param groups but this optimizer has "
            f"{len(live_groups)}; build the optimizer with the same param groups, in the same order, as the "
            "run that saved it."
        )
    owners: dict[Any, tuple[torch.Tensor, str, bool, bool, bool, bool]] = {}
    for gi, (saved, live) in enumerate(zip(saved_groups, live_groups)):
        names = _check_group(gi, saved, live)
        for pid, p, name in zip(saved["params"], live["params"], names):
            transposed = live["use_muon"] and transposed_for(live.get(TRANSPOSED_KEY), name)
            owners[pid] = (p, name, live["use_muon"], normuon_on(saved), transposed, live.get("algorithm") == "lion")
    return owners


def _check_group(gi: int, saved: Mapping, live: Mapping) -> list[str]:
    """One group's kind, names, size and row blocks; returns the live parameters' names."""
    algorithms = (saved.get("algorithm", "adamw"), live.get("algorithm", "adamw"))
    if not live["use_muon"] and algorithms[0] != algorithms[1]:
        raise ValueError(f"Muon.load_state_dict: the checkpoint's {_group_label(saved, gi)} ran algorithm="
                         f"{algorithms[0]!r} but this optimizer's runs {algorithms[1]!r}; set the group's `algorithm` "
                         "as in the run that saved it.")
    if saved.get("use_muon") != live["use_muon"]:
        raise ValueError(
            f"Muon.load_state_dict: the checkpoint's {_group_label(saved, gi)} has use_muon="
            f"{saved.get('use_muon')!r} but this optimizer's has use_muon={live['use_muon']!r}; build the "
            "param groups in the same order as the run that saved it."
        )
    saved_names, live_names = saved.get("param_names"), live.get("param_names")
    if saved_names is not None and live_names is not None:
        problem = names_mismatch(list(saved_names), list(live_names))
        if problem is not None:
            raise ValueError(
                f"Muon.load_state_dict: the parameters of the checkpoint's param_groups[{gi}] do not match "
                f"this optimizer's: {problem}."
            )
    if len(saved["params"]) != len(live["params"]):
        raise ValueError(
            f"Muon.load_state_dict: the checkpoint's {_group_label(saved, gi)} has {len(saved['params'])} "
            f"parameters but this optimizer's {_group_label(live, gi)} has {len(live['params'])}; build the "
            "param groups from the same model, in the same order, as the run that saved it."
        )
    names = list(live_names) if live_names else [f"param_groups[{gi}]['params'][{j}]" for j in range(len(live["params"]))]
    if live["use_muon"]:
        # by canonical name on both sides, as the names themselves are compared above
        canonical = [canonical_name(n) for n in names]
        try:
            saved_blocks = from_checkpoint(canonical_keys(saved.get(ROW_BLOCKS_KEY)), canonical)
        except ValueError as err:
            raise ValueError(f"Muon.load_state_dict: the checkpoint's param_groups[{gi}]: {err}") from None
        problem = row_blocks_mismatch(saved_blocks, canonical_keys(live.get(ROW_BLOCKS_KEY)), canonical,
                                      f"param_groups[{gi}]")
        if problem is not None:
            raise ValueError(f"Muon.load_state_dict: {problem}.")
    return names


def _check_param_state(entry: Any, p: torch.Tensor, name: str, use_muon: bool, normuon: bool = False,
                       transposed: bool = False, lion: bool = False) -> None:
    elementwise = LION_STATE_KEYS_SET if lion else ADAMW_STATE_KEYS_SET
    expected = (NORMUON_STATE_KEYS if normuon else MUON_STATE_KEYS) if use_muon else elementwise
    if not isinstance(entry, Mapping) or set(entry) != expected:
        got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
        if use_muon and isinstance(entry, Mapping) and set(entry) ^ expected == {ROW_STATE_KEY}:
            raise ValueError(
                f"Muon.load_state_dict: the checkpoint's state for '{name}' has {got}, but its group has "
                f"normuon_beta2={'set' if normuon else 'None'}: '{ROW_STATE_KEY}' (NorMuon's per-row second moment) "
                "is there exactly when NorMuon is on. Through torch.distributed.checkpoint the loading optimizer's "
                "options decide which keys are read: build it with the normuon_beta2 of the run that saved it."
            )
        raise ValueError(
            f"Muon.load_state_dict: the checkpoint's state for '{name}' has {got}, but a "
            f"{'Muon' if use_muon else 'Lion' if lion else 'AdamW'} parameter's state is {sorted(expected)} (layout version "
            f"{LAYOUT_VERSION}); the checkpoint was written by another optimizer or layout. " + _FRESH_START
        )
    for key, value in entry.items():
        if key == "step":
            if not (torch.is_tensor(value) and value.numel() == 1) and not isinstance(value, (int, float)):
                raise ValueError(f"Muon.load_state_dict: state 'step' of '{name}' must be a scalar, got {value!r}")
            continue
        shape, placements = tuple(p.shape), tuple(p.placements) if is_dtensor(p) else ()
        if key == ROW_STATE_KEY:  # one value per row of the matrix view (matrix_view.py)
            shape, placements = row_state_layout(shape, placements, transposed)
        if not torch.is_tensor(value) or tuple(value.shape) != shape:
            got_shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(
                f"Muon.load_state_dict: state '{key}' of '{name}' has shape {got_shape} but the parameter's "
                f"{'per-row state' if key == ROW_STATE_KEY else 'state'} has shape {shape}; the checkpoint "
                "belongs to a different model."
            )
        if is_dtensor(p) != is_dtensor(value) or (
            is_dtensor(p) and (tuple(value.placements) != placements or value.device_mesh != p.device_mesh)
        ):
            raise ValueError(
                f"Muon.load_state_dict: state '{key}' of '{name}' is {_where(value)} but the parameter is "
                f"{_where(p) if key != ROW_STATE_KEY else f'a DTensor with placements {placements}'}. " + _RESHARD_HINT
            )


def _where(t: torch.Tensor) -> str:
    return f"a DTensor with placements {tuple(t.placements)}" if is_dtensor(t) else "a plain tensor"


def qk_clip_from_groups(saved_groups: list[Mapping], live: QKClipConfig | None) -> QKClipConfig | None:
    """The QK-clip config a checkpoint's groups describe (raises ValueError if unusable).

    The checkpoint's threshold, head_dim and patterns win, like every other saved
    hyperparameter; ``classify`` comes from ``live``, since a callable is not saved.
    """
    records = [g.get(QK_CLIP_KEY) for g in saved_groups]
    for gi, record in enumerate(records):
        if not isinstance(record, Mapping) or set(record) not in (set(qk_clip_record(None)), OLD_QK_KEYS):
            raise ValueError(
                f"Muon.load_state_dict: the checkpoint's {_group_label(saved_groups[gi], gi)} has no valid "
                f"'{QK_CLIP_KEY}' (got {record!r}). " + _FRESH_START
            )
    if not records:
        return live
    records = [{**qk_clip_record(None), **r} if set(r) == OLD_QK_KEYS else r for r in records]
    record = _normalised(records[0])
    if any(_normalised(r) != record for r in records[1:]):
        raise ValueError(
            f"Muon.load_state_dict: the checkpoint's param groups disagree on '{QK_CLIP_KEY}' ({records}); "
            "the checkpoint is damaged or was edited."
        )
    if record != _normalised(qk_clip_record(live)):
        logger.warning(
            "Muon.load_state_dict: QK-clip settings from the checkpoint %s replace this optimizer's %s "
            "(set optimizer.qk_clip after loading to change them)", record, qk_clip_record(live),
        )
    if record["threshold"] is None:
        return None
    classify = live.classify if live is not None else None
    if record["custom_classify"] and classify is None:
        raise ValueError(
            "Muon.load_state_dict: the checkpoint's QK-clip used a custom QKClipConfig.classify, which a "
            "checkpoint cannot hold; construct Muon with qk_clip=QKClipConfig(..., classify=<the same "
            "function>) before loading."
        )
    return config_from_record(record, classify)
