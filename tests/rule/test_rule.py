"""The rule's formulas (adjust_lr, the momentum and Nesterov stages, apply_update_) against
torch.optim.Muon's helper and the written-out formulas (float64)."""

import math

import pytest
import torch
from torch.optim._muon import _adjust_lr as torch_adjust_lr

from optimizer.rule import adjust_lr, apply_update_, momentum_, nesterov_input_


def muon_momentum_(buf, grad, momentum, nesterov):
    """The rule's first two stages on one tensor: update ``buf`` in place, return what Newton–Schulz
    orthogonalises (``buf`` itself without Nesterov)."""
    (g,) = momentum_([buf], [grad], momentum)
    return nesterov_input_(torch.empty_like(buf), g, buf, momentum, True) if nesterov else buf


@pytest.mark.parametrize("shape", [(64, 64), (128, 32), (32, 128), (1, 7)])
@pytest.mark.parametrize("mode", ["original", "match_rms_adamw"])
def test_adjust_lr_matches_torch(shape, mode):
    assert adjust_lr(0.02, shape, mode) == pytest.approx(torch_adjust_lr(0.02, mode, torch.Size(shape)), rel=1e-12)


def test_adjust_lr_values_and_3d():
    assert adjust_lr(1.0, (128, 32), "original") == pytest.approx(2.0)
    assert adjust_lr(1.0, (32, 128), "original") == pytest.approx(1.0)
    assert adjust_lr(1.0, (100, 16), "match_rms_adamw") == pytest.approx(2.0)
    # [E, out, in]: the matrix is the last two dims, the expert count does not enter
    assert adjust_lr(0.1, (8, 128, 32), "original") == pytest.approx(0.2)
    assert adjust_lr(0.1, (8, 16, 100), "match_rms_adamw") == pytest.approx(0.2)
    assert adjust_lr(0.3, (5, 7), None) == 0.3
    assert adjust_lr(0.3, (5, 7), "none") == 0.3
    with pytest.raises(ValueError, match="unknown mode 'rms'"):
        adjust_lr(0.1, (4, 4), "rms")
    with pytest.raises(ValueError, match="matrix shape"):
        adjust_lr(0.1, (4,), "original")


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_matches_formula(nesterov):
    g = torch.Generator().manual_seed(0)
    mu = 0.9
    buf = torch.zeros(6, 5)
    ref_buf = torch.zeros(6, 5, dtype=torch.float64)
    for _ in range(4):
        grad = torch.randn(6, 5, generator=g)
        update = muon_momentum_(buf, grad, mu, nesterov)
        gd = grad.double()
        ref_buf = mu * ref_buf + (1 - mu) * gd
        ref_update = (1 - mu) * gd + mu * ref_buf if nesterov else ref_buf
        torch.testing.assert_close(buf.double(), ref_buf, atol=1e-6, rtol=0)
        torch.testing.assert_close(update.double(), ref_update, atol=1e-6, rtol=0)
    if nesterov:
        assert update.data_ptr() != buf.data_ptr()
    else:
        assert update.data_ptr() == buf.data_ptr()


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_apply_update_formula(wd):
    g = torch.Generator().manual_seed(1)
    p = torch.randn(4, 3, generator=g)
    u = torch.randn(4, 3, generator=g).bfloat16()  # NS output may be bf16
    expected = p.double() * (1 - 0.01 * wd) - 0.05 * u.double()
    apply_update_(p, u, lr=0.01, adjusted_lr=0.05, weight_decay=wd)
    assert p.dtype == torch.float32
    torch.testing.assert_close(p.double(), expected, atol=1e-6, rtol=0)


def test_functions_work_on_3d_expert_stacks():
    mu = 0.95
    buf = torch.zeros(3, 4, 5)
    grad = torch.ones(3, 4, 5)
    upd = muon_momentum_(buf, grad, mu, True)
    assert torch.allclose(buf, torch.full_like(buf, 1 - mu))
    assert torch.allclose(upd, torch.full_like(buf, (1 - mu) + mu * (1 - mu)))
    assert math.isclose(adjust_lr(1.0, buf.shape, "original"), 1.0)
