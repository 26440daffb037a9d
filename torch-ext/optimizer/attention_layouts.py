"""Which rows of an attention projection weight are which head, and which part of it.

A linear layer's weight is ``[out, in]``; output feature ``r`` is produced by row ``r``, and the
attention module reshapes those features into heads.  How it does so differs between models:

* separate weights (``wq``, ``wk``, ``wv``): rows are ``heads x head_dim``, head-major;
* fused QKV weights (one ``wqkv``), in three layouts (:class:`FusedQKV`);
* MLA (DeepSeek-V3 / Kimi K2, :class:`MLAHeads`): per head, a query part without rotary
  embedding and one with it; per head a key part and a value part in ``wkv_b``; and one rotary
  key shared by all heads at the end of ``wkv_a``.

A :class:`RowLayout` records, for every *global* row of one weight, its :class:`Part` and its head
(the query head for query parts, the key/value head for key and value parts).  QK-clip turns
that into per-row scales (``qk_clip/head_map.py``); split orthogonalisation turns it into row blocks
(``row_blocks.py``).  Everything here is pure: shapes and integers in, CPU LongTensors out.

Head ``h`` of ``n_q`` query heads uses key/value head ``h // (n_q // n_kv)`` (grouped-query
attention as ``repeat_interleave`` / SDPA's ``enable_gqa`` / torchtitan / Hugging Face do it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

FUSED_QKV_LAYOUTS = ("grouped", "concat", "interleaved")


class Part(IntEnum):
    """What a weight row computes."""

    Q = 0  #: query, head-specific (MHA/GQA, rotary applied to the whole head)
    Q_NOPE = 1  #: MLA query, head-specific, no rotary embedding
    Q_PE = 2  #: MLA query, head-specific, rotary embedding
    K = 3  #: key of one key/value head (MHA/GQA)
    K_NOPE = 4  #: MLA key, head-specific, no rotary embedding (rows of ``wkv_b``)
    K_PE_SHARED = 5  #: MLA rotary key shared by every head (last rows of ``wkv_a``)
    V = 6  #: value of one key/value head
    LATENT = 7  #: MLA compressed key/value (first rows of ``wkv_a``), no head


KEY_PARTS = (Part.K, Part.K_NOPE)


@dataclass(frozen=True, eq=False)
class RowLayout:
    """Per global row of one weight: its part and its head (``-1`` for rows of no head).

    ``part[r]`` holds a :class:`Part` value; ``head[r]`` is a query head for query parts and a
    key/value head for key and value parts.  ``n_q_heads`` / ``n_kv_heads`` are the heads of the
    attention the weight belongs to (not only those present in this weight).
    """

    part: Tensor
    head: Tensor
    n_q_heads: int
    n_kv_heads: int

    def __post_init__(self):
        if self.part.shape != self.head.shape or self.part.ndim != 1:
            raise ValueError("RowLayout: part and head must be 1-D tensors of one entry per row")

    @property
    def num_rows(self) -> int:
        return self.part.numel()

    def rows(self, part: Part | int, head: int | None = None) -> Tensor:
        """Global rows of ``part`` (of one ``head`` if given), in ascending order."""
        keep = self.part == int(part)
        if head is not None:
            keep &= self.head == head
        return keep.nonzero().flatten()


def _layout(parts: list[tuple[Part, Tensor]], n_q: int, n_kv: int) -> RowLayout:
    """Assemble a layout from ``[rows_shape]``-shaped (part, head) grids flattened row-major."""
    part = torch.cat([torch.full((h.numel(),), int(p), dtype=torch.long) for p, h in parts])
    head = torch.cat([h.reshape(-1).long() for _, h in parts])
    return RowLayout(part=part, head=head, n_q_heads=n_q, n_kv_heads=n_kv)


def _heads_grid(n_heads: int, size: int) -> Tensor:
    """``[n_heads, size]`` grid of head indices (row-major: head h's ``size`` rows together)."""
    return torch.arange(n_heads).repeat_interleave(size)


def _check_pos_int(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")
    return value


# --------------------------------------------------------------------------- separate weights


def separate_q_layout(n_heads: int, head_dim: int, n_kv_heads: int | None = None) -> RowLayout:
    """A query weight ``[n_heads * head_dim, in]`` (``wq``, ``q_proj``)."""
    return _layout([(Part.Q, _heads_grid(n_heads, head_dim))], n_heads, n_kv_heads or n_heads)


def separate_k_layout(n_kv_heads: int, head_dim: int, n_q_heads: int | None = None) -> RowLayout:
    """A key weight ``[n_kv_heads * head_dim, in]`` (``wk``, ``k_proj``)."""
    return _layout([(Part.K, _heads_grid(n_kv_heads, head_dim))], n_q_heads or n_kv_heads, n_kv_heads)


# --------------------------------------------------------------------------- fused QKV


@dataclass(frozen=True)
class FusedQKV:
    """A fused ``[(n_heads + 2 * n_kv_heads) * head_dim, in]`` query/key/value weight.

    Args:
        n_heads: query heads (global, before tensor parallelism).
        n_kv_heads: key/value heads; must divide ``n_heads``.
        head_dim: rows per head (the same for q, k and v).
        layout: how the rows are ordered:

            * ``"grouped"`` (torchtitan's ``FusedQKVLinear.wqkv``, Megatron-LM's GQA
              ``linear_qkv``): per key/value group ``g``, its ``n_heads // n_kv_heads`` query
              heads, then key head ``g``, then value head ``g`` — the weight viewed as
              ``[n_kv_heads, n_heads // n_kv_heads + 2, head_dim, in]``.  Column-wise tensor
              parallelism over whole groups keeps every rank's q, k and v together.
            * ``"concat"``: ``[Q; K; V]``, all query heads, then all key heads, then all value
              heads (``torch.cat([wq, wk, wv])``; many Hugging Face ``qkv_proj``).
            * ``"interleaved"`` (GPT-NeoX ``query_key_value``): per head ``h``, query ``h``, key
              ``h``, value ``h``.  Multi-head attention only (``n_kv_heads == n_heads``); with
              grouped-query attention use ``"grouped"``, which it equals when the counts match.
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    layout: str = "grouped"

    def __post_init__(self):
        for name in ("n_heads", "n_kv_heads", "head_dim"):
            _check_pos_int("FusedQKV", name, getattr(self, name))
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"FusedQKV: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}; "
                "every key/value head must serve the same number of query heads"
            )
        if self.layout not in FUSED_QKV_LAYOUTS:
            raise ValueError(f"FusedQKV: layout must be one of {FUSED_QKV_LAYOUTS}, got {self.layout!r}")
        if self.layout == "interleaved" and self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"FusedQKV: layout='interleaved' (per head q, k, v) needs n_kv_heads == n_heads, got "
                f"{self.n_kv_heads} and {self.n_heads}; grouped-query fused weights (torchtitan, Megatron) "
                "use layout='grouped'"
            )

    @property
    def num_rows(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def heads_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    def row_layout(self) -> RowLayout:
        n_q, n_kv, d, g = self.n_heads, self.n_kv_heads, self.head_dim, self.heads_per_kv
        if self.layout == "concat":
            return _layout(
                [(Part.Q, _heads_grid(n_q, d)), (Part.K, _heads_grid(n_kv, d)), (Part.V, _heads_grid(n_kv, d))],
                n_q, n_kv,
            )
        # grouped (interleaved is grouped with one query head per group): [n_kv, g + 2, d]
        slot = torch.arange(g + 2)[None, :, None].expand(n_kv, g + 2, d)
        group = torch.arange(n_kv)[:, None, None].expand(n_kv, g + 2, d)
        part = torch.where(slot < g, int(Part.Q), torch.where(slot == g, int(Part.K), int(Part.V)))
        head = torch.where(slot < g, group * g + slot, group)
        return RowLayout(part=part.reshape(-1).long(), head=head.reshape(-1).long(), n_q_heads=n_q, n_kv_heads=n_kv)


# --------------------------------------------------------------------------- MLA


@dataclass(frozen=True)
class MLAHeads:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) head sizes, as torchtitan names them.

    ``wq`` (no query LoRA) or ``wq_b`` (after ``wq_a`` and ``q_norm``) has ``n_heads x
    (qk_nope_head_dim + qk_rope_head_dim)`` rows, per head first the part without rotary
    embedding (q_nope), then the rotary part (q_pe).  ``wkv_b`` has ``n_heads x (qk_nope_head_dim
    + v_head_dim)`` rows, per head the key part (k_nope) then the value part.  ``wkv_a`` has
    ``kv_lora_rank + qk_rope_head_dim`` rows: the compressed key/value, then the rotary key shared
    by all heads.  (torchtitan ``models/deepseek_v3/model.py``: ``q.view(T, -1, qk_head_dim)``
    split ``[nope, rope]``; ``kv.view(T, -1, nope + v)`` split ``[nope, v]``; ``wkv_a`` output
    split ``[kv_lora_rank, rope]``.)
    """

    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    def __post_init__(self):
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check_pos_int("MLAHeads", name, getattr(self, name))

    @property
    def q_head_rows(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_head_rows(self) -> int:
        return self.qk_nope_head_dim + self.v_head_dim

    def q_layout(self, n_heads: int) -> RowLayout:
        """``wq`` / ``wq_b``: per head ``[q_nope; q_pe]``."""
        nope, rope = self.qk_nope_head_dim, self.qk_rope_head_dim
        head = torch.arange(n_heads)[:, None].expand(n_heads, nope + rope)
        part = torch.where(torch.arange(nope + rope) < nope, int(Part.Q_NOPE), int(Part.Q_PE)).expand(n_heads, -1)
        return RowLayout(part=part.reshape(-1).long(), head=head.reshape(-1).long(), n_q_heads=n_heads,
                         n_kv_heads=n_heads)

    def kv_b_layout(self, n_heads: int) -> RowLayout:
        """``wkv_b``: per head ``[k_nope; v]``."""
        nope, v = self.qk_nope_head_dim, self.v_head_dim
        head = torch.arange(n_heads)[:, None].expand(n_heads, nope + v)
        part = torch.where(torch.arange(nope + v) < nope, int(Part.K_NOPE), int(Part.V)).expand(n_heads, -1)
        return RowLayout(part=part.reshape(-1).long(), head=head.reshape(-1).long(), n_q_heads=n_heads,
                         n_kv_heads=n_heads)

    def kv_a_layout(self, kv_lora_rank: int, n_heads: int) -> RowLayout:
        """``wkv_a``: ``[latent (kv_lora_rank rows); shared rotary key (qk_rope_head_dim rows)]``."""
        _check_pos_int("MLAHeads.kv_a_layout", "kv_lora_rank", kv_lora_rank)
        return _layout(
            [(Part.LATENT, torch.full((kv_lora_rank,), -1)),
             (Part.K_PE_SHARED, torch.full((self.qk_rope_head_dim,), -1))],
            n_heads, n_heads,
        )
