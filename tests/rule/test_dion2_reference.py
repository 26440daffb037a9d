"""The fp64 Dion2/NorDion2 reference (``tests/dion2_reference.py``) against properties written
here, so that the reference the rule is compared with is itself checked:

* k is dion's rounding, ``max(1, ceil(fraction * s))`` with the product in floating point;
* the selection dim comes from the global shape (the shorter side; NorDion2: rows);
* the chosen slices are the k largest by L1 norm (norms computed here another way), equal
  norms taken lower index first;
* the momentum's chosen slices are ``ef_decay`` times the accumulated ones, the rest the
  accumulated ones, bit for bit;
* unchosen weights change only by weight decay, bit for bit; the chosen ones by
  ``adjust(lr) O`` with ``O`` the polar factor of the chosen submatrix (checked by its
  properties: orthonormal, ``U O^T`` symmetric positive definite);
* NorDion2's normalisation of the chosen rows, v of the other rows unchanged; experts select
  per expert; maximize, cautious weight decay and Lion.
"""

from __future__ import annotations

import math

import pytest
import torch

import dion2_reference as ref

LR, WD, EF = 0.02, 0.1, 0.9
SHAPES = {"wide": (8, 24), "tall": (24, 8), "square": (12, 12), "experts": (3, 10, 16), "tall experts": (2, 18, 6)}


def _inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(3)]  # W, G, M


def _matrices(t):
    return t.reshape(-1, *t.shape[-2:])


def _slices(matrix, dim):
    return matrix if dim == -2 else matrix.T


# ---------------------------------------------------------------- k and the dim


@pytest.mark.parametrize("fraction,size,k", [
    (0.25, 16, 4), (0.25, 17, 5), (0.5, 7, 4), (1.0, 13, 13), (0.001, 10, 1), (0.3, 10, 3),
    (0.07, 100, 8),  # 0.07 * 100 == 7.000000000000001 in float64: dion's ceil gives 8, not 7
    (0.5, 0, 0),  # an empty dim chooses nothing
])
def test_k_is_dions_rounding(fraction, size, k):
    assert 0.07 * 100 > 7  # the float product this case rests on
    assert ref.chosen_count(fraction, size) == k


@pytest.mark.parametrize("shape,dim,rows_only", [
    ((8, 24), -2, False), ((24, 8), -1, False), ((12, 12), -2, False), ((3, 10, 16), -2, False),
    ((2, 18, 6), -1, False), ((24, 8), -2, True), ((2, 18, 6), -2, True),
])
def test_selection_dim_from_global_shape(shape, dim, rows_only):
    assert ref.selection_dim(shape, rows_only) == dim
    W, G, M = _inputs(shape)
    r = ref.step(W, G, M, fraction=0.25, ef_decay=EF, lr=LR, weight_decay=WD, rows_only=rows_only)
    assert r.dim == dim
    k = math.ceil(0.25 * shape[dim])
    assert all(len(c) == k for c in r.chosen)


# ---------------------------------------------------------------- the selection


@pytest.mark.parametrize("name", SHAPES)
def test_chosen_are_the_top_k_by_l1_norm(name):
    shape = SHAPES[name]
    W, G, M = _inputs(shape, seed=1)
    r = ref.step(W, G, M, fraction=0.3, ef_decay=EF, lr=LR, weight_decay=WD)
    for b, matrix in enumerate(_matrices(M + G)):
        norms = _slices(matrix, r.dim).abs().sum(dim=1)  # torch's own sum, not fsum
        chosen = set(r.chosen[b])
        others = [i for i in range(len(norms)) if i not in chosen]
        assert len(chosen) == math.ceil(0.3 * len(norms))
        assert min(norms[i] for i in chosen) > max(norms[i] for i in others)
        assert r.chosen[b] == sorted(r.chosen[b])


def test_equal_norms_are_taken_lower_index_first():
    M = torch.zeros(8, 16, dtype=torch.float64)
    M[1] = M[3] = M[6] = torch.arange(16.0)  # three rows with exactly the same norm
    M[5] = 2 * torch.arange(16.0)  # the largest
    W, G, _ = _inputs((8, 16))
    r = ref.step(W, torch.zeros_like(G), M, fraction=0.375, ef_decay=EF, lr=LR, weight_decay=WD)  # k = 3
    assert r.chosen == [[1, 3, 5]]
    r = ref.step(W, torch.zeros_like(G), torch.zeros_like(M), fraction=0.25, ef_decay=EF, lr=LR, weight_decay=WD)
    assert r.chosen == [[0, 1]]  # all zero: the first k
    # a permuted copy of a row has the same multiset of entries: the fsum norms are equal
    M2 = torch.zeros(4, 6, dtype=torch.float64)
    M2[2] = torch.tensor([1e16, 1.0, -1e16, 3.0, 0.5, 2.0])
    M2[0] = M2[2].flip(0)
    assert ref.slice_norms(M2, -2)[0] == ref.slice_norms(M2, -2)[2]
    assert ref.step(W[:4, :6], torch.zeros(4, 6, dtype=torch.float64), M2, fraction=0.25, ef_decay=EF, lr=LR,
                    weight_decay=WD).chosen == [[0]]


# ---------------------------------------------------------------- momentum and weights


@pytest.mark.parametrize("name", SHAPES)
def test_momentum_chosen_decayed_the_rest_accumulated(name):
    W, G, M = _inputs(SHAPES[name], seed=2)
    r = ref.step(W, G, M, fraction=0.25, ef_decay=EF, lr=LR, weight_decay=WD)
    acc = M + G
    for b, (new, old) in enumerate(zip(_matrices(r.momentum), _matrices(acc))):
        new, old = _slices(new, r.dim), _slices(old, r.dim)
        for i in range(new.shape[0]):
            expected = EF * old[i] if i in r.chosen[b] else old[i]
            assert torch.equal(new[i], expected), (b, i)


@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm", None])
@pytest.mark.parametrize("name", SHAPES)
def test_unchosen_weights_change_only_by_weight_decay(name, adjust_lr):
    shape = SHAPES[name]
    W, G, M = _inputs(shape, seed=3)
    r = ref.step(W, G, M, fraction=0.25, ef_decay=EF, lr=LR, weight_decay=WD, adjust_lr=adjust_lr)
    m, n = shape[-2:]
    adjusted = {"spectral_norm": LR * math.sqrt(m / n), "rms_norm": LR * 0.2 * math.sqrt(max(m, n)),
                None: LR}[adjust_lr]
    for b, (new, old, acc) in enumerate(zip(_matrices(r.weight), _matrices(W), _matrices(M + G))):
        new, old, acc = _slices(new, r.dim), _slices(old, r.dim), _slices(acc, r.dim)
        chosen = r.chosen[b]
        for i in range(new.shape[0]):
            if i not in chosen:
                assert torch.equal(new[i], old[i] * (1 - LR * WD)), (b, i)
        # the chosen slices: W (1 - lr wd) - adjusted O, O the polar factor of the chosen submatrix
        O = (old[chosen] * (1 - LR * WD) - new[chosen]) / adjusted  # [k, long side]
        U = acc[chosen]
        k = len(chosen)
        torch.testing.assert_close(O @ O.T, torch.eye(k, dtype=torch.float64), atol=1e-10, rtol=0)
        H = U @ O.T  # U = H O with H = (U U^T)^(1/2): symmetric positive definite
        torch.testing.assert_close(H, H.T, atol=1e-10, rtol=0)
        assert torch.linalg.eigvalsh((H + H.T) / 2).min() > 0
        torch.testing.assert_close(H @ H, U @ U.T, atol=1e-9, rtol=1e-9)


def test_the_update_is_taken_before_the_decay():
    """With ef_decay = 0 the chosen momentum is zeroed, yet the step still moves the chosen
    weights by the orthogonalised accumulated momentum (U is read before the decay)."""
    W, G, M = _inputs((8, 24), seed=10)
    r = ref.step(W, G, M, fraction=0.25, ef_decay=0.0, lr=LR, weight_decay=WD, adjust_lr=None)
    K = r.chosen[0]
    assert torch.equal(r.momentum[K], torch.zeros_like(r.momentum[K]))
    torch.testing.assert_close(W[K] * (1 - LR * WD) - r.weight[K], LR * ref.polar_factor((M + G)[K]),
                               atol=1e-14, rtol=0)


def test_maximize_negates_the_gradient_and_cautious_decays_the_unchosen():
    W, G, M = _inputs((8, 24), seed=4)
    a = ref.step(W, G, M, fraction=0.25, ef_decay=EF, lr=LR, weight_decay=WD, maximize=True)
    b = ref.step(W, -G, M, fraction=0.25, ef_decay=EF, lr=LR, weight_decay=WD)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.momentum, b.momentum)
    c = ref.step(W, G, M, fraction=0.25, ef_decay=EF, lr=LR, weight_decay=WD, cautious=True)
    unchosen = [i for i in range(8) if i not in c.chosen[0]]
    assert torch.equal(c.weight[unchosen], W[unchosen] - LR * WD * W[unchosen])  # W * 0 >= 0: decayed
    chosen = c.chosen[0]
    D = c.update[chosen]
    expected = W[chosen] - LR * WD * W[chosen] * (W[chosen] * D >= 0) - LR * math.sqrt(8 / 24) * D
    assert torch.equal(c.weight[chosen], expected)
    assert ((W[chosen] * D) < 0).any()  # the mask does something here


def test_experts_select_per_expert_as_separate_matrices():
    W, G, M = _inputs((3, 10, 16), seed=5)
    r = ref.step(W, G, M, fraction=0.3, ef_decay=EF, lr=LR, weight_decay=WD)
    assert len({tuple(c) for c in r.chosen}) > 1  # the experts chose differently
    for e in range(3):
        s = ref.step(W[e], G[e], M[e], fraction=0.3, ef_decay=EF, lr=LR, weight_decay=WD)
        assert s.chosen == [r.chosen[e]]
        assert torch.equal(s.weight, r.weight[e]) and torch.equal(s.momentum, r.momentum[e])


# A wide chosen submatrix's polar factor has unit rows (every row's mean square is 1/n); more
# chosen rows than columns (tall: 24 x 8 at 0.5 chooses 12 rows of 8) give rows of unequal norms.
@pytest.mark.parametrize("shape,fraction", [((8, 24), 0.25), ((24, 8), 0.25), ((24, 8), 0.5), ((2, 18, 6), 0.5)])
def test_nordion2_normalises_the_chosen_rows(shape, fraction):
    W, G, M = _inputs(shape, seed=6)
    v = torch.rand(*shape[:-1], 1, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    beta2 = 0.9
    r = ref.step(W, G, M, fraction=fraction, ef_decay=EF, lr=LR, weight_decay=WD, row_state=v, beta2=beta2)
    assert r.dim == -2  # rows, whatever the shape
    m, n = shape[-2:]
    for b, (acc, vb, vnew, D) in enumerate(zip(_matrices(M + G), _matrices(v), _matrices(r.row_state),
                                               _matrices(r.update))):
        K = r.chosen[b]
        others = [i for i in range(m) if i not in K]
        assert torch.equal(vnew[others], vb[others])
        O = ref.polar_factor(acc[K])
        vk = beta2 * vb[K] + (1 - beta2) * (O ** 2).sum(dim=1, keepdim=True) / n
        torch.testing.assert_close(vnew[K], vk, atol=0, rtol=1e-13)
        hat = O / (vk.sqrt() + 1e-8)
        hat = hat * O.norm() / hat.norm()
        torch.testing.assert_close(D[K], hat, atol=1e-12, rtol=0)
        assert torch.equal(D[others], torch.zeros_like(D[others]))


def test_bf16_momentum_rounds_once_per_write():
    W, G, M = _inputs((8, 24), seed=8)
    M = M.bfloat16().double()
    store = lambda t: t.bfloat16().double()  # noqa: E731
    r = ref.step(W, G, M, fraction=0.25, ef_decay=EF, lr=LR, weight_decay=WD, store=store)
    acc = (M + G).bfloat16().double()
    K = r.chosen[0]
    others = [i for i in range(8) if i not in K]
    assert torch.equal(r.momentum[others], acc[others])
    assert torch.equal(r.momentum[K], (EF * acc[K]).bfloat16().double())


def test_lion_is_dions():
    W, G, M = _inputs((5, 7), seed=9)
    M[0, 0], G[0, 0] = 0.0, 0.0  # sign(0) = 0: no step there, only decay
    new_w, new_m = ref.lion_step(W, G, M, lr=LR, betas=(0.9, 0.99), weight_decay=WD)
    direction = torch.sign(0.9 * M + 0.1 * G)
    assert direction[0, 0] == 0
    torch.testing.assert_close(new_w, W * (1 - LR * WD) - LR * direction, atol=0, rtol=0)
    # the reference's b2 M + (1 - b2) G: (1 - 0.99) is not 0.01 in float64; a few roundings apart
    atol = 4 * torch.finfo(torch.float64).eps * float((M.abs() + G.abs()).max())
    torch.testing.assert_close(new_m, 0.99 * M + 0.01 * G, atol=atol, rtol=0)
