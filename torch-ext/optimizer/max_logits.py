"""Per-query-head max attention logits, the input of QK-clip (``step(qk_logits=...)``).

QK-clip needs, per layer, each query head's largest pre-softmax logit ``scale * q . k`` in the
last forward pass, over the batch and every (query, key) pair the mask lets through, and the same
vector on every rank.  Three helpers:

* :func:`eager_max_logits` — from the query and key tensors of eager attention, computed in
  chunks of queries so that it never holds more than ``[batch, heads, chunk, keys]`` scores
  (the eager attention itself holds ``[batch, heads, queries, keys]``).  Causal masks, boolean
  masks and flex-style ``mask_mod`` functions are respected; grouped-query attention needs no
  repeated keys.
* :func:`max_logits_from_flex` / :func:`flex_attention_with_max_logits` — from
  ``flex_attention``'s auxiliary ``max_scores`` (``return_aux=AuxRequest(max_scores=True)``; torch
  2.13 computes them on CUDA only, not on CPU).  These are the scores after ``scale`` and after any
  ``score_mod`` (so a bias added by ``score_mod`` is included).
* :func:`gather_max_logits` — turns each rank's local values (its tensor-parallel heads, its
  data-parallel batch) into the full per-layer vectors, identical on every rank: max-reduce over
  the data-parallel groups, all-gather over the tensor-parallel group (rank ``r`` of a
  column-parallel attention holds the ``r``-th contiguous range of heads).  All layers travel in
  one collective per group.

Call them under ``torch.no_grad()`` on tensors you already have; nothing here synchronises the
host.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from einops import rearrange
import torch.distributed as dist
from torch import Tensor

DEFAULT_CHUNK_ELEMENTS = 1 << 24  # scores held at once by eager_max_logits (64 MiB in fp32)


def eager_max_logits(
    query: Tensor,
    key: Tensor,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    attn_mask: Tensor | None = None,
    mask_mod: Callable | None = None,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Per-query-head max of ``scale * query @ key^T`` over batch and visible positions.

    Args:
        query: ``[B, Hq, Lq, D]`` (SDPA / flex layout); key: ``[B, Hkv, Lk, D]`` with ``Hq`` a
            multiple of ``Hkv`` (query head ``h`` attends with key head ``h // (Hq // Hkv)``).
        scale: softmax scale; default ``1 / sqrt(D)`` as in SDPA.
        is_causal: query ``i`` sees keys ``j <= i`` (SDPA's ``is_causal``, top-left aligned).
        attn_mask: boolean, broadcastable to ``[B, Hq, Lq, Lk]``, True where attention is allowed
            (SDPA's boolean mask).  Additive float masks are refused: a bias is not a logit of q.k.
        mask_mod: a flex-attention mask function ``(b, h, q_idx, kv_idx) -> bool tensor`` written
            with tensor ops (it is called once per chunk on broadcast index tensors).
        chunk_size: queries per chunk; default keeps ``B * Hq * chunk * Lk <= 2**24``.
        compute_dtype: dtype of the score matmul (float32 by default, so the max is not rounded
            to bf16).

    Returns a float32 ``[Hq]`` tensor on the query's device; a head with nothing visible gets
    ``-inf`` (QK-clip leaves such heads alone).
    """
    _check_inputs(query, key, attn_mask)
    B, Hq, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    scale = D ** -0.5 if scale is None else float(scale)
    group = Hq // Hkv
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_ELEMENTS // max(1, B * Hq * Lk))
        if is_causal:  # at least 8 chunks, so that the keys no query of a chunk sees are skipped
            chunk_size = min(chunk_size, max(1, -(-Lq // 8)))
    if attn_mask is not None:
        attn_mask = attn_mask.expand(B, Hq, Lq, Lk)  # a view: nothing materialised
    # GQA without repeating keys: the query heads of a KV group share that group's keys
    k_t = rearrange(key.to(compute_dtype), "b kv lk d -> b kv 1 d lk")
    kv_idx = torch.arange(Lk, device=query.device)
    best = torch.full((Hq,), float("-inf"), device=query.device)
    for start in range(0, Lq, chunk_size):
        stop = min(Lq, start + chunk_size)
        # Causal (top-left aligned, as SDPA's is_causal): no query of the chunk sees a key past
        # its last row, so those keys are not multiplied at all (about half the work).
        seen = min(Lk, stop) if is_causal else Lk
        keys = kv_idx[:seen]
        q = rearrange(query[:, :, start:stop].to(compute_dtype), "b (kv g) l d -> b kv g l d", g=group)
        scores = rearrange(torch.matmul(q, k_t[..., :seen]).float().mul_(scale), "b kv g l lk -> b (kv g) l lk")
        visible = _visible(keys, start, stop, (B, Hq), is_causal, attn_mask, mask_mod)
        if visible is not None:
            scores = scores.masked_fill_(~visible.expand_as(scores), float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


def _check_inputs(query: Tensor, key: Tensor, attn_mask: Tensor | None) -> None:
    if query.ndim != 4 or key.ndim != 4:
        raise ValueError(
            f"eager_max_logits: query and key must be [batch, heads, seq, head_dim], got {tuple(query.shape)} and "
            f"{tuple(key.shape)} (transpose [batch, seq, heads, head_dim] tensors with .transpose(1, 2))"
        )
    B, Hq, _, D = query.shape
    Bk, Hkv, _, Dk = key.shape
    if Bk != B or Dk != D or Hkv == 0 or Hq % Hkv:
        raise ValueError(
            f"eager_max_logits: query {tuple(query.shape)} and key {tuple(key.shape)} do not match: same batch and "
            "head_dim, and query heads a multiple of key heads"
        )
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise ValueError(
            "eager_max_logits: attn_mask must be boolean (True = attend); an additive float mask changes the "
            "scores, not q.k, so pass the boolean pattern it encodes"
        )


def _visible(keys: Tensor, start: int, stop: int, batch_heads: tuple[int, int], is_causal: bool,
             attn_mask: Tensor | None, mask_mod: Callable | None) -> Tensor | None:
    """Which (query of ``start:stop``, key of ``keys``) pairs are visible, or None for all of them."""
    device, seen = keys.device, keys.numel()
    visible = None
    if is_causal:
        q_idx = torch.arange(start, stop, device=device)
        visible = keys[None, :] <= q_idx[:, None]
    if attn_mask is not None:
        chunk = attn_mask[:, :, start:stop, :seen]
        visible = chunk if visible is None else visible & chunk
    if mask_mod is not None:
        B, Hq = batch_heads
        b = torch.arange(B, device=device).view(B, 1, 1, 1)
        h = torch.arange(Hq, device=device).view(1, Hq, 1, 1)
        qi = torch.arange(start, stop, device=device).view(1, 1, -1, 1)
        allowed = torch.as_tensor(mask_mod(b, h, qi, keys.view(1, 1, 1, seen)), device=device)
        visible = allowed if visible is None else visible & allowed
    return visible


def max_logits_from_flex(max_scores) -> Tensor:
    """Per-head max from ``flex_attention``'s ``aux.max_scores`` (``[B, H, L]``) or the AuxOutput."""
    scores = getattr(max_scores, "max_scores", max_scores)
    if scores is None:
        raise ValueError("max_logits_from_flex: the AuxOutput has no max_scores; call flex_attention with "
                         "return_aux=AuxRequest(max_scores=True)")
    if scores.ndim != 3:
        raise ValueError(f"max_logits_from_flex: expected max_scores of shape [batch, heads, queries], got "
                         f"{tuple(scores.shape)}")
    return scores.detach().float().amax(dim=(0, 2))


def flex_attention_with_max_logits(query: Tensor, key: Tensor, value: Tensor, *, flex_attention=None, **kwargs):
    """``flex_attention(query, key, value, **kwargs)`` plus the per-head max logits: ``(out, [H])``.

    Pass your compiled ``flex_attention`` as ``flex_attention=`` (default: the eager one).  Needs a
    device where flex_attention returns ``max_scores`` (CUDA in torch 2.13).  To also get the
    log-sum-exp, call flex_attention with ``return_aux=AuxRequest(lse=True, max_scores=True)``
    yourself and pass the AuxOutput to :func:`max_logits_from_flex`.
    """
    from torch.nn.attention.flex_attention import AuxRequest
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    if "return_aux" in kwargs or "return_lse" in kwargs:
        raise TypeError("flex_attention_with_max_logits requests the aux outputs itself; for the lse too, call "
                        "flex_attention(..., return_aux=AuxRequest(lse=True, max_scores=True)) and "
                        "max_logits_from_flex(aux)")
    fn = flex_attention or eager_flex
    out, aux = fn(query, key, value, return_aux=AuxRequest(max_scores=True), **kwargs)
    return out, max_logits_from_flex(aux)


# --------------------------------------------------------------------------- across ranks


def gather_max_logits(
    local: Mapping | Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    dp_groups: Sequence[dist.ProcessGroup] = (),
):
    """Full per-layer max logits, the same on every rank, from each rank's local per-head maxima.

    ``local``: ``{layer: [local query heads]}`` (or one tensor).  Each rank holds its own batch
    (data parallel, context parallel: max-reduced over every group in ``dp_groups``) and, with
    tensor parallelism, a contiguous range of heads (all-gathered over ``tp_group``, rank order =
    head order; every TP rank must hold the same number of heads).  NaN is turned into +inf
    before reducing, because a max-reduction may drop NaN; QK-clip refuses both.  One collective
    per group for all layers.  Returns the same structure as ``local``.
    """
    single = isinstance(local, Tensor)
    items = {None: local} if single else dict(local)
    if not items:
        return {} if not single else local
    for k, t in items.items():
        if not isinstance(t, Tensor) or t.ndim != 1:
            raise ValueError(f"gather_max_logits: local[{k!r}] must be a 1-D tensor of local per-head maxima")
    sizes = [t.numel() for t in items.values()]
    flat = torch.cat([t.detach().float() for t in items.values()])
    flat = torch.where(torch.isnan(flat), float("inf"), flat)
    for group in dp_groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    if tp > 1:
        parts = [torch.empty_like(flat) for _ in range(tp)]
        dist.all_gather(parts, flat, group=tp_group)
        stacked = torch.stack(parts)  # [tp, total local heads]
        pieces = stacked.split(sizes, dim=1)
        out = {k: piece.reshape(-1) for k, piece in zip(items, pieces)}  # rank-major: TP rank r's heads r-th
    else:
        out = dict(zip(items, flat.split(sizes)))
    return out[None] if single else out


def mesh_groups(mesh, tp_dim: str | None = "tp", dp_dims: Sequence[str] = ("dp_replicate", "dp_shard", "cp")):
    """``(tp_group, dp_groups)`` of a DeviceMesh for :func:`gather_max_logits` (absent dims skipped)."""
    names = tuple(mesh.mesh_dim_names or ())
    tp_group = mesh.get_group(tp_dim) if tp_dim in names else None
    dp_groups = tuple(mesh.get_group(d) for d in dp_dims if d in names)
    return tp_group, dp_groups
