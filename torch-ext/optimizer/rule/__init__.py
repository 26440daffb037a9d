"""The Muon update rule, as functions of local tensors.

One Muon step for a weight ``W`` with gradient ``G`` (KellerJordan/Muon; torch.optim.Muon):

    B <- mu B + (1 - mu) G                         momentum, an EMA        every local piece
    X <- (1 - mu) G + mu B   (Nesterov)   or  B    what is orthogonalised  every local piece
    O <- NS(X)                                     Newton–Schulz           the owner, whole matrices
    v <- beta2 v + (1 - beta2) mean_j O_ij^2       NorMuon (optional)      the owner, one value per row
    O <- O / (sqrt(v) + 1e-8) * ||O||_F / ||.||_F
    W <- W (1 - lr wd) - adjust_lr(lr, shape) O    decoupled weight decay  every local piece
         (cautious: decay only where W O >= 0)
    W[rows of head h] *= gamma_h ** (1/2 or 1)     QK-clip (MuonClip)      every local piece

``maximize`` negates G first.  Newton–Schulz runs on each matrix of a 3-D expert stack
``[E, out, in]``, and on each declared row block of a fused weight (``row_blocks.py``), each
block with the learning rate adjusted for its own shape.  The variants are data of a step, not
branches of the runtime: NorMuon is part of the owner's stage (per matrix, per expert, per row
block, before a block's lr factor), its per-row state ``v`` travels with the rows of the pieces
(``row_state_into`` / the owner stage's second argument / ``apply_update``'s), cautious weight
decay is part of ``apply_update``, and a narrower momentum buffer (``momentum_dtype``) only
changes where the momentum is stored: every stage computes in the wider dtype.

Everything elementwise works unchanged on a local shard, so momentum, weight decay, the update
and QK-clip run where the pieces are; only Newton–Schulz needs whole matrices.  The parallel
runtime (``parallel/execution/pipeline.py``) moves the pieces and calls a :class:`MatrixStep`'s stages:
``input_into`` (a piece of X), ``row_state_into`` (its rows of v), ``orthogonalize`` (the owner's
stage), ``apply_update`` and ``scale_rows``.  The single-device path and the gather baseline call
the same stages.

    formulas.py      the elementwise formulas: momentum, Nesterov input, the update with weight
                     decay (cautious too), the lr adjustment, the dtypes a step computes in
    normuon.py       NorMuon's per-row normalisation, whole and cut over ranks
    owner_stage.py   the owner's stage: Newton–Schulz per matrix or row block, then NorMuon
    matrix_step.py   MatrixStep: one parameter's local tensors and the stages the runtime calls
"""

from .formulas import (adjust_lr, apply_update_, block_lr_factor, cautious_mask, decode_rows, encode_rows, momentum_,
                       momentum_dtype, nesterov_input_, normuon_on, row_state_dtype, work_dtype)
from .matrix_step import MatrixStep
from .normuon import normuon_normalize, normuon_normalize_split
from .owner_stage import OwnerStage, orthogonalize_in_blocks

__all__ = ["MatrixStep", "OwnerStage", "adjust_lr", "apply_update_", "block_lr_factor", "cautious_mask", "decode_rows",
           "encode_rows", "momentum_", "momentum_dtype", "nesterov_input_", "normuon_normalize",
           "normuon_normalize_split", "normuon_on", "orthogonalize_in_blocks", "row_state_dtype", "work_dtype"]
