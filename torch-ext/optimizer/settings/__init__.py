"""Every option of Muon, declared once.

Two kinds of options:

* **optimizer options**, one value per optimizer: the fields of :class:`MuonSettings`, a frozen
  dataclass (how Newton–Schulz runs, how a step is distributed, QK-clip);
* **group options**, one value per param group: :data:`GROUP_OPTIONS` (the hyper-parameters a
  scheduler or a user may set per group: lr, momentum, ...), each declared for the kinds of group
  it applies to (:data:`KINDS`: Muon, Dion2, AdamW, Lion; ``groups.kind_of``).  The constructor keyword of the same
  name (or the declared ``keyword``) is the default for groups that do not set it.

Everything else is derived from these declarations: the constructor's keywords, their defaults
and validation (:func:`from_constructor`), the defaults torch's ``Optimizer`` fills into groups
(:func:`torch_defaults`), the checks of a group
(:func:`check_group`), the record every rank compares before a step and its digest
(:func:`record`, :func:`digest`), the part of the step context's cache key that settings make
(:func:`settings_key`) and the docstring of ``Muon.__init__`` (:func:`constructor_doc`).  Adding an
option is one declaration plus its use; the cross-rank agreement, pickling and the context's
cache key pick it up with no other change.

Files: ``declarations.py`` (the options), ``checks.py`` (their checks), ``constructor.py`` (the
constructor's keywords and defaults), ``groups.py`` (a group's options: filled, normalised, checked),
``comparison.py`` and ``records.py`` (how values and settings are compared across ranks and in
the context's cache key).
"""

from .checks import check_number, dtype_of
from .comparison import rank_independent_repr, snapshot
from .constructor import (TORCH_STYLE, constructor_doc, constructor_keywords, constructor_signature, from_constructor,
                          from_legacy, torch_defaults)
from .declarations import (ADAMW, ADJUST_LR_FN_MODES, ADJUST_LR_MODES, ALL, DION2, ELEMENTWISE_KINDS, GROUP_OPTIONS, KINDS,
                           LION, MATRIX_KINDS, MUON, TORCH_POSITIONAL, Declared, GroupOption, MuonSettings,
                           adjust_lr_from_fn, options_of, resolve_adjust_lr_fn)
from .groups import (KIND_NAMES, check_group, fill_group, held_options, is_default, kind_of, normalize_group,
                     strip_torch_defaults)
from .records import digest, record, settings_key

__all__ = [
    "ADAMW", "ADJUST_LR_FN_MODES", "ADJUST_LR_MODES", "ALL", "DION2", "ELEMENTWISE_KINDS", "GROUP_OPTIONS", "KINDS",
    "KIND_NAMES", "LION", "MATRIX_KINDS", "MUON", "TORCH_POSITIONAL", "TORCH_STYLE", "Declared", "GroupOption",
    "MuonSettings", "adjust_lr_from_fn", "check_group", "check_number", "constructor_doc", "constructor_keywords",
    "constructor_signature", "digest", "dtype_of", "fill_group", "from_constructor", "from_legacy", "held_options",
    "is_default", "kind_of", "normalize_group", "options_of", "rank_independent_repr", "record",
    "resolve_adjust_lr_fn", "settings_key", "snapshot", "strip_torch_defaults", "torch_defaults",
]
