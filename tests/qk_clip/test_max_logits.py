"""Max-logit helpers: the chunked eager max equals the max of explicitly materialised logits; the
cross-rank helper gives every rank the single-device values under FSDP+TP (gloo ranks)."""

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from harness import run_ranks
from optimizer.max_logits import (
    eager_max_logits,
    flex_attention_with_max_logits,
    gather_max_logits,
    max_logits_from_flex,
    mesh_groups,
)
from tolerances import max_logit_atol, unit_roundoff

U32 = unit_roundoff(torch.float32)  # the reference's rounding to float32


def explicit_max(q, k, scale=None, causal=False, mask=None):
    """Repeat the key heads, materialise every logit, mask, take the per-head max."""
    hq, hkv = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(hq // hkv, dim=1)
    s = (q.double() @ kk.double().transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(), -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask.expand_as(s), -math.inf)
    return s.amax(dim=(0, 2, 3)).float()


def qk(b=2, hq=6, hkv=2, lq=9, lk=9, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g) * torch.linspace(0.5, 3, hq)[None, :, None, None]
    k = torch.randn(b, hkv, lk, d, generator=g)
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize("hkv", [1, 2, 3, 6])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, None])
def test_eager_equals_explicit(hkv, causal, chunk):
    q, k = qk(hkv=hkv, seed=hkv)
    got = eager_max_logits(q, k, is_causal=causal, chunk_size=chunk)
    torch.testing.assert_close(got, explicit_max(q, k, causal=causal), rtol=U32, atol=max_logit_atol(q, k, 8 ** -0.5))
    assert got.dtype == torch.float32 and got.shape == (6,)


def test_causal_changes_the_answer():
    """Keys after a query must not count: build a case where the largest logit is above the diagonal."""
    q, k = qk(hkv=6, lq=5, lk=5)
    k[:, :, -1] = q[:, :, 0] * 10  # the last key aligns with the first query: only non-causal sees it
    full, causal = eager_max_logits(q, k), eager_max_logits(q, k, is_causal=True)
    assert bool((full > causal).all())
    torch.testing.assert_close(causal, explicit_max(q, k, causal=True), rtol=U32, atol=max_logit_atol(q, k, 8 ** -0.5))


def test_cross_attention_lengths_scale_and_bf16():
    q, k = qk(lq=5, lk=11)
    torch.testing.assert_close(eager_max_logits(q, k, scale=0.3, chunk_size=2), explicit_max(q, k, scale=0.3),
                               rtol=U32, atol=max_logit_atol(q, k, 0.3))
    qb, kb = q.bfloat16(), k.bfloat16()  # computed in fp32 from the bf16 values
    torch.testing.assert_close(eager_max_logits(qb, kb), explicit_max(qb.float(), kb.float()), rtol=U32,
                               atol=max_logit_atol(qb.float(), kb.float(), 8 ** -0.5))


def test_bool_mask_and_mask_mod():
    q, k = qk(hkv=3, lq=8, lk=8)
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])  # packed documents, causal within each

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    dense = ((doc[:, None] == doc[None, :]) & torch.ones(8, 8, dtype=torch.bool).tril())[None, None]
    want = explicit_max(q, k, mask=dense)
    tol = dict(rtol=U32, atol=max_logit_atol(q, k, 8 ** -0.5))
    torch.testing.assert_close(eager_max_logits(q, k, mask_mod=mask_mod, chunk_size=3), want, **tol)
    torch.testing.assert_close(eager_max_logits(q, k, attn_mask=dense, chunk_size=5), want, **tol)
    # a head with nothing visible gets -inf (and a per-batch / per-head mask broadcasts)
    per_head = torch.ones(1, 6, 8, 8, dtype=torch.bool)
    per_head[:, 2] = False
    got = eager_max_logits(q, k, attn_mask=per_head)
    assert got[2] == -math.inf and bool(torch.isfinite(got[[0, 1, 3, 4, 5]]).all())


def test_input_errors():
    q, k = qk()
    with pytest.raises(ValueError, match="boolean"):
        eager_max_logits(q, k, attn_mask=torch.zeros(9, 9))
    with pytest.raises(ValueError, match=r"\[batch, heads, seq, head_dim\]"):
        eager_max_logits(q[0], k[0])
    with pytest.raises(ValueError, match="do not match"):
        eager_max_logits(q, qk(hkv=4)[1])


def test_chunk_never_holds_more_than_a_chunk():
    """The largest score tensor allocated is [B, Hq, chunk, Lk]."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                Largest.biggest = max(Largest.biggest, out.numel())
            return out

    q, k = qk(b=2, hq=6, hkv=2, lq=40, lk=40, d=4)
    with Largest():
        eager_max_logits(q, k, is_causal=True, chunk_size=5)
    assert Largest.biggest <= max(2 * 6 * 5 * 40, q.numel(), k.numel())


def test_flex_max_scores_reduction_cpu_math():
    """torch 2.13 returns flex_attention max_scores on CUDA only; its CPU reference (the HOP's math
    implementation, which flex_attention's public API rescales by ln 2) gives the same semantics."""
    from torch._higher_order_ops.flex_attention import math_attention
    from torch.nn.attention.flex_attention import create_block_mask

    q, k = qk(hkv=2, lq=16, lk=16)
    v = torch.randn_like(k)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = create_block_mask(causal, None, None, 16, 16, device="cpu")
    _, _, max_scores = math_attention(q, k, v, lambda s, b, h, m, n: s, block_mask.as_tuple(), 8 ** -0.5, {})
    got = max_logits_from_flex(max_scores * math.log(2))
    # the math implementation works in base 2 (scores times fp32 log2(e)), back by fp32 ln 2: two
    # rounded constants and two products, 4 roundings relative, and the reference's own; the atol
    # covers the dot products of both sides (twice: both in float32 against eager)
    tol = dict(rtol=5 * U32, atol=2 * max_logit_atol(q, k, 8 ** -0.5))
    torch.testing.assert_close(got, explicit_max(q, k, causal=True), **tol)
    torch.testing.assert_close(got, eager_max_logits(q, k, mask_mod=causal), **tol)
    with pytest.raises(ValueError, match="max_scores"):
        max_logits_from_flex(torch.zeros(2, 3))


def test_flex_wrapper_refuses_its_own_aux_arguments():
    q, k = qk()
    with pytest.raises(TypeError, match="max_logits_from_flex"):
        flex_attention_with_max_logits(q, k, k, return_aux=None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention max_scores need CUDA in torch 2.13")
def test_flex_attention_with_max_logits_cuda():
    from torch.nn.attention.flex_attention import create_block_mask

    q, k = (t.cuda() for t in qk(hkv=2, lq=128, lk=128, d=16))
    v = torch.randn_like(k)
    block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 128, 128, device="cuda")
    out, per_head = flex_attention_with_max_logits(q, k, v, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(per_head.cpu(), explicit_max(q.cpu(), k.cpu(), causal=True), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- across ranks


def _fsdp_tp_rank(rank, world_size, mesh_shape, names):
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    dp = mesh.get_local_rank("dp_shard") if "dp_shard" in names else 0
    tp = mesh.get_local_rank("tp") if "tp" in names else 0
    n_dp = mesh.size(names.index("dp_shard")) if "dp_shard" in names else 1
    n_tp = mesh.size(names.index("tp")) if "tp" in names else 1
    full, local = {}, {}
    for layer, (hq, hkv) in enumerate([(8, 4), (4, 4), (8, 2)]):
        q, k = qk(b=4, hq=hq, hkv=hkv, lq=6, lk=6, seed=layer)
        full[layer] = eager_max_logits(q, k, is_causal=True)
        bq = slice(dp * 4 // n_dp, (dp + 1) * 4 // n_dp)  # this rank's batch
        hq_l, hkv_l = hq // n_tp, hkv // n_tp  # this rank's contiguous heads (column-parallel wq / wk)
        local[layer] = eager_max_logits(q[bq, tp * hq_l:(tp + 1) * hq_l], k[bq, tp * hkv_l:(tp + 1) * hkv_l],
                                        is_causal=True)
    tp_group, dp_groups = mesh_groups(mesh)
    got = gather_max_logits(local, tp_group=tp_group, dp_groups=dp_groups)
    assert list(got) == [0, 1, 2]
    for layer in full:
        assert torch.equal(got[layer], full[layer]), (layer, got[layer], full[layer])
    single = gather_max_logits(local[0], tp_group=tp_group, dp_groups=dp_groups)
    assert torch.equal(single, full[0])
    # a NaN on one rank reaches every rank as +inf (a max-reduction may drop NaN)
    if rank == world_size - 1:
        local[1] = local[1].clone()
        local[1][0] = float("nan")
    nan = gather_max_logits(local, tp_group=tp_group, dp_groups=dp_groups)
    return [t.tolist() for t in got.values()], bool(torch.isposinf(nan[1]).any())


@pytest.mark.parametrize("world_size, mesh_shape, names", [
    (4, (2, 2), ("dp_shard", "tp")),  # FSDP + TP
    (2, (2,), ("tp",)),
    (2, (2,), ("dp_shard",)),
])
def test_gather_max_logits_identical_on_every_rank(world_size, mesh_shape, names):
    results = run_ranks(_fsdp_tp_rank, world_size, mesh_shape, names, timeout=60)
    values = [r[0] for r in results]
    assert all(v == values[0] for v in values)  # bit-identical everywhere (and equal to single-device, per rank)
    assert all(r[1] for r in results)
