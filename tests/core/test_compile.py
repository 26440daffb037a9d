"""``torch.compile(opt.step)`` on the installed torch release (issue 32; Dion2 and NorDion2 groups: issue 40).

The numbers of a compiled step against an eager one (inductor, fp32) are checked in
``test_dropin.py::test_compiled_step_matches_eager_step_and_torch_adamw``; this file checks what a
compiled step *records* on the optimizer, which dynamo mishandled on some releases: an attribute
written after a graph break (in the resumed frame) raised "Attempted setattr on a user-defined
object that does not have an AttributeMutation mutation_type" on torch 2.11 and was silently
dropped on torch 2.13 (``last_step_skipped`` stayed False after a skipped step).  The reference is
the same optimizer stepped eagerly on the same gradients.  ``backend="eager"``: the attribute
handling is dynamo's (the frontend), the same under every backend, and this backend compiles in
seconds.  Both files run on every release in the supported range (``.ci/run``'s compat runs).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from optimizer import Muon, QKClipConfig

HEAD_DIM = 4
THRESHOLD = 1.0


def _named_params(seed: int = 0):
    """q and k of one attention layer (2 heads each), an MLP matrix, and a norm (AdamW)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"layers.0.attention.wq.weight": (8, 6), "layers.0.attention.wk.weight": (8, 6),
              "layers.0.mlp.w1.weight": (10, 6), "layers.0.norm.weight": (6,)}
    return [(name, nn.Parameter(torch.randn(shape, generator=g))) for name, shape in shapes.items()]


def _groups(named):
    matrices = [(n, p) for n, p in named if p.dim() == 2]
    vectors = [(n, p) for n, p in named if p.dim() != 2]
    return [{"params": [p for _, p in matrices], "param_names": [n for n, _ in matrices], "use_muon": True},
            {"params": [p for _, p in vectors], "param_names": [n for n, _ in vectors], "use_muon": False}]


def _grads(named, step: int, nonfinite: bool):
    g = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=g) for _, p in named]
    if nonfinite:
        grads[2][1, 2] = math.inf  # one element of one Muon gradient
    return grads


def _logits(step: int):
    """Per-head max logits of layer 0: head 0 over the threshold, head 1 under it."""
    return {0: torch.tensor([THRESHOLD * (3.0 + step), THRESHOLD * 0.5])}


def _pair(**kw):
    """(compiled optimizer, its parameters, eager optimizer, its parameters), equal at the start."""
    ours, eager = _named_params(), _named_params()
    make = lambda named: Muon(_groups(named), lr=0.02, weight_decay=0.1, compute_dtype=torch.float32, **kw)  # noqa: E731
    return make(ours), ours, make(eager), eager


def _set_grads(named, grads):
    for (_, p), gr in zip(named, grads):
        p.grad = gr.clone()


def _assert_params_equal(ours, eager, what):
    for (name, p), (_, q) in zip(ours, eager):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0, msg=lambda m: f"{what}: {name}: {m}")


def test_compiled_step_records_skipped_steps_like_eager():
    """``skip_nonfinite``: a step with a non-finite gradient changes nothing and sets
    ``last_step_skipped``; the next finite step clears it, compiled as eagerly."""
    torch._dynamo.reset()
    opt, ours, eager_opt, eager = _pair(skip_nonfinite=True)
    step = torch.compile(opt.step, backend="eager")
    for t, nonfinite in enumerate([False, True, False, True]):
        grads = _grads(ours, t, nonfinite)
        before = [p.detach().clone() for _, p in ours]
        _set_grads(ours, grads)
        _set_grads(eager, grads)
        step()
        eager_opt.step()
        assert eager_opt.last_step_skipped is nonfinite  # the reference does what the test says
        assert opt.last_step_skipped is nonfinite, f"step {t}: compiled last_step_skipped {opt.last_step_skipped}"
        if nonfinite:
            assert all(torch.equal(p.detach(), b) for (_, p), b in zip(ours, before)), f"step {t} was not skipped"
        _assert_params_equal(ours, eager, f"step {t}")
    assert max((p - b).abs().max().item() for (_, p), (_, b) in zip(ours, _named_params())) > 1e-2  # they moved


def test_compiled_step_records_qk_clip_report_and_stats_like_eager():
    """QK-clip's report and the pipeline's stats of each compiled step equal the eager step's."""
    torch._dynamo.reset()
    opt, ours, eager_opt, eager = _pair(qk_clip=QKClipConfig(head_dim=HEAD_DIM, threshold=THRESHOLD))
    step = torch.compile(opt.step, backend="eager")
    for t in range(3):
        grads = _grads(ours, t, nonfinite=False)
        _set_grads(ours, grads)
        _set_grads(eager, grads)
        step(qk_logits=_logits(t))
        eager_opt.step(qk_logits=_logits(t))
        ref, got = eager_opt.qk_clip_report, opt.qk_clip_report
        assert ref is not None and ref.clipped_heads == {0: 1}  # the reference clipped head 0 only
        assert got is not None, f"step {t}: the compiled step left no QK-clip report"
        assert (got.clipped_heads, got.max_logit) == (ref.clipped_heads, ref.max_logit), f"step {t}"
        counts = lambda s: (s.matrices, s.owned, s.chunks, s.bytes_sent, s.all_gathers)  # noqa: E731
        assert counts(eager_opt.last_step_stats)[0] == 3
        assert counts(opt.last_step_stats) == counts(eager_opt.last_step_stats), f"step {t}"
        _assert_params_equal(ours, eager, f"step {t}")
    reports = set()
    for t in range(2):  # a new report (and stats object) every step, not the first one kept
        step(qk_logits=_logits(3 + t))
        reports.add(id(opt.qk_clip_report))
        assert opt.qk_clip_report.max_logit == {0: pytest.approx(THRESHOLD * (6.0 + t))}
    assert len(reports) == 2


# ------------------------------------------------------------------------ Dion2 and NorDion2

DION2_GROUPS = {
    "dion2": dict(dion2_fraction=0.25, dion2_ef_decay=0.9, adjust_lr="spectral_norm"),
    "nordion2": dict(dion2_fraction=0.5, dion2_ef_decay=0.8, normuon_beta2=0.9, cautious_wd=True),
}


@pytest.mark.parametrize("variant", list(DION2_GROUPS))
def test_compiled_dion2_step_matches_eager(variant):
    """``torch.compile(opt.step)`` (inductor) of a Dion2 / NorDion2 group on plain tensors (wide,
    tall, a 3-D stack) gives the eager step's parameters and state (momentum, NorDion2's ``v``)
    each step, fp32.  Each step moves the chosen slices only; the eager step is checked against the
    float64 formulas in tests/rule/test_dion2_muon.py."""
    torch._dynamo.reset()

    def named(seed=0):
        g = torch.Generator().manual_seed(seed)
        shapes = {"wide": (6, 16), "tall": (16, 6), "experts": (2, 8, 12), "norm": (6,)}
        return [(n, nn.Parameter(torch.randn(s, generator=g))) for n, s in shapes.items()]

    def make(params):
        matrices = [p for _, p in params if p.dim() >= 2]
        return Muon([{"params": matrices, "use_muon": True, **DION2_GROUPS[variant]},
                     {"params": [p for _, p in params if p.dim() < 2], "use_muon": False}],
                    lr=0.02, weight_decay=0.1, compute_dtype=torch.float32)

    ours, eager = named(), named()
    opt, eager_opt = make(ours), make(eager)
    start = dict(named())["wide"].detach()
    step = torch.compile(opt.step)
    for t in range(3):
        grads = _grads(ours, t, nonfinite=False)
        _set_grads(ours, grads)
        _set_grads(eager, grads)
        step()
        eager_opt.step()
        _assert_params_equal(ours, eager, f"{variant}, step {t}")
        for (name, p), (_, q) in zip(ours, eager):
            for key, want in eager_opt.state[q].items():
                if torch.is_tensor(want) and want.dim() > 0:
                    torch.testing.assert_close(opt.state[p][key], want, atol=1e-6, rtol=0,
                                               msg=lambda m: f"{variant}, step {t}: {name} {key}: {m}")
        if t == 0:  # the first step moves k = ceil(fraction * 6) rows of `wide` (its shorter side) by the update
            wide, decayed = dict(ours)["wide"].detach(), start * (1 - 0.02 * 0.1)
            moved = [i for i in range(6) if not torch.allclose(wide[i], decayed[i], atol=1e-5, rtol=0)]  # update ~1e-2
            assert len(moved) == math.ceil(DION2_GROUPS[variant]["dion2_fraction"] * 6), moved
    assert {k for _, p in ours if p.dim() >= 2 for k in opt.state[p]} == (
        {"momentum_buffer", "normuon_v"} if variant == "nordion2" else {"momentum_buffer"})
