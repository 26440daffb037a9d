"""Every parameter of the optimizer with its name, its group and how Muon reads it as a matrix.

Read from the param groups alone (``param_names``, or the position; ``use_muon``;
``muon_transposed``), never from the optimizer's internals: the step context, the construction
checks, QK-clip's head map and the process groups all list the parameters this way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .matrix_view import TRANSPOSED_KEY, transposed_for, view_shape


@dataclass(frozen=True)
class NamedParam:
    """One parameter of the optimizer, as a step sees it."""

    name: str
    param: torch.Tensor
    group: int  # index into param_groups
    use_muon: bool
    transposed: bool = False  # stored [in, out]: Muon reads its transpose (matrix_view.py)

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape Muon reads: ``[..., out, in]``."""
        return view_shape(self.param.shape, self.transposed)


def named_params(param_groups: Sequence[Mapping]) -> list[NamedParam]:
    """Every parameter with its name (``param_names``, or its position), group and matrix view."""
    out = []
    for gi, group in enumerate(param_groups):
        # as robust as the groups are not: a step refuses bad names and kinds (Muon.group_problems)
        names = group.get("param_names") if isinstance(group.get("param_names"), (list, tuple)) else None
        use_muon = group.get("use_muon") is True
        for i, p in enumerate(group["params"]):
            name = names[i] if names and i < len(names) else f"param_groups[{gi}]['params'][{i}]"
            out.append(NamedParam(name, p, gi, use_muon, use_muon and transposed_for(group.get(TRANSPOSED_KEY), name)))
    return out
