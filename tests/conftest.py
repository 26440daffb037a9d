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


# The slowest tests first (`pytest --durations`, 2 cores; tests/README.md, "Run time"). xdist's
# default scheduler hands tests out in collection order, round robin, then one at a time as
# workers free up: started first, the long ones run beside the short ones instead of leaving one
# worker alone with a minute-long test at the end. Only the order changes, never what runs; a
# test not listed keeps its place after these. Prefixes of node ids, slowest first.
SLOWEST_FIRST = (
    "tests/end_to_end/test_gpu_check_script.py",
    "tests/end_to_end/test_config_matrix.py::test_config_under_torchrun",
    "tests/core/test_dropin.py::test_compiled_step_matches_eager_step_and_torch_adamw",
    "tests/parallel/test_ns_kernels.py::test_parallel_muon_on_the_kernels_equals_single_device",
    "tests/parallel/test_settings_agreement.py::test_settings_digest_is_the_same_in_separate_processes",
    "tests/end_to_end/test_benchmarks_smoke.py::test_peak_memory_stays_within_the_plans_bound",
    "tests/parallel/test_ns_kernels.py::test_kernels_are_as_close_to_fp64_as_torch_is",
    "tests/parallel/test_faults.py::test_two_thousand_small_matrices_with_a_fixed_number_of_process_groups",
    "tests/end_to_end/test_config_matrix.py::test_normuon_under_torchrun",
    "tests/integrations/test_torchtitan.py",
    "tests/kernels/test_fused_momentum_input.py::test_parallel_equals_the_two_pass_order_bitwise",
    "tests/core/test_compile.py",
    "tests/docs/test_snippets.py",
)


def slowest_first_rank(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(SLOWEST_FIRST) if nodeid.startswith(prefix)), len(SLOWEST_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: slowest_first_rank(item.nodeid))  # stable: the rest keep their order
