"""Dion2's predicted bytes and Newton–Schulz FLOPs per step beside Muon's (scale_model.py's Dion2 section).

A prediction, not a plan: the α-saving distributed step is designed in docs/dion2.md ("Bytes
per step against Muon") and this prices its formula on the modelled models' shapes, FSDP
``Shard(0)`` on a 1-D mesh of S ranks (R replicas under the replica split: the same formula's
replica term), expert stacks ``[E, m, n]`` sharded on torchtitan's dim (``Shard(1)``: every
member holds rows of every expert; ``Shard(0)``: experts held whole, nothing travels for either
optimizer).  Per matrix ``m x n`` with ``P = m n`` entries, wire dtype of ``w`` bytes, chosen
fraction ``α' = k/s`` (``k`` from the optimizer's own ``chosen_count``, ``s`` the size of the
selection dim, from ``selection_dim``), ``c`` members holding a part of each slice (1 when the
selection dim is the split one, else the members holding rows), world totals, the owner's own
piece never travelling::

    Muon   2 P w (S-1)/S                         + P w (R-1)
    Dion2  2 α' P w (S-1)/S  + 9 s c R (S-1)/S   + α' P w (R-1)
           chosen slices       fp64 partials       replicas
                               + uint8 masks

Newton–Schulz FLOPs: Muon's of the whole matrix, Dion2's of the ``k``-slice submatrix (what
the owner orthogonalises), both through scale_model's one cost function.  The per-rank figure
is a lower bound for any owners: max(world FLOPs / ranks, largest unit).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from optimizer.dion2.rule import ROWS, chosen_count, selection_dim

SELECTION_BYTES = 9  # per slice and member: an fp64 partial norm out, a uint8 mask back
DEFAULT_FRACTIONS = (0.25, 0.125)
DEFAULT_RANKS = (512, 1024)


def _chunk_holders(size: int, members: int) -> int:
    """Members holding a non-empty piece when torch.chunk cuts ``size`` over ``members``."""
    if size == 0:
        return 0
    per = math.ceil(size / members)
    return math.ceil(size / per)


def matrix_bytes(shape: Sequence[int], fraction: float | None, shards: int, replicas: int, wire_bytes: int,
                 split: int | None) -> dict:
    """World bytes per step of one parameter ``[..., m, n]`` (a leading dim: experts, selected
    each on its own): ``{"chosen", "selection", "replicas", "total"}`` for Dion2 at ``fraction``,
    Muon's when ``fraction`` is None (no selection, whole matrices).  ``split``: the matrix dim
    FSDP splits over the ``shards`` members (``ROWS`` -2, ``COLUMNS`` -1), None where each member
    holds whole matrices (experts on ``Shard(0)``): nothing travels."""
    *batch, m, n = shape
    experts = math.prod(batch)
    P = experts * m * n
    spread = 0.0 if split is None else (shards - 1) / shards  # the share of pieces that travel to an owner
    chosen_frac, selection = 1.0, 0.0
    if fraction is not None:
        dim = selection_dim((m, n))
        s = m if dim == ROWS else n
        chosen_frac = chosen_count(fraction, s) / s
        c = 1 if split == dim else _chunk_holders(m if split == ROWS else n, shards)
        selection = SELECTION_BYTES * experts * s * c * replicas * spread
    chosen = 2 * chosen_frac * P * wire_bytes * spread
    replica = chosen_frac * P * wire_bytes * (replicas - 1)
    return {"chosen": chosen, "selection": selection, "replicas": replica, "total": chosen + selection + replica}


def submatrix_shape(shape: Sequence[int], fraction: float | None) -> tuple[int, ...]:
    """What the owner orthogonalises: the whole matrix (Muon), or its ``k`` chosen slices."""
    if fraction is None:
        return tuple(shape)
    *batch, m, n = shape
    dim = selection_dim((m, n))
    k = chosen_count(fraction, m if dim == ROWS else n)
    return (*batch, k, n) if dim == ROWS else (*batch, m, k)


def price(params: Sequence[tuple[str, tuple[int, ...]]], fraction: float | None, shards: int, replicas: int,
          wire_bytes: int, expert_dim: int | None, cost: Callable[[tuple[int, ...]], float]) -> dict:
    """A model's step for Muon (``fraction`` None) or Dion2: world bytes by kind, world NS FLOPs
    and the largest unit's, on FSDP ``Shard(0)`` (experts on ``expert_dim``)."""
    totals = {"chosen": 0.0, "selection": 0.0, "replicas": 0.0, "total": 0.0}
    flops, largest = 0.0, 0.0
    for _, shape in params:
        split = ROWS if len(shape) == 2 or expert_dim == 1 else None  # Shard(0) / Shard(1): rows
        for key, value in matrix_bytes(shape, fraction, shards, replicas, wire_bytes, split).items():
            totals[key] += value
        sub = submatrix_shape(shape, fraction)
        unit = cost(sub[-2:]) if len(sub) > 2 else cost(sub)  # an expert stack: one unit per expert
        flops += unit * (math.prod(sub[:-2]) if len(sub) > 2 else 1)
        largest = max(largest, unit)
    ranks = shards * replicas
    return {**{f"{k}_bytes": v for k, v in totals.items()}, "ns_flops": flops, "largest_unit_flops": largest,
            "per_rank_flops_lower_bound": max(flops / ranks, largest)}


def compare(model, ranks: int, fractions: Sequence[float], wire_bytes: int, expert_dim: int | None,
            cost: Callable) -> list[dict]:
    """One row per fraction (and Muon's first): bytes and FLOPs, and their ratios to Muon's."""
    muon = price(model.muon_params, None, ranks, 1, wire_bytes, expert_dim, cost)
    rows = [{"model": model.name, "ranks": ranks, "expert_dim": expert_dim, "fraction": None, **muon,
             "bytes_over_muon": 1.0, "flops_over_muon": 1.0}]
    for f in fractions:
        d = price(model.muon_params, f, ranks, 1, wire_bytes, expert_dim, cost)
        rows.append({"model": model.name, "ranks": ranks, "expert_dim": expert_dim, "fraction": f, **d,
                     "bytes_over_muon": d["total_bytes"] / muon["total_bytes"],
                     "flops_over_muon": d["ns_flops"] / muon["ns_flops"]})
    return rows


MiB = 2**20
HEADER = ["model", "ranks", "optimizer", "GiB moved (world)", "of which selection", "x Muon's bytes",
          "NS TFLOP (world)", "x Muon's FLOPs", "per-rank TFLOP lower bound"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        name = "Muon" if r["fraction"] is None else f"Dion2 α={r['fraction']:g}"
        out.append([r["model"], str(r["ranks"]), name, f"{r['total_bytes'] / 2**30:,.2f}",
                    f"{r['selection_bytes'] / 2**30:,.3f}", f"{r['bytes_over_muon']:.3f}",
                    f"{r['ns_flops'] / 1e12:,.1f}", f"{r['flops_over_muon']:.3f}",
                    f"{r['per_rank_flops_lower_bound'] / 1e12:,.3f}"])
    return out


def markdown(rows: list[dict], wire: str) -> list[str]:
    lines = ["## Dion2 against Muon (a prediction: the α-saving step is designed, not built)", "",
             f"docs/dion2.md's bytes formula on these shapes, FSDP `Shard(0)`, experts on torchtitan's dim, "
             f"{wire} wire; Newton–Schulz FLOPs of the k-slice submatrix (Muon: the whole matrix), through "
             "the same cost function as above. *GiB moved*: world totals per step (gather and scatter of "
             "the chosen slices, plus the selection's fp64 partial norms and uint8 masks); *per-rank lower "
             "bound*: max(world FLOPs / ranks, largest unit), for any owners (no plan is made for Dion2 here).",
             "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(rows)]
    return lines
