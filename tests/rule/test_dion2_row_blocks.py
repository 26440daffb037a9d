"""Row blocks (``muon_row_blocks``) in Dion2 and NorDion2 groups, single device, against the
float64 formulas applied per block.

Each block is its own matrix for Dion2 (``docs/dion2.md``): the reference
(``tests/dion2_reference.py``) steps the block's rows ``[..., rows_b, n]`` of the weight, gradient
and momentum as a separate weight: its own selection dim (rows if ``rows_b <= n`` else columns;
NorDion2 rows), ``k = chosen_count(fraction, s_b)``, the lr factor of its own shape, the
``ef_decay`` of its own chosen slices.  Read off the optimizer's tensors: the slices that moved
in each block are the reference's chosen ones, the momentum is the reference's bit for bit, the
weights within the roundings (Newton–Schulz's bound, ``tests/tolerances.py``).  Blocks of two
shapes in one weight (one selecting rows, one columns), non-contiguous blocks, expert stacks,
``muon_transposed``, every ``adjust_lr`` mode, cautious weight decay and ``maximize``.

DTensors with row blocks in a Dion2 group step as this path does, bit for bit
(``tests/parallel/test_dion2_row_blocks_dtensor.py``).
"""

from __future__ import annotations

import pytest
import torch

import dion2_reference as ref
from optimizer import Muon
from optimizer.newton_schulz import zeropower_via_newtonschulz
from tolerances import newton_schulz_atol, normuon_rtol, unit_roundoff

LR, WD, EF, BETA2 = 0.02, 0.1, 0.9, 0.9
U64 = unit_roundoff(torch.float64)
NS = {"ns_coefficients": "polar_express", "ns_method": "classic", "ns_kernels": "torch"}


def orth(x):
    return zeropower_via_newtonschulz(x.contiguous(), ns_steps=5, coefficients="polar_express",
                                      compute_dtype=torch.float64, method="classic", ns_kernels="torch")


def _even_odd(name, shape):
    """A callable spec: the even rows, then the odd rows (two non-contiguous blocks)."""
    return [torch.arange(0, shape[0], 2), torch.arange(1, shape[0], 2)]


CASES = {  # name -> (weight shape [..., out, in], spec, each block's rows)
    "heads": ((16, 24), "heads:4", [list(range(i, i + 4)) for i in range(0, 16, 4)]),
    "rows and columns": ((16, 10), "blocks:4,12", [list(range(4)), list(range(4, 16))]),  # 4x10 rows, 12x10 columns
    "non-contiguous": ((12, 8), _even_odd, [list(range(0, 12, 2)), list(range(1, 12, 2))]),  # 6x8: rows
    "experts": ((2, 12, 8), "blocks:4,8", [list(range(4)), list(range(4, 12))]),
    "tall heads": ((3 * 10, 6), "heads:10", [list(range(i, i + 10)) for i in range(0, 30, 10)]),  # columns
}


def _reference(w, g, m, v, blocks, *, fraction, nor, mode, cautious=False, maximize=False):
    """The formulas per block: (weight, momentum, v, [(rows, chosen per matrix, dim, tolerance)])."""
    W, M, V = w.clone(), m.clone(), None if v is None else v.clone()
    out = []
    for rows in blocks:
        ix = torch.tensor(rows)
        sub = lambda t: t.index_select(-2, ix)  # noqa: E731
        r = ref.step(sub(w), sub(g), sub(m), fraction=fraction, ef_decay=EF, lr=LR, weight_decay=WD, adjust_lr=mode,
                     orthogonalize=orth, row_state=None if v is None else sub(v), beta2=BETA2 if nor else None,
                     cautious=cautious, maximize=maximize)
        W.index_copy_(-2, ix, r.weight)
        M.index_copy_(-2, ix, r.momentum)
        if V is not None:
            V.index_copy_(-2, ix, r.row_state)
        m_b, n = len(rows), w.shape[-1]
        k = max(map(len, r.chosen))
        adjusted = ref.adjust(LR, (m_b, n), mode)
        ns_atol = newton_schulz_atol((k, n) if r.dim == -2 else (m_b, k), torch.float64, ns_steps=5,
                                     coefficients="polar_express", method="classic")
        hat_rtol, v_rtol = normuon_rtol(k, n, torch.float64, BETA2) if nor else (0.0, 0.0)
        scale = float(r.update.abs().max())
        w_tol = 2 * U64 * float(w.abs().max() + adjusted * scale) + adjusted * (2 * ns_atol + hat_rtol * scale)
        out.append((ix, r.chosen, r.dim, w_tol, v_rtol + 2 * ns_atol))
    return W, M, V, out


def moved(before, after, dim):
    """Per matrix of the stack: the slices with an entry that is not exactly ``before (1 - lr wd)``."""
    changed = (after != before * (1 - LR * WD)).reshape(-1, *after.shape[-2:])
    along = changed.any(dim=-1) if dim == -2 else changed.any(dim=-2)
    return [torch.nonzero(x).flatten().tolist() for x in along]


def run_blocks(case, *, nor=False, transposed=False, fraction=0.3, adjust_lr="spectral_norm", steps=3, seed=0,
               cautious=False, maximize=False):
    shape, spec, blocks = CASES[case]
    mode = {"match_rms_adamw": "rms_norm"}.get(adjust_lr, adjust_lr)
    gen = torch.Generator().manual_seed(seed)
    W, *grads = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(steps + 1))
    view = (lambda t: t.mT) if transposed else (lambda t: t)
    p = torch.nn.Parameter(view(W).contiguous())
    group = {"params": [p], "param_names": ["w"], "use_muon": True, "muon_row_blocks": spec,
             **({"normuon_beta2": BETA2} if nor else {}), **({"muon_transposed": True} if transposed else {})}
    opt = Muon([group], lr=LR, weight_decay=WD, dion2_fraction=fraction, dion2_ef_decay=EF, adjust_lr=adjust_lr,
               compute_dtype=torch.float64, cautious_wd=cautious, maximize=maximize, **NS)
    rw, rm = W.clone(), torch.zeros_like(W)
    rv = torch.zeros(*shape[:-1], 1, dtype=torch.float64) if nor else None
    for t, G in enumerate(grads, start=1):
        before = view(p.detach()).clone()
        p.grad = view(G).contiguous()
        opt.step()
        rw, rm, rv, per_block = _reference(rw, G, rm, rv, blocks, fraction=fraction, nor=nor, mode=mode,
                                           cautious=cautious, maximize=maximize)
        after = view(p.detach())
        assert torch.equal(view(opt.state[p]["momentum_buffer"]), rm), f"step {t}: momentum"
        for b, (ix, chosen, dim, w_tol, v_tol) in enumerate(per_block):
            sub = lambda x: x.index_select(-2, ix)  # noqa: E731
            if not cautious:  # cautious decay changes chosen entries by the mask: moved != chosen there
                assert moved(sub(before), sub(after), dim) == chosen, f"step {t} block {b}: the slices that moved"
            torch.testing.assert_close(sub(after), sub(rw), atol=t * w_tol, rtol=0,
                                       msg=lambda s, b=b: f"step {t} block {b}: weights: {s}")
            if nor:
                torch.testing.assert_close(sub(opt.state[p]["normuon_v"]), sub(rv), atol=0, rtol=t * v_tol)


@pytest.mark.parametrize("case", CASES)
def test_dion2_row_blocks_match_the_formulas_per_block(case):
    run_blocks(case)


@pytest.mark.parametrize("case", ["heads", "rows and columns", "experts"])
def test_nordion2_row_blocks_match_the_formulas_per_block(case):
    run_blocks(case, nor=True, fraction=0.5)


@pytest.mark.parametrize("adjust_lr", ["match_rms_adamw", None])
def test_each_block_takes_the_lr_factor_of_its_own_shape(adjust_lr):
    run_blocks("rows and columns", adjust_lr=adjust_lr)


def test_transposed_weights_take_blocks_of_their_out_in_view():
    run_blocks("rows and columns", transposed=True)
    run_blocks("heads", transposed=True, nor=True, fraction=0.5)


@pytest.mark.parametrize("variant", [dict(cautious=True), dict(maximize=True), dict(nor=True, cautious=True)])
def test_cautious_and_maximize_with_row_blocks(variant):
    run_blocks("rows and columns", **variant)


def test_blocks_choose_differently_from_the_whole_matrix():
    """Not vacuous: on these inputs the whole matrix's Dion2 chooses other slices than its blocks'."""
    shape, _, blocks = CASES["rows and columns"]
    gen = torch.Generator().manual_seed(0)
    W, G = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(2))
    whole = ref.step(W, G, torch.zeros_like(W), fraction=0.3, ef_decay=EF, lr=LR, weight_decay=WD, orthogonalize=orth)
    per_block = _reference(W, G, torch.zeros_like(W), None, blocks, fraction=0.3, nor=False, mode="spectral_norm")
    assert whole.dim == -1 and [dim for *_, dim, _, _ in per_block[3]] == [-2, -1]
    assert not torch.allclose(whole.weight, per_block[0], atol=1e-3)
