"""Run configurations: one small TOML file per mesh layout (see ``configs/``).

``load_config(path, world_size=None)`` parses and validates a file and returns a
:class:`RunConfig`.  Every rejection is a :class:`ConfigError` whose message names
the file and the offending key, and says what to do.

Sections (all keys optional unless noted; unknown keys are errors)::

    [mesh]       dp_replicate, dp_shard, tp, ep      degrees, default 1
    [model]      fields of examples.model.ModelArgs (attention = "gqa" | "fused_qkv" | "mla")
    [train]      steps, lr, weight_decay, momentum, seed, batch_size, seq_len,
                 warmup_steps, schedule ("constant" | "cosine"), log_every, eval_every
    [data]       source ("synthetic" | "stdlib"), val_sequences
    [qk_clip]    enabled, threshold, head_dim (defaults to model.head_dim; not with MLA)
    [muon]       row_blocks ("none" | "qkv" | "heads"), dion2_fraction, dion2_ef_decay, normuon_beta2
    [compare]    adamw_lr, check_steps, normuon_lr, dion2_lr   (read by examples/main_job.py only)
    [placements] "name-glob" = ["Shard(1)", "Replicate()", "_StridedShard(0, sf=2)", ...]

``[data] source = "stdlib"`` trains on the standard-library text corpus
(``examples/data.py``; byte tokens, so ``model.vocab_size`` must be 256) and
allows ``eval_every`` (validation loss every that many steps, on
``val_sequences`` fixed windows); ``"synthetic"`` is the permutation task.
``[compare]`` is the main job's: the learning rate of the AdamW-only run (the
Muon run uses ``train.lr``), of the NorMuon run (``normuon_lr``; none without it),
of the Dion2 run (``dion2_lr``; none without it), and how many of the Muon-family
runs' first steps are checked against the same optimizer on one device.

``[model] attention`` picks the attention (``examples/model.py``); the MLA sizes
(``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
``v_head_dim``, ``rope_theta``) are refused unless it is ``"mla"``, and
``n_kv_heads``/``head_dim`` when it is.  QK-clip follows the attention:
``QKClipConfig(head_dim=...)``, ``(fused_qkv=FusedQKV(..., "grouped"))`` or
``(mla=MLAHeads(...))``.  ``[muon] row_blocks`` declares split
orthogonalisation (Muon's ``"muon_row_blocks"`` param-group key): ``"qkv"``
orthogonalises the q, k and v rows of a fused ``wqkv`` as three matrices (fused
attention only); ``"heads"`` every attention head of the q/k/v projections on its
own (``wq``/``wk``/``wv`` per head; ``wqkv`` per q, k, v head; MLA's ``wq``/``wq_b``
and ``wkv_b`` per head); ``"none"`` (default) whole matrices.  ``[muon] dion2_fraction``
(and ``dion2_ef_decay``, ``normuon_beta2``) are Muon's group options of the same names, set on
the Muon group (:data:`MUON_GROUP_OPTIONS`): Dion2 at that fraction, NorDion2 with
``normuon_beta2`` (docs/dion2.md); each value is checked by the optimizer's own declaration
(``optimizer.settings``).  A Dion2 group has no momentum coefficient, so ``[train] momentum``
is refused with it.

Mesh dims with degree > 1 form the device mesh, in the order
``dp_replicate, dp_shard, ep, tp``.  Without ``[placements]`` the model is
parallelized with the real APIs: TP via ``parallelize_module`` on ``tp``, expert
sharding on ``ep``, FSDP2 ``fully_shard`` on ``dp_shard`` (HSDP with
``dp_replicate``).  With ``[placements]`` (the "solver" mode) each parameter is
placed with ``distribute_tensor`` per the first glob (``fnmatch``, file order) that
matches its name; each list has one placement per mesh dim, and every parameter
must be matched.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import tomllib
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .model import HEAD_FIELDS, MLA_FIELDS, ModelArgs, Transformer

# Mesh dims in mesh order; a dim appears in the mesh only when its degree is > 1.
MESH_DIMS = ("dp_replicate", "dp_shard", "ep", "tp")


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the key."""


@dataclass(frozen=True)
class MeshConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.ep * self.tp

    @property
    def dim_names(self) -> tuple[str, ...]:
        return tuple(d for d in MESH_DIMS if getattr(self, d) > 1)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in self.dim_names)


SCHEDULES = ("constant", "cosine")
DATA_SOURCES = ("synthetic", "stdlib")
ROW_BLOCKS = ("none", "qkv", "heads")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 24
    lr: float = 0.02
    weight_decay: float = 0.0
    momentum: float = 0.95
    seed: int = 0
    batch_size: int = 8
    seq_len: int = 16
    # Learning-rate multiplier: linear warmup over warmup_steps, then "constant"
    # (1.0) or "cosine" (from 1.0 down to COSINE_FLOOR at the last step).
    warmup_steps: int = 0
    schedule: str = "constant"
    log_every: int = 1
    eval_every: int = 0  # 0: no validation


@dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"
    val_sequences: int = 64


@dataclass(frozen=True)
class CompareConfig:
    adamw_lr: float = 1e-3
    check_steps: int = 20
    normuon_lr: float | None = None  # the main job's NorMuon run (None: no such run)
    dion2_lr: float | None = None  # the main job's Dion2 run (None: no such run)


@dataclass(frozen=True)
class QKClipSettings:
    enabled: bool = False
    threshold: float = 100.0
    head_dim: int | None = None  # None: the model's head_dim


# Muon's group options a config's [muon] table sets on the Muon group (besides row_blocks), each
# declared and checked once, in optimizer.settings.GROUP_OPTIONS; None: not set (Muon's default).
MUON_GROUP_OPTIONS = ("dion2_fraction", "dion2_ef_decay", "normuon_beta2")


@dataclass(frozen=True)
class MuonSettings:
    row_blocks: str = "none"  # "none" | "qkv" | "heads": see the module docstring
    dion2_fraction: float | None = None  # Dion2 on the Muon group (None: Muon)
    dion2_ef_decay: float | None = None  # Dion2's error-feedback decay (None: Muon's default)
    normuon_beta2: float | None = None  # NorMuon (with dion2_fraction: NorDion2)

    def group_options(self) -> dict:
        """The Muon group's options this config sets (MUON_GROUP_OPTIONS that are not None)."""
        return {k: getattr(self, k) for k in MUON_GROUP_OPTIONS if getattr(self, k) is not None}


@dataclass(frozen=True)
class RunConfig:
    name: str
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelArgs = field(default_factory=ModelArgs)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    qk_clip: QKClipSettings = field(default_factory=QKClipSettings)
    compare: CompareConfig = field(default_factory=CompareConfig)
    muon: MuonSettings = field(default_factory=MuonSettings)
    # Solver-style plan: (name glob, placements per mesh dim), in file order; None
    # when the model is parallelized with fully_shard / parallelize_module.
    placements: tuple[tuple[str, tuple[Placement, ...]], ...] | None = None

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def dp_degree(self) -> int:
        """Number of ranks that see different data."""
        if self.placements is not None:
            return self.world_size  # plan mode computes replicated: every rank is a data rank
        return self.mesh.dp_replicate * self.mesh.dp_shard

    def placement_for(self, param_name: str) -> tuple[Placement, ...] | None:
        """The plan's placements for a parameter (first matching glob), or None."""
        for pattern, placements in self.placements or ():
            if fnmatch.fnmatchcase(param_name, pattern):
                return placements
        return None


_PLACEMENT_FORMS = (
    "Replicate()", "Shard(d)", "Shard(dim=d)", "_StridedShard(d, sf=s)",
    "_StridedShard(dim=d, split_factor=s)",
)
_REPLICATE_RE = re.compile(r"Replicate\(\)")
_SHARD_RE = re.compile(r"Shard\((?:dim=)?(\d+)\)")
_STRIDED_RE = re.compile(r"_StridedShard\((?:dim=)?(\d+),(?:sf=|split_factor=)?(\d+)\)")


def parse_placement(text: str) -> Placement:
    """Parse ``"Replicate()"``, ``"Shard(1)"``, ``"_StridedShard(0, sf=2)"`` (spaces ignored)."""
    if not isinstance(text, str):
        raise ValueError(f"placement must be a string like 'Shard(0)', got {text!r}")
    s = re.sub(r"\s+", "", text)
    if _REPLICATE_RE.fullmatch(s):
        return Replicate()
    if m := _SHARD_RE.fullmatch(s):
        return Shard(int(m.group(1)))
    if m := _STRIDED_RE.fullmatch(s):
        sf = int(m.group(2))
        if sf < 1:
            raise ValueError(f"placement {text!r}: split factor must be >= 1")
        return _StridedShard(int(m.group(1)), split_factor=sf)
    if s.startswith("Partial"):
        raise ValueError(
            f"placement {text!r}: Partial is a pending reduction, not a parameter placement; "
            "use Replicate() or a Shard"
        )
    raise ValueError(f"cannot parse placement {text!r}; expected one of {', '.join(_PLACEMENT_FORMS)}")


def config_world_size(path: str | os.PathLike) -> int:
    """World size a config needs (validates the file)."""
    return load_config(path).world_size


def load_config(path: str | os.PathLike, world_size: int | None = None) -> RunConfig:
    """Load and validate a run config; with ``world_size``, also check the degrees multiply to it."""
    path = os.fspath(path)
    where = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML: {e}") from e
    return build_config(raw, name=os.path.splitext(where)[0], world_size=world_size, where=where)


def build_config(raw: dict, name: str, world_size: int | None = None, where: str | None = None) -> RunConfig:
    """Validate an already-parsed TOML mapping (what :func:`load_config` does after reading)."""
    where = where or name

    def fail(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{where}: [{key}] {msg}" if "." not in key else f"{where}: {key}: {msg}")

    sections = {"mesh", "model", "train", "data", "qk_clip", "compare", "muon", "placements"}
    for key in raw:
        if key not in sections:
            raise fail(key, f"unknown section; expected one of {sorted(sections)}")

    mesh = _dataclass_from(MeshConfig, raw.get("mesh", {}), "mesh", fail)
    for d in MESH_DIMS:
        if getattr(mesh, d) < 1:
            raise fail(f"mesh.{d}", f"degree must be >= 1, got {getattr(mesh, d)}")
    if world_size is not None and mesh.world_size != world_size:
        product = " * ".join(f"{d}={getattr(mesh, d)}" for d in MESH_DIMS if getattr(mesh, d) > 1) or "1"
        raise fail("mesh", f"degrees multiply to {mesh.world_size} ({product}) but the world size is "
                   f"{world_size}; launch {mesh.world_size} processes or change the degrees")

    model_table = raw.get("model", {})
    if isinstance(model_table, dict):
        attention = model_table.get("attention", ModelArgs.attention)
        unused = [k for k in (HEAD_FIELDS if attention == "mla" else MLA_FIELDS if attention in
                              ("gqa", "fused_qkv") else ()) if k in model_table]
        if unused:
            what = ("MLA has one key per query head and its own head sizes (qk_nope_head_dim, "
                    "qk_rope_head_dim, v_head_dim)" if attention == "mla"
                    else "they size multi-head latent attention only")
            raise fail(f"model.{unused[0]}", f"is not used with attention = \"{attention}\": {what}; remove it")
    try:
        model = _dataclass_from(ModelArgs, model_table, "model", fail)
    except ValueError as e:  # ModelArgs.__post_init__ names the field
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: {str(e).replace('ModelArgs.', 'model.')}") from e
    train = _dataclass_from(TrainConfig, raw.get("train", {}), "train", fail)
    data = _dataclass_from(DataConfig, raw.get("data", {}), "data", fail)
    qk_clip = _dataclass_from(QKClipSettings, raw.get("qk_clip", {}), "qk_clip", fail)
    compare = _dataclass_from(CompareConfig, raw.get("compare", {}), "compare", fail)
    muon = _dataclass_from(MuonSettings, raw.get("muon", {}), "muon", fail)

    for key in ("steps", "batch_size", "seq_len", "log_every"):
        if getattr(train, key) < 1:
            raise fail(f"train.{key}", f"must be >= 1, got {getattr(train, key)}")
    for key in ("warmup_steps", "eval_every"):
        if getattr(train, key) < 0:
            raise fail(f"train.{key}", f"must be >= 0, got {getattr(train, key)}")
    if train.schedule not in SCHEDULES:
        raise fail("train.schedule", f"must be one of {list(SCHEDULES)}, got {train.schedule!r}")
    for key, value in (("train.lr", train.lr), ("compare.adamw_lr", compare.adamw_lr)):
        if not value > 0:
            raise fail(key, f"must be > 0, got {value}")
    for key in ("normuon_lr", "dion2_lr"):
        value = getattr(compare, key)
        if value is not None and not value > 0:
            raise fail(f"compare.{key}", f"must be > 0, got {value!r}")
    if compare.check_steps < 0:
        raise fail("compare.check_steps", f"must be >= 0, got {compare.check_steps}")
    if data.source not in DATA_SOURCES:
        raise fail("data.source", f"must be one of {list(DATA_SOURCES)}, got {data.source!r}")
    if data.source == "stdlib" and model.vocab_size != 256:
        raise fail("model.vocab_size", f"is {model.vocab_size} but [data] source = \"stdlib\" has byte "
                   "tokens; set vocab_size = 256")
    if train.eval_every and data.source != "stdlib":
        raise fail("train.eval_every", "needs [data] source = \"stdlib\" (the synthetic task has no "
                   "validation split); set eval_every = 0 or change the source")
    if data.val_sequences < 1:
        raise fail("data.val_sequences", f"must be >= 1, got {data.val_sequences}")
    if muon.row_blocks not in ROW_BLOCKS:
        raise fail("muon.row_blocks", f"must be one of {list(ROW_BLOCKS)}, got {muon.row_blocks!r}")
    if muon.row_blocks == "qkv" and model.attention != "fused_qkv":
        raise fail("muon.row_blocks", f"\"qkv\" splits a fused wqkv, but model.attention is "
                   f"{model.attention!r}; use \"heads\" or \"none\", or attention = \"fused_qkv\"")
    _check_muon_group_options(muon, raw.get("train", {}), fail)
    if qk_clip.head_dim is not None and model.attention == "mla":
        raise fail("qk_clip.head_dim", "is not used with attention = \"mla\" (QK-clip takes the MLA head "
                   "sizes from [model]); remove it")
    if qk_clip.head_dim is not None and qk_clip.head_dim != model.head_dim:
        raise fail("qk_clip.head_dim", f"is {qk_clip.head_dim} but model.head_dim is {model.head_dim}; "
                   "omit it or make them equal")
    if qk_clip.threshold <= 0:
        raise fail("qk_clip.threshold", f"must be > 0, got {qk_clip.threshold}")

    placements = None
    if "placements" in raw:
        placements = _parse_plan(raw["placements"], mesh, model, fail)
    else:
        if mesh.dp_replicate > 1 and mesh.dp_shard == 1:
            raise fail("mesh.dp_replicate", "needs dp_shard > 1 (HSDP); pure replication is not supported")
        if mesh.tp > 1:
            for key in ("n_heads",) if model.attention == "mla" else ("n_heads", "n_kv_heads"):
                if getattr(model, key) % mesh.tp:
                    raise fail(f"model.{key}", f"{getattr(model, key)} is not divisible by mesh.tp="
                               f"{mesh.tp}; tensor parallelism splits whole heads")
        if mesh.ep > 1 and mesh.tp > 1:
            raise fail("mesh.ep", "expert sharding together with tp is not supported; set one of them to 1")
        if mesh.ep > 1 and mesh.dp_shard > 1:
            # FSDP shards expert weights on dim 1 there, and FSDP2 pads only dim-0 shards.
            for key in ("expert_dim", "dim"):
                if getattr(model, key) % mesh.dp_shard:
                    raise fail(f"model.{key}", f"{getattr(model, key)} is not divisible by mesh.dp_shard="
                               f"{mesh.dp_shard}; with ep, FSDP shards expert weights on dim 1, which "
                               "fully_shard supports for even sizes only")

    dp = mesh.world_size if placements is not None else mesh.dp_replicate * mesh.dp_shard
    if train.batch_size % dp:
        raise fail("train.batch_size", f"{train.batch_size} is not divisible by the {dp} data-parallel "
                   "ranks; every rank takes an equal slice of the global batch")
    if train.eval_every and data.val_sequences % dp:
        raise fail("data.val_sequences", f"{data.val_sequences} is not divisible by the {dp} data-parallel "
                   "ranks; every rank evaluates an equal slice")
    return RunConfig(name=name, mesh=mesh, model=model, train=train, data=data, qk_clip=qk_clip,
                     compare=compare, muon=muon, placements=placements)


def _check_muon_group_options(muon: MuonSettings, train_table: dict, fail) -> None:
    """[muon]'s group options, checked by the optimizer's own declarations (one home for each
    check), and what does not go with them."""
    from optimizer.settings import GROUP_OPTIONS

    declared = {o.name: o for o in GROUP_OPTIONS}
    for key, value in muon.group_options().items():
        try:
            declared[key].check(value, key, {})
        except ValueError as e:
            raise fail(f"muon.{key}", str(e)) from e
    if muon.dion2_ef_decay is not None and muon.dion2_fraction is None:
        raise fail("muon.dion2_ef_decay", "applies to Dion2 groups only; set [muon] dion2_fraction too, or remove it")
    if muon.dion2_fraction is not None and "momentum" in train_table:
        raise fail("train.momentum", f"does not apply with [muon] dion2_fraction = {muon.dion2_fraction}: a Dion2 "
                   "group has no momentum coefficient (its momentum is the sum M + G); remove it")


def _dataclass_from(cls, values, section: str, fail):
    if not isinstance(values, dict):
        raise fail(section, "must be a table")
    types = {f.name: _expected_types(cls, f) for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in types:
            raise fail(f"{section}.{key}", f"unknown key; expected one of {sorted(types)}")
        expected = types[key]
        # bool is an int subclass: a TOML `true` must not pass as a degree or a size.
        if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
            raise fail(f"{section}.{key}", f"expected {' or '.join(t.__name__ for t in expected)}, "
                       f"got {value!r}")
    return cls(**{k: (float(v) if float in types[k] else v) for k, v in values.items()})


def _expected_types(cls, f: dataclasses.Field) -> tuple[type, ...]:
    if cls is QKClipSettings and f.name == "head_dim":
        return (int,)
    if (cls is CompareConfig and f.name in ("normuon_lr", "dion2_lr")) or (cls is MuonSettings and f.name in MUON_GROUP_OPTIONS):
        return (float, int)
    if isinstance(f.default, bool):
        return (bool,)
    if isinstance(f.default, float):
        return (float, int)  # `lr = 1` in TOML is fine for a float
    return (type(f.default),)


def _parse_plan(table, mesh: MeshConfig, model_args: ModelArgs, fail):
    if not isinstance(table, dict) or not table:
        raise fail("placements", "must be a non-empty table of \"name-glob\" = [placement, ...]")
    ndim = len(mesh.dim_names)
    if ndim == 0:
        raise fail("placements", "needs a mesh with at least one degree > 1")
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Transformer(model_args).named_parameters()}

    plan = []
    for pattern, entries in table.items():
        key = f'placements."{pattern}"'
        if not isinstance(entries, list) or len(entries) != ndim:
            raise fail(key, f"needs a list of {ndim} placements, one per mesh dim {mesh.dim_names}, "
                       f"got {entries!r}")
        try:
            placements = tuple(parse_placement(e) for e in entries)
        except ValueError as e:
            raise fail(key, str(e)) from e
        if not any(fnmatch.fnmatchcase(n, pattern) for n in shapes):
            raise fail(key, "matches no parameter of the model; parameter names look like "
                       "'layers.0.attention.wq.weight'")
        plan.append((pattern, placements))

    # The first matching pattern governs a parameter: check each against its own.
    for n, shape in shapes.items():
        governing = next(((p, pl) for p, pl in plan if fnmatch.fnmatchcase(n, p)), None)
        if governing is None:
            raise fail("placements", f"parameter {n!r} is matched by no pattern; add one, e.g. "
                       "\"*\" = [...] as the last entry")
        pattern, placements = governing
        for p in placements:
            dim = getattr(p, "dim", None)
            if dim is not None and dim >= len(shape):
                raise fail(f'placements."{pattern}"', f"{p!r} shards dim {dim} but {n} has shape "
                           f"{tuple(shape)}; give it its own pattern earlier in the table")
    return tuple(plan)
