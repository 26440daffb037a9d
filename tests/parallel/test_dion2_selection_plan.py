"""Dion2's selection plan (``parallel/planning/dion2_selection.py``), pure: no ranks.

Every member of a shard group computes its own plan; the ``all_to_all_single`` only match (and
never hang) if what member ``a`` plans to send ``b`` is what ``b`` plans to receive from ``a``,
and if all agree on the owners.  Also: the selection dim is the global shape's, every global slice
is held by the members the placements say (``torch.chunk`` written here), and the bytes equal the
design's closed form ``9 s c (S-1)/S`` per unit on even splits (``docs/dion2.md``).
A row block's unit restricts each member's rows to the block's (positions within the block).
"""

from __future__ import annotations

import itertools

import pytest

from dist_cases import parse_placement
from optimizer.parallel.planning.dion2_selection import exchange_plan, slice_map

LAYOUTS = [
    ((4,), ["S0"]), ((4,), ["S1"]), ((4,), ["SS0/2"]), ((2, 2), ["S0", "S1"]), ((2, 2), ["SS0/2", "S0"]),
    ((8,), ["S0"]), ((2, 2, 2), ["SS0/2", "S0", "S1"]),
]
SHAPES = [(8, 16), (16, 8), (12, 12), (7, 13), (13, 7), (3, 10), (10, 3)]


def plans(mesh_shape, placements, shapes, fraction=0.25, rows_only=False):
    coords = list(itertools.product(*(range(s) for s in mesh_shape)))
    pls = [parse_placement(p) for p in placements]
    params = [(s, pls) for s in shapes]
    return [exchange_plan(params, mesh_shape, coords, me, fraction, rows_only) for me in range(len(coords))]


@pytest.mark.parametrize("mesh_shape,placements", LAYOUTS)
@pytest.mark.parametrize("rows_only", [False, True])
def test_members_agree(mesh_shape, placements, rows_only):
    ps = plans(mesh_shape, placements, SHAPES, rows_only=rows_only)
    for a, b in itertools.product(range(len(ps)), repeat=2):
        assert ps[a].norm_send[b] == ps[b].norm_recv[a], f"member {a} sends {b} what {b} does not expect"
    assert len({tuple(u.owner for u in p.units) for p in ps}) == 1, "members disagree about the owners"
    for p in ps:
        for u in p.units:
            assert _key(u.maps[p.me]) == _key(ps[0].units[u.param].maps[p.me]), "members' maps differ"


def _key(smap):
    as_list = [list(range(ix.start, ix.stop)) if isinstance(ix, slice) else ix.tolist() for ix in smap.indices]
    return smap.dim, smap.size, smap.k, smap.batch, as_list


def _chunks(n: int, k: int) -> list[list[int]]:
    size = -(-n // k)
    return [list(range(min(c * size, n), min((c + 1) * size, n))) for c in range(k)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows_only", [False, True])
def test_dim_and_slices_follow_the_global_shape(shape, rows_only):
    m, n = shape
    dim = -2 if rows_only or m <= n else -1
    for placements in (["S0"], ["S1"]):
        maps = [slice_map(shape, (4,), [parse_placement(placements[0])], (c,), 0.5, rows_only) for c in range(4)]
        split_dim = -2 if placements == ["S0"] else -1
        for c, smap in enumerate(maps):
            assert smap.dim == dim and smap.size == shape[dim]
            got = smap.slices
            got = list(range(got.start, got.stop)) if isinstance(got, slice) else got.tolist()
            want = _chunks(shape[dim], 4)[c] if split_dim == dim else list(range(shape[dim]))
            assert got == want, (placements, c)


@pytest.mark.parametrize("mesh_shape,placements,shape,c", [
    ((4,), ["S0"], (8, 16), 1),    # wide, rows split: each member holds whole rows
    ((4,), ["S0"], (16, 8), 4),    # tall, columns chosen: every member holds a piece of each
    ((4,), ["S1"], (8, 16), 4),
    ((2, 2), ["S0", "S1"], (8, 16), 2),
    ((2, 2), ["SS0/2", "S0"], (8, 16), 1),
])
def test_bytes_are_the_design_formula(mesh_shape, placements, shape, c):
    ps = plans(mesh_shape, placements, [shape])
    members, s = len(ps), min(shape)
    assert sum(p.wire_bytes() for p in ps) == 9 * s * c * (members - 1) // members


def test_owners_spread_and_bad_member_refused():
    ps = plans((4,), ["S0"], [(8, 16)] * 4)
    assert sorted(u.owner for u in ps[0].units) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="member 4 outside a shard group of 4"):
        exchange_plan([((8, 16), [parse_placement("S0")])], (4,), [(0,), (1,), (2,), (3,)], 4, 0.5)


BLOCKS = {"heads": [list(range(i, i + 4)) for i in range(0, 16, 4)],
          "rows_and_columns": [list(range(4)), list(range(4, 16))],  # 4 x 12: rows; 12 x 12: rows (m <= n)
          "non_contiguous": [list(range(0, 16, 2)), list(range(1, 16, 2))],
          "reversed": [list(range(15, -1, -1))]}


@pytest.mark.parametrize("blocks", list(BLOCKS))
@pytest.mark.parametrize("mesh_shape,placements", LAYOUTS[:5])
def test_row_blocks_restrict_each_members_rows(blocks, mesh_shape, placements):
    """A block's unit (``slice_map`` with the block's rows): each member's ``local_rows`` are its
    local rows (``local_indices``, checked against DTensor elsewhere) whose global row is in the
    block, in local order, and its row indices their positions within the block (written here);
    the dim and ``k`` are the block's shape's; together the members hold every (block row, column)
    once; and the members agree on the two all-to-alls."""
    from optimizer.distributed.placements import local_indices

    shape, pls = (16, 12), [parse_placement(p) for p in placements]
    coords = list(itertools.product(*(range(s) for s in mesh_shape)))
    for rows in BLOCKS[blocks]:
        held = set()
        for c in coords:
            smap = slice_map(shape, mesh_shape, pls, c, 0.25, block=tuple(rows))
            mine = _as(local_indices(shape, mesh_shape, pls, c)[-2])
            local = [i for i, g in enumerate(mine) if g in rows]
            assert _as(smap.local_rows) == local
            assert _as(smap.indices[-2]) == [rows.index(mine[i]) for i in local]
            assert (smap.dim, smap.size) == ((-2, len(rows)) if len(rows) <= 12 else (-1, 12))
            assert smap.k == max(1, -(-len(rows) // 4) if smap.dim == -2 else 3)
            held |= {(r, col) for r in _as(smap.indices[-2]) for col in _as(smap.indices[-1])}
        assert held == {(r, col) for r in range(len(rows)) for col in range(12)}
    params = [(shape, pls, tuple(rows)) for rows in BLOCKS[blocks]]
    ps = [exchange_plan(params, mesh_shape, coords, me, 0.25) for me in range(len(coords))]
    for a, b in itertools.product(range(len(ps)), repeat=2):
        assert ps[a].norm_send[b] == ps[b].norm_recv[a]


def _as(ix):
    return list(range(ix.start, ix.stop)) if isinstance(ix, slice) else ix.tolist()
