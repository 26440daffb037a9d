"""``ns_kernels`` is resolved once per group (newton_schulz/implementation.py), not per call.

On a pretended GPU (tests/pretend_gpu.py: ``"auto"`` takes the kernels, the tile rule sees an
H100), adding a group resolves its option (counted: the resolution runs, and with it the
decision's device queries); then 3 steps resolve nothing: no call of the decision
(kernels/backend.py ``choose``, ``resolve``, ``unavailable_reason``, ``auto_takes_kernels``), of
the device queries (kernels/environment.py), of the first-use check (self_check.failure) or of
the group-level resolution, while the kernels run (their launches counted: the symmetric products
and the fused elementwise stages). On one process (plain tensors, an ``"auto"`` and a
``"triton"`` group) and on 2 forked ranks with every matrix cut over them (``ns_split``).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks

pytest.importorskip("triton")

STEPS = 3
SHAPES = {"wide": (130, 200), "tall": (200, 130), "experts": (2, 66, 130)}  # 130 rows: 3 fp32 tile rows


def _targets():
    """(module, name, counter key) of every function that resolves or queries the device."""
    from optimizer.kernels import backend, environment, self_check
    from optimizer.newton_schulz import implementation

    resolving = [(backend, n) for n in ("choose", "resolve", "unavailable_reason", "auto_takes_kernels")]
    resolving += [(environment, n) for n in ("device_key", "cuda_properties", "interpreting", "triton_import_error",
                                             "loaded_compiled")]
    resolving += [(self_check, "failure"), (implementation, "resolve_implementation")]
    from optimizer.kernels import elementwise_kernel, matmul_add_kernel, symmetric_kernel

    launching = [(symmetric_kernel, "symmetric_matmul_triton"), (matmul_add_kernel, "matmul_add_triton"),
                 (elementwise_kernel, "momentum_nesterov_triton"), (elementwise_kernel, "apply_update_triton")]
    return resolving, launching


def count_calls(setattr_) -> tuple[dict, dict]:
    """Wrap every target with a counter (through ``setattr_``); returns (resolutions, launches)."""
    resolving, launching = _targets()
    counts: tuple[dict, dict] = ({}, {})
    for table, targets in zip(counts, (resolving, launching)):
        for module, name in targets:
            real = getattr(module, name)
            table[name] = 0

            def counted(*args, real=real, name=name, table=table, **kwargs):
                table[name] += 1
                return real(*args, **kwargs)
            setattr_(module, name, counted)
    return counts


def zeroed(table: dict) -> dict:
    before = dict(table)
    for name in table:
        table[name] = 0
    return before


def test_three_steps_resolve_nothing_after_the_groups_are_added(monkeypatch):
    from pretend_gpu import pretend_auto_takes_the_kernels

    from optimizer import Muon

    pretend_auto_takes_the_kernels(monkeypatch)
    resolutions, launches = count_calls(monkeypatch.setattr)
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in SHAPES.items()}
    opt = Muon([{"params": [params["wide"], params["experts"]], "use_muon": True},
                {"params": [params["tall"]], "use_muon": True, "ns_kernels": "triton"}], lr=0.02, weight_decay=0.1)
    at_add = zeroed(resolutions)
    assert at_add["resolve_implementation"] == 2 and at_add["unavailable_reason"] > 0, at_add  # "auto", "triton"
    zeroed(launches)
    for _ in range(STEPS):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    assert resolutions == dict.fromkeys(resolutions, 0), resolutions
    # the kernels ran: symmetric products each step, the fused stages on every parameter
    assert launches["symmetric_matmul_triton"] >= 2 * STEPS * len(SHAPES), launches
    assert launches["momentum_nesterov_triton"] >= STEPS * len(SHAPES), launches
    assert launches["apply_update_triton"] >= STEPS * len(SHAPES), launches
    assert all(torch.isfinite(p).all() for p in params.values())


def _cut_rank(rank, world_size):
    from dist_cases import build_groups, make_case_tensors, parse_placement, to_dtensor
    from torch.distributed.device_mesh import init_device_mesh

    from optimizer import Muon

    resolutions, launches = count_calls(setattr)  # a forked rank: nothing to restore
    specs = [("wide", SHAPES["wide"], ["S0"]), ("tall", SHAPES["tall"], ["S1"]), ("experts", SHAPES["experts"], ["S1"])]
    mesh = init_device_mesh("cpu", (world_size,))
    full, grads = make_case_tensors(specs, STEPS)
    named = [(n, torch.nn.Parameter(to_dtensor(full[n], mesh, [parse_placement(x) for x in pl])))
             for n, _, pl in specs]
    opt = Muon(build_groups(named, {"ns_split": "always", "ns_kernels": "auto"}), lr=0.02)
    at_add = zeroed(resolutions)
    zeroed(launches)
    for s in range(STEPS):
        for (n, p), (_, _, pl) in zip(named, specs):
            p.grad = to_dtensor(grads[s][n], mesh, p.placements)
        opt.step()
    return at_add, dict(resolutions), dict(launches), opt.last_step_stats.split_units


def test_cut_units_resolve_nothing_either(monkeypatch):
    from pretend_gpu import pretend_auto_takes_the_kernels

    pretend_auto_takes_the_kernels(monkeypatch)  # inherited by the forked ranks
    for at_add, during, launched, cut in run_ranks(_cut_rank, 2, timeout=600):
        assert at_add["resolve_implementation"] >= 1, at_add
        assert during == dict.fromkeys(during, 0), during
        assert cut > 0 and launched["symmetric_matmul_triton"] > 0 and launched["momentum_nesterov_triton"] > 0, (
            cut, launched)
