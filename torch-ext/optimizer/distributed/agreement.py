"""Agreeing on rank-dependent decisions before any collective runs.

A collective hangs when some ranks enter it and others do not.  Whether a
parameter has a gradient, whether ``qk_logits`` were passed, whether a
gradient is finite, whether a rank's input validated or its closure raised,
which parameters and settings a rank's optimizer holds: all of these are local
facts that can differ between ranks.  We pack them into one fixed-size integer
vector and sum it over every rank that takes part in the step, so all ranks see
the same counts and take the same branch: proceed, skip, or raise the same error.

The vector is built on the collective's device: host facts are copied in
without waiting, device facts (a non-finite gradient, a checksum of
``qk_logits``) are computed there, and the summed vector is read back once.
That read is the step's only host synchronisation.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

_CHECKSUM_PRIME = 1_048_573  # < 2**20: sums of squares over many ranks stay far inside int64


def checksum_text(text: str) -> int:
    return zlib.crc32(text.encode()) % _CHECKSUM_PRIME


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclass
class Outcome:
    ranks: int  # how many ranks agreed
    grad_counts: list[int]  # per DTensor parameter: ranks on which it has a gradient
    counts: dict[str, int]  # every named fact, summed over ranks
    same_device_digest: bool  # the device digest is equal on every rank


def parameter_checksums(described_params: Sequence[str], has_grad: Sequence[int]) -> tuple[int, int]:
    """Checksums of the parameters' descriptions and of which of them have gradients (see :func:`agree`)."""
    structure = checksum_text("\n".join(described_params))
    with_grad = sum(checksum_text(f"{i}:{d}") for i, (d, f) in enumerate(zip(described_params, has_grad)) if f)
    return structure, with_grad % _CHECKSUM_PRIME


def agree(
    described_params: Sequence[str],
    has_grad: Sequence[int],
    *,
    facts: Mapping[str, int | torch.Tensor],
    settings: int = 0,
    device_digest: torch.Tensor,
    group: dist.ProcessGroup | None,
    device: torch.device = torch.device("cpu"),
    describe_settings: Callable[[], Mapping[str, str]] | None = None,
    checksums: tuple[int, int] | None = None,
) -> Outcome:
    """One all-reduce over ``group``; raise the same error everywhere if the ranks'
    optimizers differ, else return the summed facts.

    ``described_params`` describes each DTensor parameter (name, shape,
    placements, mesh) in optimizer order.  Ranks whose optimizers hold
    different parameters (``add_param_group`` on some ranks only, differently
    built models) would send vectors of different lengths, which no collective
    survives: gloo hands one rank a wrong sum, NCCL hangs.  So the one
    all-reduce of a normal step has a fixed size: the number of parameters, a
    checksum of their descriptions, a checksum of which have gradients and a
    checksum of the settings, each with its square (``sum**2 == n *
    sum_of_squares`` exactly when all ranks sent the same value), the named
    ``facts`` (host ints, or 0-d device tensors computed on the device), and the
    device digest with its square.  Every rank must pass the same fact names (send
    zeros for facts it lacks); they are laid out in sorted order.  Per-parameter
    gradient counts are reduced only when the gradient checksums differ, an error
    path.  ``checksums``: :func:`parameter_checksums` of the same two lists, when
    the caller keeps them across steps.
    """
    n = group_size(group)
    num = len(described_params)
    structure, with_grad = checksums or parameter_checksums(described_params, has_grad)
    header = [v for x in (num, structure, with_grad, settings) for v in (x, x * x)]
    names = sorted(facts)
    host = [name for name in names if not torch.is_tensor(facts[name])]
    on_device = [name for name in names if torch.is_tensor(facts[name])]
    vector = _fact_vector(header, [int(facts[k]) for k in host], [facts[k] for k in on_device], device_digest, device)
    if group is not None:
        dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group)
    totals = vector.tolist()  # the step's one read-back

    def same_everywhere(k: int) -> bool:
        return totals[2 * k] ** 2 == n * totals[2 * k + 1]

    if not (same_everywhere(0) and same_everywhere(1)):
        _raise_different_parameters(described_params, group)
    if not same_everywhere(3):
        _raise_different_settings(describe_settings() if describe_settings else {}, group)
    if same_everywhere(2):
        grad_counts = [n * f for f in has_grad]
    else:
        grad_counts = sum_over_ranks(list(has_grad), group, device)
    k = len(header)
    counts = dict(zip(host + on_device, totals[k: k + len(names)]))
    k += len(names)
    same_digest = totals[k] ** 2 == n * totals[k + 1]
    return Outcome(n, grad_counts, counts, same_digest)


def _fact_vector(header: list[int], host: list[int], on_device: list[torch.Tensor], device_digest: torch.Tensor,
                 device: torch.device) -> torch.Tensor:
    """The vector the ranks sum: the header and host facts copied in without waiting, the device
    facts where they are, then the device digest and its square."""
    parts = [_to_device(torch.tensor(header + host, dtype=torch.int64), device)]
    parts += [t.to(device=device, dtype=torch.int64, non_blocking=True).reshape(1) for t in on_device]
    d = device_digest.to(device=device, dtype=torch.int64, non_blocking=True).reshape(1)
    parts += [d, d * d]
    return torch.cat(parts)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    # pinned, so that the copy is queued on the stream and the host does not wait
    return host.pin_memory().to(device, non_blocking=True)


def sum_over_ranks(values: list[int], group: dist.ProcessGroup | None, device=torch.device("cpu")) -> list[int]:
    """Element-wise sum of ``values`` over ``group`` (identity without a group)."""
    if group is None or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


def device_checksum(tensors: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """A small checksum of ``{key: tensor}`` contents, computed where the tensors are
    (no host read): their float32 bit patterns, weighted by position, modulo a prime."""
    total = None
    for key in sorted(tensors):
        t = tensors[key].detach()
        bits = t.to(torch.float32).contiguous().view(torch.int32).to(torch.int64).reshape(-1) & 0xFFFFFFFF
        bits = bits % _CHECKSUM_PRIME
        weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64) * (key % 1021 + 1)
        part = (bits * (weights % _CHECKSUM_PRIME)) % _CHECKSUM_PRIME
        part = part.sum() % _CHECKSUM_PRIME
        total = part if total is None else (total + part.to(total.device)) % _CHECKSUM_PRIME
    return total if total is not None else torch.zeros((), dtype=torch.int64)


# ---------------------------------------------------------------------------
# Error paths: every rank gets here together.
# ---------------------------------------------------------------------------


def _gather(obj, group) -> tuple[list, list[int]]:
    objs: list = [None] * group_size(group)
    if group is None:
        objs = [obj]
    else:
        dist.all_gather_object(objs, obj, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else [0]
    return objs, list(ranks)


def summarise_ranks(values: Sequence, ranks: Sequence[int], limit: int = 4) -> str:
    """``ranks 0-511: A; ranks 512-1023: B`` — which ranks hold which value, at any world size."""
    by_value: dict[str, list[int]] = {}
    for v, r in zip(values, ranks):
        by_value.setdefault(str(v), []).append(r)
    ordered = sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    parts = [f"{_ranges(rs)}: {v}" for v, rs in ordered[:limit]]
    if len(ordered) > limit:
        rest = sum(len(rs) for _, rs in ordered[limit:])
        parts.append(f"{len(ordered) - limit} more values on {rest} ranks")
    return "; ".join(parts)


def _ranges(ranks: Sequence[int]) -> str:
    rs = sorted(ranks)
    spans, start, prev = [], rs[0], rs[0]
    for r in rs[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    shown = ", ".join(spans[:6]) + (f", ... ({len(spans) - 6} more ranges)" if len(spans) > 6 else "")
    return f"rank{'s' if len(rs) > 1 else ''} {shown}"


def _raise_different_parameters(described: Sequence[str], group) -> None:
    lists, ranks = _gather(list(described), group)
    i = next((i for i in range(max(map(len, lists))) if len({tuple(l[i:i + 1]) for l in lists}) > 1), 0)
    held = summarise_ranks([l[i] if i < len(l) else "nothing" for l in lists], ranks)
    counts = summarise_ranks([len(l) for l in lists], ranks)
    raise RuntimeError(
        f"Muon.step: the ranks' optimizers hold different DTensor parameters (how many: {counts}); at "
        f"position {i}: {held}. Build the optimizer from the same parameters, in the same order, on every "
        "rank, and call add_param_group on every rank."
    )


def _raise_different_settings(record: Mapping[str, str], group) -> None:
    records, ranks = _gather(dict(record), group)
    keys = sorted({k for r in records for k in r})
    differing = [k for k in keys if len({r.get(k) for r in records}) > 1]
    first = differing[0] if differing else "?"
    values = summarise_ranks([r.get(first, "missing") for r in records], ranks)
    raise RuntimeError(
        f"Muon.step: the ranks' optimizer settings differ ({len(differing)} setting(s): "
        f"{', '.join(differing[:5])}{', ...' if len(differing) > 5 else ''}); {first}: {values}. "
        "Build the optimizer with the same settings on every rank (and change them on every rank)."
    )
