"""What Muon's state dict holds, and the checks that keep a checkpoint from loading wrong.

torch's optimizer state dict is ``{"state": {param id: {...}}, "param_groups": [...]}``,
and torch.distributed.checkpoint's ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` keep exactly those two entries (param ids become
parameter FQNs).  So everything Muon needs to recognise its own checkpoints goes
into every param group:

* ``muon_state_version``: the layout below.  A checkpoint without it, or with
  another version, is refused with a message that says what to do, instead of
  being read as if its tensors meant what they mean today.
* ``muon_row_blocks`` (Muon groups): how each weight is split into blocks for
  orthogonalisation (None: whole).  Checked on load, never overridden: see ``row_blocks.py``.
* ``qk_clip_settings``: the optimizer's QK-clip config (threshold, head_dim, name
  patterns, and whether a custom ``classify`` callable was used; a callable
  cannot be saved, so the loading optimizer must bring its own).  The structure
  is the same whether QK-clip is on or off, because DCP loads by matching keys.

Parameter names are compared the way torch.distributed.checkpoint names parameters: without the
segments that wrappers insert (``_orig_mod`` from ``torch.compile``, ``_checkpoint_wrapped_module``
from activation checkpointing, ``_fsdp_wrapped_module`` from FSDP1), so a checkpoint written
from the unwrapped model loads into the wrapped one and back, as it does for torch.optim.AdamW.

Layout version 2, per parameter:
  Muon groups (``use_muon=True``):  ``momentum_buffer``, shaped and placed like the param (its
    dtype: the group's ``momentum_dtype``, else the param's); and ``normuon_v`` exactly when the
    group has ``normuon_beta2`` set: ``[..., rows, 1]`` (NorMuon's per-row second moment, fp32 or
    wider), a DTensor with the param's placements where a shard of the last dim is ``Replicate``
    (``distributed.placements.row_placements``), so that DCP saves and reshards it.
  AdamW groups:  ``step`` (0-d float32 tensor), ``exp_avg``, ``exp_avg_sq`` (like the param).
Version 2 differs from 1 in one group key: a Muon group's ``eps`` is its Newton–Schulz epsilon
(torch.optim.Muon's meaning); in version 1 it was an unused copy of AdamW's, and the Newton–Schulz
eps was the optimizer's own, not saved.  A version-1 checkpoint loads with each Muon group's eps
taken from the loading optimizer (built with the same ``eps``, it is the value the run used).

Group options added later without a version bump (``normuon_beta2``, ``cautious_wd``,
``momentum_dtype``) are *optional* (``settings.GroupOption.optional``): a group holds one only
when it is on, and a group without it reads as off.  So checkpoints from before them have the same
keys as today's with the options off: torch.distributed.checkpoint loads the keys of the loading
optimizer's state dict and refuses a checkpoint that lacks one, nested or flattened, so a key every
group held would make every older checkpoint unloadable through DCP.  The price: through DCP the
loading optimizer decides which of them are read, so build it with the options of the run that
saved (a plain ``load_state_dict`` restores them from the checkpoint, like ``lr``).

``momentum_dtype`` (how this optimizer stores its momentum) and ``ns_kernels`` (what runs
Newton–Schulz here) are choices of the machine, not of the run: the loading optimizer keeps its own
(:data:`KEPT_GROUP_OPTIONS`, ``GroupOption.kept_on_load``), so a checkpoint saved with
``ns_kernels="triton"`` resumes on a machine built with ``"torch"``, and a buffer saved in another
dtype is converted (with a logged note).  torch's loader would cast every floating state tensor to
its parameter's dtype; ``momentum_buffer`` and ``normuon_v`` are kept out of that cast
(:func:`split_kept_state`), so a bf16 buffer stays bf16 and fp32 ``v`` of a bf16 parameter stays fp32.

Loadable too (:func:`upgrade`): ``torch.optim.Muon``'s state dicts (per parameter
``momentum_buffer``, as ours; groups with ``adjust_lr_fn``), so that a run can switch to this
optimizer mid-training.  Options a checkpoint predates take the loading optimizer's values
(torch's own loader would drop them).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .adamw import ADAMW_STATE_KEYS
from .qk_clip import QKClipConfig, config_from_record, config_record
from .matrix_view import TRANSPOSED_KEY, row_state_layout, transposed_for
from .rule import momentum_dtype, normuon_on, row_state_dtype, work_dtype
from .row_blocks import ROW_BLOCKS_KEY, from_checkpoint, row_blocks_for_checkpoint, row_blocks_mismatch
from .settings import GROUP_OPTIONS, check_group, held_options, kind_of, normalize_group, resolve_adjust_lr_fn
from .tensors import is_dtensor

logger = logging.getLogger("optimizer.muon")

LAYOUT_VERSION = 2
VERSION_KEY = "muon_state_version"
QK_CLIP_KEY = "qk_clip_settings"

MOMENTUM_KEY, ROW_STATE_KEY = "momentum_buffer", "normuon_v"
MUON_STATE_KEYS = frozenset({MOMENTUM_KEY})
NORMUON_STATE_KEYS = frozenset({MOMENTUM_KEY, ROW_STATE_KEY})
ADAMW_STATE_KEYS_SET = frozenset(ADAMW_STATE_KEYS)
# How this machine runs and stores the step: on load, the loading optimizer keeps its own value.
KEPT_GROUP_OPTIONS = tuple(dict.fromkeys(o.name for o in GROUP_OPTIONS if o.kept_on_load))
# State whose dtype is the optimizer's choice, not the parameter's: kept out of torch's cast on load.
KEPT_DTYPE_STATE = (MOMENTUM_KEY, ROW_STATE_KEY)

_FRESH_START = (
    "To resume anyway, load only the model weights and let the optimizer start from fresh state, "
    "or load this checkpoint with the Muon release that wrote it."
)
_RESHARD_HINT = (
    "A plain state_dict() only loads into the same layout; to load across shardings or world sizes "
    "use torch.distributed.checkpoint (get_optimizer_state_dict / set_optimizer_state_dict with "
    "dcp.save / dcp.load)."
)


# The segments torch.distributed.checkpoint drops from parameter names (``_get_fqns`` in
# torch/distributed/checkpoint/state_dict.py; torchtitan's ``canonical_fqn`` drops the second).
# DDP's ``module.`` prefix is not among them: from a name alone it cannot be told from a
# submodule called ``module``.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def canonical_name(name: str) -> str:
    """``name`` without wrapper segments: ``_orig_mod.layers.0._checkpoint_wrapped_module.w`` -> ``layers.0.w``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def _shown(names: list[str], limit: int = 5) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(f"'{n}'" for n in names[:limit]) + more


def names_mismatch(saved_names: list[str], live_names: list[str]) -> str | None:
    """What differs between a checkpoint group's parameter names and a live group's, or None.

    Names are compared without wrapper segments (:func:`canonical_name`). The answer says
    whether the same parameters come in another order, or which names only one side has.
    """
    saved = [canonical_name(n) for n in saved_names]
    live = [canonical_name(n) for n in live_names]
    if saved == live:
        return None
    saved_set, live_set = set(saved), set(live)
    only_saved = [n for n in saved if n not in live_set]
    only_live = [n for n in live if n not in saved_set]
    if not only_saved and not only_live and len(saved) == len(live):
        j = next(j for j, (a, b) in enumerate(zip(saved, live)) if a != b)
        return (
            f"the same parameters in another order (position {j} is '{saved[j]}' in the checkpoint but "
            f"'{live[j]}' here); build the param groups in the same order as the run that saved it"
        )
    parts = []
    if only_saved:
        parts.append(f"only the checkpoint has {_shown(only_saved)}")
    if only_live:
        parts.append(f"only this optimizer has {_shown(only_live)}")
    if not parts:  # same names, repeated a different number of times
        parts.append(f"the checkpoint lists {len(saved)} names and this optimizer {len(live)}")
    return (
        "; ".join(parts) + " (names compared without the wrapper segments "
        f"{', '.join(WRAPPER_SEGMENTS)}); build the optimizer from the same model, with the same "
        "param groups, as the run that saved it"
    )


def _canonical_keys(row_blocks_value):
    """A ``{param_name: spec}`` value keyed by :func:`canonical_name`; any other value as it is."""
    if isinstance(row_blocks_value, Mapping):
        return {canonical_name(k): v for k, v in row_blocks_value.items()}
    return row_blocks_value


def qk_clip_record(cfg: QKClipConfig | None) -> dict[str, Any]:
    """The savable part of a QK-clip config (same keys whether it is on or off)."""
    return config_record(cfg)


# The keys layout version 1 wrote before fused QKV and MLA existed: still loadable.
_OLD_QK_KEYS = frozenset({"threshold", "head_dim", "q_patterns", "k_patterns", "custom_classify"})


def stamp_group(group: dict, cfg: QKClipConfig | None) -> None:
    """Write the layout version and the current QK-clip settings into a live param group.

    A Muon group also always carries ``muon_row_blocks`` (None: whole matrices), because DCP
    loads only the keys the live state dict has: without it, a checkpoint's blocks would never
    be read back to be compared.
    """
    group[VERSION_KEY] = LAYOUT_VERSION
    group[QK_CLIP_KEY] = qk_clip_record(cfg)
    if group.get("use_muon"):
        group.setdefault(ROW_BLOCKS_KEY, None)


def split_kept_state(state_dict: Mapping, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``state_dict``'s state without the tensors whose dtype the optimizer chooses
    (:data:`KEPT_DTYPE_STATE`), and those tensors as ``{(parameter, key): tensor}`` (the parameter
    that a state entry's id stands for, as torch maps them: groups in order)."""
    params = {}
    for saved, live in zip(state_dict["param_groups"], opt.param_groups):
        params.update(zip(saved["params"], live["params"]))
    rest, kept = {}, {}
    for pid, entry in state_dict["state"].items():
        if pid not in params or not isinstance(entry, Mapping):  # not a parameter's: kept as torch keeps it
            rest[pid] = entry
            continue
        rest[pid] = {k: v for k, v in entry.items() if k not in KEPT_DTYPE_STATE}
        for key in KEPT_DTYPE_STATE:
            if key in entry:
                kept[(params[pid], key)] = entry[key]
    return rest, kept


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


def run_load_pre_hooks(opt: torch.optim.Optimizer, state_dict: Any) -> Any:
    """torch's load-state-dict pre-hooks, run first as ``Optimizer.load_state_dict`` runs them (on a
    shallow copy; a hook's return value replaces the state dict), so that a hook can adapt a
    checkpoint before it is checked."""
    if isinstance(state_dict, Mapping):
        state_dict = dict(state_dict)
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


@contextlib.contextmanager
def load_hooks_run_here(opt: torch.optim.Optimizer) -> Iterator[None]:
    """torch's ``load_state_dict`` without its hooks: the pre-hooks have run already, and the
    post-hooks run after the state this optimizer restores itself (:func:`load`)."""
    pre, post = opt._optimizer_load_state_dict_pre_hooks, opt._optimizer_load_state_dict_post_hooks
    opt._optimizer_load_state_dict_pre_hooks, opt._optimizer_load_state_dict_post_hooks = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        opt._optimizer_load_state_dict_pre_hooks, opt._optimizer_load_state_dict_post_hooks = pre, post


def is_torch_muon(state_dict: Mapping) -> bool:
    """A ``torch.optim.Muon`` state dict: groups with its keys, none of ours."""
    groups = state_dict.get("param_groups") or []
    return bool(groups) and all(
        isinstance(g, Mapping) and "adjust_lr_fn" in g and "ns_steps" in g and "use_muon" not in g
        and VERSION_KEY not in g for g in groups)


def upgrade(state_dict: Any, live_groups: Sequence[Mapping], qk_clip: QKClipConfig | None) -> Any:
    """``state_dict`` in this layout version: a ``torch.optim.Muon`` state dict's groups become Muon
    groups (``adjust_lr_fn`` read as torch reads it), a version-1 checkpoint's Muon groups get
    their Newton–Schulz ``eps`` (module docstring), and options a checkpoint predates take the
    live group's values (of any checkpoint: the options every group holds, as torch's optimizers
    give a state dict from before a flag its default).  Anything else is returned as it is, for
    :func:`check_loadable` to judge."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("param_groups"), list):
        return state_dict
    saved = state_dict["param_groups"]
    torch_muon = is_torch_muon(state_dict)
    if not torch_muon and not any(isinstance(g, Mapping) and g.get(VERSION_KEY) == 1 for g in saved):
        return {**state_dict, "param_groups": [_with_held_options(g, live_groups[gi] if gi < len(live_groups) else {})
                                               for gi, g in enumerate(saved)]}
    groups = []
    for gi, group in enumerate(saved):
        group = dict(group)
        live = live_groups[gi] if gi < len(live_groups) else {}
        if torch_muon:
            resolve_adjust_lr_fn(group, f"torch.optim.Muon checkpoint param_groups[{gi}]")
            group.update({"use_muon": True, VERSION_KEY: LAYOUT_VERSION, QK_CLIP_KEY: qk_clip_record(qk_clip),
                          ROW_BLOCKS_KEY: None})
            logger.info("Muon.load_state_dict: param_groups[%d] is torch.optim.Muon's; its momentum carries over", gi)
        elif group.get(VERSION_KEY) == 1:
            if group.get("use_muon") and "eps" in live:
                group["eps"] = live["eps"]  # version 1 kept AdamW's eps here; NS eps was not saved
            group[VERSION_KEY] = LAYOUT_VERSION
        for key, value in live.items():
            if key not in group and key != "params":
                group[key] = value
        groups.append(group)
    return {**state_dict, "param_groups": groups}


def _with_held_options(saved: Any, live: Mapping) -> Any:
    """A checkpoint group with the options every group of its kind holds that it lacks (saved
    before them) taken from the live group; any other value as it is."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("use_muon"), bool):
        return saved
    missing = {name: live[name] for name in held_options(kind_of(saved)) if name not in saved and name in live}
    return {**saved, **missing} if missing else saved


def upgrade_pickled_groups(param_groups: list[dict], ns_eps: float) -> None:
    """A pickled (not state-dict) optimizer from before version 2: its Muon groups' ``eps`` is the
    Newton–Schulz eps it kept as an attribute."""
    for group in param_groups:
        if group.get("use_muon"):
            group["eps"] = ns_eps
        if VERSION_KEY in group:
            group[VERSION_KEY] = LAYOUT_VERSION


def with_plain_row_blocks(state: dict, live_groups: Sequence[Mapping], names: Sequence[str]) -> dict:
    """A state dict whose Muon groups hold their row blocks as plain strings, one per parameter
    (``row_blocks.row_blocks_for_checkpoint``; ``names``: every parameter's, in group order)."""
    start = 0
    for live, group in zip(live_groups, state["param_groups"]):
        mine = names[start: start + len(live["params"])]
        start += len(live["params"])
        if live["use_muon"]:
            group[ROW_BLOCKS_KEY] = row_blocks_for_checkpoint(live.get(ROW_BLOCKS_KEY), mine)
    return state


def load(opt: torch.optim.Optimizer, state_dict: Any, torch_load) -> QKClipConfig | None:
    """``Muon.load_state_dict``: torch's load-state-dict pre-hooks first (a hook may adapt an old
    checkpoint), then what they return is upgraded (:func:`upgrade`) and checked before anything
    changes (:func:`check_loadable`, every group's options), then ``torch_load`` (torch's own
    loader, which restores group options as torch's optimizers do), then the state whose dtype is
    this optimizer's choice (:func:`restore_kept_state`), and torch's post-hooks last.
    State entries of no parameter are kept, as torch keeps them.  The checkpoint's row blocks were
    checked equal to the optimizer's, which keeps its specs as they were written, and so does its
    machine's choices (:data:`KEPT_GROUP_OPTIONS`).  Returns the QK-clip config the checkpoint describes
    (a custom ``classify`` is kept from the optimizer's)."""
    live_qk_clip = opt.settings.qk_clip
    state_dict = upgrade(run_load_pre_hooks(opt, state_dict), opt.param_groups, live_qk_clip)
    check_loadable(opt, state_dict)
    for i, group in enumerate(state_dict["param_groups"]):
        check_group(group, f"checkpoint param_groups[{i}]")
    qk_clip = qk_clip_from_groups(state_dict["param_groups"], live_qk_clip)
    row_blocks = [g.get(ROW_BLOCKS_KEY) for g in opt.param_groups]
    kept_options = [{k: g[k] for k in KEPT_GROUP_OPTIONS if k in g} for g in opt.param_groups]
    rest, kept = split_kept_state(state_dict, opt)
    with load_hooks_run_here(opt):
        torch_load({**state_dict, "state": rest})
    for group, blocks, own in zip(opt.param_groups, row_blocks, kept_options):
        for k in KEPT_GROUP_OPTIONS:
            group.pop(k, None)
        group.update(own)
        normalize_group(group)
        if group["use_muon"]:
            group[ROW_BLOCKS_KEY] = blocks
    restore_kept_state(opt, kept)
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)
    return qk_clip


def restore_kept_state(opt: torch.optim.Optimizer, kept: Mapping) -> None:
    """Momentum buffers and NorMuon's v, moved to their parameter's device in the dtype this
    optimizer keeps them in (torch's loader would have cast them to the parameter's dtype); a
    buffer saved in another dtype is converted, with a note."""
    group_of = {p: g for g in opt.param_groups for p in g["params"]}
    converted: dict[tuple[str, str, str], int] = {}
    for (p, key), value in kept.items():
        group = group_of[p]
        dtype = momentum_dtype(p, group) if key == MOMENTUM_KEY else row_state_dtype(work_dtype(p, group))
        if value.dtype != dtype:
            what = (key, str(value.dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))
            converted[what] = converted.get(what, 0) + 1
        opt.state[p][key] = value.to(device=p.device, dtype=dtype)
    for (key, saved, live), count in converted.items():
        logger.warning("Muon.load_state_dict: %d '%s' tensors were saved as %s and are converted to %s, the dtype "
                       "this optimizer keeps them in (momentum_dtype, or the parameter's; set momentum_dtype to keep "
                       "a saved momentum as it was)", count, key, saved, live)


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


def _check_groups(saved_groups: list[Mapping], live_groups: list[Mapping]) -> dict[Any, tuple]:
    """The groups match; returns ``{saved param id: (live param, name, use_muon, normuon, transposed)}``."""
    if len(saved_groups) != len(live_groups):
        raise ValueError(
            f"Muon.load_state_dict: the checkpoint has {len(saved_groups)} param groups but this optimizer has "
            f"{len(live_groups)}; build the optimizer with the same param groups, in the same order, as the "
            "run that saved it."
        )
    owners: dict[Any, tuple[torch.Tensor, str, bool, bool, bool]] = {}
    for gi, (saved, live) in enumerate(zip(saved_groups, live_groups)):
        names = _check_group(gi, saved, live)
        for pid, p, name in zip(saved["params"], live["params"], names):
            transposed = live["use_muon"] and transposed_for(live.get(TRANSPOSED_KEY), name)
            owners[pid] = (p, name, live["use_muon"], normuon_on(saved), transposed)
    return owners


def _check_group(gi: int, saved: Mapping, live: Mapping) -> list[str]:
    """One group's kind, names, size and row blocks; returns the live parameters' names."""
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
            saved_blocks = from_checkpoint(_canonical_keys(saved.get(ROW_BLOCKS_KEY)), canonical)
        except ValueError as err:
            raise ValueError(f"Muon.load_state_dict: the checkpoint's param_groups[{gi}]: {err}") from None
        problem = row_blocks_mismatch(saved_blocks, _canonical_keys(live.get(ROW_BLOCKS_KEY)), canonical,
                                      f"param_groups[{gi}]")
        if problem is not None:
            raise ValueError(f"Muon.load_state_dict: {problem}.")
    return names


def _check_param_state(entry: Any, p: torch.Tensor, name: str, use_muon: bool, normuon: bool = False,
                       transposed: bool = False) -> None:
    expected = (NORMUON_STATE_KEYS if normuon else MUON_STATE_KEYS) if use_muon else ADAMW_STATE_KEYS_SET
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
            f"{'Muon' if use_muon else 'AdamW'} parameter's state is {sorted(expected)} (layout version "
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
        if not isinstance(record, Mapping) or set(record) not in (set(qk_clip_record(None)), _OLD_QK_KEYS):
            raise ValueError(
                f"Muon.load_state_dict: the checkpoint's {_group_label(saved_groups[gi], gi)} has no valid "
                f"'{QK_CLIP_KEY}' (got {record!r}). " + _FRESH_START
            )
    if not records:
        return live
    records = [{**qk_clip_record(None), **r} if set(r) == _OLD_QK_KEYS else r for r in records]
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
