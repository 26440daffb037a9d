"""QK-clip problems found at the start of a step, on 2 and 4 ranks: the same error everywhere,
no hang, parameters and optimizer state untouched.

Construction-time problems (pairs, head counts, duplicates, AdamW groups, 3-D weights)
are tested in test_qk_clip_head_map.py; these are the ones only a step can see.
"""

from __future__ import annotations

import math

import pytest
import torch

from dist_cases import build_groups, make_case_tensors, outcome, parse_placement, to_dtensor
from harness import run_ranks

SPECS = [
    ("layers.0.attention.wq.weight", (16, 12), ["S0"]),
    ("layers.0.attention.wk.weight", (8, 12), ["S0"]),
    ("layers.0.ffn.w1.weight", (10, 12), ["S1"]),
]


def _case(rank, world_size, what):
    from optimizer import Muon, QKClipConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    params, grads = make_case_tensors(SPECS, 1)
    named = [(n, torch.nn.Parameter(to_dtensor(params[n], mesh, [parse_placement(x) for x in pl])))
             for n, _, pl in SPECS]
    opt = Muon(build_groups(named), lr=0.02, qk_clip=QKClipConfig(head_dim=4, threshold=1.0))
    for n, p in named:
        p.grad = to_dtensor(grads[0][n], mesh, p.placements)
    logits = {0: torch.tensor([5.0, 0.5, 2.0, 0.1])}
    if what == "q_without_grad":
        named[0][1].grad = None
    elif what == "nan":
        logits = {0: torch.tensor([5.0, math.nan, 2.0, 0.1])}
    elif what == "posinf":
        logits = {0: torch.tensor([5.0, math.inf, 2.0, 0.1])}
    elif what == "meta":
        logits = {0: torch.empty(4, device="meta")}
    elif what == "nonpositive":
        logits = {0: torch.tensor([-3.0, 0.0, -math.inf, 0.5])}
    before = [p.to_local().clone() for _, p in named]
    result = outcome(lambda: opt.step(qk_logits=logits))
    unchanged = all(torch.equal(p.to_local(), b) for (_, p), b in zip(named, before))
    finite = all(bool(torch.isfinite(p.to_local()).all()) for _, p in named)
    return result, (unchanged, finite), len(opt.state), opt.qk_clip_report


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("what, kind, words", [
    ("q_without_grad", "ValueError", ["'layers.0.attention.wq.weight'", "no gradient", "together"]),
    ("nan", "ValueError", ["NaN or +inf"]),
    ("posinf", "ValueError", ["NaN or +inf"]),
    ("meta", "ValueError", ["meta device"]),
])
def test_step_time_qk_problems_fail_every_rank_alike(world, what, kind, words):
    results = run_ranks(_case, world, what, timeout=60)
    messages = {msg for (k, msg), _, _, _ in results}
    assert len(messages) == 1, messages
    for (k, msg), (unchanged, _), n_state, _ in results:
        assert k == kind and all(w in msg for w in words), msg
        assert unchanged and n_state == 0


def test_logits_at_or_below_zero_clip_nothing_and_give_no_nan():
    for (k, msg), (unchanged, finite), n_state, report in run_ranks(_case, 2, "nonpositive", timeout=60):
        assert k == "ok", msg
        assert not unchanged and n_state > 0  # the step ran
        assert finite and report.clipped_heads == {0: 0}


def test_qk_clip_without_logits_says_so_once_and_a_source_is_read(caplog):
    """Trainer and accelerate call step() with no arguments: QK-clip must not be silently off."""
    import logging

    from optimizer import Muon, QKClipConfig

    g = torch.Generator().manual_seed(0)
    wq, wk = (torch.nn.Parameter(torch.randn(8, 6, generator=g)) for _ in range(2))
    opt = Muon([{"params": [wq, wk], "param_names": ["layers.0.wq.weight", "layers.0.wk.weight"], "use_muon": True}],
               lr=0.01, qk_clip=QKClipConfig(head_dim=4, threshold=1.0))
    for step in range(2):
        wq.grad, wk.grad = torch.ones_like(wq), torch.ones_like(wk)
        with caplog.at_level(logging.WARNING, logger="optimizer.muon"):
            opt.step()
    warnings = [r for r in caplog.records if "got no qk_logits" in r.getMessage()]
    assert len(warnings) == 1 and "set_qk_logits_source" in warnings[0].getMessage()
    assert opt.qk_clip_report is None
    calls = []

    def source():
        calls.append(1)
        return {0: torch.tensor([5.0, 0.5])}

    opt.set_qk_logits_source(source)
    opt.param_groups[0]["lr"] = 0.0  # no update, no decay: only QK-clip moves the weights
    before = wq.detach().clone()
    opt.step()
    assert calls == [1] and opt.qk_clip_report.clipped_heads == {0: 1}
    # head 0 (rows 0-3) shrinks by sqrt(threshold / logit) = sqrt(1/5); head 1 (under it) stays
    torch.testing.assert_close(wq.detach()[:4], before[:4] * (1 / 5) ** 0.5)
    torch.testing.assert_close(wq.detach()[4:], before[4:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="set_qk_logits_source"):
        opt.set_qk_logits_source("not callable")
