"""The Dion2 half of a step: tensors held whole by the rule, DTensors by the owner of their chosen slices.

Every parameter of a Dion2 group (a ``use_muon`` group with ``dion2_fraction``; NorDion2 with
``normuon_beta2`` too) held whole is stepped by ``dion2_rule.dion2_step_`` on the whole matrix it
holds; the DTensor parameters all together by ``parallel/execution/dion2_step.py`` (the exact
selection, only the chosen slices travelling to an owner and back, every rank stepping its own
piece exactly as one device steps the whole; ``docs/dion2.md``).

What the step reads of a group is Muon's: the momentum buffer (``momentum_buffer``, in
``momentum_dtype``), NorMuon's ``normuon_v`` (``normuon_beta2``), ``lr`` and ``adjust_lr`` (of the
matrix's own shape, never the chosen submatrix's), ``weight_decay``, ``cautious_wd``,
``maximize``, the ``[out, in]`` view of a ``muon_transposed`` weight, and Newton–Schulz's options
(``ns_steps``, ``ns_coefficients``, ``ns_method``, ``eps``, ``ns_kernels``), which orthogonalise
the chosen ``k``-slice submatrix.  What it does not build is refused
(``checks.dion2_group_problem``).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import torch

from . import rule as dion2_rule
from ..checkpoint import MOMENTUM_KEY, ROW_STATE_KEY
from ..matrix_view import local_matrix
from ..named_params import NamedParam
from ..newton_schulz.group import NewtonSchulz  # Newton–Schulz's one entry point here
from ..newton_schulz.implementation import Implementation
from ..rule import adjust_lr, normuon_on, work_dtype
from ..settings import GROUP_OPTIONS, MuonSettings
from ..parallel.execution.dion2_step import Dion2Item, dion2_dtensor_update_
from ..step.muon_update import momentum_buffers, row_states
from ..tensors import is_dtensor

#: ``dion2_ef_decay``'s declared default (an optional option at its default is not held by a group).
EF_DECAY_DEFAULT = next(o.default for o in GROUP_OPTIONS if o.name == "dion2_ef_decay")


def dion2_update(entries: Sequence[NamedParam], groups: Sequence[Mapping], implementations: Sequence[Implementation],
                 state: MutableMapping, settings: MuonSettings) -> None:
    """One Dion2 step of every parameter in ``entries`` (each with a gradient; ``groups[i]`` its
    group, ``implementations[i]`` its ``ns_kernels`` as resolved when the step context was built),
    in place on the parameter, its momentum and its NorMuon ``v``."""
    if not entries:
        return
    params = [e.param for e in entries]
    views = [e.transposed for e in entries]
    bufs = momentum_buffers(params, groups, state)
    rows = row_states(params, groups, views, state)
    distributed = []
    for e, group, implementation, buf, v in zip(entries, groups, implementations, bufs, rows):
        options = _options(e, group, implementation, settings)
        if is_dtensor(e.param):  # every rank of its mesh steps it below, all together, in the agreed order
            entry = state[e.param]
            distributed.append(Dion2Item(e.param, entry[MOMENTUM_KEY],
                                         entry.get(ROW_STATE_KEY) if v is not None else None, e.transposed, options))
        else:
            _step_one(e, local_matrix(buf, e.transposed), v, options)
    dion2_dtensor_update_(distributed)


def _options(e: NamedParam, group: Mapping, implementation: Implementation, settings: MuonSettings) -> dict:
    """The rule's keywords for parameter ``e`` of ``group`` this step (the same for both paths)."""
    lr = group["lr"]
    return dict(
        fraction=group["dion2_fraction"], ef_decay=group.get("dion2_ef_decay", EF_DECAY_DEFAULT), lr=lr,
        adjusted=adjust_lr(lr, e.shape, group["adjust_lr"]), weight_decay=group["weight_decay"],
        orthogonalize=NewtonSchulz(group["ns_steps"], group["ns_coefficients"], group.get("ns_method", "auto"),
                                   group["eps"], settings.compute_dtype, implementation),
        normuon_beta2=group.get("normuon_beta2") if normuon_on(group) else None,
        cautious=bool(group.get("cautious_wd", False)), maximize=bool(group.get("maximize", False)),
        dtype=work_dtype(e.param, group))


def _step_one(e: NamedParam, buf: torch.Tensor, v: torch.Tensor | None, options: dict) -> None:
    _, v_new = dion2_rule.dion2_step_(local_matrix(e.param, e.transposed), local_matrix(e.param.grad, e.transposed),
                                      buf, row_state=v, **options)
    if v is not None and v_new is not v:
        v.copy_(v_new)
