"""A tiny decoder-only transformer for the tests and the training demo.

It has every kind of parameter the optimizer must handle: embeddings, attention
projections, a SwiGLU MLP, an MoE layer whose expert weights are 3-D
``[n_experts, out, in]`` parameters, RMSNorm weights and an lm_head.  Parameter
names follow Llama/torchtitan checkpoints (``layers.{i}.attention.wq.weight``,
``layers.{i}.moe.experts.w1``, ...) so that QK-clip's name matching finds the
attention weights.  ``ModelArgs.attention`` picks the attention:

* ``"gqa"`` (default): separate ``wq``/``wk``/``wv``/``wo``, grouped-query heads;
* ``"fused_qkv"``: one ``wqkv`` in torchtitan's "grouped" layout (per key/value
  group its query heads, then its key head, then its value head:
  ``optimizer.FusedQKV(..., layout="grouped")``), and ``wo``;
* ``"mla"``: DeepSeek-V3 / Kimi K2 multi-head latent attention with torchtitan's
  deepseek_v3 names: ``wq`` (or ``wq_a``, ``q_norm``, ``wq_b`` with a query LoRA),
  ``wkv_a`` (latent, then the rotary key shared by all heads), ``kv_norm``,
  ``wkv_b`` (per head ``[k_nope; v]``), ``wo``; rotary embedding on the rope parts.

Every attention computes its logits explicitly and records the per-query-head
maximum of its last forward (``last_max_logits``, from
``optimizer.max_logits.eager_max_logits``); :func:`collect_qk_logits` turns those
into the ``qk_logits`` argument of ``Muon.step`` with
``optimizer.max_logits.gather_max_logits``.

The modules run unchanged under tensor parallelism (``parallelize_module`` with
``use_local_output=True``: head counts are derived from the local weight shapes)
and under expert parallelism (expert weights as DTensors sharded on the expert
dim; see :class:`Experts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from optimizer.attention_layouts import FusedQKV, MLAHeads
from optimizer.max_logits import eager_max_logits, gather_max_logits

ATTENTION_KINDS = ("gqa", "fused_qkv", "mla")
# ModelArgs fields that only one kind of attention reads (the config loader refuses them elsewhere).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_theta")
HEAD_FIELDS = ("n_kv_heads", "head_dim")  # gqa and fused_qkv; MLA has one key per query head


@dataclass
class ModelArgs:
    vocab_size: int = 64
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 128
    n_experts: int = 4
    expert_dim: int = 32
    top_k: int = 2
    norm_eps: float = 1e-5
    # Std of the q/k projection init, in units of 1/sqrt(dim).  Above 1 the initial
    # attention logits are large enough for a low QK-clip threshold to trigger.
    qk_init_gain: float = 1.0
    # "gqa" | "fused_qkv" | "mla" (see the module docstring).
    attention: str = "gqa"
    # MLA only (torchtitan deepseek_v3 names); q_lora_rank 0: a plain `wq`, no query LoRA.
    q_lora_rank: int = 0
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                    "ffn_dim", "n_experts", "expert_dim", "top_k", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"ModelArgs.{name} must be >= 1, got {getattr(self, name)}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"ModelArgs.attention must be one of {list(ATTENTION_KINDS)}, got {self.attention!r}")
        if self.q_lora_rank < 0:
            raise ValueError(f"ModelArgs.q_lora_rank must be >= 0 (0: no query LoRA), got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"ModelArgs.qk_rope_head_dim must be even (rotary embedding rotates pairs), "
                             f"got {self.qk_rope_head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelArgs.rope_theta must be > 0, got {self.rope_theta}")
        if self.attention != "mla" and self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelArgs.n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}) for grouped-query attention"
            )
        if self.top_k > self.n_experts:
            raise ValueError(f"ModelArgs.top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")

    @property
    def fused_qkv(self) -> FusedQKV:
        """The layout of ``wqkv`` (attention = "fused_qkv"), for QK-clip and split orthogonalisation."""
        return FusedQKV(self.n_heads, self.n_kv_heads, self.head_dim, layout="grouped")

    @property
    def mla_heads(self) -> MLAHeads:
        """The MLA head sizes (attention = "mla"), for QK-clip."""
        return MLAHeads(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention with explicit logits ``q.k / sqrt(d)``; ``(out, max_logits)``.

    ``q``: ``[B, Hq, L, d]``; ``k``: ``[B, Hkv, L, d]``; ``v``: ``[B, Hkv, L, dv]`` with ``Hq`` a
    multiple of ``Hkv`` (query head ``h`` uses key/value head ``h // (Hq // Hkv)``).  ``out`` is
    ``[B, Hq, L, dv]``; ``max_logits`` the per-query-head max logit over batch and causally
    visible positions (float32 ``[Hq]``, detached): what QK-clip bounds.
    """
    scale_divisor = math.sqrt(q.shape[-1])
    with torch.no_grad():
        # The library's helper, GQA keys not repeated.  Asked for the unscaled max and divided
        # as the logits below are: the products q.k are the same and rounding is monotone, so
        # this is bit for bit the largest logit the softmax sees (multiplying by 1/sqrt(d)
        # instead can differ in the last bit; tests/end_to_end/test_attention_variants.py checks).
        max_logits = eager_max_logits(q.detach(), k.detach(), scale=1.0, is_causal=True) / scale_divisor
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    seqlen = q.shape[2]
    logits = (q @ k.transpose(-2, -1)) / scale_divisor
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=q.device).tril()
    logits = logits.masked_fill(~causal, float("-inf"))
    return torch.softmax(logits, dim=-1) @ v, max_logits


class Attention(nn.Module):
    """Causal grouped-query attention with separate ``wq``/``wk``/``wv`` (attention = "gqa")."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # Per query head (local heads under TP) max of q.k/sqrt(head_dim) over batch and
        # the causally visible positions of the last forward; detached.
        self.last_max_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Under TP (use_local_output=True) these hold this rank's heads only, so
        # the head counts come from the activations, not from ModelArgs.
        q = q.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        out, self.last_max_logits = causal_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FusedQKVAttention(nn.Module):
    """Grouped-query attention with one fused ``wqkv`` in torchtitan's "grouped" layout.

    ``wqkv.weight`` viewed as ``[n_kv_heads, n_heads // n_kv_heads + 2, head_dim, dim]``: per
    key/value group ``g`` its query heads ``g * group .. (g + 1) * group - 1``, then key head
    ``g``, then value head ``g``.  Column-wise tensor parallelism splits the rows into
    contiguous ranges of whole groups, so every rank keeps its heads' q, k and v together.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.group = args.n_heads // args.n_kv_heads  # query heads per key/value head
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.last_max_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        qkv = self.wqkv(x).view(bsz, seqlen, -1, self.group + 2, self.head_dim)  # [B, L, local groups, ., d]
        q = qkv[:, :, :, :self.group].reshape(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        k = qkv[:, :, :, self.group].transpose(1, 2)
        v = qkv[:, :, :, self.group + 1].transpose(1, 2)
        out, self.last_max_logits = causal_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    @torch.no_grad()
    def scale_qk_init_(self, gain: float) -> None:
        w = self.wqkv.weight.view(-1, self.group + 2, self.head_dim, self.wqkv.weight.shape[-1])
        w[:, :self.group + 1].mul_(gain)  # query and key rows; value rows keep the fan-in scale


def apply_rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[B, L, H, d]`` at positions ``0..L-1``.

    Consecutive pairs ``(x[2i], x[2i+1])`` rotate by ``pos * theta**(-2i/d)`` (torchtitan's
    complex form, written with real arithmetic).
    """
    seqlen, d = x.shape[1], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.arange(seqlen, device=x.device, dtype=torch.float32)[:, None] * inv_freq  # [L, d/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


def sum_gradient_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward, gradient summed over the 1-D ``mesh`` backward (Megatron's "f").

    For a tensor every rank of ``mesh`` computes alike but each uses for part of the work
    (its own heads): the sum of the partial gradients is the full one, the same on every rank.
    """
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V3 / Kimi K2), torchtitan deepseek_v3 names and layout.

    Queries: ``wq`` (``q_lora_rank == 0``) or ``wq_b(q_norm(wq_a(x)))``, per head
    ``[q_nope; q_pe]``.  Keys and values: ``wkv_a(x)`` is ``[latent (kv_lora_rank); k_pe
    (qk_rope_head_dim)]``; ``wkv_b(kv_norm(latent))`` per head ``[k_nope; v]``; the rotary key
    ``k_pe`` is shared by all heads.  Rotary embedding on ``q_pe`` and ``k_pe``; logits scaled by
    ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (no YaRN).

    Tensor parallelism (torchtitan's plan): ``wq``/``wq_b`` and ``wkv_b`` column-wise (whole
    heads), ``wo`` row-wise, the low-rank ``wq_a``, ``q_norm``, ``wkv_a``, ``kv_norm``
    replicated.  The column-wise layers sum their input's gradient over ``tp``; the shared
    ``k_pe`` feeds this rank's heads directly, so ``parallelize`` sets ``tp_mesh`` and its
    gradient is summed here (:func:`sum_gradient_over`).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.rope_theta = args.rope_theta
        q_rows = args.n_heads * (self.nope + self.rope)
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, q_rows, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, q_rows, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        self.tp_mesh: DeviceMesh | None = None  # set by examples.parallelize.apply_tp
        self.last_max_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_pe = q.view(bsz, seqlen, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        if self.tp_mesh is not None:
            k_pe = sum_gradient_over(k_pe, self.tp_mesh)
        q = torch.cat([q_nope, apply_rotary(q_pe, self.rope_theta)], dim=-1)
        k_pe = apply_rotary(k_pe.unsqueeze(2), self.rope_theta)  # [B, L, 1, rope]
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        out, self.last_max_logits = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    @torch.no_grad()
    def scale_qk_init_(self, gain: float) -> None:
        (self.wq if self.q_lora_rank == 0 else self.wq_b).weight.mul_(gain)
        self.wkv_b.weight.view(-1, self.nope + self.v_dim, self.kv_lora_rank)[:, :self.nope].mul_(gain)
        self.wkv_a.weight[self.kv_lora_rank:].mul_(gain)  # the shared rotary key


ATTENTIONS = {"gqa": Attention, "fused_qkv": FusedQKVAttention, "mla": MLAttention}


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """SwiGLU experts as 3-D weights ``[n_experts, out, in]``, computed densely.

    Every expert processes every token and the outputs are mixed with the router's
    (sparse, top-k) gates: wasteful, but it makes the layer work under any sharding
    without a token dispatcher.  When the weights are DTensors sharded on the expert
    dim (expert parallelism), each rank computes its local experts and the partial
    mixtures are summed over the expert-parallel mesh dim.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        # x: [tokens, dim]; gates: [tokens, n_experts] (zero outside the top-k)
        w1, w2, w3 = self.w1, self.w2, self.w3
        if not isinstance(w1, DTensor):
            return _mix_experts(x, gates, w1, w2, w3)
        mesh = w1.device_mesh
        expert_dims = [i for i, p in enumerate(w1.placements) if p == Shard(0)]
        if len(expert_dims) != 1 or any(
            not isinstance(p, Replicate) for i, p in enumerate(w1.placements) if i != expert_dims[0]
        ):
            raise NotImplementedError(
                f"Experts.forward supports expert weights sharded as Shard(0) on one mesh dim "
                f"(expert parallelism), got placements {w1.placements}"
            )
        ep_dim = expert_dims[0]
        replicate = [Replicate()] * mesh.ndim
        partial = list(replicate)
        partial[ep_dim] = Partial()
        # x and gates are the same on every ep rank, but each rank's backward only
        # sees its local experts' share of their gradient: identity forward,
        # all-reduce backward (Megatron's "f"), via a Partial gradient placement.
        x, gates = (
            DTensor.from_local(t, mesh, replicate, run_check=False).to_local(grad_placements=partial)
            for t in (x, gates)
        )
        first, count = _shard0_range(w1.shape[0], mesh.size(ep_dim), mesh.get_local_rank(ep_dim))
        local_mix = _mix_experts(
            x, gates[:, first:first + count], w1.to_local(), w2.to_local(), w3.to_local()
        )
        # sum over all experts = sum over ep ranks of the local experts' mixtures.
        summed = DTensor.from_local(local_mix, mesh, partial, run_check=False)
        return summed.redistribute(mesh, replicate).to_local()


def _mix_experts(x, gates, w1, w2, w3):
    h = F.silu(torch.einsum("td,ehd->teh", x, w1)) * torch.einsum("td,ehd->teh", x, w3)
    return torch.einsum("teh,edh,te->td", h, w2, gates)


def _shard0_range(size: int, n: int, rank: int) -> tuple[int, int]:
    """(first index, count) of ``rank``'s chunk under ``Shard(0)`` (``torch.chunk`` semantics)."""
    chunk = -(-size // n)
    first = min(rank * chunk, size)
    return first, min(chunk, size - first)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.top_k
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = Experts(args.n_experts, args.dim, args.expert_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(tokens), dim=-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        return self.experts(tokens, gates).view_as(x)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = ATTENTIONS[args.attention](args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.moe_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        x = x + self.feed_forward(self.ffn_norm(x))
        return x + self.moe(self.moe_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from ``seed`` (same on every rank, independent of global RNG)."""
        gen = torch.Generator().manual_seed(seed)
        std = self.args.dim ** -0.5
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if name == "tok_embeddings.weight":
                scale = 1.0
            elif self.args.attention == "gqa" and name.endswith(("wq.weight", "wk.weight")):
                scale = self.args.qk_init_gain * std
            else:
                scale = p.shape[-1] ** -0.5  # fan-in of every [.., out, in] matrix
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
        if self.args.attention != "gqa":  # the rows that make queries and keys, as wq/wk above
            for layer in self.layers:
                layer.attention.scale_qk_init_(self.args.qk_init_gain)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``; with ``targets``, the mean cross-entropy loss instead.

        Training passes ``targets`` so that the loss is computed inside the model:
        under TP the lm_head's output is ``DTensor.to_local()``, a *view*, and a root
        module wrapped by FSDP2 that returns a view gets a warning on every forward
        (an in-place op on that view would drop FSDP2's pre-backward hook).  The loss
        is a fresh tensor, and the logits never leave the module.
        """
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build_model(args: ModelArgs, seed: int) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed)
    return model


def collect_qk_logits(
    model: nn.Module,
    tp_group: dist.ProcessGroup | None = None,
    dp_groups: tuple[dist.ProcessGroup, ...] = (),
) -> dict[int, torch.Tensor]:
    """``{layer: per-query-head max logit}`` of the last forward, the same on every rank.

    Each attention recorded its local heads' maxima over its own batch
    (``last_max_logits``); ``optimizer.max_logits.gather_max_logits`` takes the max over
    ``dp_groups`` (the ranks that see other data) and gathers the heads over ``tp_group``
    (column-wise TP: rank ``r`` holds the ``r``-th block of heads).
    ``examples.parallelize.max_logit_groups`` gives both for a config.  Collective over those
    groups.
    """
    local = {}
    for i, layer in enumerate(model.layers):
        logits = layer.attention.last_max_logits
        if logits is None:
            raise RuntimeError(f"layers.{i}.attention has no recorded logits: run a forward first")
        local[i] = logits
    return gather_max_logits(local, tp_group=tp_group, dp_groups=dp_groups)
