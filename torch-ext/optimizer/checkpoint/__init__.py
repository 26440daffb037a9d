"""Checkpoints: what Muon's state dict holds, and the checks that keep one from loading wrong.

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

Files: ``layout.py`` (the keys, stamping a live group), ``names.py`` (names as DCP compares them),
``upgrade.py`` (earlier layouts, ``torch.optim.Muon``), ``checks.py`` (before anything loads), ``load.py``
(the loading itself).
"""

from .layout import (LAYOUT_VERSION, MOMENTUM_KEY, QK_CLIP_KEY, ROW_STATE_KEY, VERSION_KEY, stamp_group,
                     with_plain_row_blocks)
from .load import load
from .names import canonical_name
from .upgrade import upgrade_pickled_groups

__all__ = ["LAYOUT_VERSION", "MOMENTUM_KEY", "QK_CLIP_KEY", "ROW_STATE_KEY", "VERSION_KEY", "canonical_name", "load",
           "stamp_group", "upgrade_pickled_groups", "with_plain_row_blocks"]
