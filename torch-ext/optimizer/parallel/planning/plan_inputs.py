"""A Muon parameter as planning reads it: a :class:`~.plan_data.PlanParam` from the parameter and
its group's options.

Its Newton–Schulz cost (:func:`ns_cost`, summed over its row blocks when it has some), how it may
be cut over ranks (:func:`split_model`, from ``ns_split``), what its pieces travel as
(:func:`wire_dtype`), the bytes of its state; and the plan's settings (:func:`plan_settings`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Callable

import torch

from ...distributed.layout import ParamLayout
from ...matrix_view import LayoutCache, view_shape
from ...named_params import NamedParam
from ...newton_schulz.forms import default_compute_dtype, newton_schulz_flops, ns_io_dtype
from ...row_blocks import ROW_BLOCKS_KEY, RowBlocks, resolve_row_blocks, spec_for
from ...rule import normuon_on, row_state_dtype, work_dtype
from ...settings import MuonSettings
from ...tensors import is_dtensor, local_view
from .cut_hardware import SplitHardware, hardware_for
from .cut_model import SplitModel
from .plan_data import PlanParam, PlanSettings

# "auto" splits a matrix over replicas when its Newton–Schulz does at least this many
# FLOPs per byte of update shipped to the other replicas: a GPU's bf16 rate over an
# inter-node link (~400 TFLOP/s over ~40 GB/s per GPU), a CPU core's fp32 rate over
# loopback (~50 GFLOP/s over ~1 GB/s).
DEFAULT_REPLICA_FLOPS_PER_BYTE = {"cuda": 1e4, "cpu": 50.0}


def plan_input(e: NamedParam, group: Mapping, settings: MuonSettings, layouts: LayoutCache,
               rank: int) -> tuple[PlanParam, RowBlocks | None, list[str]]:
    """Muon parameter ``e`` of ``group`` as planning reads it, its row blocks (None: none), and
    the problems found on this rank (its local shard's shape, its row blocks)."""
    p = e.param
    problems = []
    layout = layouts.of(p, e.transposed) if is_dtensor(p) else None
    if layout is not None:
        problem = local_shape_problem(e.name, p, layout, rank, e.transposed)
        if problem:
            problems.append(problem)
    device = local_view(p).device
    compute = settings.compute_dtype or default_compute_dtype(device)
    cost, ns_key = ns_cost(group, settings.compute_dtype, device), e.group
    blocks = None
    if group.get(ROW_BLOCKS_KEY) is not None:
        try:
            blocks = resolve_row_blocks(spec_for(group[ROW_BLOCKS_KEY], e.name, f"Muon: param_groups[{e.group}]"),
                                        e.name, e.shape)
        except ValueError as err:
            problems.append(str(err))
        if blocks is not None:
            ns_key = (e.group, e.name)  # its own orthogonalisation: never batched with others
            cost = blocks_cost(blocks, cost)
    work = work_dtype(p, group)
    cuttable = group.get(ROW_BLOCKS_KEY) is None
    return PlanParam(
        name=e.name, shape=e.shape, layout=layout, wire_dtype=wire_dtype(compute, p),
        device=local_view(p).device, ns_key=ns_key, cost=cost,
        mesh=p.device_mesh if layout is not None else None,
        compute_itemsize=compute.itemsize, state_itemsize=work.itemsize,
        row_bytes=row_state_dtype(work).itemsize if normuon_on(group) else 0,
        # a unit with row blocks is orthogonalised whole, block by block (docs/parallel.md: ns_split); a cut
        # NorMuon unit takes its row statistics from the whole matrix (rule.normuon_normalize_split)
        split=split_model(group, settings.compute_dtype, local_view(p).device) if cuttable else None,
    ), blocks, problems


def plan_settings(settings: MuonSettings, device_type: str) -> PlanSettings:
    """The plan's settings, ``replica_split_flops_per_byte`` defaulting to the device's figure."""
    flops_per_byte = settings.replica_split_flops_per_byte
    if flops_per_byte is None:
        flops_per_byte = DEFAULT_REPLICA_FLOPS_PER_BYTE.get(device_type, 1e4)
    return PlanSettings(chunk_size=settings.chunk_size, replica_split=settings.replica_split,
                        replica_min_flops_per_byte=flops_per_byte, mode=settings.distributed_mode)


def ns_cost(group: Mapping, compute_dtype: torch.dtype | None,
            device: torch.device | None = None) -> Callable[[tuple[int, ...]], float]:
    """Newton–Schulz FLOPs of a (sub-)shape, of the form ``ns_method`` picks for it (owners are
    balanced on the work actually done); ``compute_dtype`` as the user set it (None: the device's
    defaults, where the Gram form may run in fp16: ``newton_schulz.ns_form_dtypes``)."""
    steps, method, coefficients = group["ns_steps"], group.get("ns_method", "auto"), group["ns_coefficients"]

    def cost(shape: tuple[int, ...]) -> float:
        return float(newton_schulz_flops(shape, steps, method, compute_dtype, coefficients, device))

    return cost


def blocks_cost(blocks: RowBlocks, matrix_cost: Callable) -> Callable[[tuple[int, ...]], float]:
    # Newton–Schulz runs per block (of every expert of a 3-D unit): the sum over blocks
    def cost(shape: tuple[int, ...]) -> float:
        matrices = math.prod(shape[:-2])
        return float(matrices * sum(c.count * matrix_cost((c.rows_per_block, shape[-1])) for c in blocks.classes))

    return cost


def split_hardware(device: torch.device) -> SplitHardware:
    """The figures ``ns_split="auto"`` plans with on ``device`` (tests swap in others)."""
    return hardware_for(device)


def split_model(group: Mapping, compute_dtype: torch.dtype | None, device: torch.device) -> SplitModel | None:
    """How a Muon group's matrices may be cut over ranks (``ns_split``), or None for "never".
    ``compute_dtype`` as the user set it (None: the device's, per form), so that the cut's cost
    model prices the form and dtype the split iteration runs (``choose_ns_form``).
    Weights with row blocks are never cut (:func:`plan_input`): their blocks are orthogonalised
    apart, each with its own lr factor."""
    mode = group.get("ns_split", "auto")
    if mode == "never":
        return None
    return SplitModel.of(mode, split_hardware(device), group["ns_steps"], group.get("ns_method", "auto"),
                         group["ns_coefficients"], compute_dtype)


def wire_dtype(compute: torch.dtype, p) -> torch.dtype:
    """What a sharded update travels as: the Newton–Schulz dtype when narrower, as Newton–Schulz
    reads it (``ns_io_dtype``: bf16 for fp16, whose range a momentum entry may exceed)."""
    return ns_io_dtype(p.dtype, compute) if compute.itemsize < p.dtype.itemsize else p.dtype


def local_shape_problem(name: str, p, layout: ParamLayout, rank: int, transposed: bool = False) -> str | None:
    """This rank's local shard of ``p`` has the shape its placements put here, or the error naming it."""
    coord = layout.grid.coordinate(rank)
    if coord is None:
        return None  # param_problem names it
    want = view_shape(layout.local_shape(coord), transposed)  # back to the stored orientation
    got = tuple(local_view(p).shape)
    if got != want:
        return (
            f"Muon: parameter '{name}' has a local shard of shape {got} on this rank, but its placements "
            f"{tuple(p.placements)} on a {tuple(layout.grid.shape)} mesh put a shard of shape {want} here "
            "(torch.chunk semantics). The DTensor was built with a layout its placements do not describe; "
            "build it with distribute_tensor/redistribute or pass the right shape/stride to from_local."
        )
    return None
