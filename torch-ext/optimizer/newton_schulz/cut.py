"""Newton–Schulz of one matrix (or one batch of matrices) cut by columns over the k ranks of a
group (``ns_split``): each member holds a column block ``X_i`` ([..., m, n_i], m <= n: a tall
matrix is transposed first) and together they compute their blocks of exactly what
``whole.zeropower_via_newtonschulz`` returns for the whole matrix.

The iteration only multiplies X on the left by m x m matrices, so column blocks never mix; the
one global quantity is the Gram matrix ``A = sum_i X_i X_i^T``, all-reduced once per segment
(the first time together with the norm). The steps are iteration.py's, on the same products
(products.py); what is distributed is here: B and the Gram recursion by rows (``b_split``,
``recursion``: all-gathers of row blocks), and two halves of a batch interleaved so that one's
collectives run while the other computes. The form and dtype are the whole matrix's
(``forms.choose_ns_form`` on the full shape). docs/newton_schulz.md ("A matrix cut over ranks")
has the algorithm, its collectives and its measured numerics; parallel/planning/cut_cost.py
models its cost. No host synchronisation, no process-group creation: every member calls with the
same shapes and arguments (``widths``: every member's block width, in group-rank order).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..parallel.planning.cut_cost import (check_b_split, check_recursion, choose_b_split, choose_recursion, row_block,
                                          wide_dtype)
from ..parallel.planning.cut_hardware import SplitHardware, hardware_for
from .coefficients import CoefficientSpec, norm_safety_for, resolve_ns_coefficients
from .forms import check_ns_method, choose_ns_form, ns_io_dtype
from .implementation import Implementation, check_ns_kernels, implementation_for_call
from .iteration import gram_segment_factor, step_polynomial
from .restarts import gram_restart_plan


def group_size_rank(group) -> tuple[int, int]:
    """(members, this rank's place) of ``group``; (1, 0) without a process group."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def split_zeropower_via_newtonschulz(
    X: Tensor,
    widths: Sequence[int],
    group: dist.ProcessGroup | None = None,
    ns_steps: int = 5,
    coefficients: CoefficientSpec = "fixed",
    eps: float = 1e-7,
    compute_dtype: torch.dtype | None = None,
    norm_safety: float | None = None,
    method: str = "auto",
    *,
    b_split: str = "auto",
    recursion: str = "auto",
    hardware: SplitHardware | None = None,
    ns_kernels: str | Implementation = "auto",
) -> Tensor:
    """This rank's column block of ``zeropower_via_newtonschulz(G, ...)``, G split over ``group``.

    ``X`` is this rank's block ``[..., m, n_i]`` of G in short-side-first orientation (m <= n;
    transpose a tall matrix first, and its result back); ``widths`` the block widths of every
    member of ``group`` in group-rank order (``widths[rank] == n_i``, each >= 1; see
    ``parallel.planning.cut_cost.column_blocks``). Leading dims are a batch (expert stacks), done
    with one collective per iteration. The other arguments are ``zeropower_via_newtonschulz``'s
    and mean the same (the form "auto" picks is the one it picks for the whole matrix).
    ``b_split``: how B = b A + c A^2 is computed in classic steps ("replicated", "rows" or "auto":
    ``choose_b_split`` with ``hardware``, default ``hardware_for`` the device); ``recursion``: how
    a Gram segment's m x m recursion runs ("redundant", "rows" or "auto": ``choose_recursion``,
    per segment). Returns the block in the compute dtype. Collective: every member calls it with
    the same arguments.
    """
    return _split_ns(X, widths, group, ns_steps, coefficients, eps, compute_dtype, norm_safety, method,
                     b_split, hardware, None, recursion, ns_kernels)


def _split_ns(X, widths, group, ns_steps, coefficients, eps, compute_dtype, norm_safety, method, b_split,
              hardware, record, recursion="auto", ns_kernels="auto"):
    """The implementation; ``record`` (tests): a list that receives every replicated matrix."""
    k, rank, widths, steps, norm_safety = _checked_call(X, widths, group, ns_steps, coefficients,
                                                         norm_safety, method, b_split)
    if not isinstance(ns_kernels, Implementation):
        check_ns_kernels(ns_kernels)
    check_recursion(recursion)
    m, ni = X.shape[-2], X.shape[-1]
    full = (*X.shape[:-1], sum(widths))
    form, dtype = choose_ns_form(full, ns_steps, method, compute_dtype, steps, X.device)  # as the unsplit call
    io = ns_io_dtype(X.dtype, dtype)  # the compute dtype, or bf16 for fp16 on a wider input
    if X.numel() == 0:  # no rows, or an empty batch: the same on every member, no collective
        return torch.zeros(X.shape, dtype=io, device=X.device)
    plan = gram_restart_plan(steps, ns_steps, dtype) if form == "gram" else (1,) * ns_steps
    hardware = hardware or hardware_for(X.device)
    if b_split == "auto":
        b_split = choose_b_split(full, k, dtype, hardware)
    rows = k > 1 and b_split == "rows"
    ways = [recursion if recursion != "auto" else choose_recursion(full, k, length, dtype, hardware)
            for length in plan]

    Xb = X.to(io).reshape(-1, m, ni)
    # the same products on every member: the option is agreed, and the members share a device type
    products = implementation_for_call(ns_kernels, X.device, dtype).products(Xb, dtype)
    # Two or more matrices: two halves, interleaved, so that one half's collectives run while the
    # other half computes (every member runs the same schedule, so the group sees one order).
    halves = [Xb] if Xb.shape[0] < 2 or k == 1 else list(torch.tensor_split(Xb, 2))

    def iteration(half):
        if half.shape[0] == 1:  # 2-D kernels for a single matrix, as the unsplit code
            half = half[0]
        half, A = yield from _normalise_first_gram(half, X.dtype, dtype, norm_safety, eps, products, k, group)
        return (yield from _iterate(half, A, steps, plan, rows, ways, products, k, rank, group, record))

    outs = _interleaved([iteration(h) for h in halves])
    out = outs[0] if len(outs) == 1 else torch.cat([o.reshape(-1, m, ni) for o in outs])
    return out.reshape(X.shape).to(io)


def _interleaved(runs) -> list:
    """Run generators that yield an async collective's work each time they must wait on one:
    resume each only once its work is done, taking them in turn (a deterministic order, the
    same on every member), so that one's collective overlaps the others' products.  Returns
    what each returns."""
    results = [None] * len(runs)
    pending: deque = deque()

    def advance(i, run):
        try:
            pending.append((i, run, next(run)))
        except StopIteration as done:
            results[i] = done.value

    for i, run in enumerate(runs):
        advance(i, run)
    while pending:
        i, run, work = pending.popleft()
        work.wait()
        advance(i, run)
    return results


def _checked_call(X, widths, group, ns_steps, coefficients, norm_safety, method, b_split):
    """The group's size and this rank's place in it, the widths as ints, the coefficient triples,
    the norm safety factor; a clear error for anything inconsistent."""
    if X.ndim < 2:
        raise ValueError(f"split_zeropower_via_newtonschulz expects a block [..., m, n_i], got shape {tuple(X.shape)}")
    check_ns_method(method)
    check_b_split(b_split)
    k, rank = group_size_rank(group)
    widths = tuple(int(w) for w in widths)
    m, ni = X.shape[-2], X.shape[-1]
    if len(widths) != k or min(widths) < 1 or widths[rank] != ni:
        raise ValueError(
            f"split_zeropower_via_newtonschulz: widths {widths} must give each of the group's {k} members "
            f"a block at least one column wide, this rank's ({rank}) being {ni}"
        )
    n = sum(widths)
    if m > n:
        raise ValueError(
            f"split_zeropower_via_newtonschulz: the matrix is [{m}, {n}]: pass it short side first "
            "(transpose a tall matrix, split its columns, transpose the result back)"
        )
    steps = resolve_ns_coefficients(coefficients, ns_steps)
    return k, rank, widths, steps, norm_safety_for(coefficients, norm_safety)


def _iterate(Xb, A, steps, plan, rows, ways, products, k, rank, group, record):
    """The segments of ``plan`` on this rank's normalised block ``Xb``, ``A`` being its first Gram
    matrix (already summed over the group): one all-reduce of the next Gram matrix per segment
    after the first; a one-step segment is a classic step (B replicated, or by ``rows`` and
    an all-gather), a longer one runs the m x m recursion (``ways``: "redundant" or "rows", per
    segment) and applies its factor Q.  A generator (:func:`_interleaved`): it yields each
    collective's work before it needs the result, and returns the block."""
    first = 0
    for length, way in zip(plan, ways):
        segment, first = steps[first : first + length], first + length
        if A is None:
            A = products.gram(Xb)
            if k > 1:
                yield dist.all_reduce(A, group=group, async_op=True)
        if record is not None:
            record.append(A)
        if length == 1:
            a, b, c = segment[0]
            if rows:
                B = yield from _b_rows(A, b, c, products, k, rank, group)
            else:
                B = step_polynomial(A, b, c, products)
            if record is not None:
                record.append(B)
            Xb = products.general(B, Xb, Xb, beta=a)  # a X_i + B X_i
        else:
            if k > 1 and way == "rows":
                Q = yield from _gram_factor_rows(A, segment, products, k, rank, group, record)
            else:
                Q = gram_segment_factor(A, segment, products)
            if record is not None:
                record.append(Q)
            Xb = products.general(Q, Xb)
        A = None
    return Xb


def _normalise_first_gram(Xb, input_dtype, dtype, norm_safety, eps, products, k, group):
    """The block divided by the whole matrix's norm (times ``norm_safety``, at least ``eps``) and
    the first Gram matrix, from one all-reduce of ``[G_i G_i^T, ||G_i||^2]`` in the wide dtype
    (a generator, as :func:`_iterate`).

    ``Xb`` is the block as read (``ns_io_dtype``). In fp16 the unscaled block's Gram matrix could
    pass 65504, so its own norm scales it into [-1, 1] first and scales the fp16 product back in
    the wide dtype: ``||G_i||^2 (Y_i Y_i^T)``, Y_i = G_i / ||G_i||. ``products.gram`` writes the
    block's Gram matrix into the wide buffer (torch's path rounds it to the compute dtype first,
    the kernels' round their fp32 accumulation once, to the wide dtype)."""
    wide = wide_dtype(dtype, input_dtype)
    lead, m = Xb.shape[:-2], Xb.shape[-2]
    count = math.prod(lead)
    buf = torch.empty(count * m * m + count, dtype=wide, device=Xb.device)
    gram = buf[: count * m * m].view(*lead, m, m)
    squares = buf[count * m * m :].view(*lead, 1, 1)
    norm = torch.linalg.vector_norm(Xb, dim=(-2, -1), keepdim=True, dtype=wide)
    torch.mul(norm, norm, out=squares)
    if dtype == torch.float16:
        local = norm.clamp_min(torch.finfo(wide).tiny)
        Y = torch.div(Xb, local, out=torch.empty(Xb.shape, dtype=dtype, device=Xb.device))
        # ||G_i||^2 (Y_i Y_i^T): the fp16 product widened exactly, then one wide multiplication
        products.gram(Y, out=gram).mul_(squares)
    else:
        products.gram(Xb, out=gram)
    if k > 1:
        yield dist.all_reduce(buf, group=group, async_op=True)
    scale = (squares.sqrt() * norm_safety).clamp_min(eps)
    X = torch.div(Xb, scale, out=torch.empty(Xb.shape, dtype=dtype, device=Xb.device))
    A = torch.div(gram, scale * scale, out=torch.empty(gram.shape, dtype=dtype, device=Xb.device))
    return X, A


def _b_rows(A: Tensor, b: float, c: float, products, k: int, rank: int, group):
    """B = b A + c A^2 with each member computing its rows, then one all-gather (a generator).
    A block of rows is not symmetric: ``products.general``."""
    start, stop, p = row_block(A.shape[-1], k, rank)
    mine = A[..., start:stop, :]
    return (yield from _gather_rows(products.general(mine, A, mine, alpha=c, beta=b), k, p, group))


def _gram_factor_rows(A: Tensor, segment, products, k: int, rank: int, group, record):
    """Q of one Gram segment (``iteration.gram_segment_factor``'s products) with each member
    computing its rows of every product, and 2L all-gathers (a generator). ``A`` is the
    segment's Gram matrix, whole and the same on every member; so is what returns. Row blocks are
    not symmetric: every product is ``products.general``."""
    m = A.shape[-1]
    start, stop, p = row_block(m, k, rank)
    general = products.general
    Q = None
    for j, (a, b, c) in enumerate(segment):
        mine = A[..., start:stop, :]
        B_rows = general(mine, A, mine, alpha=c, beta=b)  # b A + c A A
        B = yield from _gather_rows(B_rows, k, p, group)
        if record is not None:
            record.append(B)
        if Q is None:  # q(A) = a I + B: the identity's ones sit at (i, start + i) of these rows
            Q = B_rows.clone()
            Q[..., :, start:stop].diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = general(Q, B, Q, beta=a)  # Q q(A) = a Q + Q B
        if j + 1 < len(segment):
            AQ_rows = general(mine, B, mine, beta=a)  # A q(A) = a A + A B
            # the next A = q(A) A q(A) = a AQ + B AQ, by columns: AQ's columns are its rows transposed
            columns = general(B, AQ_rows.mT, AQ_rows.mT, beta=a)
            A = yield from _gather_rows(columns.mT, k, p, group)  # symmetric: its rows are these columns transposed
            if record is not None:
                record.append(A)
    return (yield from _gather_rows(Q, k, p, group))


def _gather_rows(part: Tensor, k: int, p: int, group):
    """The whole m x m matrix from every member's rows ``part`` (``[..., r, m]``, r <= p: member j
    holds rows ``[j p, j p + r)``), by one all-gather of p rows each (the last members pad; a
    generator)."""
    lead, r, m = part.shape[:-2], part.shape[-2], part.shape[-1]
    if r < p:  # pad to p rows (the last members); the padding is dropped below
        padded = part.new_zeros((*lead, p, m))
        padded[..., :r, :] = part
        part = padded
    gathered = part.new_empty((k, *lead, p, m))
    flat = part.contiguous().view(-1)  # flat: what every backend takes
    yield _all_gather(gathered.view(-1), flat, group=group, async_op=True)
    if part.ndim == 2:
        return gathered.view(k * p, m)[:m]
    return gathered.movedim(0, -3).reshape(*lead, k * p, m)[..., :m, :]
