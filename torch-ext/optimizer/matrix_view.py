"""How Muon reads a parameter as a matrix: ``[..., out, in]``, as ``nn.Linear`` stores it, or transposed.

Newton–Schulz does not care which way round a matrix is stored (it is transpose-equivariant),
but everything that reads rows does: the learning-rate adjustment (``sqrt(max(1, out/in))``),
per-row statistics (NorMuon), QK-clip's head rows and row blocks.  Hugging Face's GPT-2 stores
its ``Conv1D`` weights ``[in, out]``, and some MoE experts ``[E, in, out]``; a Muon group marks
them with ``"muon_transposed"`` (``True`` for every parameter of the group, or ``{param_name:
True}``), and the optimizer then works on the transposed view of the parameter, its gradient and
its state everywhere, so that such a weight is updated exactly as its ``nn.Linear`` twin.

For a DTensor the view is the DTensor's own transpose: the last two tensor dims swap, and so do
the dims its ``Shard`` / ``_StridedShard`` placements name (the local shard is the local
tensor's transpose).  The momentum stays stored as the parameter is, so checkpoints do not
change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor
from torch.distributed.tensor.placement_types import Placement, Shard

from .distributed.layout import MeshGrid, ParamLayout
from .distributed.placements import is_strided_shard, row_placements
from .tensors import is_dtensor

TRANSPOSED_KEY = "muon_transposed"


def transposed_for(group_value, name: str) -> bool:
    """Whether parameter ``name`` is stored transposed, from a group's ``muon_transposed`` value."""
    if isinstance(group_value, Mapping):
        return bool(group_value.get(name, False))
    return bool(group_value)


def check_transposed(group_value, names: Sequence[str], where: str) -> None:
    """``None``/a bool for every parameter, or ``{param_name: bool}`` naming only the group's parameters."""
    if group_value is None or isinstance(group_value, bool):
        return
    if not isinstance(group_value, Mapping):
        raise ValueError(f"{where}: {TRANSPOSED_KEY} must be True/False or {{param_name: True}}, got {group_value!r}")
    known = set(names)
    unknown = [k for k in group_value if k not in known]
    if unknown:
        raise ValueError(f"{where}: {TRANSPOSED_KEY} names {unknown}, which are not parameters of this group")
    bad = {k: v for k, v in group_value.items() if not isinstance(v, bool)}
    if bad:
        raise ValueError(f"{where}: {TRANSPOSED_KEY} values must be True or False, got {bad}")


def view_shape(shape: Sequence[int], transposed: bool) -> tuple[int, ...]:
    shape = tuple(shape)
    return (*shape[:-2], shape[-1], shape[-2]) if transposed and len(shape) >= 2 else shape


def view_placements(placements: Sequence[Placement], ndim: int, transposed: bool) -> tuple[Placement, ...]:
    """Placements of the transposed DTensor: a shard of dim -1 shards dim -2 of the view and back."""
    if not transposed:
        return tuple(placements)

    def swap(dim: int) -> int:
        dim %= ndim
        return {ndim - 1: ndim - 2, ndim - 2: ndim - 1}.get(dim, dim)

    out = []
    for p in placements:
        if is_strided_shard(p):
            out.append(type(p)(swap(p.dim), split_factor=p.split_factor))
        elif isinstance(p, Shard):
            out.append(Shard(swap(p.dim)))
        else:
            out.append(p)
    return tuple(out)


def local_matrix(t: Tensor, transposed: bool) -> Tensor:
    """A local tensor as Muon reads it (a view: in-place updates reach the stored tensor)."""
    return t.mT if transposed else t


def row_state_layout(shape: Sequence[int], placements: Sequence[Placement],
                     transposed: bool) -> tuple[tuple[int, ...], tuple[Placement, ...]]:
    """Shape and placements of per-row state ``[..., rows, 1]`` (NorMuon's v) of a parameter of
    ``shape`` and ``placements`` (``()`` for a plain tensor) read as its matrix view: one value per
    row of the view, a DTensor whose local rows are exactly the view's (``row_placements``)."""
    rows_shape = (*view_shape(shape, transposed)[:-1], 1)
    if not placements:
        return rows_shape, ()
    return rows_shape, row_placements(view_placements(placements, len(shape), transposed), len(shape))


class LayoutCache:
    """One :class:`ParamLayout` per distinct (mesh, shape, placements) as Muon reads it, shared by
    the optimizer's step contexts: the plan caches index math by layout object, and models repeat
    a few shapes."""

    def __init__(self):
        self._grids: dict[object, MeshGrid] = {}
        self._layouts: dict[tuple, ParamLayout] = {}

    def grid(self, mesh) -> MeshGrid:
        hit = self._grids.get(mesh)
        if hit is None:
            hit = self._grids[mesh] = MeshGrid.of(mesh)
        return hit

    def of(self, p, transposed: bool = False) -> ParamLayout:
        """The layout of ``p`` as Muon reads it (transposed: the DTensor's transpose)."""
        shape = view_shape(p.shape, transposed)
        placements = view_placements(p.placements, p.dim(), transposed)
        key = (p.device_mesh, shape, placements)
        hit = self._layouts.get(key)
        if hit is None:
            hit = self._layouts[key] = ParamLayout(shape, self.grid(p.device_mesh), placements)
        return hit

    def local_rows(self, p, transposed: bool, rank: int) -> slice | Tensor:
        """Global rows (of the matrix view) of ``rank``'s piece of ``p``."""
        if not is_dtensor(p):
            return slice(0, view_shape(p.shape, transposed)[0])
        layout = self.of(p, transposed)
        return layout.indices(layout.grid.coordinate(rank))[0]
