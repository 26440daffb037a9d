"""dion's constructors (microsoft/dion ``Dion2``, ``NorDion2``, ``Dion3``) on :class:`~optimizer.Muon`.

dion's keywords and group keys mapped onto Muon's options, so that code written for dion's Dion2
runs unchanged (``docs/from_dion.md`` has the table).  Thin: every value is then checked, agreed
and stepped as Muon's own options are (``step.py`` runs the groups, plain tensors and DTensors).

Nothing a caller passes is silently dropped: a keyword or group key with no meaning here is
refused by name, with what to do instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import rule as dion2_rule
from ..muon import Muon
from ..named_params import named_params
from ..settings import GROUP_OPTIONS
from ..settings.checks import check_ef_decay, check_fraction
from ..tensors import is_dtensor

logger = logging.getLogger(__name__)

#: dion's ``adjust_lr`` -> Muon's: "rms_norm" is Muon's "match_rms_adamw" (0.2 sqrt(max(A, B))).
ADJUST_LR = {"spectral_norm": "spectral_norm", "rms_norm": "match_rms_adamw", None: None}
ELEMENTWISE = ("adamw", "lion")
_WARNED_LOCAL: list[bool] = []  # selection_scope="local" is warned about once per process


def _declared_check(name: str, kind_hint: str, value, where: str) -> None:
    """Muon's declared check of option ``name`` (the declaration whose kinds include ``kind_hint``),
    with the error naming dion's keyword ``where``."""
    option = next(o for o in GROUP_OPTIONS if o.name == name and kind_hint in o.kinds)
    option.check(value, where, {})


def muon_keywords(who: str, *, lr, weight_decay, fraction, ef_decay, betas, epsilon, adjust_lr, use_triton,
                  use_polar_express, use_gram_newton_schulz, newton_schulz_func, triton_post_ortho,
                  selection_scope, normuon_beta2=None, ef_name="ef_decay") -> dict[str, Any]:
    """dion's constructor keywords as Muon's (refusing what has no meaning here, by dion's name)."""
    check_fraction(fraction, "fraction")
    check_ef_decay(ef_decay, ef_name)
    _declared_check("betas", "adamw", betas, "betas")
    _declared_check("eps", "adamw", epsilon, "epsilon")
    _check_unbuilt(who, newton_schulz_func, triton_post_ortho, selection_scope)
    kernels = {None: "auto", False: "torch", True: "auto"}
    methods = {None: "auto", False: "classic", True: "gram"}
    for name, value in (("use_triton", use_triton), ("use_gram_newton_schulz", use_gram_newton_schulz),
                        ("use_polar_express", use_polar_express)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{who}: `{name}` must be True, False or None, got {value!r}")
    if use_polar_express is None:
        raise ValueError(f"{who}: `use_polar_express` must be True or False, got None")
    out = dict(lr=lr, weight_decay=weight_decay, dion2_fraction=float(fraction), dion2_ef_decay=ef_decay,
               adjust_lr=_adjust_lr(who, adjust_lr), adamw_betas=tuple(betas), lion_betas=tuple(betas),
               adamw_eps=epsilon, eps=epsilon, ns_kernels=kernels[use_triton],
               ns_method=methods[use_gram_newton_schulz],
               # dion's Gram Newton–Schulz always runs Polar Express's coefficients
               ns_coefficients="polar_express" if use_polar_express or use_gram_newton_schulz else "fixed")
    if normuon_beta2 is not None:
        out["normuon_beta2"] = normuon_beta2
    return out


def _adjust_lr(who: str, mode):
    if not isinstance(mode, (str, type(None))) or mode not in ADJUST_LR:
        raise ValueError(f"{who}: `adjust_lr` must be 'spectral_norm', 'rms_norm' or None (dion's modes), got {mode!r}")
    return ADJUST_LR[mode]


def _check_unbuilt(who: str, newton_schulz_func, triton_post_ortho, selection_scope) -> None:
    """dion's keywords that select machinery this package replaces: refused with the reason, or,
    for ``selection_scope="local"``, accepted with one warning (the selection here is exact)."""
    if newton_schulz_func is not None:
        raise ValueError(f"{who}: `newton_schulz_func` is not supported: a callable cannot be batched, split over "
                         "ranks or run on the kernels. Use Muon's ns_coefficients/ns_steps/ns_method (dion's "
                         "use_polar_express and use_gram_newton_schulz map onto them)")
    if triton_post_ortho not in (False, None):
        raise ValueError(f"{who}: `triton_post_ortho`={triton_post_ortho!r} is not supported: the update after "
                         "Newton–Schulz runs as ns_kernels chooses. Remove it (or pass False)")
    if selection_scope not in (None, "global", "local"):
        raise ValueError(f"{who}: `selection_scope` must be 'global' or 'local' (dion's), got {selection_scope!r}")
    if selection_scope == "local" and not _WARNED_LOCAL:
        _WARNED_LOCAL.append(True)
        logger.warning("%s: selection_scope='local' selects here exactly as 'global' would (the top-k of the whole "
                       "matrix, as on one device), not per shard; dion's 'local' result depends on the sharding",
                       who)


def dion_groups(params, who: str, algorithm: str, betas, flatten: bool, dion2_keys: Mapping[str, str]) -> list[dict]:
    """dion's ``params`` (tensors, ``(name, tensor)`` pairs, or groups with dion's keys) as Muon's
    groups: ``algorithm`` (``"dion2"``/``"nordion2"``, the default) -> a Dion2 group, ``"adamw"``/
    ``"lion"`` -> a ``use_muon=False`` group; ``dion2_keys`` maps dion's group keys of the Dion2
    groups onto Muon's (``fraction`` -> ``dion2_fraction``, ...)."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    if not params or not all(isinstance(g, Mapping) for g in params):
        params = [{"params": params}]
    return [_dion_group(dict(g), f"{who}: param group {i}", algorithm, betas, flatten, dion2_keys)
            for i, g in enumerate(params)]


def _dion_group(group: dict, where: str, algorithm: str, betas, flatten: bool, dion2_keys) -> dict:
    algo = group.pop("algorithm", algorithm)
    if algo == algorithm:
        return _matrix_group(group, where, flatten or group.pop("flatten", False), dion2_keys)
    if algo not in ELEMENTWISE:
        raise ValueError(f"{where}: algorithm={algo!r} is not one this optimizer runs: {algorithm!r} (the "
                         f"default), 'adamw' or 'lion'")
    foreign = sorted(set(group) & {*dion2_keys, "flatten", "num_heads", "split_sizes", "selection_scope"})
    if foreign:
        raise ValueError(f"{where} (algorithm={algo!r}) sets `{foreign[0]}`, which applies to {algorithm} groups "
                         "only; remove it")
    beta1, beta2 = group.pop("beta1", betas[0]), group.pop("beta2", betas[1])
    group.setdefault("betas", (beta1, beta2))
    if "epsilon" in group:
        if algo == "lion":
            raise ValueError(f"{where} (algorithm='lion') sets `epsilon`: Lion has no epsilon; remove it")
        group["eps"] = group.pop("epsilon")
    return {**group, "use_muon": False, **({"algorithm": "lion"} if algo == "lion" else {})}


def _matrix_group(group: dict, where: str, flatten: bool, dion2_keys) -> dict:
    for key in ("num_heads", "split_sizes"):
        if key in group:
            raise ValueError(f"{where} sets `{key}`, dion's row split, which is not mapped here: remove it and "
                             "set muon_row_blocks on the group ('heads:<head_dim>' or 'blocks:<r1>,<r2>,...'; "
                             "each block its own Dion2 matrix, on plain tensors)")
    for key in ("beta1", "beta2"):
        if key in group:
            raise ValueError(f"{where} sets `{key}`, which applies to 'adamw' and 'lion' groups only; remove it")
    if "selection_scope" in group:
        _check_unbuilt(where, None, False, group.pop("selection_scope"))
    if "adjust_lr" in group:
        group["adjust_lr"] = _adjust_lr(where, group["adjust_lr"])
    for dion_key, ours in (*dion2_keys.items(), ("epsilon", "eps")):
        if dion_key in group:
            group[ours] = group.pop(dion_key)
    if flatten:
        for i, p in enumerate(group.get("params", [])):
            shape = tuple((p[1] if isinstance(p, tuple) else p).shape)
            if len(shape) > 2:
                raise ValueError(f"{where}: flatten=True with the {len(shape)}-D parameter {i} {shape}: 3-D weights "
                                 "are expert stacks here (each matrix its own selection); put conv kernels in an "
                                 "'adamw' or 'lion' group, or leave flatten=False")
    return {**group, "use_muon": True}


def check_mesh(who: str, mesh, groups: Iterable[Mapping]) -> None:
    """dion's ``distributed_mesh``: None, a ``DeviceMesh`` or a ``ProcessGroup``.  Placements are
    read from the parameters, so it only has to agree with them: every DTensor's mesh holds the
    mesh's ranks (it, or one it is a sub-mesh of: HSDP's shard dim)."""
    if mesh is None:
        return
    from torch.distributed import ProcessGroup, get_process_group_ranks
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        ranks = set(mesh.mesh.flatten().tolist())
    elif isinstance(mesh, ProcessGroup):
        ranks = set(get_process_group_ranks(mesh))
    else:
        raise TypeError(f"{who}: `distributed_mesh` must be None, a DeviceMesh or a ProcessGroup, got "
                        f"{type(mesh).__name__}")
    for i, group in enumerate(groups):
        for p in group.get("params", []):
            p = p[1] if isinstance(p, tuple) else p
            if is_dtensor(p) and not ranks <= set(p.device_mesh.mesh.flatten().tolist()):
                raise ValueError(f"{who}: param group {i} holds a DTensor on ranks "
                                 f"{sorted(p.device_mesh.mesh.flatten().tolist())}, which do not include "
                                 f"distributed_mesh's {sorted(ranks)}; pass the parameters' mesh (or None)")


def log_selection(opt: Muon, who: str) -> None:
    """dion's ``verbose=True``: each Dion2 parameter's selection dim and k, logged once (INFO)."""
    for e in named_params(opt.param_groups):
        group = opt.param_groups[e.group]
        fraction = group.get("dion2_fraction")
        if not e.use_muon or fraction is None:
            continue
        dim = dion2_rule.selection_dim(e.shape, rows_only=group.get("normuon_beta2") is not None)
        k = dion2_rule.chosen_count(fraction, e.shape[dim])
        logger.info("%s: %s %s selects %d of its %d %s", who, e.name, tuple(e.shape), k, e.shape[dim],
                        "rows" if dim == dion2_rule.ROWS else "columns")


class _DionGroups(Muon):
    """dion's group keys also in ``add_param_group`` (a group without ``use_muon`` is dion's: mapped
    as the constructor maps it); the mapping's inputs survive pickling and ``deepcopy``."""

    ALGORITHM = ""
    DION2_KEYS: dict[str, str] = {}

    def add_param_group(self, param_group: dict) -> None:
        if isinstance(param_group, Mapping) and "use_muon" not in param_group:
            betas, flatten = self.__dict__.get("_dion_groups", ((0.9, 0.95), False))
            param_group = _dion_group(dict(param_group), f"{type(self).__name__}: param group "
                                      f"{len(self.param_groups)}", self.ALGORITHM, betas, flatten, self.DION2_KEYS)
        super().add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_dion_groups": self.__dict__.get("_dion_groups")}


class Dion2(_DionGroups):
    """dion's ``Dion2`` (microsoft/dion ``dion/dion2.py``): its keywords and defaults, on Muon.

    Groups are dion's: ``algorithm="dion2"`` (the default) groups are Dion2 groups (Muon groups
    with ``dion2_fraction``), ``"adamw"`` and ``"lion"`` groups are Muon's ``use_muon=False``
    groups; dion's group keys (``fraction``, ``ef_decay``, ``beta1``, ``beta2``, ``epsilon``) are
    mapped.  ``use_triton`` / ``use_gram_newton_schulz``: None (the default here) lets Muon choose
    (``ns_kernels="auto"``, ``ns_method="auto"``), False is "torch" / "classic", True is "auto"
    (the kernels where they run) / "gram".  ``docs/from_dion.md`` lists every keyword."""

    ALGORITHM = "dion2"
    DION2_KEYS = {"fraction": "dion2_fraction", "ef_decay": "dion2_ef_decay"}

    def __init__(self, params, distributed_mesh=None, lr: float = 0.01, fraction: float = 0.25,
                 ef_decay: float = 0.95, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.01,
                 epsilon: float = 1e-8, adjust_lr: str | None = "spectral_norm", flatten: bool = False,
                 use_triton: bool | None = None, use_polar_express: bool = True,
                 use_gram_newton_schulz: bool | None = None, newton_schulz_func=None, verbose: bool = False,
                 triton_post_ortho: bool = False, selection_scope: str | None = None):
        who = type(self).__name__
        keywords = muon_keywords(
            who, lr=lr, weight_decay=weight_decay, fraction=fraction, ef_decay=ef_decay, betas=betas, epsilon=epsilon,
            adjust_lr=adjust_lr, use_triton=use_triton, use_polar_express=use_polar_express,
            use_gram_newton_schulz=use_gram_newton_schulz, newton_schulz_func=newton_schulz_func,
            triton_post_ortho=triton_post_ortho, selection_scope=selection_scope)
        _build(self, who, params, distributed_mesh, keywords, betas, flatten, verbose)


class NorDion2(_DionGroups):
    """dion's ``NorDion2`` (``dion/nordion2.py``; also ``Dion3``): Dion2 with NorMuon's per-row
    normalisation of the chosen rows.  ``mu`` is the error-feedback decay (Muon's
    ``dion2_ef_decay``), ``muon_beta2`` NorMuon's beta2 (``normuon_beta2``); groups use
    ``algorithm="nordion2"`` (the default), ``"adamw"`` or ``"lion"``.  Otherwise as :class:`Dion2`."""

    ALGORITHM = "nordion2"
    DION2_KEYS = {"fraction": "dion2_fraction", "mu": "dion2_ef_decay", "muon_beta2": "normuon_beta2"}

    def __init__(self, params, distributed_mesh=None, lr: float = 0.01, fraction: float = 0.25, mu: float = 0.95,
                 muon_beta2: float = 0.95, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.01,
                 epsilon: float = 1e-8, adjust_lr: str | None = "spectral_norm", flatten: bool = False,
                 use_triton: bool | None = None, use_polar_express: bool = True,
                 use_gram_newton_schulz: bool | None = None, newton_schulz_func=None,
                 triton_post_ortho: bool = False, selection_scope: str | None = None):
        who = type(self).__name__
        _declared_check("normuon_beta2", "muon", muon_beta2, "muon_beta2")
        keywords = muon_keywords(
            who, lr=lr, weight_decay=weight_decay, fraction=fraction, ef_decay=mu, betas=betas, epsilon=epsilon,
            adjust_lr=adjust_lr, use_triton=use_triton, use_polar_express=use_polar_express,
            use_gram_newton_schulz=use_gram_newton_schulz, newton_schulz_func=newton_schulz_func,
            triton_post_ortho=triton_post_ortho, selection_scope=selection_scope, normuon_beta2=muon_beta2,
            ef_name="mu")
        _build(self, who, params, distributed_mesh, keywords, betas, flatten, False)


#: dion exports NorDion2 also as Dion3 (an alias, not a subclass).
Dion3 = NorDion2


def _build(opt: _DionGroups, who: str, params, mesh, keywords: dict, betas, flatten, verbose) -> None:
    """Map the groups, check the mesh and build the Muon underneath."""
    if not isinstance(flatten, bool) or not isinstance(verbose, bool):
        raise ValueError(f"{who}: `flatten` and `verbose` must be True or False, got {flatten!r}, {verbose!r}")
    groups = dion_groups(params, who, opt.ALGORITHM, tuple(betas), flatten, opt.DION2_KEYS)
    check_mesh(who, mesh, groups)
    opt._dion_groups = (tuple(betas), flatten)
    Muon.__init__(opt, groups, **keywords)
    if verbose:
        log_selection(opt, who)
