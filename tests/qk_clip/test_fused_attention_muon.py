"""Fused q/k/v through ``Muon.step``: split orthogonalisation and QK-clip equal separate weights.

A fused ``wqkv`` declared with ``muon_row_blocks=FusedQKV(...)`` (and, for QK-clip,
``QKClipConfig(fused_qkv=...)``) must be updated exactly as the separate ``wq``/``wk``/``wv``
would be: each block orthogonalised on its own with its own adjusted learning rate, and
each q/k row clipped by its own head.  The reference is Muon on the separate weights (on
one device); the fused weight is checked whole on one device, and sharded with
FSDP+TP-style interleaved rows in the parallel pipeline (whose owner splits the gathered
matrix into blocks).
"""

from __future__ import annotations

import pytest
import torch

from dist_cases import parse_placement, to_dtensor
from harness import run_ranks
from optimizer import Muon, QKClipConfig
from optimizer.attention_layouts import FusedQKV, Part

N_HEADS, N_KV, HEAD_DIM, DIM = 4, 2, 4, 12
STEPS, THRESHOLD = 3, 1.0
KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr="match_rms_adamw")


def _inputs(n_kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"wq": (N_HEADS * HEAD_DIM, DIM), "wk": (n_kv * HEAD_DIM, DIM), "wv": (n_kv * HEAD_DIM, DIM)}
    params = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(STEPS)]
    logits = [{0: torch.rand(N_HEADS, generator=g) * 3 * THRESHOLD} for _ in range(STEPS)]
    return params, grads, logits


def _fuse(parts: dict, fused: FusedQKV) -> torch.Tensor:
    layout = fused.row_layout()
    out = torch.empty(fused.num_rows, DIM)
    for part, name in ((Part.Q, "wq"), (Part.K, "wk"), (Part.V, "wv")):
        out[layout.rows(part)] = parts[name]
    return out


def _unfuse(w: torch.Tensor, fused: FusedQKV) -> dict:
    layout = fused.row_layout()
    return {name: w[layout.rows(part)] for part, name in ((Part.Q, "wq"), (Part.K, "wk"), (Part.V, "wv"))}


def _separate(qk: bool, n_kv: int = N_KV):
    params, grads, logits = _inputs(n_kv)
    names = {k: f"layers.0.attention.{k}.weight" for k in params}
    named = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = Muon([{"params": list(named.values()), "param_names": [names[k] for k in named], "use_muon": True}],
               qk_clip=QKClipConfig(head_dim=HEAD_DIM, threshold=THRESHOLD) if qk else None, **KW)
    for s in range(STEPS):
        for k, p in named.items():
            p.grad = grads[s][k].clone()
        opt.step(qk_logits=logits[s] if qk else None)
    return {k: p.detach() for k, p in named.items()}


def _fused_optimizer(w, fused, qk):
    group = {"params": [w], "param_names": ["layers.0.attention.wqkv.weight"], "use_muon": True,
             "muon_row_blocks": fused}
    return Muon([group], qk_clip=QKClipConfig(threshold=THRESHOLD, fused_qkv=fused) if qk else None, **KW)


def _fused_single(fused: FusedQKV, qk: bool):
    params, grads, logits = _inputs(fused.n_kv_heads)
    w = torch.nn.Parameter(_fuse(params, fused))
    opt = _fused_optimizer(w, fused, qk)
    for s in range(STEPS):
        w.grad = _fuse(grads[s], fused)
        opt.step(qk_logits=logits[s] if qk else None)
    return _unfuse(w.detach(), fused)


LAYOUTS = {
    "grouped": FusedQKV(N_HEADS, N_KV, HEAD_DIM, "grouped"),
    "concat": FusedQKV(N_HEADS, N_KV, HEAD_DIM, "concat"),
    "interleaved": FusedQKV(N_HEADS, N_HEADS, HEAD_DIM, "interleaved"),  # MHA only
}


@pytest.mark.parametrize("qk", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fused_weight_on_one_device_equals_separate_weights(layout, qk):
    fused = LAYOUTS[layout]
    want = _separate(qk, fused.n_kv_heads)  # interleaved is MHA: its separate weights too
    got = _fused_single(fused, qk)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=2e-6, rtol=1e-5, msg=lambda m: f"{layout} qk={qk} {k}: {m}")


def test_blocks_change_the_result():
    """Not vacuous: orthogonalising the fused matrix whole gives another update."""
    fused = LAYOUTS["grouped"]
    params, grads, _ = _inputs(N_KV)
    w = torch.nn.Parameter(_fuse(params, fused))
    opt = Muon([{"params": [w], "use_muon": True}], **KW)
    for s in range(STEPS):
        w.grad = _fuse(grads[s], fused)
        opt.step()
    whole = _unfuse(w.detach(), fused)
    blocked = _fused_single(fused, False)
    assert not torch.allclose(whole["wq"], blocked["wq"], atol=1e-4)


def _fused_sharded(rank, world_size, layout, qk, placements):
    from torch.distributed.device_mesh import init_device_mesh

    fused = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (2, 2))
    params, grads, logits = _inputs(fused.n_kv_heads)
    pl = [parse_placement(x) for x in placements]
    w = torch.nn.Parameter(to_dtensor(_fuse(params, fused), mesh, pl))
    opt = _fused_optimizer(w, fused, qk)
    for s in range(STEPS):
        w.grad = to_dtensor(_fuse(grads[s], fused), mesh, pl)
        opt.step(qk_logits=logits[s] if qk else None)
    return _unfuse(w.full_tensor().detach(), fused), opt.last_step_stats.owned


@pytest.mark.parametrize("placements", [["SS0/2", "S0"], ["S0", "S1"]])
@pytest.mark.parametrize("layout", ["grouped", "concat"])
def test_sharded_fused_weight_in_the_pipeline_equals_separate_weights(layout, placements):
    for qk in (False, True):
        want = _separate(qk)
        results = run_ranks(_fused_sharded, 4, layout, qk, placements, timeout=90)
        assert sum(owned for _, owned in results) >= 1  # an owner gathered and split it
        for got, _ in results:
            for k in want:
                torch.testing.assert_close(got[k], want[k], atol=2e-6, rtol=1e-5,
                                           msg=lambda m: f"{layout} {placements} qk={qk} {k}: {m}")


def _one_step(opt, w, grad):
    w.grad = grad.clone()
    opt.step()


def test_checkpoint_keeps_row_blocks_and_refuses_other_blocks(tmp_path):
    """Blocks change the update but no state shape, so a checkpoint must carry them and refuse others."""
    import io

    fused = LAYOUTS["grouped"]
    params, grads, _ = _inputs(fused.n_kv_heads)
    w = torch.nn.Parameter(_fuse(params, fused))
    opt = _fused_optimizer(w, fused, qk=False)
    _one_step(opt, w, _fuse(grads[0], fused))
    buf = io.BytesIO()
    torch.save({"w": w.detach().clone(), "opt": opt.state_dict()}, buf)
    _one_step(opt, w, _fuse(grads[1], fused))  # the uninterrupted run

    def resumed(row_blocks):
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        w2 = torch.nn.Parameter(saved["w"])
        group = {"params": [w2], "param_names": ["layers.0.attention.wqkv.weight"], "use_muon": True}
        if row_blocks is not None:
            group["muon_row_blocks"] = row_blocks
        return w2, Muon([group], **KW), saved["opt"]

    w2, opt2, sd = resumed(fused)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["muon_row_blocks"] == fused
    _one_step(opt2, w2, _fuse(grads[1], fused))
    assert torch.equal(w2.detach(), w.detach())

    for other in (None, "heads:4", FusedQKV(N_HEADS, N_KV, HEAD_DIM, "concat")):
        w3, opt3, sd = resumed(other)
        with pytest.raises(ValueError, match="muon_row_blocks.*wqkv|wqkv.*muon_row_blocks"):
            opt3.load_state_dict(sd)
        assert not opt3.state and opt3.param_groups[0].get("muon_row_blocks") == other  # nothing changed

    # a checkpoint written without blocks does not load into an optimizer that declares them
    w4, opt4, _ = resumed(None)
    _one_step(opt4, w4, _fuse(grads[0], fused))
    sd_plain = opt4.state_dict()
    w5, opt5, _ = resumed(fused)
    with pytest.raises(ValueError, match="muon_row_blocks"):
        opt5.load_state_dict(sd_plain)


def test_equivalent_row_block_specs_load():
    w = torch.nn.Parameter(torch.randn(8, 6))
    names = ["layers.0.attention.wq.weight"]
    opt = Muon([{"params": [w], "param_names": names, "use_muon": True, "muon_row_blocks": "heads:4"}], **KW)
    w.grad = torch.randn(8, 6)
    opt.step()
    from optimizer import HeadBlocks

    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = Muon([{"params": [w2], "param_names": names, "use_muon": True,
                  "muon_row_blocks": {names[0]: HeadBlocks(4)}}], **KW)
    opt2.load_state_dict(opt.state_dict())  # the same blocks, spelled differently
    assert torch.equal(opt2.state[w2]["momentum_buffer"], opt.state[w]["momentum_buffer"])


def test_dcp_checkpoint_row_blocks_are_read_back_and_compared(tmp_path):
    """DCP loads only the keys the live state dict has: the blocks key must be there to be checked."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    fused = LAYOUTS["grouped"]

    def make(row_blocks):
        model = torch.nn.Linear(DIM, fused.num_rows, bias=False)
        group = {"params": [model.weight], "param_names": ["weight"], "use_muon": True}
        if row_blocks is not None:
            group["muon_row_blocks"] = row_blocks
        return model, Muon([group], **KW)

    model, opt = make(fused)
    model.weight.grad = torch.randn_like(model.weight)
    opt.step()
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path))
    for row_blocks, loads in ((fused, True), (None, False), ("heads:4", False)):
        model2, opt2 = make(row_blocks)
        sd = {"optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(sd, checkpoint_id=str(tmp_path))
        if loads:
            set_optimizer_state_dict(model2, opt2, sd["optim"])
            assert torch.equal(opt2.state[model2.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"])
        else:
            with pytest.raises(ValueError, match="'weight' was orthogonalised with muon_row_blocks"):
                set_optimizer_state_dict(model2, opt2, sd["optim"])
            # (dcp.load already wrote the tensors in place into the live state: only the groups are ours)
            assert opt2.param_groups[0]["muon_row_blocks"] == row_blocks


def test_row_blocks_by_name_load_across_wrapper_prefixes():
    """Names are compared without wrapper segments (torch.compile's ``_orig_mod``); so are the keys
    of a ``{param_name: spec}`` row-blocks value."""
    fused = LAYOUTS["grouped"]
    plain, wrapped = "layers.0.attention.wqkv.weight", "_orig_mod.layers.0.attention.wqkv.weight"

    def make(name, spec):
        w = torch.nn.Parameter(torch.randn(fused.num_rows, DIM, generator=torch.Generator().manual_seed(0)))
        return w, Muon([{"params": [w], "param_names": [name], "use_muon": True,
                         "muon_row_blocks": {name: spec}}], **KW)

    w, opt = make(plain, fused)
    _one_step(opt, w, torch.randn(fused.num_rows, DIM))
    w2, opt2 = make(wrapped, fused)
    opt2.load_state_dict(opt.state_dict())
    assert torch.equal(opt2.state[w2]["momentum_buffer"], opt.state[w]["momentum_buffer"])
    w3, opt3 = make(wrapped, "heads:4")
    with pytest.raises(ValueError, match="'layers.0.attention.wqkv.weight' was orthogonalised with"):
        opt3.load_state_dict(opt.state_dict())
