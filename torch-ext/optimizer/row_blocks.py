"""Split orthogonalisation: row blocks of one weight that Muon orthogonalises as separate matrices.

A fused ``wqkv`` is three projections in one tensor, and Muon orthogonalising it as one matrix
couples them (the update's singular directions mix q, k and v).  Declaring row blocks makes Muon
orthogonalise each block on its own, exactly as if the weights were separate; per-head blocks
orthogonalise every head on its own (per-head Muon).

How a user declares it: a Muon param group key ``"muon_row_blocks"``, whose value is either one
spec for every parameter of the group or a dict ``{param_name: spec}`` (named groups).  A spec is

* ``"heads:<d>"`` (or :class:`HeadBlocks(d)`): blocks of ``d`` consecutive rows (one head each);
* ``"blocks:<r1>,<r2>,..."`` (or :class:`RowBlockSizes((r1, r2, ...))`): consecutive blocks of
  these sizes, in order (e.g. ``"blocks:1408,1408"`` for a fused ``[gate; up]`` projection);
* a :class:`~optimizer.attention_layouts.FusedQKV`: three blocks, the q, k and v rows, each in
  head order (what the separate ``wq``/``wk``/``wv`` would hold);
* :class:`SplitQKV(fused, per_head=True)`: every q, k and v head its own block;
* a callable ``(name, shape) -> sequence of blocks`` (slices or LongTensors of global rows
  that partition the rows).  Callables cannot be saved in a checkpoint.

A 3-D weight ``[E, R, C]`` (stacked MoE experts) takes the same specs: they describe the rows of
each expert's ``[R, C]`` matrix, and every expert is split the same way (a callable receives
``(name, (R, C))``).

**Plain forms.**  Param groups end up in ``optimizer.state_dict()``, and Hugging Face's Trainer
reads ``optimizer.pt`` back with ``torch.load(weights_only=True)``, which refuses any class it does
not know (``Unsupported global``).  Every spec except a callable therefore has a plain form, a
string (:func:`spec_to_plain`; :func:`parse_spec` reads both forms, and the two forms of a spec
compare equal after parsing, so a checkpoint written with either loads into an optimizer
declaring the other):

==========================================  ================================================
spec                                        plain form
==========================================  ================================================
``HeadBlocks(64)``                          ``"heads:64"``
``RowBlockSizes((8, 8))``                   ``"blocks:8,8"``
``FusedQKV(8, 2, 64, "grouped")``           ``"fused_qkv:8,2,64,grouped"``
``SplitQKV(FusedQKV(...), per_head=True)``  ``"split_qkv:8,2,64,grouped,per_head"``
==========================================  ================================================

``Muon.state_dict()`` saves a group's value as a list, one plain form (or None) per parameter of
the group, in its order (:func:`row_blocks_for_checkpoint`): one string leaf per parameter, so
that torch.distributed.checkpoint, which loads by matching keys, finds the same keys whatever
the blocks are (and named and unnamed groups save alike), and the loader can compare them.  Checkpoints written before the plain forms,
which hold the dataclass objects, still parse (load them with ``weights_only=False``).

Blocks of equal shape are orthogonalised in one batched call (``rule.orthogonalize_in_blocks``).
The learning-rate adjustment uses each block's own shape: the rule multiplies block ``b``'s
orthogonalised update by ``adjust_lr(1, shape_b) / adjust_lr(1, full_shape)``, so that the caller
applies the whole matrix's adjusted lr as usual and every block ends up with its own: with
``"match_rms_adamw"`` a ``[128, 4096]`` head of a ``[12288, 4096]`` weight is multiplied by
``sqrt(4096 / 12288)``, so its effective factor is ``0.2 * sqrt(4096)``, as for a separate
``[128, 4096]`` matrix.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .attention_layouts import FusedQKV, Part

ROW_BLOCKS_KEY = "muon_row_blocks"
_ROW_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_HEADS_RE = re.compile(r"^heads:(\d+)$")
_BLOCKS_RE = re.compile(r"^blocks:(\d+(?:,\d+)*)$")
_QKV_RE = re.compile(r"^(fused_qkv|split_qkv):(\d+),(\d+),(\d+),(\w+)(,per_head)?$")
_SPEC_FORMS = (
    "'heads:<head_dim>', 'blocks:<r1>,<r2>,...', 'fused_qkv:<n_heads>,<n_kv_heads>,<head_dim>,<layout>', "
    "'split_qkv:...[,per_head]', HeadBlocks(d), RowBlockSizes((r1, ...)), FusedQKV(...), "
    "SplitQKV(FusedQKV(...), per_head=True), a callable (name, shape) -> blocks, or None"
)


@dataclass(frozen=True)
class HeadBlocks:
    """Blocks of ``head_dim`` consecutive rows (``"heads:<head_dim>"``)."""

    head_dim: int

    def __post_init__(self):
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"HeadBlocks: head_dim must be a positive int, got {self.head_dim!r}")


@dataclass(frozen=True)
class RowBlockSizes:
    """Consecutive blocks of these row counts, in order (``"blocks:<r1>,<r2>,..."``).

    E.g. a Hugging Face MoE ``gate_up_proj`` ``[E, 2 * I, H]`` holds each expert's gate rows then
    its up rows: ``RowBlockSizes((I, I))`` orthogonalises them as the two matrices a dense MLP's
    ``gate_proj`` and ``up_proj`` are.
    """

    sizes: tuple[int, ...]

    def __post_init__(self):
        sizes = tuple(self.sizes) if isinstance(self.sizes, (tuple, list)) else None
        if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
            raise ValueError(f"RowBlockSizes: sizes must be a non-empty sequence of positive ints, got {self.sizes!r}")
        object.__setattr__(self, "sizes", sizes)


@dataclass(frozen=True)
class SplitQKV:
    """The q, k and v rows of a fused weight as blocks; with ``per_head`` every head its own."""

    fused: FusedQKV
    per_head: bool = False

    def __post_init__(self):
        if not isinstance(self.fused, FusedQKV):
            raise ValueError(f"SplitQKV: fused must be a FusedQKV, got {self.fused!r}")


@dataclass(frozen=True, eq=False)
class BlockClass:
    """Blocks of one shape: ``count`` blocks of ``rows_per_block`` rows, ``rows`` concatenated."""

    rows: Tensor  # int64 [count * rows_per_block], block-major
    count: int
    rows_per_block: int


@dataclass(eq=False)
class RowBlocks:
    """A partition of a weight's rows into blocks, grouped by shape for batching.

    For a 3-D ``[E, R, C]`` weight it partitions the ``R`` rows of every expert's matrix.
    """

    num_rows: int
    blocks: tuple  # of slice | LongTensor, in declaration order
    classes: tuple  # of BlockClass
    _on_device: dict = field(default_factory=dict, repr=False)

    @property
    def shapes(self) -> list[int]:
        return [c.rows_per_block for c in self.classes for _ in range(c.count)]

    def rows_of_each(self) -> list[Tensor]:
        """Each block's global rows (int64, CPU), in declaration order (Dion2 steps every block as its own matrix)."""
        return [torch.arange(*b.indices(self.num_rows)) if isinstance(b, slice) else b.to("cpu", torch.long)
                for b in self.blocks]

    def class_rows(self, device) -> list[Tensor]:
        key = str(torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = [c.rows.to(device) for c in self.classes]
        return self._on_device[key]


def _parse_qkv(match: re.Match, where: str):
    kind, n_heads, n_kv, head_dim, layout, per_head = match.groups()
    try:
        fused = FusedQKV(int(n_heads), int(n_kv), int(head_dim), layout)
    except ValueError as err:
        raise ValueError(f"{where}: {ROW_BLOCKS_KEY} spec {match.string!r}: {err}") from None
    if kind == "fused_qkv":
        if per_head:
            raise ValueError(f"{where}: {ROW_BLOCKS_KEY} spec {match.string!r}: per_head belongs to split_qkv")
        return fused
    return SplitQKV(fused, per_head=bool(per_head))


def parse_spec(spec, where: str):
    """Normalise a user spec, in either form (see the module docstring); None means "whole matrix".

    Returns None, a :class:`HeadBlocks`, :class:`RowBlockSizes`, ``FusedQKV``, :class:`SplitQKV`
    or the callable itself, so that the plain and the object form of one spec compare equal.
    """
    if spec is None or isinstance(spec, (HeadBlocks, RowBlockSizes, SplitQKV, FusedQKV)):
        return spec
    if isinstance(spec, str):
        text = spec.strip()
        m = _HEADS_RE.match(text)
        if m and int(m.group(1)) > 0:
            return HeadBlocks(int(m.group(1)))
        m = _BLOCKS_RE.match(text)
        if m and all(int(s) > 0 for s in m.group(1).split(",")):
            return RowBlockSizes(tuple(int(s) for s in m.group(1).split(",")))
        m = _QKV_RE.match(text)
        if m:
            return _parse_qkv(m, where)
    elif callable(spec) and not isinstance(spec, Mapping):
        return spec
    raise ValueError(f"{where}: {ROW_BLOCKS_KEY} spec {spec!r} is not understood; use {_SPEC_FORMS}")


def spec_to_plain(spec, where: str = "spec_to_plain"):
    """The plain form of a spec (strings, ints and bools only), which ``torch.load(weights_only=True)``
    reads: ``HeadBlocks(16) -> "heads:16"``, ``RowBlockSizes((8, 8)) -> "blocks:8,8"``, ``FusedQKV`` /
    ``SplitQKV`` -> ``"fused_qkv:..."`` / ``"split_qkv:..."``.  None stays None; a callable raises
    ``ValueError``: it cannot be saved, pass it again when loading."""
    spec = parse_spec(spec, where)
    if spec is None:
        return None
    if isinstance(spec, HeadBlocks):
        return f"heads:{spec.head_dim}"
    if isinstance(spec, RowBlockSizes):
        return "blocks:" + ",".join(str(s) for s in spec.sizes)
    if isinstance(spec, (FusedQKV, SplitQKV)):
        fused = spec if isinstance(spec, FusedQKV) else spec.fused
        kind = "fused_qkv" if isinstance(spec, FusedQKV) else "split_qkv"
        per_head = ",per_head" if isinstance(spec, SplitQKV) and spec.per_head else ""
        return f"{kind}:{fused.n_heads},{fused.n_kv_heads},{fused.head_dim},{fused.layout}{per_head}"
    raise ValueError(
        f"{where}: a callable {ROW_BLOCKS_KEY} spec ({spec!r}) has no plain form and cannot be saved in a "
        "checkpoint; use a 'heads:'/'blocks:' string or a FusedQKV/SplitQKV, or pass the callable again when loading"
    )


def row_blocks_to_plain(group_value, where: str = ROW_BLOCKS_KEY):
    """A group's ``muon_row_blocks`` value (one spec, or ``{param_name: spec}``) in plain form."""
    if isinstance(group_value, Mapping):
        return {name: spec_to_plain(v, f"{where} '{name}'") for name, v in group_value.items()}
    return spec_to_plain(group_value, where)


def row_blocks_for_checkpoint(group_value, names: Sequence[str]) -> list:
    """``[plain spec or None]``, one per parameter of a group in its order (module docstring); a
    callable spec stays the callable (it has no plain form: pass it again when loading)."""
    out = []
    for name in names:
        spec = parse_spec(group_value.get(name) if isinstance(group_value, Mapping) else group_value, f"'{name}'")
        out.append(spec if callable(spec) else spec_to_plain(spec))
    return out


def from_checkpoint(saved_value, names: Sequence[str]):
    """A checkpoint's ``muon_row_blocks`` as a group value: the per-parameter list
    :func:`row_blocks_for_checkpoint` writes becomes ``{name: spec}``; older forms pass through."""
    if isinstance(saved_value, (list, tuple)):
        if len(saved_value) != len(names):
            raise ValueError(f"the checkpoint lists {len(saved_value)} {ROW_BLOCKS_KEY} entries for {len(names)} parameters")
        return dict(zip(names, saved_value))
    return saved_value


def spec_for(group_value, name: str, where: str):
    """The spec for one parameter from a group's ``muon_row_blocks`` value (spec or {name: spec})."""
    if isinstance(group_value, Mapping):
        return parse_spec(group_value.get(name), f"{where} '{name}'")
    return parse_spec(group_value, f"{where} '{name}'")


def check_group_row_blocks(group_value, names: Sequence[str], where: str) -> None:
    """A dict value must only name parameters of the group (a typo would silently not split); a
    list (a checkpoint's, :func:`row_blocks_for_checkpoint`) holds one spec per parameter."""
    if isinstance(group_value, (list, tuple)):
        for i, v in enumerate(group_value):
            parse_spec(v, f"{where} [{i}]")
        return
    if isinstance(group_value, Mapping):
        known = set(names)
        unknown = [k for k in group_value if k not in known]
        if unknown:
            raise ValueError(
                f"{where}: {ROW_BLOCKS_KEY} names {unknown}, which are not parameters of this group "
                f"(its param_names: {list(names)[:8]}{' ...' if len(names) > 8 else ''})"
            )
        for k, v in group_value.items():
            parse_spec(v, f"{where} '{k}'")
    else:
        parse_spec(group_value, where)


def row_blocks_mismatch(saved_value, live_value, names: Sequence[str], where: str) -> str | None:
    """What differs between a checkpoint group's ``muon_row_blocks`` and a live group's, or None.

    Row blocks change what Muon computes but not the shape of any state, so a checkpoint written
    with other blocks would load without complaint and go on orthogonalising differently.  Specs
    are compared per parameter after normalising (``"heads:64"`` equals ``HeadBlocks(64)``, a
    plain ``{"kind": "fused_qkv", ...}`` dict equals its ``FusedQKV``); a checkpoint without the
    key declared none.
    """
    for name in names:
        saved = spec_for(saved_value, name, f"checkpoint {where}")
        live = spec_for(live_value, name, where)
        if saved != live:
            return (
                f"'{name}' was orthogonalised with {ROW_BLOCKS_KEY}={saved!r} in the checkpoint but this "
                f"optimizer declares {live!r}; build the optimizer with the checkpoint's {ROW_BLOCKS_KEY} "
                "(blocks are part of the model's layout, not a hyperparameter to change on resume)"
            )
    return None


def resolve_row_blocks(spec, name: str, global_shape: Sequence[int]) -> RowBlocks | None:
    """The row blocks of one weight (None: orthogonalise the whole matrix).  Pure; raises
    ``ValueError`` naming ``name`` when the spec does not fit the shape.

    ``global_shape`` is ``[R, C]``, or ``[E, R, C]`` for stacked experts: then the blocks partition
    the ``R`` rows of each expert's matrix (the spec resolves on the last two dims).
    """
    spec = parse_spec(spec, f"'{name}'")
    if spec is None:
        return None
    shape = tuple(int(s) for s in global_shape)
    if len(shape) not in (2, 3):
        raise ValueError(
            f"'{name}': {ROW_BLOCKS_KEY} needs a 2-D weight [out, in] or a 3-D stack of expert weights "
            f"[E, out, in], got shape {list(shape)}"
        )
    matrix = shape[-2:]
    rows = matrix[0]
    if isinstance(spec, HeadBlocks):
        if rows % spec.head_dim:
            raise ValueError(f"'{name}' has {rows} rows, not a multiple of the block size {spec.head_dim} "
                             f"({ROW_BLOCKS_KEY}='heads:{spec.head_dim}')")
        blocks = [slice(s, s + spec.head_dim) for s in range(0, rows, spec.head_dim)]
    elif isinstance(spec, RowBlockSizes):
        if sum(spec.sizes) != rows:
            raise ValueError(
                f"'{name}' has {rows} rows{' per expert' if len(shape) == 3 else ''} but "
                f"{ROW_BLOCKS_KEY}='blocks:{','.join(map(str, spec.sizes))}' covers {sum(spec.sizes)}"
            )
        starts = [sum(spec.sizes[:i]) for i in range(len(spec.sizes))]
        blocks = [slice(s, s + n) for s, n in zip(starts, spec.sizes)]
    elif isinstance(spec, (FusedQKV, SplitQKV)):
        fused = spec if isinstance(spec, FusedQKV) else spec.fused
        if rows != fused.num_rows:
            raise ValueError(f"'{name}' has {rows} rows but {fused} has {fused.num_rows}; fix the FusedQKV head counts")
        layout = fused.row_layout()
        per_head = isinstance(spec, SplitQKV) and spec.per_head
        blocks = []
        for part, n in ((Part.Q, fused.n_heads), (Part.K, fused.n_kv_heads), (Part.V, fused.n_kv_heads)):
            if per_head:
                blocks += [_as_block(layout.rows(part, h)) for h in range(n)]
            else:
                blocks.append(_as_block(layout.rows(part)))
    else:
        blocks = _call_spec(spec, name, matrix)
    return compile_blocks(blocks, rows, name)


def _call_spec(spec, name: str, matrix: tuple[int, int]) -> list:
    """A callable spec's blocks; whatever it raises, or a result that is not a sequence, is a
    ValueError naming the parameter (the same at ``add_param_group`` and at a step, where every
    rank must see a refusal of the same kind to agree on it)."""
    try:
        blocks = spec(name, matrix)
    except Exception as err:  # noqa: BLE001 - the user's function: say whose and where
        raise ValueError(f"'{name}': the callable {ROW_BLOCKS_KEY} spec {spec!r} raised {type(err).__name__}: {err} "
                         f"(called with ({name!r}, {matrix}))") from err
    if isinstance(blocks, (str, bytes, Mapping, Tensor)) or not isinstance(blocks, (Sequence, Iterator)):
        raise ValueError(f"'{name}': the callable {ROW_BLOCKS_KEY} spec {spec!r} returned {blocks!r}; it must return "
                         "a sequence of blocks (slices or 1-D LongTensors of global rows) that partition the "
                         f"{matrix[0]} rows")
    return list(blocks)


def _as_block(rows: Tensor) -> slice | Tensor:
    """A slice when the rows are consecutive (views instead of gathers), else the LongTensor."""
    if rows.numel() and int(rows[-1]) - int(rows[0]) + 1 == rows.numel():
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


def _int_slice(b) -> bool:
    ends = (b.start, b.stop, b.step) if isinstance(b, slice) else ()
    return isinstance(b, slice) and b.step != 0 and all(v is None or isinstance(v, int) for v in ends)


def compile_blocks(blocks: Sequence, num_rows: int, name: str = "weight") -> RowBlocks:
    """Check that ``blocks`` partition ``range(num_rows)`` and group them by size."""
    as_rows = []
    for i, b in enumerate(blocks):
        if _int_slice(b):
            start, stop, step = b.indices(num_rows)
            r = torch.arange(start, stop, step)
        elif isinstance(b, Tensor) and b.ndim == 1 and b.dtype in _ROW_DTYPES:
            r = b.to("cpu", torch.long)
        else:
            raise ValueError(f"'{name}': row block {i} must be a slice of ints (step not 0) or a 1-D integer "
                             f"tensor of global rows, got {b!r}")
        if r.numel() == 0:
            raise ValueError(f"'{name}': row block {i} is empty")
        as_rows.append(r)
    every = torch.cat(as_rows) if as_rows else torch.zeros(0, dtype=torch.long)
    if every.numel() and (int(every.min()) < 0 or int(every.max()) >= num_rows):
        raise ValueError(f"'{name}': row blocks name rows outside [0, {num_rows})")
    counts = torch.bincount(every, minlength=num_rows)
    if not bool((counts == 1).all()):
        missing, twice = int((counts == 0).sum()), int((counts > 1).sum())
        raise ValueError(
            f"'{name}': row blocks must cover each of the {num_rows} rows exactly once ({missing} rows in no block, "
            f"{twice} in more than one)"
        )
    by_size: dict[int, list[Tensor]] = {}
    for r in as_rows:
        by_size.setdefault(r.numel(), []).append(r)
    classes = tuple(BlockClass(torch.cat(rs), len(rs), size) for size, rs in by_size.items())
    return RowBlocks(num_rows=num_rows, blocks=tuple(blocks), classes=classes)
