import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The package lives in torch-ext/ (kernels layout); examples/ and tests/ hold helpers.
for p in (os.path.join(ROOT, "torch-ext"), ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

torch.set_num_threads(1)

# Triton kernels (optimizer.kernels; tests/kernels) run on CPU tensors under Triton's interpreter,
# which Triton chooses when it defines a kernel, its own library functions included: those are
# defined when triton.language is first imported, and torch._dynamo below imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")

# DTensor imports torch._dynamo lazily, which costs seconds in every forked
# rank; importing it once here, before ranks fork, makes them start fast.
import torch._dynamo  # noqa: E402,F401


import pytest  # noqa: E402


@pytest.fixture
def torch_muon_in_fp32():
    """torch.optim.Muon orthogonalises in bf16 and divides by a bf16-rounded norm; ours runs fp32 in
    the tests (compute_dtype=float32, the classic form), so torch's runs its own iteration in fp32
    too: like for like, to float32 rounding (optimizer.testing.torch_muon_newton_schulz)."""
    from optimizer.testing import torch_muon_newton_schulz

    with torch_muon_newton_schulz(torch.float32):
        yield
