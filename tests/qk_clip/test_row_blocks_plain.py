"""Row-block specs: the "blocks:" spec, 3-D expert stacks, and the plain forms that
torch.load(weights_only=True) reads (Hugging Face Trainer's resume path)."""

import pickle

import pytest
import torch

from optimizer.attention_layouts import FusedQKV
from optimizer.newton_schulz import zeropower_via_newtonschulz
from optimizer.rule import orthogonalize_in_blocks
from optimizer.row_blocks import (
    HeadBlocks,
    RowBlockSizes,
    SplitQKV,
    check_group_row_blocks,
    parse_spec,
    resolve_row_blocks,
    row_blocks_mismatch,
    row_blocks_to_plain,
    spec_for,
    spec_to_plain,
)
from tolerances import newton_schulz_atol, unit_roundoff


# Batched blocks against blocks orthogonalised one by one: the same iteration in another order, run
# in float64 against its rounding bound (tests/tolerances.py), far below a misplaced row's change.
def ns(x):
    return zeropower_via_newtonschulz(x, compute_dtype=torch.float64, method="classic")


FUSED = FusedQKV(4, 2, 3, "grouped")
SPECS_AND_PLAIN = [
    (HeadBlocks(16), "heads:16"),
    (RowBlockSizes((8, 8)), "blocks:8,8"),
    (RowBlockSizes((3, 5, 2)), "blocks:3,5,2"),
    (FUSED, "fused_qkv:4,2,3,grouped"),
    (SplitQKV(FUSED), "split_qkv:4,2,3,grouped"),
    (SplitQKV(FusedQKV(2, 2, 4, "interleaved"), per_head=True), "split_qkv:2,2,4,interleaved,per_head"),
]


@pytest.mark.parametrize("spec, plain", SPECS_AND_PLAIN, ids=lambda v: repr(v)[:30])
def test_plain_form_round_trip_and_equality(spec, plain):
    assert spec_to_plain(spec) == plain
    assert spec_to_plain(plain) == plain  # idempotent
    assert parse_spec(plain, "g") == spec == parse_spec(spec, "g")
    # equal across forms where the optimizer compares specs (checkpoint vs live group)
    assert row_blocks_mismatch({"w": plain}, {"w": spec}, ["w"], "g") is None
    assert row_blocks_mismatch(plain, {"w": spec}, ["w"], "g") is None  # group-wide value vs per-name
    assert row_blocks_mismatch({"w": plain}, None, ["w"], "g") is not None


def test_a_plain_string_is_a_group_wide_spec_and_a_dict_a_name_map():
    plain = spec_to_plain(FUSED)
    assert spec_for(plain, "any.weight", "g") == FUSED
    check_group_row_blocks(plain, ["a", "b"], "g")
    assert spec_for({"a": plain}, "a", "g") == FUSED and spec_for({"a": plain}, "b", "g") is None
    with pytest.raises(ValueError, match=r"names \['kind'\]"):
        check_group_row_blocks({"kind": "heads:2"}, ["a"], "g")  # a dict is always {name: spec}


def test_bad_plain_forms_name_the_problem():
    with pytest.raises(ValueError, match="n_heads=3 is not a multiple"):
        parse_spec("fused_qkv:3,2,3,grouped", "g")
    with pytest.raises(ValueError, match="per_head belongs to split_qkv"):
        parse_spec("fused_qkv:4,2,3,grouped,per_head", "g")
    for bad in ("blocks:", "blocks:4,0", "blocks:4,x", "blocks:-1", "heads:0", "fused_qkv:4,2", "split_qkv:4,2,3",
                {"kind": "fused_qkv", "n_heads": 4}):
        with pytest.raises(ValueError, match="not understood"):
            parse_spec(bad, "g")
    with pytest.raises(ValueError, match="positive ints"):
        RowBlockSizes((4, 0))


def test_callable_has_no_plain_form_and_old_objects_still_parse():
    fn = lambda name, shape: [slice(0, shape[0])]  # noqa: E731
    with pytest.raises(ValueError, match="callable .* cannot be saved"):
        spec_to_plain(fn)
    with pytest.raises(ValueError, match="cannot be saved"):
        row_blocks_to_plain({"a": "heads:2", "b": fn})
    assert parse_spec(fn, "g") is fn
    # a checkpoint written before the plain forms holds the dataclass objects: they still parse
    old = pickle.loads(pickle.dumps({"w": HeadBlocks(4), "v": SplitQKV(FUSED, per_head=True)}))
    assert spec_for(old, "w", "g") == HeadBlocks(4) and spec_for(old, "v", "g") == SplitQKV(FUSED, per_head=True)
    assert row_blocks_to_plain(old) == {"w": "heads:4", "v": spec_to_plain(SplitQKV(FUSED, per_head=True))}
    assert row_blocks_to_plain(None) is None and row_blocks_to_plain(FUSED) == spec_to_plain(FUSED)


def test_weights_only_load_of_groups_holding_every_plain_form(tmp_path):
    groups = [
        {"params": [0], "param_names": ["a", "b", "c", "d", "e"], "use_muon": True,
         "muon_row_blocks": {"a": "heads:16", "b": "blocks:8,8", "c": spec_to_plain(FUSED),
                             "d": spec_to_plain(SplitQKV(FUSED, per_head=True)), "e": None},
         "muon_transposed": {"a": True}},
        {"params": [1], "param_names": ["f"], "use_muon": True, "muon_row_blocks": spec_to_plain(SplitQKV(FUSED))},
        {"params": [2], "param_names": ["g"], "use_muon": False, "betas": (0.9, 0.95), "weight_decay": 0.0},
    ]
    path = tmp_path / "optimizer.pt"
    torch.save({"state": {0: {"momentum_buffer": torch.zeros(2)}}, "param_groups": groups}, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["param_groups"] == groups
    value = loaded["param_groups"][0]["muon_row_blocks"]
    assert [spec_for(value, n, "g") for n in "abcde"] == [
        HeadBlocks(16), RowBlockSizes((8, 8)), FUSED, SplitQKV(FUSED, per_head=True), None]
    assert spec_for(loaded["param_groups"][1]["muon_row_blocks"], "f", "g") == SplitQKV(FUSED)
    # the dataclass objects are what Trainer could not load (the bug this form fixes)
    torch.save({"param_groups": [{"muon_row_blocks": {"a": HeadBlocks(16)}}]}, path)
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(path, weights_only=True)


def test_blocks_spec_resolves_consecutive_rows_in_order():
    rb = resolve_row_blocks("blocks:3,5,2", "w", (10, 4))
    assert list(rb.blocks) == [slice(0, 3), slice(3, 8), slice(8, 10)]
    assert sorted(rb.shapes) == [2, 3, 5]
    with pytest.raises(ValueError, match="'w' has 10 rows but muon_row_blocks='blocks:3,5' covers 8"):
        resolve_row_blocks("blocks:3,5", "w", (10, 4))
    with pytest.raises(ValueError, match="per expert"):
        resolve_row_blocks("blocks:3,5", "experts.w", (2, 10, 4))


def test_3d_blocks_split_every_expert_alike():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 10, 6, generator=g, dtype=torch.float64)  # [E, 2I, H] with I = 5
    atol = newton_schulz_atol(w.shape, torch.float64)  # the "original" lr factors below are <= 1
    rb = resolve_row_blocks("blocks:5,5", "mlp.experts.gate_up_proj", w.shape)
    assert rb.num_rows == 10
    got = orthogonalize_in_blocks(w, rb, ns)
    want = torch.stack([torch.cat([ns(e[:5]), ns(e[5:])]) for e in w])
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    # whole-expert orthogonalisation is something else (the test would notice a missing split)
    assert not torch.allclose(got, ns(w), atol=1e-3)
    # the 3-D batch gives what the 2-D path gives matrix by matrix, including per-block lr factors
    got = orthogonalize_in_blocks(w, resolve_row_blocks("blocks:2,8", "x", w.shape), ns, adjust_lr_mode="original")
    for e in range(3):
        torch.testing.assert_close(
            got[e], orthogonalize_in_blocks(w[e], resolve_row_blocks("blocks:2,8", "x", w[e].shape), ns,
                                            adjust_lr_mode="original"), atol=atol, rtol=2 * unit_roundoff(torch.float64))
    # a callable sees each expert's [R, C]
    seen = []
    resolve_row_blocks(lambda name, shape: seen.append(shape) or [slice(0, shape[0])], "x", (3, 10, 6))
    assert seen == [(10, 6)]


def test_a_state_dict_with_dataclass_specs_loads_with_weights_only_and_continues():
    """Trainer resumes with torch.load(weights_only=True): an optimizer whose groups hold
    HeadBlocks / FusedQKV / SplitQKV objects saves them in their plain forms (issue 23)."""
    import io

    from optimizer import Muon

    def build():
        g = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(torch.randn(16, 8, generator=g))
        q = torch.nn.Parameter(torch.randn(24, 8, generator=g))
        f = torch.nn.Parameter(torch.randn(24, 8, generator=g))
        blocks = {"a": HeadBlocks(4), "wqkv": SplitQKV(FusedQKV(2, 1, 6, "grouped"), per_head=True),
                  "fused": FusedQKV(2, 1, 6, "concat")}
        opt = Muon([{"params": [w, q, f], "param_names": ["a", "wqkv", "fused"], "use_muon": True,
                     "muon_row_blocks": blocks}], lr=0.02)
        return [w, q, f], opt

    def grads(step):
        g = torch.Generator().manual_seed(10 + step)
        return [torch.randn(16, 8, generator=g), torch.randn(24, 8, generator=g), torch.randn(24, 8, generator=g)]

    params, opt = build()
    for step in range(4):
        if step == 2:
            buf = io.BytesIO()
            torch.save({"optim": opt.state_dict(), "params": [p.detach().clone() for p in params]}, buf)
        for p, g in zip(params, grads(step)):
            p.grad = g
        opt.step()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # raises "Unsupported global" for dataclass specs
    # one plain string per parameter, in the group's order
    assert saved["optim"]["param_groups"][0]["muon_row_blocks"] == [
        "heads:4", "split_qkv:2,1,6,grouped,per_head", "fused_qkv:2,1,6,concat"]
    resumed, opt2 = build()
    with torch.no_grad():
        for p, s in zip(resumed, saved["params"]):
            p.copy_(s)
    opt2.load_state_dict(saved["optim"])
    assert opt2.param_groups[0]["muon_row_blocks"]["a"] == HeadBlocks(4)  # the specs as this optimizer declared them
    for step in (2, 3):
        for p, g in zip(resumed, grads(step)):
            p.grad = g
        opt2.step()
    for p, q in zip(params, resumed):
        assert torch.equal(p, q)
