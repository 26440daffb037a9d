"""What this rank knows before the ranks agree, and the verdict on what they agreed.

The step's one all-reduce is ``distributed/agreement.agree``.  Here is what goes into it (this
rank's :class:`LocalFacts`: its problems, QK-clip's values, the facts to sum, and the DTensor
parameters' descriptions) and what comes out of it (:func:`verdict`: the same error on every
rank, or whether every rank skips the step).  Device facts stay on the device until the sum is
read back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..distributed.agreement import Outcome
from ..qk_clip.logits_checks import check_agreed_logits
from ..qk_clip.step import ClipStep


@dataclass
class LocalFacts:
    """What this rank knows about a step before the ranks agree (named, not positional)."""

    errors: list[str]
    missing_groups: list[tuple[int, ...]]  # process groups the plan needs that no rank created yet
    closure_error: BaseException | None
    qk_logits: Mapping | None
    clip: ClipStep | None
    nonfinite_grads: torch.Tensor
    nonfinite_logits: torch.Tensor
    logits_digest: torch.Tensor

    def summed(self) -> dict[str, int | torch.Tensor]:
        """The facts the ranks sum (the agreement lays them out by name)."""
        return {
            "qk_logits_passed": int(self.qk_logits is not None),
            "rejected_inputs": int(bool(self.errors)),
            "closure_raised": int(self.closure_error is not None),
            "nonfinite_grads": self.nonfinite_grads,
            "nonfinite_logits": self.nonfinite_logits,
            "missing_groups": int(bool(self.missing_groups)),
        }


def verdict(facts: LocalFacts, outcome: Outcome, dtensor_names: Sequence[str]) -> bool:
    """Raise the same error on every rank if any rank cannot step; else whether every rank
    skips the step (``skip_nonfinite`` and a non-finite gradient somewhere)."""
    counts, n = outcome.counts, outcome.ranks
    if facts.closure_error is not None:
        raise facts.closure_error
    if counts["closure_raised"]:
        raise RuntimeError(
            f"Muon.step: the closure raised on {counts['closure_raised']} of {n} ranks (their errors say why); "
            "this rank stops too so that no collective hangs."
        )
    if facts.errors:
        raise ValueError("\n".join(facts.errors))
    if counts["rejected_inputs"]:
        raise RuntimeError(
            f"Muon.step: {counts['rejected_inputs']} of {n} ranks rejected their inputs (their errors say why); "
            "this rank stops too so that no collective hangs."
        )
    for name, c in zip(dtensor_names, outcome.grad_counts):
        if 0 < c < n:
            raise RuntimeError(
                f"Muon.step: parameter '{name}' has a gradient on {c} of {n} ranks and None on the "
                "others. A sharded parameter needs a gradient on every rank: use it in every rank's "
                "forward, or call zero_grad(set_to_none=False) so unused parameters get zero gradients."
            )
    check_agreed_logits(counts["qk_logits_passed"], n, outcome.same_device_digest, counts["nonfinite_logits"],
                        facts.qk_logits)
    if counts["missing_groups"]:
        raise RuntimeError(
            f"Muon.step: {counts['missing_groups']} of {n} ranks lack process groups the step needs, and they "
            "could not be created here: the optimizer's ranks are not the whole world. Build the optimizer after "
            "the parameters are sharded (its constructor creates them, collectively)."
        )
    return counts["nonfinite_grads"] > 0


def describe(name: str, p) -> str:
    """A DTensor parameter as the agreement compares it across ranks."""
    return f"'{name}' {tuple(p.shape)} {tuple(p.placements)} on mesh {tuple(p.device_mesh.shape)}"


def mesh_device(mesh) -> torch.device:
    """The device the agreement's collective runs on for a mesh."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def count_nonfinite(grads: list[torch.Tensor]) -> torch.Tensor:
    """How many local gradients hold a NaN/Inf, as a 0-d device tensor (no host sync).

    The max-abs norm of finite values is finite in any dtype (an fp16 sum of squares
    would overflow above 65504 and flag finite gradients).
    """
    nonempty = [g for g in grads if g.numel()]
    if not nonempty:
        return torch.zeros((), dtype=torch.int64, device=grads[0].device if grads else "cpu")
    norms = torch._foreach_norm(nonempty, float("inf"))
    return (~torch.isfinite(torch.stack([n.float() for n in norms]))).sum()
