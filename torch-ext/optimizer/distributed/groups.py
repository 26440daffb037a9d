"""The process groups parallel Muon communicates on, created collectively, once.

A process group must be created by every rank of the world, in the same order
(``new_group`` without local synchronisation: with NCCL and a device-bound
default group torch splits the world communicator, which needs every rank).  So
groups are never created inside ``step()``: the optimizer works out, at
construction (and in ``add_param_group``), every rank set it will need, the ranks
exchange those lists, and every rank creates the union in one sorted order.

Rank sets that are a single mesh dim reuse the mesh's own group; only sets
spanning several mesh dims (a shard group over FSDP x TP, a replica group over
two replicate dims) and an optimizer-wide group smaller than the world (pipeline
stages) are created here.  Created groups are cached per process and shared by
every optimizer.
"""

from __future__ import annotations

import atexit
from typing import Iterable, Sequence

import torch.distributed as dist

from .layout import ParamLayout

# sorted ranks -> group, for groups this package created.  Dropped if the default
# process group is destroyed and created again.
_CREATED: dict[tuple[int, ...], dist.ProcessGroup] = {}
_CREATED_FOR: list = [None]
#: every ``new_group`` call this package made, in order (tests check it is the same on every rank)
CREATION_LOG: list[tuple[int, ...]] = []


def _created() -> dict[tuple[int, ...], dist.ProcessGroup]:
    if _CREATED_FOR[0] is not dist.group.WORLD:
        _CREATED.clear()
        CREATION_LOG.clear()
        _CREATED_FOR[0] = dist.group.WORLD
    return _CREATED


@atexit.register
def _release() -> None:
    # Drop our references before the interpreter finalises: a gloo group whose last
    # reference dies during finalisation joins its threads too late, and the process
    # aborts ("terminate called without an active exception").
    _CREATED.clear()


def num_created_groups() -> int:
    """How many process groups this package has created in this process."""
    return len(_created()) if dist.is_initialized() else 0


def rank_sets_needed(layouts: Iterable[tuple[ParamLayout, object]], union: Sequence[int]) -> list[tuple[int, ...]]:
    """Every rank set, of every rank of these meshes, that needs a group of its own.

    ``layouts`` pairs each parameter's layout with its DeviceMesh.  A shard or
    replica group spanning one mesh dim is the mesh's own group; one spanning two
    or more needs a new group.  All coordinates are listed, not only this rank's:
    non-members take part in creating a group too.  ``union`` (the ranks of every
    mesh together) needs a group unless it is the whole world.
    """
    needed: set[tuple[int, ...]] = set()
    seen: set[tuple] = set()
    for layout, _ in layouts:
        for dims in (layout.matrix_dims, layout.replica_dims):
            key = (layout.grid, dims)
            if len(dims) < 2 or key in seen:
                continue
            seen.add(key)
            needed.update(tuple(sorted(s)) for s in layout.grid.partition(dims))
    needed.add(tuple(sorted(set(union))))
    world = dist.get_world_size() if dist.is_initialized() else 1
    # One rank needs no group; the whole world is WORLD.
    return sorted(s for s in needed if 1 < len(s) < world)


def create_collectively(needed: Sequence[tuple[int, ...]]) -> None:
    """Create the groups for ``needed`` rank sets, together with every other rank.

    Collective over the default group: every rank calls this at the same point
    (Muon's constructor, ``add_param_group``).  The ranks first exchange their
    lists, so ranks whose parameters differ (pipeline stages, expert vs dense
    meshes) still create the same groups in the same order.
    """
    if not dist.is_initialized():
        return
    lists: list = [list(needed)]
    if dist.get_world_size() > 1 and dist.get_backend() != "fake":
        # The fake backend (tests, host-overhead benchmarks) simulates one rank of a
        # large world; its collectives move no data, so every rank's list is its own.
        lists = [None] * dist.get_world_size()
        dist.all_gather_object(lists, list(needed))
    created = _created()
    for ranks in sorted({tuple(s) for lst in lists for s in lst}):
        if ranks not in created:
            created[ranks] = dist.new_group(list(ranks))
            CREATION_LOG.append(ranks)


def has_group(ranks: Sequence[int]) -> bool:
    """Whether :func:`create_collectively` already made the group of ``ranks``."""
    return tuple(sorted(ranks)) in _created()


def group_for(ranks: Sequence[int], mesh=None, mesh_dims: Sequence[int] = ()) -> dist.ProcessGroup | None:
    """The group of ``ranks``: None for one rank, WORLD, the mesh's own group for one
    mesh dim, else the group created by :func:`create_collectively`."""
    key = tuple(sorted(ranks))
    if len(key) <= 1:
        return None
    if len(key) == dist.get_world_size():
        return dist.group.WORLD
    if mesh is not None and len(mesh_dims) == 1:
        return mesh.get_group(mesh_dims[0])
    group = _created().get(key)
    if group is None:
        raise RuntimeError(
            f"Muon: no process group for ranks {_short(key)}: groups are created when the optimizer is built "
            "(and in add_param_group), collectively on every rank. Build the optimizer after the parameters "
            "are sharded (fully_shard / parallelize_module / distribute_tensor), on every rank, and add "
            "parameters with add_param_group on every rank."
        )
    return group


def _short(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:4]))}, ..., {ranks[-1]}] ({len(ranks)} ranks)"
