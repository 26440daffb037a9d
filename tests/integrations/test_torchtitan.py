"""optimizer.Muon inside torchtitan 0.3, with torchtitan's own model code and parallelize functions.

Every distributed test trains a tiny torchtitan model (llama3, or qwen3 MoE) parallelised by
torchtitan's ``parallelize_llama`` / ``parallelize_qwen3`` on forked CPU/gloo ranks, steps it
through :class:`MuonOptimizersContainer` (what torchtitan's trainer builds from config), and
compares every parameter with single-device ``optimizer.Muon`` on plain tensors fed the same
full gradients (``DTensor.full_tensor()`` of each rank's gradient). The CPU shims torchtitan
needs are in titan_fixture.py. Skipped only where torchtitan is not installed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (CI installs it: scripts/install.sh)")
from torchtitan_support import unsupported_reason  # noqa: E402

if unsupported_reason():  # torch 2.10 and 2.11
    pytest.skip(unsupported_reason(), allow_module_level=True)

import titan_fixture  # noqa: E402  (imported once here so forked ranks do not import torchtitan again)
from harness import run_ranks  # noqa: E402
from torch import nn  # noqa: E402

from optimizer import FusedQKV, MLAHeads, Muon, QKClipConfig, SplitQKV  # noqa: E402
from optimizer.integrations.torchtitan import (  # noqa: E402
    ADAMW_PATTERN,
    MaxLogitRecorder,
    MuonOptimizersContainer,
    default_param_groups,
    find_hidden_shards,
)
from optimizer.row_blocks import ROW_BLOCKS_KEY  # noqa: E402

LR = 2e-2
HEADS_PER_KV = titan_fixture.HEADS // titan_fixture.KV_HEADS
TOL = 1e-5  # fp32 Newton–Schulz on CPU: measured 0 or a few ulps; anything real is >= 1e-3


def container_config(**kw) -> MuonOptimizersContainer.Config:
    return MuonOptimizersContainer.Config(**{"param_groups": default_param_groups(lr=LR), "compute_dtype": "float32", **kw})


def reference_for(opts: MuonOptimizersContainer, full: dict[str, torch.Tensor], qk_clip=None, row_blocks=None):
    """Single-device Muon on plain copies of the full weights, with the container's groups and hyperparameters.

    ``row_blocks``: when given, the reference's own ``{name: spec}`` split orthogonalisation
    (the container's is dropped, so the comparison does not trust it)."""
    params = {n: nn.Parameter(w.clone()) for n, w in full.items()}
    groups = []
    for g in opts.optimizers[0].param_groups:
        group = {**{k: v for k, v in g.items() if k != "params"}, "params": [params[n] for n in g["param_names"]]}
        if row_blocks is not None:
            group.pop(ROW_BLOCKS_KEY, None)
            blocks = {n: row_blocks[n] for n in g["param_names"] if n in row_blocks}
            if blocks and g["use_muon"]:
                group[ROW_BLOCKS_KEY] = blocks
        groups.append(group)
    return params, Muon(groups, compute_dtype=torch.float32, qk_clip=qk_clip)


def train_and_compare(rank, world, model, degrees, steps=2, backend="partial_dtensor", qk_logits=None, config_kw=None,
                      record=False):
    """Train ``steps`` steps and compare with single-device Muon; with ``record``, also return how far the
    MaxLogitRecorder's step-0 logits are from those materialised on a single-device copy (relative)."""
    parallel, full, dims = titan_fixture.build(model, world, backend=backend, **degrees)
    opts = container_config(**(config_kw or {})).build(model_parts=[parallel])
    if qk_logits is not None:
        opts.set_qk_logits_fn(lambda parts: qk_logits)
    ref_params, ref = reference_for(opts, full, qk_clip=opts.qk_clip_config)
    recorder = MaxLogitRecorder.for_parallel_dims([parallel], dims) if record else None
    record_error = None
    for step in range(steps):
        titan_fixture.forward_backward(parallel, step, dims)
        if recorder is not None:
            got = recorder([parallel])
            want = materialised_max_logits(titan_fixture.plain_model(model, full), [titan_fixture.batch_tokens(0)], None)
            record_error = max(((got[k] - want[k]).abs() / want[k].abs()).max().item() for k in want)
            recorder.remove()
            recorder = None
        grads = {n: titan_fixture.full_tensor(p.grad) for n, p in parallel.named_parameters()}
        opts.step()
        opts.zero_grad()
        for n, p in ref_params.items():
            p.grad = grads[n]
        ref.step(qk_logits=qk_logits)
    deviation = {n: (titan_fixture.full_tensor(p.detach()) - ref_params[n].detach()).abs().max().item()
                 for n, p in parallel.named_parameters()}
    moved = {n: (ref_params[n].detach() - full[n]).abs().max().item() for n in full}
    placements = {n: str(tuple(p.placements)) if hasattr(p, "placements") else "plain"
                  for n, p in parallel.named_parameters()}
    return (deviation, moved, placements, record_error) if record else (deviation, moved, placements)


def check(results, expect_placements=()):
    deviation, moved, placements = results[0][:3]
    worst = max(deviation, key=deviation.get)
    assert deviation[worst] <= TOL, f"'{worst}' ({placements[worst]}) is {deviation[worst]:.3g} off single-device Muon"
    assert min(moved.values()) > 1e-4, "some parameter did not move: the comparison would be vacuous"
    for name_part, placement in expect_placements:  # the layouts torchtitan is known to produce
        assert any(name_part in n and p == placement for n, p in placements.items()), (name_part, placement, placements)
    return placements


# ----------------------------------------------------------------------- llama3, dense layouts

LLAMA3_LAYOUTS = {
    "fsdp": (2, dict(data_parallel_shard_degree=2), [("wq.weight", "(Shard(dim=0),)")]),
    "tp": (2, dict(data_parallel_shard_degree=1, tensor_parallel_degree=2),
           [("wq.weight", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"), ("wo.weight", "(Shard(dim=0), Shard(dim=1))")]),
    "tp_no_sp": (2, dict(data_parallel_shard_degree=1, tensor_parallel_degree=2, enable_sequence_parallel=False),
                 [("wo.weight", "(Shard(dim=0), Shard(dim=1))")]),
    "fsdp_tp": (4, dict(data_parallel_shard_degree=2, tensor_parallel_degree=2),
                [("w1.weight", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"), ("w2.weight", "(Shard(dim=0), Shard(dim=1))")]),
    "hsdp": (4, dict(data_parallel_replicate_degree=2, data_parallel_shard_degree=2),
             [("wk.weight", "(Replicate(), Shard(dim=0))")]),
}


@pytest.mark.parametrize("layout", list(LLAMA3_LAYOUTS))
def test_llama3_matches_single_device_muon(layout):
    world, degrees, expected = LLAMA3_LAYOUTS[layout]
    check(run_ranks(train_and_compare, world, "llama3", degrees, timeout=240), expected)


@pytest.mark.parametrize("world,degrees", [
    (2, dict(data_parallel_shard_degree=1, tensor_parallel_degree=2)),
    (4, dict(data_parallel_shard_degree=2, tensor_parallel_degree=2)),
], ids=["tp", "fsdp_tp"])
def test_llama3_full_dtensor_backend(world, degrees):
    """Also: the MaxLogitRecorder reads full_dtensor's query/key DTensors (batch Shard(0), heads Shard(2))."""
    results = run_ranks(train_and_compare, world, "llama3", degrees, backend="full_dtensor", record=True, timeout=240)
    check(results)
    assert all(r[3] <= 1e-5 for r in results), [r[3] for r in results]


# Dion2 and NorDion2 through the preset (issue 40): the Muon group becomes a Dion2 group; the
# reference (reference_for) copies the container's groups, so it is single-device Dion2 on the full
# weights (checked against the float64 formulas in tests/rule/test_dion2_muon.py).
DION2_PRESETS = {
    "dion2": dict(dion2_fraction=0.25, dion2_ef_decay=0.9, adjust_lr="spectral_norm"),
    "nordion2": dict(dion2_fraction=0.5, dion2_ef_decay=0.8, normuon_beta2=0.9),
}


@pytest.mark.parametrize("preset,layout", [("dion2", "fsdp_tp"), ("nordion2", "tp")])
def test_llama3_dion2_matches_single_device_dion2(preset, layout):
    world, degrees, expected = LLAMA3_LAYOUTS[layout]
    groups = default_param_groups(lr=LR, **DION2_PRESETS[preset])
    check(run_ranks(train_and_compare, world, "llama3", degrees, config_kw=dict(param_groups=groups), timeout=240),
          expected)


def test_dion2_presets_build_dion2_groups():
    """default_param_groups(dion2_fraction=...) makes the Muon group a Dion2 (NorDion2) group with the
    given options and no momentum; momentum/nesterov with it are refused, naming them."""
    from optimizer.settings import DION2, kind_of

    for preset, options in DION2_PRESETS.items():
        opts = container_config(param_groups=default_param_groups(lr=LR, **options)).build(
            model_parts=[titan_fixture.plain_model("llama3")])
        muon = [g for g in opts.optimizers[0].param_groups if g["use_muon"]]
        assert muon and all(kind_of(g) == DION2 for g in muon), preset
        assert all(g[k] == v for g in muon for k, v in options.items()), preset
        assert all("momentum" not in g and "nesterov" not in g for g in muon), preset
    muon_kwargs = default_param_groups()[1].optimizer_kwargs  # without Dion2: Muon's momentum as before
    assert (muon_kwargs["momentum"], muon_kwargs["nesterov"]) == (0.95, True) and "dion2_fraction" not in muon_kwargs
    for given in (dict(momentum=0.9), dict(nesterov=False), dict(momentum=0.95)):
        with pytest.raises(ValueError, match=f"{next(iter(given))}.*dion2_fraction=0.25.*no momentum coefficient"):
            default_param_groups(dion2_fraction=0.25, **given)


def test_llama3_gather_mode():
    check(run_ranks(train_and_compare, 4, "llama3", dict(data_parallel_shard_degree=2, tensor_parallel_degree=2),
                    config_kw=dict(distributed_mode="gather"), timeout=240))


# ------------------------------------------------------------------------- qwen3 MoE, EP + FSDP

MOE_LAYOUTS = {
    "ep_fsdp": dict(data_parallel_shard_degree=4, expert_parallel_degree=2),
    "ep_tp_fsdp": dict(data_parallel_shard_degree=2, tensor_parallel_degree=2, expert_parallel_degree=2),
}


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_qwen3_moe_matches_single_device_muon(layout):
    placements = check(run_ranks(train_and_compare, 4, "qwen3_moe", MOE_LAYOUTS[layout], timeout=300))
    experts = {n: p for n, p in placements.items() if "inner_experts" in n}
    assert len(experts) == 3 * titan_fixture.LAYERS, placements
    if layout == "ep_fsdp":  # experts [E, out, in] on ('efsdp', 'ep'), as torchtitan lays them out
        assert set(experts.values()) == {"(_StridedShard(dim=0, sf=2), Shard(dim=0))"}, experts


# ------------------------------------------------------------------------------------ QK-clip

def materialised_max_logits(model: nn.Module, batches: list[torch.Tensor], expected_scale: float | None) -> dict:
    """Per layer, every query head's max of ``scale * q k^T`` over ``batches``, from full logit matrices.

    q and k are what torchtitan's attention hands its inner SDPA (after RoPE; MLA's [nope; rope]),
    captured on a single-device model; the logits are materialised as ``[B, H, L, L]`` in float64
    with the keys repeated for grouped-query heads and an explicit causal mask. The scale is the
    one the test derives from the model config (checked against what the module passes).
    """
    from torchtitan.models.common.attention import BaseAttention

    captured: dict = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, BaseAttention):
            block = name.rsplit(".attention", 1)[0]  # "layers.3" or "mtp_layers.0"
            key = int(block.split(".")[1]) if block.startswith("layers.") else block

            def grab(mod, args, kwargs, key=key):
                captured.setdefault(key, []).append((args[0].detach(), args[1].detach(), kwargs.get("scale"),
                                                     kwargs.get("is_causal", True)))
            hooks.append(m.inner_attention.register_forward_pre_hook(grab, with_kwargs=True))
    with torch.no_grad():
        for tokens in batches:
            model(tokens[:, :-1])
    for h in hooks:
        h.remove()
    out = {}
    for key, calls in captured.items():
        best = None
        for q, k, scale, causal in calls:
            assert causal is True
            if expected_scale is None:
                assert scale is None, scale
                scale = q.shape[-1] ** -0.5  # SDPA's default
            else:
                assert scale == pytest.approx(expected_scale, rel=1e-12), (scale, expected_scale)
            q, k = q.double().transpose(1, 2), k.double().transpose(1, 2)  # [B, H, L, D]
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            logits = scale * q @ k.transpose(-1, -2)
            seq = q.shape[2]
            logits = logits.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
            m = logits.amax(dim=(0, 2, 3)).float()
            best = m if best is None else torch.maximum(best, m)
        out[key] = best
    return out


def _mla_roles(name: str):
    """The reference's own classification of deepseek_v3 weights (MTP layer keyed apart from layers.0)."""
    parts = name.split(".")
    role = {"wq_b": "q", "wkv_b": "k"}.get(parts[-2]) if parts[-1] == "weight" else None
    if role is None:
        return None
    return (int(parts[1]) if parts[0] == "layers" else f"{parts[0]}.{parts[1]}", role)


def _expected_qk(model: str, orthogonalization: str, names) -> tuple[dict, dict, float | None]:
    """The reference's QKClipConfig kwargs, row blocks and softmax scale, from the fixture's sizes."""
    import math

    from titan_fixture import HEAD_DIM, HEADS, KV_HEADS, QK_NOPE, QK_ROPE, V_HEAD

    if model == "deepseek_v3":  # yarn with rope_factor 4 and mscale 0.7 multiplies the scale by mscale^2
        scale = (QK_NOPE + QK_ROPE) ** -0.5 * (0.1 * 0.7 * math.log(4.0) + 1.0) ** 2
        return dict(mla=MLAHeads(QK_NOPE, QK_ROPE, V_HEAD), classify=_mla_roles), {}, scale
    fused = FusedQKV(HEADS, KV_HEADS, HEAD_DIM, "grouped")
    spec = {"split": fused, "per_head": SplitQKV(fused, per_head=True), "whole": None}[orthogonalization]
    return dict(fused_qkv=fused), {n: spec for n in names if n.endswith("wqkv.weight") and spec is not None}, None


def _qk_clip_rank(rank, world, model, degrees, orthogonalization, steps=2):
    """Train with QK-clip whose logits the MaxLogitRecorder takes from torchtitan's attention, each
    data-parallel rank on its own batches; step a single-device reference with its own QK-clip
    config, row blocks and logits materialised from the reference weights."""
    parallel, full, dims = titan_fixture.build(model, world, **degrees)
    dp = dims.dp_replicate * dims.dp_shard
    stream = titan_fixture.data_parallel_rank(dims)
    qk_kwargs, row_blocks, scale = _expected_qk(model, orthogonalization, full)
    plain = titan_fixture.plain_model(model, full)

    def batches(step):
        return [titan_fixture.batch_tokens(step, stream=d) for d in range(dp)]

    wanted = [materialised_max_logits(plain, batches(0), scale)]
    threshold = torch.cat(list(wanted[0].values())).median().item()  # about half the heads clip at step 0
    opts = container_config(qk_clip_threshold=threshold, fused_qkv_orthogonalization=orthogonalization).build(
        model_parts=[parallel])
    recorder = MaxLogitRecorder.for_parallel_dims([parallel], dims, layers=opts.qk_layers)
    recorded = []
    opts.set_qk_logits_fn(lambda parts: recorded.append(recorder(parts)) or recorded[-1])
    ref_params, ref = reference_for(opts, full, qk_clip=QKClipConfig(threshold=threshold, **qk_kwargs),
                                    row_blocks=row_blocks)
    clipped = []
    for step in range(steps):
        if step:
            with torch.no_grad():
                titan_fixture.load_full_weights(plain, {n: p.detach() for n, p in ref_params.items()})
            wanted.append(materialised_max_logits(plain, batches(step), scale))
        titan_fixture.forward_backward(parallel, step, dims, stream=stream)
        grads = {n: titan_fixture.full_tensor(p.grad) for n, p in parallel.named_parameters()}
        opts.step()
        opts.zero_grad()
        clipped.append(opts.optimizers[0].qk_clip_report.clipped_heads)
        for n, p in ref_params.items():
            p.grad = grads[n]
        ref.step(qk_logits=wanted[-1])
    deviation = {n: (titan_fixture.full_tensor(p.detach()) - ref_params[n].detach()).abs().max().item()
                 for n, p in parallel.named_parameters()}
    moved = {n: (ref_params[n].detach() - full[n]).abs().max().item() for n in full}
    placements = {n: str(tuple(p.placements)) if hasattr(p, "placements") else "plain"
                  for n, p in parallel.named_parameters()}
    blocks = {n: (g.get(ROW_BLOCKS_KEY) or {}).get(n) for g in opts.optimizers[0].param_groups
              for n in g["param_names"] if "wqkv" in n}
    return (deviation, moved, placements), recorded, wanted, clipped, blocks


def check_qk_clip(results, n_layers):
    check([results[0][0]])
    recorded, wanted, clipped = results[0][1], results[0][2], results[0][3]
    for rank, other in enumerate(results[1:], 1):  # every rank passed the same logits to Muon
        for mine, theirs in zip(recorded, other[1]):
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), rank
    for step, (got, want) in enumerate(zip(recorded, wanted)):
        assert got.keys() == want.keys() and len(got) == n_layers, (got.keys(), want.keys())
        for layer in want:
            torch.testing.assert_close(got[layer], want[layer], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"step {step} layer {layer!r}: {m}")
    total = sum(v.numel() for v in wanted[0].values())
    assert 0 < sum(clipped[0].values()) < total, clipped  # some heads clipped, some not: not vacuous


@pytest.mark.parametrize("layout,orthogonalization", [
    ("fsdp", "whole"), ("fsdp_tp", "split"), ("fsdp_tp", "per_head"),
])
def test_fused_qkv_qk_clip_with_recorded_logits_matches_single_device(layout, orthogonalization):
    """torchtitan's default fused wqkv: QK-clip (grouped layout read from the model) with logits the
    recorder takes from the attention, and split orthogonalisation, equal single-device Muon given
    an independently built QKClipConfig / row blocks and logits materialised from the same weights."""
    world, degrees, _ = LLAMA3_LAYOUTS[layout]
    results = run_ranks(_qk_clip_rank, world, "llama3_fused", degrees, orthogonalization, timeout=240)
    check_qk_clip(results, titan_fixture.LAYERS)
    expected = {"whole": None, "split": "FusedQKV", "per_head": "SplitQKV"}[orthogonalization]
    assert {type(b).__name__ if b is not None else None for b in results[0][4].values()} == {expected}


def test_mla_qk_clip_with_recorded_logits_matches_single_device():
    """deepseek_v3 (MLA with query LoRA, YaRN softmax scale, MoE, one MTP layer) under EP + TP + FSDP:
    QK-clip on wq_b / wkv_b with recorded logits equals single-device Muon."""
    degrees = dict(data_parallel_shard_degree=2, tensor_parallel_degree=2, expert_parallel_degree=2)
    results = run_ranks(_qk_clip_rank, 4, "deepseek_v3", degrees, "whole", timeout=300)
    check_qk_clip(results, titan_fixture.LAYERS + 1)
    placements = results[0][0][2]
    assert placements["layers.1.attention.wq_b.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["layers.1.moe.routed_experts.inner_experts.w1_EFD"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"


def test_qk_layouts_read_from_the_model_are_the_rows_torchtitan_computes_with():
    """The FusedQKV ("grouped") and MLAHeads the container reads from the attention modules name the
    weight rows torchtitan's own forward uses for each head's query, key and value: checked by
    running the modules on random inputs, not by reading their code."""
    from optimizer.attention_layouts import Part
    from titan_fixture import DIM, HEAD_DIM, HEADS, KV_HEADS, QK_NOPE, QK_ROPE, V_HEAD

    model = titan_fixture.plain_model("llama3_fused")
    fused = container_config(qk_clip_threshold=100.0).build(model_parts=[model]).qk_clip_config.fused_qkv
    assert fused == FusedQKV(HEADS, KV_HEADS, HEAD_DIM, "grouped")
    qkv = model.layers["0"].attention.qkv_linear
    x = torch.randn(2, 5, DIM)
    with torch.no_grad():
        outputs = dict(zip((Part.Q, Part.K, Part.V), qkv(x)))  # each [B, L, heads, head_dim]
        layout, w = fused.row_layout(), qkv.wqkv.weight
        for part, out in outputs.items():
            for h in range(out.shape[2]):
                torch.testing.assert_close(out[:, :, h], x @ w[layout.rows(part, h)].T, msg=f"{part!r} head {h}")

    model = titan_fixture.plain_model("deepseek_v3")
    mla = container_config(qk_clip_threshold=100.0).build(model_parts=[model]).qk_clip_config.mla
    assert mla == MLAHeads(QK_NOPE, QK_ROPE, V_HEAD)
    attn, seen = model.layers["0"].attention, {}

    def grab(key):
        def hook(module, args):
            seen[key] = args[0] if key != "qkv" else args
        return hook

    hooks = [attn.wq_b.register_forward_pre_hook(grab("q_latent")),
             attn.wkv_b.register_forward_pre_hook(grab("kv_latent")),
             attn.inner_attention.register_forward_pre_hook(grab("qkv"))]
    with torch.no_grad():
        model(titan_fixture.batch_tokens(0)[:, :-1])
    for h in hooks:
        h.remove()
    q, k, v = seen["qkv"]  # [B, L, heads, nope + rope] after RoPE; v [B, L, heads, v_head_dim]
    q_rows, kv_rows = mla.q_layout(HEADS), mla.kv_b_layout(HEADS)
    for h in range(HEADS):
        project_q = seen["q_latent"] @ attn.wq_b.weight[q_rows.rows(Part.Q_NOPE, h)].T
        torch.testing.assert_close(q[:, :, h, :QK_NOPE], project_q.detach())
        project_k = seen["kv_latent"] @ attn.wkv_b.weight[kv_rows.rows(Part.K_NOPE, h)].T
        torch.testing.assert_close(k[:, :, h, :QK_NOPE], project_k.detach())
        project_v = seen["kv_latent"] @ attn.wkv_b.weight[kv_rows.rows(Part.V, h)].T
        torch.testing.assert_close(v[:, :, h], project_v.detach())
        # q_pe rows: RoPE rotates pairs of features, so each pair keeps its length
        rope = (seen["q_latent"] @ attn.wq_b.weight[q_rows.rows(Part.Q_PE, h)].T).detach().unflatten(-1, (-1, 2))
        torch.testing.assert_close(q[:, :, h, QK_NOPE:].unflatten(-1, (-1, 2)).norm(dim=-1), rope.norm(dim=-1))


def test_recorder_keeps_the_steps_max_and_records_only_training_forwards():
    """Running max over a step's forwards (gradient accumulation); every=2 records every other step;
    forwards without grad and activation-checkpoint recomputation in backward are not recorded."""
    from torch.utils.checkpoint import checkpoint

    model = titan_fixture.plain_model("llama3_fused")
    recorder = MaxLogitRecorder([model], every=2)
    a, b, c = (titan_fixture.batch_tokens(0, stream=i) for i in (0, 1, 3))
    want = materialised_max_logits(model, [a, b], None)
    # premises: the second batch raises some maxima, and so would the unrecorded third
    for other in (materialised_max_logits(model, [a], None), materialised_max_logits(model, [a, b, c], None)):
        assert any(not torch.equal(want[k], other[k]) for k in want)
    model(a[:, :-1])
    with torch.no_grad():
        model(c[:, :-1])  # validation: not recorded
    model(b[:, :-1])
    got = recorder([model])
    assert got.keys() == want.keys() == {0, 1}
    for layer in want:
        torch.testing.assert_close(got[layer], want[layer], rtol=1e-5, atol=1e-7)

    assert not recorder.recording  # step 1 of every=2
    model(a[:, :-1])
    assert recorder._forwards == 0 and recorder([model]) is None

    assert recorder.recording  # step 2: a checkpointed forward is recorded once, not again in backward
    checkpoint(lambda t: model(t).sum(), a[:, :-1], use_reentrant=False).backward()
    assert recorder._forwards == titan_fixture.LAYERS
    recorder([model])

    recorder([model])  # step 3 (not recorded); step 4 had only a no-grad forward:
    with torch.no_grad():
        model(a[:, :-1])
    with pytest.raises(RuntimeError, match="no training forward pass"):
        recorder([model])
    recorder.remove()
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_recorder_under_torch_compile():
    """torchtitan compiles each transformer block: the hook runs inside compiled blocks (eagerly,
    torch.compiler.disable) and records the same logits (backend aot_eager: no C++ toolchain needed)."""
    model = titan_fixture.plain_model("llama3_fused")
    tokens = titan_fixture.batch_tokens(0)
    want = materialised_max_logits(model, [tokens], None)
    recorder = MaxLogitRecorder([model])
    for name, block in model.layers.items():
        model.layers[name] = torch.compile(block, backend="aot_eager")
    model(tokens[:, :-1]).sum().backward()
    got = recorder([model])
    for layer in want:
        torch.testing.assert_close(got[layer], want[layer], rtol=1e-5, atol=1e-7)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_recorder_follows_flexattention_block_masks(monkeypatch):
    """torchtitan's language models use FlexAttention with its causal + packed-document BlockMask:
    the recorder takes the mask from the BlockMask, so a key in another document never counts."""
    import torchtitan.models.common.decoder as decoder
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common.attention import FlexAttention

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", flex_attention)  # eager: no inductor on CPU
    monkeypatch.setattr(decoder, "create_attention_mask", create_block_mask)
    config = titan_fixture.tiny_llama3(fuse_qkv=True)
    for layer in config.layers:
        layer.attention.inner_attention = FlexAttention.Config()
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    model.requires_grad_(False)  # eager flex_attention has no CPU backward; grad mode stays on (recorded)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3],
                              [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5]])
    tokens = titan_fixture.batch_tokens(0, seq=16)[:, :-1]
    masks = model.get_attention_masks(positions)
    recorder = MaxLogitRecorder([model])
    seen = {}
    for i in (0, 1):
        def grab(module, args, i=i):
            seen[i] = (args[0].detach(), args[1].detach())
        model.layers[str(i)].attention.inner_attention.register_forward_pre_hook(grab)
    model(tokens, positions, masks)
    got = recorder([model])

    doc = torch.cumsum(positions == 0, dim=1) - 1
    same_doc_causal = (doc[:, :, None] == doc[:, None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    for i, (q, k) in seen.items():
        q, k = q.double().transpose(1, 2), k.double().transpose(1, 2).repeat_interleave(HEADS_PER_KV, dim=1)
        logits = q @ k.transpose(-1, -2) * titan_fixture.HEAD_DIM ** -0.5
        want = logits.masked_fill(~same_doc_causal[:, None], float("-inf")).amax(dim=(0, 2, 3)).float()
        causal = logits.masked_fill(~same_doc_causal.new_ones(16, 16).tril(), float("-inf")).amax(dim=(0, 2, 3))
        assert not torch.allclose(causal.float(), want)  # premise: the document mask changes the maxima
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-7)

    inner = model.layers["0"].attention.inner_attention
    q = torch.randn(2, 16, titan_fixture.HEADS, titan_fixture.HEAD_DIM)
    with pytest.raises(ValueError, match="score_mod"):
        inner(q, q, q, attention_masks=masks, score_mod=lambda score, b, h, i, j: score)


def _qk_clipped_rank(rank, world, threshold):
    """Whether the container's QK-clip changed wq (vs. the same run with QK-clip off)."""
    out = []
    for on in (False, True):
        parallel, _, _ = titan_fixture.build("llama3", world, data_parallel_shard_degree=2)
        opts = container_config(**(dict(qk_clip_threshold=threshold) if on else {})).build(model_parts=[parallel])
        if on:
            opts.set_qk_logits_fn(lambda parts: {0: torch.full((4,), 1e4), 1: torch.full((4,), 1e4)})
        titan_fixture.forward_backward(parallel, 0)
        opts.step()
        out.append({n: titan_fixture.full_tensor(p.detach()) for n, p in parallel.named_parameters()})
    return out


def test_qk_clip_scales_q_and_k_only():
    off, on = run_ranks(_qk_clipped_rank, 2, 100.0, timeout=240)[0]
    scale = (100.0 / 1e4) ** 0.5
    for name in off:
        if name.endswith(("wq.weight", "wk.weight")):
            torch.testing.assert_close(on[name], off[name] * scale, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(on[name], off[name]), name


# ------------------------------------------------------------- torchtitan's LR scheduler

def _scheduler_rank(rank, world):
    from torchtitan.components.optimizer import LRSchedulersContainer

    parallel, full, _ = titan_fixture.build("llama3", world, data_parallel_shard_degree=2)
    opts = container_config().build(model_parts=[parallel])
    scheds = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5, decay_type="cosine").build(
        optimizers=opts, training_steps=4)
    ref_params, ref = reference_for(opts, full)
    lr_lambda = scheds.schedulers[0].lr_lambdas[0]
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lr_lambda)  # the same schedule, on single-device Muon
    lrs = []
    for step in range(4):
        titan_fixture.forward_backward(parallel, step)
        grads = {n: titan_fixture.full_tensor(p.grad) for n, p in parallel.named_parameters()}
        lrs.append([g["lr"] for g in opts.optimizers[0].param_groups])
        opts.step()
        opts.zero_grad()
        scheds.step()
        for n, p in ref_params.items():
            p.grad = grads[n]
        ref.step()
        ref_sched.step()
    deviation = max((titan_fixture.full_tensor(p.detach()) - ref_params[n].detach()).abs().max().item()
                    for n, p in parallel.named_parameters())
    return deviation, lrs


def test_torchtitan_lr_scheduler_drives_every_group():
    deviation, lrs = run_ranks(_scheduler_rank, 2, timeout=240)[0]
    assert deviation <= TOL
    assert lrs[0] == [LR / 2, LR / 2] and lrs[1] == [LR, LR]  # warmup, over both groups
    assert lrs[3][0] < LR  # decay


# ------------------------------------------------------- save / resume through torchtitan's checkpointing

def _snapshot(parallel, opts):
    """Full (unsharded) parameters, optimizer state and group lrs, keyed by name."""
    params = {n: titan_fixture.full_tensor(p.detach()).clone() for n, p in parallel.named_parameters()}
    state, lrs = {}, []
    for opt in opts.optimizers:
        for g in opt.param_groups:
            lrs.append(g["lr"])
            for n, p in zip(g["param_names"], g["params"]):
                for k, v in opt.state[p].items():
                    state[f"{n}/{k}"] = titan_fixture.full_tensor(v).clone()
    return params, state, lrs


def _checkpoint_rank(rank, world, folder, phase, degrees, preset=None):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    # the resuming run starts from other weights: everything it ends with must come from the checkpoint
    parallel, full, dims = titan_fixture.build("llama3", world, seed=0 if phase != "resume" else 1, **degrees)
    config_kw = {} if preset is None else dict(param_groups=default_param_groups(lr=LR, **DION2_PRESETS[preset]))
    opts = container_config(**config_kw).build(model_parts=[parallel])
    scheds = LRSchedulersContainer.Config(warmup_steps=4).build(optimizers=opts, training_steps=6)
    ckpt = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="ckpt", interval=1, last_save_model_only=False),
        dataloader=None, model_parts=[parallel], optimizers=opts, lr_schedulers=scheds, states={}, sd_adapter=None,
        base_folder=folder,
    )

    def train(steps):
        for step in steps:
            titan_fixture.forward_backward(parallel, step, dims)
            opts.step()
            opts.zero_grad()
            scheds.step()

    if phase == "resume":
        assert ckpt.load(step=2)
    else:
        train(range(2))
        ckpt.save(curr_step=2)
    at_checkpoint = _snapshot(parallel, opts)
    train(range(2, 4))
    ckpt.close()
    return at_checkpoint, _snapshot(parallel, opts)[0]


@pytest.mark.parametrize("save_degrees,load_degrees,preset", [
    (dict(data_parallel_shard_degree=2), dict(data_parallel_shard_degree=2), None),
    (dict(data_parallel_shard_degree=2), dict(data_parallel_shard_degree=1, tensor_parallel_degree=2), None),
    (dict(data_parallel_shard_degree=2), dict(data_parallel_shard_degree=2), "nordion2"),
    (dict(data_parallel_shard_degree=2), dict(data_parallel_shard_degree=1, tensor_parallel_degree=2), "nordion2"),
], ids=["fsdp->fsdp", "fsdp->tp", "nordion2-fsdp->fsdp", "nordion2-fsdp->tp"])
def test_save_and_resume_through_torchtitan_checkpoint(tmp_path, save_degrees, load_degrees, preset):
    """torchtitan's CheckpointManager (DCP, FQN-keyed flat optimizer state) saves and restores Muon.

    The resumed run restores every parameter, every momentum / AdamW state tensor and the
    scheduled lr exactly, also into another layout (DCP reshards FSDP's Shard(0) into TP's
    _StridedShard). On the same layout, steps 3-4 then land where the uninterrupted run does
    (on another layout the gradients themselves differ by rounding, so only the state is compared).
    """
    (saved, saved_final) = run_ranks(_checkpoint_rank, 2, str(tmp_path), "save", save_degrees, preset, timeout=240)[0]
    (loaded, loaded_final) = run_ranks(_checkpoint_rank, 2, str(tmp_path), "resume", load_degrees, preset,
                                       timeout=240)[0]
    for want, got in zip(saved[:2], loaded[:2]):
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), name
    assert any(k.endswith("momentum_buffer") for k in saved[1]) and any(k.endswith("exp_avg_sq") for k in saved[1])
    assert any(k.endswith("normuon_v") for k in saved[1]) == (preset == "nordion2")  # NorDion2's v saved and restored
    assert loaded[2] == saved[2] and 0 < saved[2][0] < LR  # mid-warmup lr restored
    if save_degrees == load_degrees:
        for name, want in saved_final.items():
            torch.testing.assert_close(loaded_final[name], want, atol=TOL, rtol=0, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- presets and refusals (one process)

def _named(cfg):
    with torch.device("meta"):
        return dict(cfg.build().named_parameters())


@pytest.mark.parametrize("make", [titan_fixture.tiny_llama3, titan_fixture.tiny_qwen3_moe], ids=["llama3", "qwen3_moe"])
def test_default_presets_fit_torchtitan_models(make):
    import re

    params = _named(make())
    adamw = {n for n in params if re.search(ADAMW_PATTERN, n)}
    assert {"tok_embeddings.weight", "lm_head.weight", "norm.weight"} <= adamw
    assert all(params[n].ndim in (2, 3) for n in set(params) - adamw)  # everything left is a matrix or experts
    assert all(params[n].ndim == 1 for n in adamw if n.endswith("norm.weight"))
    if make is titan_fixture.tiny_qwen3_moe:
        assert {n for n in params if "router.gate" in n} <= adamw
        assert any(params[n].ndim == 3 for n in set(params) - adamw)  # expert stacks go to Muon


class _ConvPart(nn.Module):
    """A custom model part torchtitan's presets do not know: a conv stem, a per-channel scale
    ``[1, C, 1]`` and a hidden Linear."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(4, 8, 3)
        self.gain = nn.Parameter(torch.ones(1, 8, 1))
        self.mix = nn.Linear(8, 8, bias=False)


def test_muon_patterns_cannot_claim_what_muon_cannot_read_as_a_matrix(caplog):
    """The roles' rule in the torchtitan adapter (issue 30): a Muon pattern matching a convolution's
    kernel (by its module) or a vector in disguise is refused at build time, naming each parameter
    and what to do; matched first by an AdamW pattern, they build, and the table of where each
    parameter went is logged at DEBUG level."""
    import logging

    from torchtitan.components.optimizer import ParamGroupConfig

    message = _refusal(container_config, _ConvPart())
    assert message is not None
    assert "'stem.weight' of shape (8, 4, 3)" in message and "conv" in message
    assert "'gain' of shape (1, 8, 1)" in message and "vector in disguise" in message
    assert "'mix.weight'" not in message and "AdamW ParamGroupConfig placed before the Muon one" in message
    groups = [ParamGroupConfig(pattern=r"^stem\.|^gain$", optimizer_name="AdamW"),
              ParamGroupConfig(pattern=".*", optimizer_name="Muon")]
    with caplog.at_level(logging.DEBUG, logger="optimizer.integrations.torchtitan"):
        opts = container_config(param_groups=groups).build(model_parts=[_ConvPart()])
    assert [(g["use_muon"], g["param_names"]) for g in opts.optimizers[0].param_groups] == [
        (False, ["gain", "stem.weight", "stem.bias"]), (True, ["mix.weight"])]
    tables = [r.getMessage() for r in caplog.records if "where each parameter went" in r.getMessage()]
    assert len(tables) == 1 and "pattern '.*'; the role's rule: 2-D weight" in tables[0]
    assert "stem.weight" in tables[0] and "module Conv1d" in tables[0]


# Every per-group option a torchtitan param group may set, with a value other than its default.
# A Muon option added to settings.GROUP_OPTIONS without an entry here fails the test below.
MUON_GROUP_VALUES = {
    "lr": 0.03, "weight_decay": 0.2, "momentum": 0.9, "nesterov": False, "ns_steps": 4,
    "ns_coefficients": "polar_express", "ns_method": "classic", "eps": 1e-6, "ns_split": "never", "ns_kernels": "torch",
    "adjust_lr": "original", "maximize": True, "muon_transposed": False, "normuon_beta2": 0.9,
    "cautious_wd": True, "momentum_dtype": torch.bfloat16,
}
ADAMW_GROUP_VALUES = {"lr": 0.03, "weight_decay": 0.2, "betas": (0.8, 0.9), "eps": 1e-6, "maximize": True,
                      "cautious_wd": True}


def test_every_group_option_passes_through_torchtitan_param_groups():
    """A group's ``optimizer_kwargs`` reach the optimizer's group unchanged, for every per-group
    option the optimizer declares (except the row blocks, which the container sets itself)."""
    from torchtitan.components.optimizer import ParamGroupConfig

    from optimizer.settings import ADAMW, MUON, options_of

    # dion2_fraction makes a group Dion2 (no momentum/nesterov: not with the values below) and
    # algorithm="lion" makes an AdamW group Lion: each runs through here as any option does; a
    # Dion2 group refuses the `momentum`/`nesterov` values below, so dion2_fraction has no case here
    declared = {o.name for o in options_of(MUON)} - {ROW_BLOCKS_KEY, "dion2_fraction"}
    assert declared == set(MUON_GROUP_VALUES), "a new Muon group option needs a value in MUON_GROUP_VALUES"
    assert {o.name for o in options_of(ADAMW)} - {"algorithm"} == set(ADAMW_GROUP_VALUES)
    cfg = container_config(param_groups=[
        ParamGroupConfig(pattern=ADAMW_PATTERN, optimizer_name="AdamW", optimizer_kwargs=dict(ADAMW_GROUP_VALUES)),
        ParamGroupConfig(pattern=".*", optimizer_name="Muon", optimizer_kwargs=dict(MUON_GROUP_VALUES)),
    ])
    opts = cfg.build(model_parts=[titan_fixture.plain_model("llama3")])
    muon = [g for g in opts.optimizers[0].param_groups if g["use_muon"]]
    adamw = [g for g in opts.optimizers[0].param_groups if not g["use_muon"]]
    assert muon and adamw
    for groups, values in ((muon, MUON_GROUP_VALUES), (adamw, ADAMW_GROUP_VALUES)):
        for g in groups:
            for name, value in values.items():
                # an optional option at its default is not held (muon_transposed False)
                assert g.get(name, False if name == "muon_transposed" else None) == value, name


def test_dion2_group_options_pass_through_torchtitan_param_groups():
    """A "Muon" param group with ``dion2_fraction`` is a Dion2 group: every option a Dion2 group
    declares (settings.GROUP_OPTIONS) reaches it unchanged, ``dion2_ef_decay`` included."""
    from torchtitan.components.optimizer import ParamGroupConfig

    from optimizer.settings import DION2, options_of

    values = {**{k: v for k, v in MUON_GROUP_VALUES.items() if k not in ("momentum", "nesterov")},
              "dion2_fraction": 0.25, "dion2_ef_decay": 0.9}
    assert {o.name for o in options_of(DION2)} - {ROW_BLOCKS_KEY} == set(values), "a new Dion2 option needs a value"
    cfg = container_config(param_groups=[
        ParamGroupConfig(pattern=ADAMW_PATTERN, optimizer_name="AdamW"),
        ParamGroupConfig(pattern=".*", optimizer_name="Muon", optimizer_kwargs=dict(values)),
    ])
    muon = [g for g in cfg.build(model_parts=[titan_fixture.plain_model("llama3")]).optimizers[0].param_groups
            if g["use_muon"]]
    assert muon and all(g.get(name, False if name == "muon_transposed" else None) == value
                        for g in muon for name, value in values.items())


def _refusal(make, model: str | nn.Module = "llama3"):
    """The ValueError message of building the container (``make() -> Config``) on a plain model, or None."""
    try:
        make().build(model_parts=[titan_fixture.plain_model(model) if isinstance(model, str) else model])
    except ValueError as err:
        return str(err)
    return None


def test_bad_configs_are_refused_clearly():
    """Each bad setting is refused when the container is built, naming the setting (or the weights) and what to do."""
    from torchtitan.components.optimizer import ParamGroupConfig

    cases = {
        "implementation": (dict(implementation="fused"), "leave it at 'auto'"),
        "dtype": (dict(compute_dtype="fp8"), "compute_dtype must be one of"),
        "logits-without-threshold": (dict(qk_logits_fn="some.module:fn"), "qk_logits_fn is set but qk_clip_threshold"),
        "record-without-threshold": (dict(record_max_logits_every=1), "record_max_logits_every is set but qk_clip"),
        "record-every": (dict(qk_clip_threshold=100.0, record_max_logits_every=0), "record_max_logits_every must be"),
        "two-logit-sources": (dict(qk_clip_threshold=100.0, record_max_logits_every=1, qk_logits_fn="a.b:c"),
                              "qk_logits_fn and record_max_logits_every are both set"),
        "orthogonalization": (dict(fused_qkv_orthogonalization="rows"), "fused_qkv_orthogonalization must be one of"),
        "record-dtype": (dict(record_max_logits_dtype="fp8"), "record_max_logits_dtype must be"),
        "optimizer-name": (dict(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="DistMuon")]),
                           "use 'Muon' for matrices or 'AdamW'"),
        "kwargs": (dict(param_groups=[ParamGroupConfig(pattern="wq", optimizer_name="Muon",
                                                       optimizer_kwargs={"adjust_lr_fn": "original"})]),
                   "unknown optimizer_kwargs ['adjust_lr_fn']"),
        "unmatched": (dict(param_groups=[ParamGroupConfig(pattern="nothing-is-called-this", optimizer_name="Muon")]),
                      "matched no parameter"),
        "unclaimed": (dict(param_groups=[ParamGroupConfig(pattern="wq", optimizer_name="Muon")]),
                      "no param group pattern matches"),
        "no-q-k-weights": (dict(qk_clip_threshold=100.0, qk_clip_q_patterns=("nope",), qk_clip_k_patterns=("nix",)),
                           "no Muon-group parameter is a query or key weight"),
        "k-without-q": (dict(qk_clip_threshold=100.0, qk_clip_q_patterns=("nope",)), "but no query weight was"),
        "q-without-k": (dict(qk_clip_threshold=100.0, qk_clip_k_patterns=("nope",)), "but no key weight was"),
        "q-in-adamw": (dict(qk_clip_threshold=100.0, param_groups=[
            ParamGroupConfig(pattern=ADAMW_PATTERN + "|wq", optimizer_name="AdamW"),
            ParamGroupConfig(pattern=".*", optimizer_name="Muon")]), "sits in an AdamW group"),
        "mla-head-dim": (dict(qk_clip_threshold=100.0, qk_clip_head_dim=16), "qk_clip_head_dim is set, but the model"),
        "qk-norm": (dict(qk_clip_threshold=100.0), "undoes that scaling: QK-clip would change nothing"),
    }
    models = {"mla-head-dim": "deepseek_v3", "qk-norm": "qwen3_moe"}  # qwen3 normalises q and k per head
    for name, (config_kw, expected) in cases.items():
        message = _refusal(lambda: container_config(**config_kw), models.get(name, "llama3"))
        assert message is not None and expected in message, (name, message)

    # the premise of the "qk-norm" refusal: under qwen3's per-head q/k norms, halving wq and wk (a 4x smaller
    # logit without norms) leaves the logits but for the norms' eps (noticeable only at this tiny init scale)
    qwen, tokens, scale = titan_fixture.plain_model("qwen3_moe"), titan_fixture.batch_tokens(0), titan_fixture.HEAD_DIM ** -0.5
    before = materialised_max_logits(qwen, [tokens], scale)
    with torch.no_grad():
        for block in qwen.layers.values():
            block.attention.qkv_linear.wq.weight.mul_(0.5)
            block.attention.qkv_linear.wk.weight.mul_(0.5)
    after = materialised_max_logits(qwen, [tokens], scale)
    for layer in before:
        torch.testing.assert_close(after[layer], before[layer], rtol=2e-3, atol=0)


def test_missing_logits_source_and_unsupported_attention_are_refused():
    """QK-clip with recording on but no recorder installed fails the step saying how to install it; a
    fused wqkv of another class than torchtitan's FusedQKVLinear (row order unknown) is refused for
    QK-clip and split orthogonalisation, not guessed; the recorder refuses attention it cannot
    reproduce (varlen attention; a FlexAttention score_mod is refused when seen, in the flex test)."""
    from torchtitan.models.common.attention import VarlenAttention

    model = titan_fixture.plain_model("llama3_fused")
    other = nn.Module()
    other.wqkv = model.layers["0"].attention.qkv_linear.wqkv
    model.layers["0"].attention.qkv_linear = other  # only the container is built: no forward
    assert "(or set it to 'whole')" in _refusal(lambda: container_config(), model)
    assert "QK-clip needs the row order" in _refusal(
        lambda: container_config(fused_qkv_orthogonalization="whole", qk_clip_threshold=100.0), model)
    assert _refusal(lambda: container_config(fused_qkv_orthogonalization="whole"), model) is None

    model = titan_fixture.plain_model("llama3_fused")
    opts = container_config(qk_clip_threshold=100.0, record_max_logits_every=1).build(model_parts=[model])
    titan_fixture.forward_backward(model, 0)
    with pytest.raises(RuntimeError, match="install_max_logit_recorder"):
        opts.step()
    with pytest.raises(ValueError, match="every must be a positive int"):
        MaxLogitRecorder([model], every=0)
    with pytest.raises(ValueError, match="no torchtitan attention module .* for layers \\[7\\]"):
        MaxLogitRecorder([model], layers=[7])
    model.layers["1"].attention.inner_attention = VarlenAttention(VarlenAttention.Config())
    with pytest.raises(ValueError, match="'layers.1.attention.inner_attention' is VarlenAttention"):
        MaxLogitRecorder([model])
    assert not model.layers["0"].attention.inner_attention._forward_pre_hooks  # nothing left behind


def _hidden_shard_rank(rank, world):
    """torchtitan's spmd_types backend without FSDP: Module.parallelize leaves TP shards as plain tensors."""
    import types

    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    titan_fixture.use_cpu()
    parallelism = ParallelismConfig(spmd_backend="spmd_types", data_parallel_shard_degree=1, tensor_parallel_degree=2)
    titan_fixture._dist_utils.set_spmd_backend("spmd_types")
    cfg = titan_fixture.tiny_llama3()
    cfg.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = cfg.build()
    model.parallelize(ParallelDims.from_config(parallelism, world))
    model.to_empty(device="cpu")
    hidden = find_hidden_shards([model])
    try:
        container_config().build(model_parts=[model])
        err = None
    except ValueError as e:
        err = str(e)
    return hidden, err, {n: type(p).__name__ for n, p in model.named_parameters()}


def test_plain_tensor_shards_are_refused():
    hidden, err, kinds = run_ranks(_hidden_shard_rank, 2, timeout=120)[0]
    assert set(kinds.values()) == {"Parameter"}  # the premise: no DTensors
    assert any("wq.weight': local shape (32, 64), declared (64, 64)" in h for h in hidden), hidden
    assert not any("norm" in h for h in hidden)  # replicated norms are whole: not reported
    assert err is not None and "spmd_backend" in err and "partial_dtensor" in err


def test_importing_the_adapter_without_torchtitan_says_how_to_install(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "torchtitan.components.optimizer", None)  # import of it fails
    for name in [n for n in sys.modules if n.startswith("optimizer.integrations.torchtitan")]:
        monkeypatch.delitem(sys.modules, name)  # the adapter package and its modules, as in a fresh process
    with pytest.raises(ImportError, match="pip install torchtitan==0.3.0"):
        importlib.import_module("optimizer.integrations.torchtitan")
    monkeypatch.undo()
    importlib.import_module("optimizer.integrations.torchtitan")


# ------------------------------------------------------------------ torchtitan's own DistMuon

def _dist_muon_rank(rank, world, degrees):
    from optimizer.integrations.torchtitan import build_torchtitan_dist_muon, dist_muon_compute_layouts

    parallel, _, _ = titan_fixture.build("qwen3_moe", world, **degrees)
    matrices = [(n, p) for n, p in parallel.named_parameters() if p.ndim in (2, 3)]
    try:
        layouts = {n: dict(l.shardings_by_mesh_axis) for n, l in dist_muon_compute_layouts(matrices).items()}
        kinds = {n: sorted(type(s).__name__ for s in spec.values()) for n, spec in layouts.items()}
        layout_error = None
    except ValueError as err:
        kinds, layout_error = None, str(err)
    try:
        build_torchtitan_dist_muon(matrices, lr=LR)
        build_error = None
    except RuntimeError as err:
        build_error = str(err)
    return kinds, layout_error, build_error


def test_dist_muon_layouts_and_cpu_refusal():
    """DistMuon (torchtitan's own distributed Muon) is CUDA-only: on CPU the builder says so before
    building; its compute layouts are Owned for whole matrices, Shard(0) for expert stacks, and
    _StridedShard (TP with FSDP, unsupported by DistMuon) is refused."""
    kinds, layout_error, build_error = run_ranks(_dist_muon_rank, 2, dict(data_parallel_shard_degree=2), timeout=120)[0]
    assert layout_error is None and "only on CUDA" in build_error
    assert kinds["layers.0.attention.qkv_linear.wq.weight"] == ["Owned"]
    assert kinds["layers.0.moe.routed_experts.inner_experts.w1_EFD"] == ["Shard"]
    kinds, layout_error, _ = run_ranks(
        _dist_muon_rank, 4, dict(data_parallel_shard_degree=2, tensor_parallel_degree=2), timeout=120)[0]
    assert kinds is None and "_StridedShard" in layout_error


# ------------------------------------------------------------- the documented config module

EXAMPLE_CONFIGS = ["llama3_debugmodel_muon", "llama3_8b_muon", "qwen3_moe_debug_muon", "llama3_debugmodel_muonclip",
                   "deepseek_v3_debugmodel_muonclip"]


def _example_rank(rank, world):
    """Parse the example configs with torchtitan's ConfigManager (CLI overrides included), then do
    what the trainer does with them on tiny models: config.optimizer.build(model_parts=...), then
    model_spec.post_optimizer_build_fn(optimizers, model_parts, parallel_dims), then train a step."""
    from torchtitan.config import ConfigManager

    def parse(name, *overrides):
        return ConfigManager().parse_args(["--module", "examples.torchtitan_muon", "--config", name, *overrides])

    parsed = {}
    for name in EXAMPLE_CONFIGS:
        cfg = parse(name, "--optimizer.distributed_mode", "gather")
        parsed[name] = (type(cfg.optimizer).__qualname__, cfg.optimizer.distributed_mode, cfg.optimizer.qk_clip_threshold,
                        cfg.parallelism.spmd_backend, cfg.optimizer.record_max_logits_every)
        assert isinstance(cfg.optimizer, MuonOptimizersContainer.Config)
    parallel, _, _ = titan_fixture.build("llama3", world, data_parallel_shard_degree=1)
    opts = parse("llama3_debugmodel_muon").optimizer.build(model_parts=[parallel])
    groups = [(g["use_muon"], len(g["params"])) for g in opts.optimizers[0].param_groups]

    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    titan_fixture.use_cpu()
    dims = ParallelDims.from_config(ParallelismConfig(), world)
    reports = {}
    for name, model in (("llama3_debugmodel_muonclip", "llama3_fused"), ("deepseek_v3_debugmodel_muonclip", "deepseek_v3")):
        dtype = "bfloat16" if model == "llama3_fused" else "float32"
        cfg = parse(name, "--optimizer.record_max_logits_every", "2", "--optimizer.record_max_logits_dtype", dtype)
        parallel = titan_fixture.plain_model(model)
        opts = cfg.optimizer.build(model_parts=[parallel])
        cfg.model_spec.post_optimizer_build_fn(opts, [parallel], dims)
        pre_hooks = len(opts._optimizer_step_pre_hooks)  # deepseek_v3's MoE load balancing hook, chained
        clipped = []
        for step in range(2):
            titan_fixture.forward_backward(parallel, step, dims)
            opts.step()
            opts.zero_grad()
            report = opts.optimizers[0].qk_clip_report
            clipped.append(None if report is None else sorted(report.max_logit, key=str))
        reports[name] = (clipped, pre_hooks, type(opts._qk_logits_fn).__name__, str(opts._qk_logits_fn.compute_dtype))
    return parsed, groups, reports


def test_example_configs_parse_and_build():
    parsed, groups, reports = run_ranks(_example_rank, 1, timeout=120)[0]
    for name, (kind, mode, threshold, backend, every) in parsed.items():
        assert (kind, mode, backend) == ("MuonOptimizersContainer.Config", "gather", "partial_dtensor"), parsed[name]
        assert (threshold, every) == ((100.0, 1) if name.endswith("muonclip") else (None, None)), parsed[name]
    n_layers = titan_fixture.LAYERS
    assert groups == [(False, 3 + 2 * n_layers), (True, 7 * n_layers)]  # emb, head, norms / q k v o w1 w2 w3
    # the trainer's post_optimizer_build_fn installs the recorder; with --optimizer.record_max_logits_every 2
    # the first step clips from recorded logits and the second does not clip
    assert reports["llama3_debugmodel_muonclip"] == ([[0, 1], None], 0, "MaxLogitRecorder", "torch.bfloat16")
    clipped, pre_hooks, source, dtype = reports["deepseek_v3_debugmodel_muonclip"]
    assert clipped == [[0, 1, "mtp_layers.0"], None] and pre_hooks == 1 and (source, dtype) == (
        "MaxLogitRecorder", "torch.float32")


def test_each_model_part_clips_only_its_own_layers():
    """Pipeline parallelism gives one model part per stage (FQNs kept, other layers removed): each
    part's Muon receives only its layers' logits, and together they clip as one Muon over the whole model."""
    import copy

    torch.manual_seed(0)
    whole = titan_fixture.tiny_llama3().build()
    with torch.no_grad():
        whole.init_weights(buffer_device=torch.device("cpu"))
    parts = [copy.deepcopy(whole), copy.deepcopy(whole)]
    del parts[0].layers["1"], parts[1].layers["0"]
    for part in parts:  # as pipeline splitting does: the first stage keeps the embeddings, the last the head
        part.config = None
    del parts[1].tok_embeddings, parts[0].norm, parts[0].lm_head
    logits = {0: torch.tensor([150.0, 20.0, 400.0, 99.0]), 1: torch.tensor([10.0, 120.0, 5.0, 300.0])}
    opts = container_config(qk_clip_threshold=100.0).build(model_parts=parts)
    seen = []
    opts.set_qk_logits_fn(lambda model_parts: seen.append(len(model_parts)) or logits)
    ref_opt = container_config(qk_clip_threshold=100.0).build(model_parts=[whole])
    ref_opt.set_qk_logits_fn(lambda model_parts: logits)
    g = torch.Generator().manual_seed(5)
    grads = {n: torch.randn(p.shape, generator=g) for n, p in whole.named_parameters()}
    for model in (whole, *parts):
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
    opts.step()
    ref_opt.step()
    assert seen == [2] and [len(o.optimizers) for o in (opts, ref_opt)] == [2, 1]
    want = dict(whole.named_parameters())
    compared = 0
    for part in parts:
        for n, p in part.named_parameters():
            if n.startswith("layers."):
                assert torch.equal(p, want[n]), n
                compared += 1
    assert compared == 2 * 9  # 2 norms + q k v o w1 w2 w3 per layer
    assert [sorted(o.qk_clip_report.max_logit) for o in opts.optimizers] == [[0], [1]]
    assert [o.qk_clip_report.clipped_heads for o in opts.optimizers] == [{0: 2}, {1: 2}]
