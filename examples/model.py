"""A tiny decoder-only transformer for the tests and the training demo.

It has every kind of parameter the optimizer must handle: embeddings, separate
q/k/v/o projections with grouped-query heads, a SwiGLU MLP, an MoE layer whose
expert weights are 3-D ``[n_experts, out, in]`` parameters, RMSNorm weights and an
lm_head.  Parameter names follow Llama-style checkpoints
(``layers.{i}.attention.wq.weight``, ``layers.{i}.moe.experts.w1``, ...) so that
QK-clip's default name matching finds the q/k projections.

Attention records the per-head maximum QK logit of its last forward
(``Attention.last_max_logits``); :func:`collect_qk_logits` turns those into the
``qk_logits`` argument of ``Muon.step``.

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
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


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

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                    "ffn_dim", "n_experts", "expert_dim", "top_k")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"ModelArgs.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelArgs.n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}) for grouped-query attention"
            )
        if self.top_k > self.n_experts:
            raise ValueError(f"ModelArgs.top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal grouped-query attention with explicit logits (so their max is observable)."""

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
        n_rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)

        logits = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril()
        logits = logits.masked_fill(~causal, float("-inf"))
        self.last_max_logits = logits.detach().amax(dim=(0, 2, 3))

        out = torch.softmax(logits, dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


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
        self.attention = Attention(args)
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
            elif name.endswith(("wq.weight", "wk.weight")):
                scale = self.args.qk_init_gain * std
            else:
                scale = p.shape[-1] ** -0.5  # fan-in of every [.., out, in] matrix
            p.copy_(torch.randn(p.shape, generator=gen) * scale)

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


def collect_qk_logits(model: nn.Module, tp_group: dist.ProcessGroup | None = None) -> dict[int, torch.Tensor]:
    """Full per-layer vectors of per-query-head max logits from the last forward.

    Under TP each rank recorded only its (contiguous, colwise) block of heads: the
    blocks are all-gathered over ``tp_group`` in rank order.  Then the max is taken
    over all ranks, i.e. over the data-parallel replicas (TP peers already agree), so
    that every rank hands the optimizer the same ``qk_logits``.  Collective: every
    rank must call it.
    """
    layers = model.layers
    local = []
    for i, layer in enumerate(layers):
        logits = layer.attention.last_max_logits
        if logits is None:
            raise RuntimeError(f"layers.{i}.attention has no recorded logits: run a forward first")
        local.append(logits.float())
    stacked = torch.stack(local)  # [n_layers, local heads]
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        parts = [torch.empty_like(stacked) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, stacked.contiguous(), group=tp_group)
        stacked = torch.cat(parts, dim=1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    return {i: stacked[i] for i in range(len(layers))}
