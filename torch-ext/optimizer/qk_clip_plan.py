"""QK-clip as data: a static plan built once from names and shapes, and per-step device math.

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

**Static part** (:func:`build_qk_clip_plan`, once per parameter set): names are classified,
everything that can be checked from names and global shapes is checked (pairs, head counts, one
weight per (layer, role), Muon groups only, 2-D), and every clipped weight gets a
:class:`ClipRows`: for each of its global rows, the slot in one step's flat *scale table*
``[sq (all layers' query heads); g (same); skv (all layers' kv heads); 1]``.

**Per step** (no host synchronisation): :func:`check_step_logits` checks ``qk_logits``'
metadata (keys, shapes, dtypes, devices) and returns messages instead of raising, so the caller
can agree across ranks first; :func:`compute_clip_step` builds the table and a 0-d "some logit is
NaN/+inf" flag on the device in a constant number of kernels; :func:`apply_clip_` scales a local
shard (one gather, one multiply).  The report (:class:`QKClipReport`) keeps device tensors and
reads them only when the user asks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .attention_layouts import KEY_PARTS, Part, RowLayout, separate_k_layout, separate_q_layout
from .qk_clip import LayerKey, QKClipConfig, QKClipReport, classify_qk_param, layer_sort_key

ROLE_WORDS = {"q": "query weight", "k": "key weight", "qkv": "fused query/key/value weight"}


@dataclass(frozen=True)
class QKParam:
    """What the plan needs to know about one optimizer parameter (global, not local, shape)."""

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
class QKClipPlan:
    """Everything static about QK-clip for one parameter set (see :func:`build_qk_clip_plan`)."""

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


def build_qk_clip_plan(
    cfg: QKClipConfig,
    params: Iterable[QKParam | tuple[str, Sequence[int], bool, int]],
    *,
    allow_empty: bool = False,
) -> QKClipPlan:
    """Classify and check every parameter; raise one ``ValueError`` listing every problem.

    ``params``: every parameter of the optimizer (Muon and AdamW groups), as ``QKParam`` or
    ``(name, global_shape, use_muon, group_index)``.  Pure: the same on every rank that holds the
    same parameters.  Call it after all groups exist (a partial list may lack a weight's pair).
    ``allow_empty=False`` refuses a config that recognises no weight at all (wrong patterns, or
    param groups without ``param_names``).
    """
    infos = [p if isinstance(p, QKParam) else QKParam(p[0], tuple(p[1]), bool(p[2]), int(p[3])) for p in params]
    errors: list[str] = []
    found: dict = {}  # layer -> role -> [QKParam]
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
    if not found and not errors and not allow_empty:
        names = [i.name for i in infos]
        hint = (
            " The parameters have no names (param groups without 'param_names'): build the groups with "
            "optimizer.get_default_muon_param_groups(model) so QK-clip can recognise q/k weights."
            if names and all(n.startswith("param_groups[") for n in names) else ""
        )
        errors.append(
            f"QK-clip is configured but no parameter was recognised as a query/key weight "
            f"({_pattern_summary(cfg)}; {len(names)} parameters, e.g. {names[:4]}).{hint} Set the patterns "
            "or QKClipConfig.classify to match your model, or drop qk_clip."
        )

    layers = sorted(found, key=layer_sort_key)
    shapes: dict = {}  # layer -> (n_q, n_kv, [(info, role, layout)])
    for layer in layers:
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
    if errors:
        raise ValueError("\n".join(errors))
    return _assemble(cfg.threshold, shapes)


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


def _assemble(threshold: float, shapes: dict) -> QKClipPlan:
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
    return QKClipPlan(
        threshold=float(threshold), layers=layers, weights=weights, total_q=total_q, total_kv=total_kv,
        kv_of_q=torch.cat(kv_of_q) if kv_of_q else empty, layer_of_q=torch.cat(layer_of_q) if layer_of_q else empty,
    )


# --------------------------------------------------------------------------- step-start checks


def check_step_logits(plan: QKClipPlan | None, qk_logits, device: torch.device | str | None) -> list[str]:
    """Problems with one step's ``qk_logits`` (metadata only: no host synchronisation).

    Returns messages instead of raising, so the caller can agree across ranks first.  Checks:
    a mapping; keys are int/str layer keys; exactly the plan's layers (a layer left out would
    silently go unclipped); per layer a floating 1-D tensor with one value per query head, on
    ``device`` (the device of the weights it clips; None skips that check).
    """
    if qk_logits is None:
        return []
    if plan is None:
        return ["Muon.step: qk_logits was passed but QK-clip is not configured; pass "
                "qk_clip=QKClipConfig(...) to Muon, or stop passing qk_logits."]
    if not isinstance(qk_logits, Mapping):
        return [f"Muon.step: qk_logits must be a dict {{layer: 1-D tensor of per-query-head max logits}}, "
                f"got {type(qk_logits).__name__}"]
    errors = []
    bad_keys = [k for k in qk_logits if isinstance(k, bool) or not isinstance(k, (int, str))]
    if bad_keys:
        return [f"Muon.step: qk_logits keys must be int or str layer keys (as in 'layers.3.' -> 3), got {bad_keys!r}"]
    extra = [k for k in qk_logits if k not in plan.layers]
    missing = [k for k in plan.layers if k not in qk_logits]
    if extra:
        errors.append(
            f"Muon.step: qk_logits has layers {sorted(extra, key=layer_sort_key)} that QK-clip does not know; its "
            f"layers are {list(plan.layers)} ({plan.describe()}). Pass logits only for those layers, or adjust "
            "QKClipConfig patterns/classify."
        )
    if missing:
        errors.append(
            f"Muon.step: qk_logits has no entry for layers {missing}, which would go unclipped; pass every "
            f"layer's per-head max logits ({len(plan.layers)} layers), or leave a layer out of QK-clip with "
            "QKClipConfig.classify returning None for its weights."
        )
    want_device = None if device is None else torch.device(device)
    for layer, heads in plan.layers.items():
        if layer not in qk_logits:
            continue
        t = qk_logits[layer]
        where = f"qk_logits[{layer!r}] (for {', '.join(repr(w) for w in heads.weights)})"
        if not isinstance(t, Tensor):
            errors.append(f"Muon.step: {where} must be a 1-D tensor of {heads.n_q_heads} per-query-head max "
                          f"logits, got {type(t).__name__}")
            continue
        if t.ndim != 1 or t.numel() != heads.n_q_heads:
            errors.append(
                f"Muon.step: {where} has shape {tuple(t.shape)}, but the layer has {heads.n_q_heads} query heads; "
                f"pass a 1-D tensor of length {heads.n_q_heads}, each query head's max attention logit (max over "
                "batch and positions, max-reduced over data-parallel ranks and gathered over tensor-parallel "
                "ranks: optimizer.max_logits.gather_max_logits)."
            )
            continue
        if not t.is_floating_point():
            errors.append(f"Muon.step: {where} has dtype {t.dtype}; pass floating-point logits")
        elif t.device.type == "meta":
            errors.append(f"Muon.step: {where} is on the meta device and holds no values; pass the logits "
                          "computed in the forward pass")
        elif want_device is not None and not _same_device(t.device, want_device):
            errors.append(f"Muon.step: {where} is on {t.device} but the weights it clips are on {want_device}; "
                          "keep the logits on the weights' device (moving them would synchronise the host)")
    return errors


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_layer_gradients(plan: QKClipPlan, has_grad: Mapping[str, bool]) -> tuple[list[str], tuple]:
    """Which layers to clip this step, given which clipped weights have a gradient.

    Rule: a layer is clipped when every one of its clipped weights has a gradient; a layer none of
    whose weights has a gradient is skipped (it was not trained this step, like any parameter
    without a gradient, and is listed in the report's ``skipped_layers``); a layer where some do
    and some do not is an error, because scaling one side of the logit would not bound it (a
    frozen ``wq`` with a trained ``wk``: freeze or train both, or leave the layer out of QK-clip).
    Returns ``(errors, active_layers)``.  ``has_grad`` must be agreed across ranks.
    """
    errors, active = [], []
    for layer, heads in plan.layers.items():
        flags = {w: bool(has_grad.get(w, False)) for w in heads.weights}
        if all(flags.values()):
            active.append(layer)
        elif any(flags.values()):
            with_grad = [w for w, f in flags.items() if f]
            without = [w for w, f in flags.items() if not f]
            errors.append(
                f"Muon.step: QK-clip must scale layer {layer!r}'s query and key weights together, but {without} "
                f"have no gradient this step while {with_grad} do. Give both a gradient (use them in the forward, "
                "or zero_grad(set_to_none=False)), freeze both, or leave the layer out of QK-clip via "
                "QKClipConfig.classify."
            )
    return errors, tuple(active)


# --------------------------------------------------------------------------- per-step device math


@dataclass(eq=False)
class ClipStep:
    """One step's QK-clip values, all on the device."""

    table: Tensor  # [plan.table_size] float32 scale table
    nonfinite: Tensor  # 0-d bool: some logit is NaN or +inf (the caller agrees on it, then raises)
    flat_logits: Tensor  # [plan.total_q] float32, the step's logits in plan order (for agreement digests)
    report: QKClipReport


def gamma(logits: Tensor, threshold: float) -> Tensor:
    """``min(1, threshold / logit)`` per head, never NaN/inf: heads at or under the threshold, and
    NaN / +inf logits (which the caller reports as errors), get 1; ``logit <= 0`` and ``-inf``
    (nothing attended) are under any positive threshold."""
    logits = logits.float()
    over = clipped_heads(logits, threshold)
    return torch.where(over, threshold / torch.where(over, logits, threshold), 1.0)


def clipped_heads(logits: Tensor, threshold: float) -> Tensor:
    """Bool per head: the head is clipped (a finite logit over the threshold)."""
    return (logits > threshold) & torch.isfinite(logits)


def nonfinite_flag(logits: Tensor) -> Tensor:
    """0-d bool device tensor: some logit is NaN or +inf (``-inf`` means nothing was attended: fine)."""
    return (torch.isnan(logits) | torch.isposinf(logits)).any()


def compute_clip_step(
    plan: QKClipPlan,
    qk_logits: Mapping,
    device: torch.device | str,
    *,
    skipped_layers: Sequence = (),
) -> ClipStep:
    """The step's scale table, NaN/+inf flag and (lazy) report, from checked ``qk_logits``.

    A constant number of kernels whatever the number of layers, and no host synchronisation.
    Call :func:`check_step_logits` first.
    """
    kv_of_q, layer_of_q = plan.device_tensors(device)
    flat = torch.cat([qk_logits[layer].detach().reshape(-1).float() for layer in plan.layers]
                     or [torch.zeros(0, device=device)])
    g = gamma(flat, plan.threshold)
    g_kv = torch.ones(plan.total_kv, device=flat.device).scatter_reduce_(0, kv_of_q, g, "amin")
    table = torch.cat([g.sqrt(), g, g_kv.sqrt(), torch.ones(1, device=flat.device)])
    clipped = clipped_heads(flat, plan.threshold).float()
    n_layers = len(plan.layers)
    counts = torch.zeros(n_layers, device=flat.device).index_add_(0, layer_of_q, clipped)
    maxima = torch.full((n_layers,), float("-inf"), device=flat.device).scatter_reduce_(0, layer_of_q, flat, "amax")
    skipped = tuple(layer for layer in plan.layers if layer in set(skipped_layers))
    report = QKClipReport.lazy(plan.threshold, tuple(plan.layers), counts, maxima, skipped_layers=skipped)
    return ClipStep(table=table, nonfinite=nonfinite_flag(flat), flat_logits=flat, report=report)


def apply_clip_(local_weight: Tensor, table: Tensor, local_index: Tensor) -> None:
    """Scale a weight's local rows in place: ``local_weight[i] *= table[local_index[i]]``.

    ``local_index`` from :meth:`ClipRows.local_index` (on the weight's device).  Two kernels; the
    product is computed in float32 and rounded once to the weight's dtype.  Rows whose slot is the
    table's ``1`` are bit-identical afterwards.
    """
    if local_weight.shape[0] != local_index.numel():
        raise ValueError(
            f"apply_clip_: {local_index.numel()} row slots for a local weight with {local_weight.shape[0]} rows"
        )
    if local_index.numel() == 0:
        return
    local_weight.mul_(table[local_index].view(-1, *([1] * (local_weight.ndim - 1))))


def describe_nonfinite(qk_logits: Mapping) -> str:
    """The error for NaN/+inf logits, naming the layers (reads the logits: call only to raise)."""
    bad = [layer for layer, t in qk_logits.items()
           if isinstance(t, Tensor) and bool(nonfinite_flag(t))]
    where = f"qk_logits{bad}" if bad else "qk_logits on another rank"
    return (f"Muon.step: {where} contain NaN or +inf; the forward pass diverged or the max was taken over "
            "uninitialised values. Pass finite per-head max logits (-inf, nothing attended, is fine).")
