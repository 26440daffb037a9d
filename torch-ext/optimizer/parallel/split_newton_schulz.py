"""Newton-Schulz for one matrix (or one batch of matrices) split by columns over k ranks.

Parallel Muon gives each matrix one owner. With more ranks than matrices, the largest matrix sets
the step time (Llama-3-70B's ``[28672, 8192]`` alone is 3.4x the ideal per-rank share at 1,024
ranks). Here the k ranks of a group each hold a column block ``X_i`` ([..., m, n_i], m <= n, the
matrix in "short side first" orientation: the caller transposes a tall one) and together compute
their blocks of exactly what :func:`~optimizer.newton_schulz.zeropower_via_newtonschulz` returns
for the whole matrix.

The iteration ``X <- a X + (b A + c A^2) X``, ``A = X X^T``, only ever multiplies X on the *left*
by an m x m matrix, so column blocks never mix: ``X_i <- a X_i + B X_i``. The one global
quantity is ``A = sum_i X_i X_i^T``: an all-reduce of m x m numbers (per matrix of a batch; one
collective for the whole batch).

Classic form, per step (``method="classic"``, or one-step Gram segments):

* ``A``: every rank computes ``X_i X_i^T`` (2 m^2 n_i FLOPs) and all-reduces it (m^2 numbers in
  the compute dtype).
* ``B = b A + c A^2``: 2 m^3 FLOPs, the same on every rank. Two ways (``b_split``):

  - ``"replicated"``: every rank computes all of B. What NVIDIA's Emerging-Optimizers
    ``newton_schulz_tp(mode="distributed")`` does (Megatron-LM's Muon for tensor-parallel weights:
    ``A = X @ X.mT``, ``all_reduce(A)``, ``B = addmm(A, A, A)``, ``X = addmm(X, B, X)``; the norm
    by a separate all-reduce of the sum of squares first). No extra communication, but the
    m^3 term does not shrink with k: at m = 8192, k = 8 it is half of each rank's FLOPs.
  - ``"rows"``: rank j computes rows ``[j p, (j+1) p)`` of B (p = ceil(m / k); 2 p m^2 FLOPs) and
    an all-gather assembles B (each rank sends (k-1) p m numbers and takes one more collective).
    Worth it when the FLOPs saved, 2 m^2 (m - p), take longer than the all-gather:
    ``2 m^2 (m - p) / rate > (k-1) p m itemsize / bandwidth + latency``. With p = m / k the
    bandwidth term alone gives ``m > rate itemsize / (2 bandwidth)`` whatever k; on the CUDA
    model (bf16 680 TFLOP/s, NVLink 360 GB/s, NCCL latencies) m = 1024 stays replicated and
    Llama-3-70B's m = 8192 splits; on this CPU (fp32 70 GFLOP/s, 1.2 GB/s, 250 us) rows pay from
    m = 260-310. ``"auto"`` applies that inequality (:func:`~.split_cost.choose_b_split`), a pure
    function of shape, k, dtype and hardware, so every rank decides alike.

  Microsoft's dion takes neither route: its Muon re-shards with all-to-alls so that each rank
  orthogonalises whole matrices (one matrix per rank and batch of world-size matrices), as our
  unsplit path does; its Dion orthogonalises a row-sharded factor by all-reducing the small
  r x r Gram matrix (Cholesky QR), the same "reduce the short side's Gram" idea as here.

* ``X_i <- a X_i + B X_i``: 2 m^2 n_i FLOPs, local.

Gram form (``gram_restart_plan`` segments of L >= 2 steps): one all-reduce of ``X X^T`` per
segment, the m x m recursion of :func:`~optimizer.newton_schulz._gram_segment_factor`
(``(4 L - 3) 2 m^3`` FLOPs), then ``X_i <- Q X_i``. Segments of one step are classic steps (as in
the unsplit code). The form and the dtype it runs in are chosen exactly as the unsplit call would
choose them for the whole matrix (``choose_ns_form`` on the full shape, device and compute dtype,
with the restart plan ``gram_restart_plan`` gives for that dtype, whatever its segment lengths):
the two forms differ by up to ~1e-3 in fp32, so results must not depend on whether the planner
split a matrix. With ``compute_dtype=None`` on CUDA the Gram form runs in fp16
(``newton_schulz.ns_form_dtypes``; segments such as 2 + 3), the block read and returned in bf16
(``ns_io_dtype``), and the first Gram matrix formed from each block scaled by its own norm (see
:func:`_normalise_first_gram`); in bf16 "auto" is always the classic form. The cost model
(:func:`split_ns_cost`, :meth:`~.split_cost.SplitHardware.form`) takes the form and dtype from the same
function, so it prices what runs. The recursion runs two ways
(``recursion``; "auto": :func:`~.split_cost.choose_recursion`, per segment):

  - ``"redundant"``: every member runs all of it (no communication; its m^3 terms do not shrink
    with k: for 5 steps in one segment, ``17 m^3`` multiply-adds capped the gain at 1.10x for
    2048 x 4096 over 2 ranks).
  - ``"rows"``: member j computes its rows ``[j p, (j+1) p)`` of every product (1/k of the
    FLOPs), and all-gathers assemble what the next product needs whole: per step B = b A + c A^2
    (from A's rows and the whole A), Q's rows (``a Q + Q B``, or ``B + a I`` first) need B whole;
    before the next step, ``AQ = a A + A B`` by rows, then the next A = ``a AQ + B AQ`` by
    *columns* (AQ is symmetric, a polynomial in A: its columns are its rows transposed), which are
    the next A's rows transposed (A is symmetric too) and are all-gathered; at the end Q is
    all-gathered for ``X_i <- Q X_i``. 2L all-gathers per segment of L steps, each (k-1) p m
    numbers per rank; what the unsplit code computes by symmetric blocks (mirroring one triangle)
    it computes by rows and transposes, the same products in another rounding order.

Normalisation, folded into the first collective. The unsplit code divides the compute-dtype
matrix by ``max(||X||_F * norm_safety, eps)`` with the norm taken in fp32 (or wider). The first
Gram matrix is formed from the *unscaled* blocks instead, and its all-reduce carries one more
number per matrix, the block's sum of squares: one buffer of ``batch (m^2 + 1)`` numbers in that
wide dtype, ``[G_i G_i^T ..., ||G_i||^2 ...]``. After the all-reduce each rank has ``||G||^2``,
divides its block by the scale (rounding once to the compute dtype, as the unsplit code does) and
takes ``A = (sum G_i G_i^T) / scale^2``. (The trace of the Gram matrix is also ``||G||^2``, but in
bf16 its diagonal is rounded; the extra number keeps the norm fp32-exact.) So the norm costs no
collective of its own; the first all-reduce is sent in the wide dtype (2x its bytes in bf16),
later ones in the compute dtype. The fold assumes ``||G||_F^2`` is representable in the wide dtype
(fp32: ``1e-19 < ||G||_F < 1e19``); outside it the unsplit code's own fp32 norm under/overflows
too. An all-zero matrix gives zeros, like the unsplit code.

Numerics (measured; tests/test_split_newton_schulz.py asserts them with margin):

* fp32, Gaussian inputs (wide, tall, square, batched), 2-8 ranks, even and uneven blocks, both
  forms and tables, 5 and 10 steps, B replicated or by rows: within 5.5e-6 of the unsplit result
  (1.15e-5 at 2048 x 4096 on 2 ranks, both forms).
* fp32, hard inputs (rank-deficient, condition number 1e4, the Gram form forced on a square
  Gaussian matrix): rounding below the noise floor is amplified; the unsplit call itself moves by
  up to 1e-2 (Gram) / 3e-3 (classic) when its columns are merely permuted, and the split deviates
  by about as much (at most 1.25x that). Without the Gram restarts it would be 1e23 off.
* bf16: the partial Gram matrices are rounded to bf16 on each rank and summed in bf16, so the
  split is another bf16 rounding path: max |split - unsplit| 3.3e-2, rms 5.5e-3 (outputs up to
  ~0.6; 2-8 ranks). That is bf16 Newton-Schulz's own sensitivity: changing one input element by
  one bf16 ulp moves the unsplit result by up to 1.6e-2 (rms 2.3e-3). Against the fp32 result,
  the split's rms error is 1.1-1.3x the unsplit's (median; at most 1.9x at 8 ranks). Summing
  fp32 partial Gram matrices (``torch.mm(..., out_dtype=torch.float32)`` on CUDA) in an fp32
  all-reduce would remove most of that, for 2x the all-reduce bytes; not done.

Products (``kernels``, the ``ns_kernels`` option; :mod:`.split_products`): resolved once per call
as the unsplit call resolves it (on the device and the compute dtype), the same on every member.
On torch's matmuls (``"torch"``, and ``"auto"`` off CUDA) this is the code of earlier releases,
bit for bit. On the Triton kernels (``"auto"`` on supported CUDA GPUs, ``"triton"``) every product
known to be symmetric computes one triangle (under ``"auto"``, from two tile rows up, as the unsplit
call: ``newton_schulz.kernel_backend``): ``X_i X_i^T`` (the first one accumulated in fp32
and written straight into the wide all-reduce buffer: in 16 bits one rounding fewer than torch's
path, the same bytes), ``b A + c A^2`` replicated, the redundant Gram recursion; ``a X_i + B X_i``,
``Q X_i`` and the row blocks of the rows-split products (not symmetric) run on
``kernels.matmul_add``, which is cuBLAS under ``"auto"``. Per member and classic step that is
``f (s^2 w + s^3) + s^2 w`` multiply-adds instead of ``2 s^2 w + s^3`` (B replicated; f ~ 0.5 the
share of tiles computed, docs/kernels.md), the same share as the unsplit call on its m x m
products.

Every replicated quantity (A, B, Q) is the output of one collective or of the same kernels on
identical inputs (torch's, or the Triton kernels', which use fixed tiles and no atomics), hence
bitwise identical on every rank of the group (asserted for both), which keeps the blocks
consistent.

No host synchronisation (no ``.item()``), no process-group creation: the caller passes a group
created once, elsewhere. Every member must call with the same shapes and arguments (``widths`` is
every member's block width, in group-rank order).

The cost model (pure, no tensors) is ``split_cost.py``: :func:`split_ns_cost` gives per-rank
FLOPs, bytes each rank sends (= receives), the collective count and the modelled time for a shape
split over k; :func:`choose_split_ranks` picks k; :func:`split_critical_path` is the time of a
split unit. Its names are re-exported here.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..newton_schulz import (
    NS_NORM_SAFETY,
    CoefficientSpec,
    _uses_symmetric_blocks,
    check_ns_method,
    choose_ns_form,
    gram_restart_plan,
    ns_io_dtype,
    resolve_ns_coefficients,
)
from ..ns_kernels import check_ns_kernels
from .planning.cut_cost import (
    B_SPLITS,
    RECURSIONS,
    SplitCost,
    check_b_split,
    check_recursion,
    choose_b_split,
    choose_recursion,
    choose_split_ranks,
    column_blocks,
    row_block,
    split_critical_path,
    split_ns_cost,
    wide_dtype,
)
from .planning.cut_hardware import CPU_GLOO, CUDA_NVLINK, SplitHardware, hardware_for
from .split_products import cut_products

__all__ = [
    "B_SPLITS",
    "RECURSIONS",
    "CPU_GLOO",
    "CUDA_NVLINK",
    "SplitCost",
    "SplitHardware",
    "choose_b_split",
    "choose_recursion",
    "choose_split_ranks",
    "column_blocks",
    "hardware_for",
    "row_sums_of_squares",
    "split_critical_path",
    "split_ns_cost",
    "split_zeropower_via_newtonschulz",
    "squares_per_row",
    "sum_over_group",
]


# ----------------------------------------------------------------------------
# The distributed iteration
# ----------------------------------------------------------------------------


def _group_size_rank(group) -> tuple[int, int]:
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
    kernels: str = "auto",
) -> Tensor:
    """This rank's column block of ``zeropower_via_newtonschulz(G, ...)``, G split over ``group``.

    ``X`` is this rank's block ``[..., m, n_i]`` of G in short-side-first orientation (m <= n;
    transpose a tall matrix first, and its result back); ``widths`` the block widths of every
    member of ``group`` in group-rank order (``widths[rank] == n_i``, each >= 1; see
    :func:`column_blocks`). Leading dims are a batch (expert stacks), done with one collective per
    iteration. The other arguments are :func:`~optimizer.newton_schulz.zeropower_via_newtonschulz`'s
    and mean the same (the form "auto" picks is the one it picks for the whole matrix).
    ``b_split``: how B = b A + c A^2 is computed in classic steps ("replicated", "rows" or "auto":
    :func:`choose_b_split` with ``hardware``, default :func:`hardware_for` the device);
    ``recursion``: how a Gram segment's m x m recursion runs ("redundant", "rows" or "auto":
    :func:`choose_recursion`, per segment); ``kernels``: what runs the products, as for the unsplit
    call (``optimizer.ns_kernels``: "auto", "torch" or "triton"; :func:`.split_products.cut_products`).
    Returns the block in the compute dtype. Collective: every member calls it with the same arguments.
    """
    return _split_ns(X, widths, group, ns_steps, coefficients, eps, compute_dtype, norm_safety, method,
                     b_split, hardware, None, recursion, kernels)


def _split_ns(X, widths, group, ns_steps, coefficients, eps, compute_dtype, norm_safety, method, b_split,
              hardware, record, recursion="auto", kernels="auto"):
    """The implementation; ``record`` (tests): a list that receives every replicated matrix."""
    k, rank, widths, steps, norm_safety = _checked_call(X, widths, group, ns_steps, coefficients,
                                                         norm_safety, method, b_split)
    check_ns_kernels(kernels)
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
    # torch's matmuls or the kernels, as the unsplit call resolves ns_kernels (one object per call)
    products = cut_products(kernels, X.device, dtype, _uses_symmetric_blocks(Xb))
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
    k, rank = _group_size_rank(group)
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
    if norm_safety is None:
        norm_safety = NS_NORM_SAFETY.get(coefficients, 1.0) if isinstance(coefficients, str) else 1.0
    if not norm_safety > 0:
        raise ValueError(f"norm_safety must be positive, got {norm_safety!r}")
    return k, rank, widths, steps, norm_safety


def _iterate(Xb, A, steps, plan, rows, ways, products, k, rank, group, record):
    """The segments of ``plan`` on this rank's normalised block ``Xb``, ``A`` being its first Gram
    matrix (already summed over the group): one all-reduce of the next Gram matrix per segment
    after the first; a one-step segment is a classic step (B replicated, or by ``rows`` and
    an all-gather), a longer one runs the m x m recursion (``ways``: "redundant" or "rows", per
    segment) and applies its factor Q; every product on ``products`` (split_products.py).  A
    generator (:func:`_interleaved`): it yields each collective's work before it needs the
    result, and returns the block."""
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
                B = products.b_of(A, b, c)
            if record is not None:
                record.append(B)
            Xb = products.general(B, Xb, Xb, beta=a)  # a X_i + B X_i
        else:
            if k > 1 and way == "rows":
                Q = yield from _gram_factor_rows(A, segment, products, k, rank, group, record)
            else:
                Q = products.segment_factor(A, segment)
            if record is not None:
                record.append(Q)
            Xb = products.general(Q, Xb)
        A = None
    return Xb


def _normalise_first_gram(Xb, input_dtype, dtype, norm_safety, eps, products, k, group):
    """The block divided by the whole matrix's norm (times ``norm_safety``, at least ``eps``) and
    the first Gram matrix, from one all-reduce of ``[G_i G_i^T, ||G_i||^2]`` in the wide dtype
    (a generator, as :func:`_iterate`).

    ``Xb`` is the block as read (``ns_io_dtype``: the compute dtype, or bf16 for fp16). In fp16 the
    unscaled block's Gram matrix could pass 65504, so its own norm scales it into [-1, 1] first
    and scales the fp16 product back in the wide dtype: ``||G_i||^2 (Y_i Y_i^T)``, Y_i = G_i / ||G_i||
    (another rounding path than the unsplit product of the normalised matrix, as bf16's is).
    ``products.gram_into`` writes the block's Gram matrix into the wide buffer: torch's path
    rounds it to the compute dtype first, the kernels' round their fp32 accumulation once, to the
    wide dtype (split_products.py)."""
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
        products.gram_into(Y, gram).mul_(squares)
    else:
        products.gram_into(Xb, gram)
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
    """Q of one Gram segment (:func:`~optimizer.newton_schulz._gram_segment_factor`'s products)
    with each member computing its rows of every product, and 2L all-gathers (module docstring;
    a generator). ``A`` is the segment's Gram matrix, whole and the same on every member; so is
    what returns. Row blocks are not symmetric: every product is ``products.general``."""
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


def squares_per_row(block: Tensor) -> Tensor:
    """Each row's sum of squares of ``block`` ``[..., r, c]``: ``[..., r]`` in fp32 (or wider)."""
    return torch.linalg.vector_norm(block, dim=-1, dtype=wide_dtype(block.dtype, block.dtype)).square()


def sum_over_group(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``t`` summed over ``group``'s members, in place (one all-reduce; nothing alone). Collective."""
    k, _ = _group_size_rank(group)
    if k > 1:
        dist.all_reduce(t, group=group)
    return t


def row_sums_of_squares(block: Tensor, group: dist.ProcessGroup | None, rows_whole: bool) -> tuple[Tensor, Tensor]:
    """For a post-processing that needs whole rows of the orthogonalised matrix (NorMuon's per-row
    ``mean(O*O, dim=-1)`` and its per-matrix Frobenius rescale) when O is split over ``group``.

    ``block``: this rank's block of O in the *parameter's* orientation ``[..., r, c]``.
    ``rows_whole``: the block holds whole rows (a tall matrix cut along its rows): the row sums
    are local, and only the squared Frobenius norm needs one all-reduce of one number per matrix.
    Otherwise (a wide matrix cut along its columns, every member holding every row) the members'
    row sums add up: one all-reduce of ``[..., r]`` numbers, and the norm follows from them.
    Returns (sum over the whole matrix's columns of each row's squares ``[..., r]``, squared
    Frobenius norm ``[...]``), in fp32 (or wider), the same on every member. Collective on
    ``group``; no host synchronisation.  (NorMuon on a row-cut block needs a second number per
    matrix, the normalised matrix's norm, which depends on the local rows' v:
    ``rule.normuon_normalize_split`` sends both in one :func:`sum_over_group` instead.)"""
    sums = squares_per_row(block)
    if rows_whole:
        return sums, sum_over_group(sums.sum(-1), group)
    sum_over_group(sums, group)
    return sums, sums.sum(-1)
