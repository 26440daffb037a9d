"""QK-clip's head map: which rows of which weight feed which head, built once from names and shapes.

Kimi K2's MuonClip, per query head ``h`` of a layer with max pre-softmax logit ``S_h`` in the
last forward pass::

    gamma_h = min(1, threshold / S_h)

and after the optimizer update, every weight row that feeds head ``h``'s logit is multiplied by
a power of ``gamma_h`` so that the logit, bilinear in query and key, shrinks by ``gamma_h``:

===========================================  ====================  ===========
row                                          scale                 table slot
===========================================  ====================  ===========
query (MHA/GQA, fused q), MLA q_nope         ``sqrt(gamma_h)``     ``sq[h]``
MLA q_pe (head-specific rotary query)        ``gamma_h``           ``g[h]``
key (MHA/GQA, fused k), MLA k_nope           ``sqrt(gamma_kv)``    ``skv[j]``
value, MLA shared rotary key, MLA latent     ``1`` (untouched)     ``one``
===========================================  ====================  ===========

``gamma_kv`` of key/value head ``j`` is the minimum over the query heads that share it (with
MHA and MLA, one query head each).  MLA's rotary key is shared by all heads, so scaling it would
change every head: Kimi K2 leaves it alone and scales the head's rotary query by the full
``gamma_h`` instead.

**The head map** (:func:`build_head_map`, once per parameter set): names are classified,
everything that can be checked from names and global shapes is checked (pairs, head counts, one
weight per (layer, role), Muon groups only, 2-D), and every clipped weight gets a
:class:`ClipRows`: for each of its global rows, the slot in one step's flat *scale table*
``[sq (all layers' query heads); g (same); skv (all layers' kv heads); 1]``.

The per-step device math that uses this map is in ``step.py``, its checks in ``logits_checks.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..attention_layouts import KEY_PARTS, Part, RowLayout, separate_k_layout, separate_q_layout
from .config import LayerKey, QKClipConfig, classify_qk_param, layer_sort_key

ROLE_WORDS = {"q": "query weight", "k": "key weight", "qkv": "fused query/key/value weight"}


@dataclass(frozen=True)
class QKParam:
    """What the head map needs to know about one optimizer parameter (global, not local, shape)."""

    name: str
    shape: tuple[int, ...]
    use_muon: bool
    group: int


@dataclass(frozen=True, eq=False)
class ClipRows:
    """The static QK-clip record of one weight.

    ``index[r]`` is the scale-table slot of global row ``r`` (see the module docstring); the
    rows of a shard are scaled by ``table[index[global_rows]]``.
    """

    name: str
    layer: LayerKey
    role: str  # "q" | "k" | "qkv"
    layout: RowLayout
    index: Tensor  # int64 [rows], CPU

    def local_index(self, rows: slice | Tensor | None = None, device: torch.device | str | None = None) -> Tensor:
        """Table slots of a shard's rows, in local order, on ``device`` (compute once per placement).

        ``rows`` gives the global row of every local row: a ``slice`` (contiguous shards) or a 1-D
        LongTensor (interleaved rows, e.g. ``_StridedShard``), as ``dtensor_local_indices(p)[0]``
        returns; None for the whole weight.
        """
        n = self.index.numel()
        if rows is None:
            picked = self.index
        elif isinstance(rows, slice):
            start, stop, step = rows.indices(n)
            if (rows.start is not None and not 0 <= rows.start <= n) or (rows.stop is not None and rows.stop > n):
                raise ValueError(f"QK-clip: row slice {rows} is outside the {n} rows of '{self.name}'")
            picked = self.index[start:stop:step]
        elif isinstance(rows, Tensor) and rows.ndim == 1 and not rows.is_floating_point():
            rows_cpu = rows.to("cpu", torch.long)
            if rows_cpu.numel() and (int(rows_cpu.min()) < 0 or int(rows_cpu.max()) >= n):
                raise ValueError(f"QK-clip: row indices of '{self.name}' must lie in [0, {n})")
            picked = self.index[rows_cpu]
        else:
            raise TypeError(f"QK-clip: rows must be None, a slice or a 1-D integer tensor, got {rows!r}")
        return picked.to(device) if device is not None else picked.clone()

    def scales(self, table: Tensor) -> Tensor:
        """Per global row scale for a step's table (tests and debugging; the step uses local_index)."""
        return table[self.index.to(table.device)]


@dataclass(frozen=True, eq=False)
class LayerHeads:
    layer: LayerKey
    n_q_heads: int
    n_kv_heads: int
    weights: tuple[str, ...]
    q_offset: int  # first query slot of this layer in the flat logits
    kv_offset: int


@dataclass(eq=False)
class HeadMap:
    """Everything static about QK-clip for one parameter set: per layer its heads, per clipped weight
    its rows' table slots (see :func:`build_head_map`)."""

    threshold: float
    layers: dict  # LayerKey -> LayerHeads, in layer_sort_key order
    weights: dict  # weight name -> ClipRows
    total_q: int
    total_kv: int
    kv_of_q: Tensor  # int64 [total_q]: flat kv slot of each flat query slot
    layer_of_q: Tensor  # int64 [total_q]: position (in `layers` order) of each query slot's layer
    _on_device: dict = field(default_factory=dict, repr=False)

    @property
    def table_size(self) -> int:
        return 2 * self.total_q + self.total_kv + 1

    def device_tensors(self, device) -> tuple[Tensor, Tensor]:
        """``(kv_of_q, layer_of_q)`` on ``device``, copied once."""
        key = str(torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = (self.kv_of_q.to(device), self.layer_of_q.to(device))
        return self._on_device[key]

    def describe(self) -> str:
        return "; ".join(
            f"layer {h.layer!r}: {h.n_q_heads} query / {h.n_kv_heads} kv heads ({', '.join(h.weights)})"
            for h in self.layers.values()
        )


# --------------------------------------------------------------------------- construction


def build_head_map(
    cfg: QKClipConfig,
    params: Iterable[QKParam | tuple[str, Sequence[int], bool, int]],
    *,
    allow_empty: bool = False,
) -> HeadMap:
    """Classify and check every parameter; raise one ``ValueError`` listing every problem.

    ``params``: every parameter of the optimizer (Muon and AdamW groups), as ``QKParam`` or
    ``(name, global_shape, use_muon, group_index)``.  Pure: the same on every rank that holds the
    same parameters.  Call it after all groups exist (a partial list may lack a weight's pair).
    ``allow_empty=False`` refuses a config that recognises no weight at all (wrong patterns, or
    param groups without ``param_names``).
    """
    infos = [p if isinstance(p, QKParam) else QKParam(p[0], tuple(p[1]), bool(p[2]), int(p[3])) for p in params]
    errors: list[str] = []
    found = _classify_params(infos, cfg, errors)
    if not found and not errors and not allow_empty:
        errors.append(_nothing_recognised(infos, cfg))
    shapes = _layer_shapes(found, cfg, errors)
    if errors:
        raise ValueError("\n".join(errors))
    return _assemble(cfg.threshold, shapes)


def qk_params(params: Sequence) -> list[QKParam]:
    """What the head map needs of every optimizer parameter (``named_params.NamedParam``s): name,
    global shape as Muon reads it, group kind and index."""
    return [QKParam(e.name, tuple(e.shape), bool(e.use_muon), int(e.group)) for e in params]


def _classify_params(infos: list[QKParam], cfg: QKClipConfig, errors: list[str]) -> dict:
    """``{layer: {role: [QKParam]}}`` of the weights QK-clip scales; problems go to ``errors``."""
    found: dict = {}
    for info in infos:
        try:
            role = classify_qk_param(info.name, cfg)
        except ValueError as err:
            errors.append(str(err))
            continue
        if role is None:
            continue
        layer, kind = role
        what = f"layer {layer!r}'s {ROLE_WORDS[kind]}"
        if not info.use_muon:
            errors.append(
                f"QK-clip: '{info.name}' is {what} but sits in an AdamW group (param_groups[{info.group}], "
                "use_muon=False). QK-clip rescales weights Muon updates, and clipping only one side of a "
                "query/key pair would not bound the logit: move it to a Muon group, or have "
                "QKClipConfig.classify return None for this layer's weights to leave the layer unclipped."
            )
        if len(info.shape) != 2:
            errors.append(
                f"QK-clip: '{info.name}' is {what} but has shape {list(info.shape)}; QK-clip scales the rows "
                "of 2-D [out_features, in_features] projection weights. Have QKClipConfig.classify return "
                "None for it if it is not a plain projection weight."
            )
        found.setdefault(layer, {}).setdefault(kind, []).append(info)
    return found


def _nothing_recognised(infos: list[QKParam], cfg: QKClipConfig) -> str:
    names = [i.name for i in infos]
    hint = (
        " The parameters have no names (param groups without 'param_names'): build the groups with "
        "optimizer.get_default_muon_param_groups(model) so QK-clip can recognise q/k weights."
        if names and all(n.startswith("param_groups[") for n in names) else ""
    )
    return (
        f"QK-clip is configured but no parameter was recognised as a query/key weight "
        f"({_pattern_summary(cfg)}; {len(names)} parameters, e.g. {names[:4]}).{hint} Set the patterns "
        "or QKClipConfig.classify to match your model, or drop qk_clip."
    )


def _layer_shapes(found: dict, cfg: QKClipConfig, errors: list[str]) -> dict:
    """``{layer: (n_q, n_kv, [(info, role, layout)])}`` in layer order; problems go to ``errors``."""
    shapes: dict = {}
    for layer in sorted(found, key=layer_sort_key):
        roles = found[layer]
        dup = [(k, v) for k, v in roles.items() if len(v) > 1]
        for kind, infos_k in dup:
            errors.append(
                f"QK-clip: {len(infos_k)} weights are layer {layer!r}'s {ROLE_WORDS[kind]}: "
                f"{[i.name for i in infos_k]}. Each (layer, role) must be exactly one weight, or the later "
                "one would replace the earlier and never be clipped (self- and cross-attention in one block, "
                "or two towers that both have 'layers.N'). Give them distinct layer keys with "
                "QKClipConfig(classify=lambda name: ('encoder.3', 'q') ...), int or str, and key qk_logits "
                "the same way."
            )
        if dup:
            continue
        problem = _pair_problem(layer, roles, cfg)
        if problem:
            errors.append(problem)
            continue
        try:
            shapes[layer] = _layer_layouts(layer, {k: v[0] for k, v in roles.items()}, cfg)
        except ValueError as err:
            errors.append(str(err))
    return shapes


def _pattern_summary(cfg: QKClipConfig) -> str:
    if cfg.classify is not None:
        return "QKClipConfig.classify returned None for every name"
    return f"q_patterns={cfg.q_patterns}, k_patterns={cfg.k_patterns}, qkv_patterns={cfg.qkv_patterns}"


def _pair_problem(layer, roles: dict, cfg: QKClipConfig) -> str | None:
    names = {k: v[0].name for k, v in roles.items()}
    if "qkv" in roles:
        if cfg.mla is not None:
            return (f"QK-clip: '{names['qkv']}' looks like a fused query/key/value weight, but QKClipConfig.mla is "
                    "set; MLA has no fused qkv weight. Adjust qkv_patterns or classify.")
        if cfg.fused_qkv is None:
            return (f"QK-clip: '{names['qkv']}' is layer {layer!r}'s fused query/key/value weight, but "
                    "QKClipConfig.fused_qkv does not say its layout: pass fused_qkv=FusedQKV(n_heads=..., "
                    "n_kv_heads=..., head_dim=..., layout='grouped' (torchtitan) | 'concat' | 'interleaved').")
        if len(roles) > 1:
            others = [n for k, n in names.items() if k != "qkv"]
            return (f"QK-clip: layer {layer!r} has the fused weight '{names['qkv']}' and also {others}; a layer's "
                    "query and key rows must come from one fused weight or from separate q and k weights, not "
                    "both. Give them distinct layer keys with QKClipConfig.classify if they are different "
                    "attentions.")
        return None
    q_word, k_word = ("query weight (wq / wq_b)", "key weight (wkv_b)") if cfg.mla is not None else ("query weight", "key weight")
    if "q" in roles and "k" not in roles:
        return (f"QK-clip: layer {layer!r} has the {q_word} '{names['q']}' but no {k_word} was recognised "
                f"(k_patterns={cfg.k_patterns}). Scaling only W_q shrinks the logit by sqrt(threshold/logit), not "
                "threshold/logit: add the key weight's name component to k_patterns, or return (layer, 'k') for "
                "it from QKClipConfig.classify.")
    if "k" in roles and "q" not in roles:
        return (f"QK-clip: layer {layer!r} has the {k_word} '{names['k']}' but no {q_word} was recognised "
                f"(q_patterns={cfg.q_patterns}). Add the query weight's name component to q_patterns, or "
                "return (layer, 'q') for it from QKClipConfig.classify.")
    return None


def _layer_layouts(layer, roles: dict, cfg: QKClipConfig):
    """``(n_q, n_kv, [(info, role, RowLayout)])`` for one layer, or ValueError naming the weights."""
    if "qkv" in roles:
        info, fused = roles["qkv"], cfg.fused_qkv
        if info.shape[0] != fused.num_rows:
            raise ValueError(
                f"QK-clip: '{info.name}' has {info.shape[0]} rows, but {fused} needs (n_heads + 2 * n_kv_heads) "
                f"* head_dim = {fused.num_rows}; set QKClipConfig.fused_qkv to this layer's head counts."
            )
        return fused.n_heads, fused.n_kv_heads, [(info, "qkv", fused.row_layout())]
    q, k = roles["q"], roles["k"]
    if cfg.mla is not None:
        mla = cfg.mla
        bad = [(i, per) for i, per in ((q, mla.q_head_rows), (k, mla.kv_head_rows)) if i.shape[0] % per]
        if bad:
            raise ValueError("\n".join(
                f"QK-clip: '{i.name}' has {i.shape[0]} rows, not a multiple of {per} "
                f"({'qk_nope_head_dim + qk_rope_head_dim' if i is q else 'qk_nope_head_dim + v_head_dim'} of "
                f"{mla}); set QKClipConfig.mla to this model's head dims." for i, per in bad))
        n_q, n_kv = q.shape[0] // mla.q_head_rows, k.shape[0] // mla.kv_head_rows
        if n_q != n_kv:
            raise ValueError(
                f"QK-clip: layer {layer!r}: '{q.name}' has {n_q} heads of {mla.q_head_rows} rows but '{k.name}' has "
                f"{n_kv} heads of {mla.kv_head_rows} rows; MLA needs the same head count in both. Check "
                "QKClipConfig.mla's head dims."
            )
        return n_q, n_q, [(q, "q", mla.q_layout(n_q)), (k, "k", mla.kv_b_layout(n_q))]
    d = cfg.head_dim
    bad = [i for i in (q, k) if i.shape[0] % d]
    if bad:
        raise ValueError("\n".join(
            f"QK-clip: '{i.name}' has {i.shape[0]} rows, not a multiple of head_dim={d}; set QKClipConfig.head_dim "
            "to the per-head size of the q/k projections (for MLA attention use QKClipConfig(mla=MLAHeads(...)))."
            for i in bad))
    n_q, n_kv = q.shape[0] // d, k.shape[0] // d
    if n_q % n_kv:
        raise ValueError(
            f"QK-clip: layer {layer!r}: '{q.name}' has {n_q} heads and '{k.name}' has {n_kv} heads of head_dim {d}; "
            "the query heads must be a multiple of the key heads (grouped-query attention). Check head_dim (for MLA "
            "attention use QKClipConfig(mla=MLAHeads(...)))."
        )
    return n_q, n_kv, [(q, "q", separate_q_layout(n_q, d, n_kv)), (k, "k", separate_k_layout(n_kv, d, n_q))]


def _table_index(layout: RowLayout, q_off: int, kv_off: int, total_q: int, total_kv: int) -> Tensor:
    """Scale-table slot of every row (see the module docstring for the table)."""
    part, head = layout.part, layout.head
    one = 2 * total_q + total_kv
    index = torch.full_like(part, one)
    half_q = (part == int(Part.Q)) | (part == int(Part.Q_NOPE))
    full_q = part == int(Part.Q_PE)
    half_kv = torch.zeros_like(half_q)
    for p in KEY_PARTS:
        half_kv |= part == int(p)
    index = torch.where(half_q, q_off + head, index)
    index = torch.where(full_q, total_q + q_off + head, index)
    index = torch.where(half_kv, 2 * total_q + kv_off + head, index)
    return index


def _assemble(threshold: float, shapes: dict) -> HeadMap:
    total_q = sum(n_q for n_q, _, _ in shapes.values())
    total_kv = sum(n_kv for _, n_kv, _ in shapes.values())
    layers, weights, kv_of_q, layer_of_q = {}, {}, [], []
    q_off = kv_off = 0
    for pos, (layer, (n_q, n_kv, members)) in enumerate(shapes.items()):
        layers[layer] = LayerHeads(layer, n_q, n_kv, tuple(i.name for i, _, _ in members), q_off, kv_off)
        kv_of_q.append(kv_off + torch.arange(n_q) // (n_q // n_kv))
        layer_of_q.append(torch.full((n_q,), pos, dtype=torch.long))
        for info, role, layout in members:
            index = _table_index(layout, q_off, kv_off, total_q, total_kv)
            weights[info.name] = ClipRows(info.name, layer, role, layout, index)
        q_off, kv_off = q_off + n_q, kv_off + n_kv
    empty = torch.zeros(0, dtype=torch.long)
    return HeadMap(
        threshold=float(threshold), layers=layers, weights=weights, total_q=total_q, total_kv=total_kv,
        kv_of_q=torch.cat(kv_of_q) if kv_of_q else empty, layer_of_q=torch.cat(layer_of_q) if layer_of_q else empty,
    )
