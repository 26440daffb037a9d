"""``Muon.load_state_dict``: hooks, upgrade, checks, torch's loader, and the state and options this
optimizer keeps as its own (the machine's choices)."""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..qk_clip import QKClipConfig
from ..row_blocks import ROW_BLOCKS_KEY
from ..rule import momentum_dtype, row_state_dtype, work_dtype
from ..settings import check_group, normalize_group
from .checks import check_loadable, qk_clip_from_groups
from .layout import KEPT_DTYPE_STATE, KEPT_GROUP_OPTIONS, MOMENTUM_KEY
from .upgrade import upgrade

logger = logging.getLogger("optimizer.muon")


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
