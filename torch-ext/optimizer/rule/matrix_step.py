"""One Muon parameter's step as the stages the runtime calls on its local pieces (the module
docstring of ``optimizer.rule`` has the order): the momentum and Newton–Schulz input, NorMuon's
rows, the owner's stage, the update and QK-clip's row scaling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels import elementwise
from ..momentum_progress import MomentumProgress
from ..newton_schulz.forms import default_compute_dtype, ns_io_dtype
from ..qk_clip.step import apply_clip_
from .formulas import apply_update_, decode_rows, encode_rows, nesterov_input_
from .owner_stage import OwnerStage


@dataclass(eq=False)
class MatrixStep:
    """One Muon parameter's local tensors and this step's hyper-parameters: the stages the
    runtime calls (see the module docstring).  ``grad`` is the gradient as the momentum saw it
    (:func:`momentum_`'s return, in the arithmetic dtype), ``buf`` the momentum (in its storage
    dtype) already updated this step, or, fused, updated as the input is formed (``pending``),
    ``row_state`` NorMuon's ``v`` for the local rows (``[..., local rows, 1]``; None without
    NorMuon)."""

    param: Tensor  # local piece, updated in place
    grad: Tensor
    buf: Tensor
    momentum: float
    nesterov: bool
    lr: float | Tensor
    adjusted_lr: float | Tensor
    weight_decay: float
    orthogonalize: OwnerStage  # the owner's stage: (x, rows) -> (update, rows)
    clip: tuple[Tensor, Tensor] | None = None  # QK-clip: (scale table, table slot of every local row)
    row_state: Tensor | None = None  # NorMuon's v of the local rows
    cautious: bool = False  # cautious weight decay
    # The elementwise stages on the fused Triton kernels (kernels/elementwise.py; the group's
    # ``ns_kernels`` resolved to them for this piece: ``Implementation.fuses``, newton_schulz/
    # implementation.py): then ``grad`` is the gradient as stored (not negated, not converted),
    # ``maximize`` says its sign, and ``buf`` is updated by the kernels: in the pass that forms
    # each region's input (``pending`` says which parts are not yet), the rest by
    # :meth:`finish_momentum` after the pipeline.  False: the torch formulas above, unchanged
    # (``buf`` updated before the step is built).
    fused: bool = False
    maximize: bool = False
    pending: MomentumProgress | None = None  # fused: this step's momentum not yet applied everywhere

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype a piece of X is formed in where it is stacked locally: the momentum's
        arithmetic dtype (never a narrower storage dtype of the buffer)."""
        if self.fused:  # grad as stored (bf16 grads of fp32 params): the parameter's dtype is the arithmetic one
            return torch.promote_types(self.param.dtype, self.buf.dtype)
        return torch.promote_types(self.grad.dtype, self.buf.dtype)

    @property
    def stack_dtype(self) -> torch.dtype:
        """The dtype a unit orthogonalised where it is (held whole) is stacked in: what
        Newton–Schulz reads (``ns_io_dtype``: the compute dtype, bf16 for an fp16 run) when the
        compute dtype is narrower than :attr:`input_dtype` (bf16 on CUDA for fp32 momentum), else
        :attr:`input_dtype`.  The input is formed in the arithmetic dtype and rounded
        once as it is stored: exactly the cast Newton–Schulz would do first (``_normalised``), as a
        sharded piece's wire dtype does, without writing and re-reading a wide copy."""
        ns = getattr(self.orthogonalize, "newton_schulz", None)
        compute = getattr(ns, "compute_dtype", None) or default_compute_dtype(self.param.device)
        wide = self.input_dtype
        return ns_io_dtype(wide, compute) if compute.itemsize < wide.itemsize else wide

    @property
    def row_bytes(self) -> int:
        """Bytes of state that travel with each row of a piece (NorMuon's v; 0: none)."""
        return 0 if self.row_state is None else self.row_state.element_size()

    @property
    def batch_key(self) -> object:
        """Steps with the same key (and shape) are orthogonalised in one batched call."""
        return id(self.orthogonalize)

    @property
    def scales_rows(self) -> bool:
        return self.clip is not None

    def orthogonalize_split(self, x: Tensor, widths: Sequence[int], group, rows: Tensor | None = None,
                            transpose: bool = False) -> tuple[Tensor, Tensor | None]:
        """The owner's stage for one block of a matrix cut over ``group`` (``ns_split``): ``x`` is
        this rank's column block, short side first (the runtime transposes a tall matrix's row
        block: ``transpose``), ``widths`` every member's block width in group-rank order, ``rows``
        the block's rows of v (NorMuon).  Returns this rank's block of what :attr:`orthogonalize`
        returns for the whole matrix, and the block's new rows of v (None without NorMuon).
        Collective on ``group``.

        NorMuon's per-row mean of O*O and per-matrix Frobenius rescale need the whole matrix:
        ``OwnerStage.split`` takes them from one all-reduce after the split call (of the ``r``
        row sums for a wide matrix cut by columns, of two numbers per matrix for a tall one cut
        by rows; :func:`normuon_normalize_split`), and v's rows travel with the blocks as they
        do with whole units."""
        return self.orthogonalize.split(x, widths, group, rows, transpose)

    def input_into(self, out: Tensor, region: tuple = ()) -> None:
        """``out`` <- the region's Newton–Schulz input (:func:`nesterov_input_`).  Fused, the
        region's momentum is updated in the same pass where none of it is yet (reads grad and
        buf, writes buf and out), after a momentum-only pass over whatever else must be brought
        up to date first (``momentum_progress.py``): every entry of buf is updated exactly once,
        and every input is formed from buf as this step stores it."""
        if self.fused:
            catch_up, fuse = self.pending.claim(region) if self.pending is not None else ([], False)
            for part in catch_up:
                self._momentum_only(part)
            elementwise.momentum_nesterov_on_kernels_(_region(self.buf, region), _region(self.grad, region), out,
                                                      self.momentum, self.nesterov, self.maximize,
                                                      update_momentum=fuse, dtype=self.input_dtype)
            return
        nesterov_input_(out, _region(self.grad, region), _region(self.buf, region), self.momentum, self.nesterov)

    def finish_momentum(self) -> None:
        """The momentum of every part of the piece whose input this rank never formed this step
        (a unit owned in another replica, nothing to send), one momentum-only pass each; a no-op
        on the torch formulas (their momentum ran before the step was built) and once done."""
        if self.pending is not None:
            for part in self.pending.finish():
                self._momentum_only(part)

    def _momentum_only(self, region: tuple) -> None:
        buf = _region(self.buf, region)
        if buf.numel():
            elementwise.momentum_nesterov_on_kernels_(buf, _region(self.grad, region), None, self.momentum,
                                                      self.nesterov, self.maximize, dtype=self.input_dtype)

    def row_state_into(self, out: Tensor, region: tuple = ()) -> None:
        """``out`` ``[..., rows, k]`` <- the piece's rows of v, as ``out``'s dtype carries them."""
        out.copy_(encode_rows(_region(self.row_state, self._rows_region(region)), out.dtype))

    def apply_update(self, region: tuple, update: Tensor, rows: Tensor | None = None) -> None:
        """Weight decay and the update of the piece; with NorMuon, store its rows of the new v."""
        if rows is not None and self.row_state is not None:
            _region(self.row_state, self._rows_region(region)).copy_(decode_rows(rows))
        if self.fused:  # one pass: reads param and update, writes param
            elementwise.apply_update_on_kernels_(_region(self.param, region), update, self.lr, self.adjusted_lr,
                                                 self.weight_decay, self.cautious)
            return
        apply_update_(_region(self.param, region), update, self.lr, self.adjusted_lr, self.weight_decay,
                      self.cautious)

    def _rows_region(self, region: tuple) -> tuple:
        """The part of v (``[..., rows, 1]``) holding a region's rows: the region without its
        column slice (a block of a matrix cut along its columns holds some columns of its rows)."""
        return region[: self.row_state.ndim - 1]

    def scale_rows(self) -> None:
        """QK-clip: scale each local row by its head's factor (2-D weights: one region, the whole piece)."""
        apply_clip_(self.param, *self.clip)


def _region(t: Tensor, region: tuple) -> Tensor:
    return t[region] if region else t
