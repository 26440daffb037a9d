"""QK-clip in Dion2 and NorDion2 groups (single device, plain tensors) against the float64 formulas.

The reference, per step: every weight stepped by single-device Dion2 written from the formulas
(``tests/dion2_reference.py``; a weight with row blocks: each block as its own matrix, its own
selection, ``k`` and lr factor), then Kimi K2's clip written out here per head, as
``docs/qk_clip.md`` defines it, with ``gamma_h = min(1, threshold / S_h)``: query rows (MHA/GQA,
fused q, MLA q_nope) times ``sqrt(gamma_h)``, MLA q_pe rows times ``gamma_h``, key rows (MHA/GQA,
fused k, MLA k_nope) times ``sqrt(min gamma)`` over the query heads sharing the key head, value
rows untouched.  Layouts: MHA, GQA (with NorDion2 and with ``muon_transposed``), MLA, and a fused
``[Q; K; V]`` weight whole and with ``muon_row_blocks`` (its q, k and v rows three Dion2 matrices).

What is compared: the momentum bit for bit (the clip never touches it, and the selection reads
only it), the weights within the roundings of the two computations: Newton–Schulz's bound
(``tolerances.newton_schulz_atol``) and the clip's scale table, which the optimizer computes in
float32 (``qk_clip.step.gamma``: a few float32 roundings of each factor), accumulated over the
steps.  Heads over and under the threshold in every layer, so a missing, early or misplaced clip
moves some rows by ~10% or more, far above the bound.
"""

from __future__ import annotations

import math

import pytest
import torch

import dion2_reference as ref
from optimizer import Muon, QKClipConfig
from optimizer.attention_layouts import FusedQKV, MLAHeads
from optimizer.newton_schulz import zeropower_via_newtonschulz
from tolerances import newton_schulz_atol, normuon_rtol, unit_roundoff

T, LR, WD, EF, BETA2, STEPS = 2.0, 0.02, 0.1, 0.9, 0.9, 3
U64, U32 = unit_roundoff(torch.float64), unit_roundoff(torch.float32)
NS = {"ns_coefficients": "polar_express", "ns_method": "classic", "ns_kernels": "torch"}
P = "layers.0.attention."


def orth(x):
    """The reference's orthogonalisation: the project's classic fp64 iteration (its own tests hold
    it to the formulas) with the group's coefficients."""
    return zeropower_via_newtonschulz(x.contiguous(), ns_steps=5, coefficients="polar_express",
                                      compute_dtype=torch.float64, method="classic", ns_kernels="torch")


def gammas(logits: torch.Tensor) -> list[float]:
    return [min(1.0, T / float(s)) for s in logits]


def _scale_heads_(w: torch.Tensor, first_row: int, head_rows: int, factors: list[float]) -> None:
    for h, f in enumerate(factors):
        w[first_row + h * head_rows: first_row + (h + 1) * head_rows] *= f


def clip_separate_(n_q: int, n_kv: int, d: int):
    """MHA/GQA ``wq``/``wk``: query head h's rows times sqrt(gamma_h); key head j's rows times
    sqrt(min gamma) over its query heads ``j * n_q / n_kv ...`` (``wv`` untouched)."""
    def clip(w: dict, logits: torch.Tensor) -> None:
        g, per = gammas(logits), n_q // n_kv
        _scale_heads_(w[P + "wq.weight"], 0, d, [math.sqrt(x) for x in g])
        _scale_heads_(w[P + "wk.weight"], 0, d, [math.sqrt(min(g[j * per:(j + 1) * per])) for j in range(n_kv)])
    return clip


def clip_fused_concat_(n_q: int, n_kv: int, d: int):
    """A ``[Q; K; V]`` weight: its q rows and k rows as the separate weights', v rows untouched."""
    def clip(w: dict, logits: torch.Tensor) -> None:
        g, per, fused = gammas(logits), n_q // n_kv, w[P + "wqkv.weight"]
        _scale_heads_(fused, 0, d, [math.sqrt(x) for x in g])
        _scale_heads_(fused, n_q * d, d, [math.sqrt(min(g[j * per:(j + 1) * per])) for j in range(n_kv)])
    return clip


def clip_mla_(heads: int, nope: int, rope: int, v: int):
    """MLA: per head h, ``wq`` rows ``[q_nope; q_pe]`` times sqrt(gamma_h) and gamma_h, ``wkv_b`` rows
    ``[k_nope; v]`` times sqrt(gamma_h) and 1."""
    def clip(w: dict, logits: torch.Tensor) -> None:
        for h, g in enumerate(gammas(logits)):
            q, kv = w[P + "wq.weight"], w[P + "wkv_b.weight"]
            base = h * (nope + rope)
            q[base:base + nope] *= math.sqrt(g)
            q[base + nope:base + nope + rope] *= g
            kv[h * (nope + v):h * (nope + v) + nope] *= math.sqrt(g)
    return clip


CASES = {  # name -> (weight shapes [out, in], QKClipConfig keywords, reference clip, query heads)
    "mha": ({P + "wq.weight": (16, 24), P + "wk.weight": (16, 24), P + "wv.weight": (16, 24)},
            dict(head_dim=4), clip_separate_(4, 4, 4), 4),
    "gqa": ({P + "wq.weight": (16, 12), P + "wk.weight": (8, 12), P + "wv.weight": (8, 12)},
            dict(head_dim=4), clip_separate_(4, 2, 4), 4),
    "mla": ({P + "wq.weight": (24, 16), P + "wkv_b.weight": (32, 10)},
            dict(mla=MLAHeads(qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)), clip_mla_(4, 4, 2, 4), 4),
    "fused": ({P + "wqkv.weight": (32, 16)}, dict(fused_qkv=FusedQKV(4, 2, 4, "concat")), clip_fused_concat_(4, 2, 4),
              4),
}


def _inputs(shapes: dict, n_q: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weights = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()} for _ in range(STEPS)]
    logits = []
    for _ in range(STEPS):
        s = torch.rand(n_q, generator=g) * 3 * T
        s[0], s[-1] = 0.5 * T, 2.5 * T  # one head under the threshold and one over, every step
        logits.append({0: s})
    return weights, grads, logits


def reference_step(w, grad, m, v, blocks, *, fraction, nor):
    """Dion2 of the formulas on the whole matrix, or on each row block as its own matrix (its own
    shape's selection and lr factor); returns (weight, momentum, v, the largest update entry, k, dim)."""
    parts = blocks or [list(range(w.shape[-2]))]
    W, M, V = w.clone(), m.clone(), None if v is None else v.clone()
    scale, ks = 0.0, []
    for rows in parts:
        ix = torch.tensor(rows)
        r = ref.step(w[ix], grad[ix], m[ix], fraction=fraction, ef_decay=EF, lr=LR, weight_decay=WD,
                     orthogonalize=orth, row_state=None if v is None else v[ix], beta2=BETA2 if nor else None)
        W[ix], M[ix] = r.weight, r.momentum
        if V is not None:
            V[ix] = r.row_state
        scale = max(scale, float(r.update.abs().max()), 0.0)
        ks.append((max(map(len, r.chosen)), r.dim, (len(rows), w.shape[-1])))
    return W, M, V, scale, ks


def _tolerances(w: torch.Tensor, scale: float, ks, nor: bool, steps: int) -> tuple[float, float]:
    """(weights' atol, NorDion2 v's rtol), summed over the steps (an error in W is only scaled by
    (1 - lr wd) and factors <= 1 after it): the fp64 roundings and Newton–Schulz's bound of each
    block's update, NorDion2's normalisation, and the float32 scale table's relative error (a
    division and a square root, each rounded once)."""
    w_bound, v_bound = 0.0, 0.0
    for k, dim, (m, n) in ks:
        k_shape = (k, n) if dim == -2 else (m, k)
        adjusted = ref.adjust(LR, (m, n), "spectral_norm")
        ns_atol = newton_schulz_atol(k_shape, torch.float64, ns_steps=5, coefficients="polar_express",
                                     method="classic")
        hat_rtol, v_rtol = normuon_rtol(k, n, torch.float64, BETA2) if nor else (0.0, 0.0)
        w_bound = max(w_bound, adjusted * (2 * ns_atol + hat_rtol * scale + 2 * U64 * scale))
        v_bound = max(v_bound, v_rtol + 2 * ns_atol)
    wmax = float(w.abs().max())
    return steps * (w_bound + 2 * U64 * wmax + 4 * U32 * wmax), steps * v_bound


def run_case(case: str, *, nor=False, transposed=False, row_blocks=None, fraction=0.3, seed=0):
    """Step a Dion2 group (NorDion2 with ``nor``) with QK-clip and the reference side by side."""
    shapes, cfg, clip_ref, n_q = CASES[case]
    weights, grads, logits = _inputs(shapes, n_q, seed)
    view = (lambda t: t.mT) if transposed else (lambda t: t)
    params = {n: torch.nn.Parameter(view(w).contiguous()) for n, w in weights.items()}
    group = {"params": list(params.values()), "param_names": list(params), "use_muon": True,
             **({"normuon_beta2": BETA2} if nor else {}), **({"muon_transposed": True} if transposed else {}),
             **({"muon_row_blocks": row_blocks[0]} if row_blocks else {})}
    opt = Muon([group], lr=LR, weight_decay=WD, dion2_fraction=fraction, dion2_ef_decay=EF,
               adjust_lr="spectral_norm", compute_dtype=torch.float64, qk_clip=QKClipConfig(threshold=T, **cfg), **NS)
    rw = {n: w.clone() for n, w in weights.items()}
    rm = {n: torch.zeros_like(w) for n, w in weights.items()}
    rv = {n: torch.zeros(w.shape[0], 1, dtype=torch.float64) if nor else None for n, w in weights.items()}
    blocks = row_blocks[1] if row_blocks else {}
    for t, (G, S) in enumerate(zip(grads, logits), start=1):
        for n, p in params.items():
            p.grad = view(G[n]).contiguous()
        opt.step(qk_logits=S)
        tol = {}
        for n in weights:
            rw[n], rm[n], rv[n], scale, ks = reference_step(rw[n], G[n], rm[n], rv[n], blocks.get(n), fraction=fraction,
                                                            nor=nor)
            tol[n] = _tolerances(rw[n], scale, ks, nor, t)
        clip_ref(rw, S[0])
        assert opt.qk_clip_report.clipped_heads == {0: sum(g < 1 for g in gammas(S[0]))}
        for n, p in params.items():
            assert torch.equal(view(opt.state[p]["momentum_buffer"]), rm[n]), f"step {t} '{n}': momentum"
            torch.testing.assert_close(view(p.detach()), rw[n], atol=tol[n][0], rtol=0,
                                       msg=lambda s, n=n: f"step {t} '{n}': weights: {s}")
            if nor:
                torch.testing.assert_close(opt.state[p]["normuon_v"], rv[n], atol=0, rtol=tol[n][1])


@pytest.mark.parametrize("case", ["mha", "gqa", "mla", "fused"])
def test_dion2_group_with_qk_clip_matches_the_formulas(case):
    run_case(case)


@pytest.mark.parametrize("case", ["gqa", "mla"])
def test_nordion2_group_with_qk_clip_matches_the_formulas(case):
    run_case(case, nor=True, fraction=0.5)


def test_transposed_weights_are_clipped_on_their_out_in_view():
    run_case("gqa", transposed=True)


def test_fused_qkv_with_row_blocks_and_qk_clip():
    """``muon_row_blocks=FusedQKV``: the q, k and v rows are three Dion2 matrices (square q rows,
    wide k and v), then the clip scales the q and k rows."""
    spec = FusedQKV(4, 2, 4, "concat")
    blocks = {P + "wqkv.weight": [list(range(0, 16)), list(range(16, 24)), list(range(24, 32))]}
    run_case("fused", row_blocks=(spec, blocks))


def test_a_layer_split_between_a_dion2_and_a_muon_group_is_clipped():
    """``wq`` in a Dion2 group, ``wk`` in a Muon group: both have a gradient, so the layer is clipped
    (not refused as half-trained); with ``lr=0`` only the clip moves the weights."""
    weights, grads, logits = _inputs(CASES["gqa"][0], 4, seed=3)
    wq, wk = (torch.nn.Parameter(weights[P + n].clone()) for n in ("wq.weight", "wk.weight"))
    opt = Muon([{"params": [wq], "param_names": [P + "wq.weight"], "use_muon": True, "dion2_fraction": 0.5},
                {"params": [wk], "param_names": [P + "wk.weight"], "use_muon": True}],
               lr=0.0, weight_decay=WD, compute_dtype=torch.float64, qk_clip=QKClipConfig(head_dim=4, threshold=T))
    wq.grad, wk.grad = grads[0][P + "wq.weight"].clone(), grads[0][P + "wk.weight"].clone()
    opt.step(qk_logits=logits[0])
    want = {P + "wq.weight": weights[P + "wq.weight"].clone(), P + "wk.weight": weights[P + "wk.weight"].clone()}
    clip_separate_(4, 2, 4)(want, logits[0][0])
    for p, n in ((wq, "wq.weight"), (wk, "wk.weight")):
        torch.testing.assert_close(p.detach(), want[P + n], atol=4 * U32 * float(want[P + n].abs().max()), rtol=0)
    assert not torch.equal(wq.detach(), weights[P + "wq.weight"])
