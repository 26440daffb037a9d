"""Which parts of one piece's momentum buffer this step has updated (pure bookkeeping, no tensors).

Where the elementwise stages are fused (``newton_schulz.implementation.Implementation.fuses``), a
piece's momentum is updated in the same pass that forms its Newton–Schulz input
(``MatrixStep.input_into``: reads grad and buf, writes buf and the input, 14 B per fp32 entry with
a bf16 input, where a momentum pass and then an input pass move 12 + 10).  But the runtime forms the input region by region (a range of
experts, a cut unit's rows or columns), some regions never (a unit owned in another replica, a
piece with nothing to send), and may form one region twice; every buffer entry must still be
updated exactly once per step.  :class:`MomentumProgress` says, for each region the runtime asks
for, which other parts must first get a momentum-only pass and whether the forming pass updates
its region's momentum itself; :meth:`MomentumProgress.finish` returns what is left after the
pipeline.

What it tracks: parts done as disjoint ranges along one dim (``dim``), each region a tuple of
basic slices (``parallel.planning.plan_data.Region``).  A region that is the whole piece, or a slab along
that dim disjoint from the parts done, is fused (one pass updates and forms it); a region already
done only reads; anything else (a box, a slab along another dim, a partial overlap) first brings
every part still pending up to date, so the buffer is read as this step's.  The runtime's regions
are whole pieces, expert ranges and cut units' row or column blocks: one fused pass each, in
practice.
"""

from __future__ import annotations

from collections.abc import Sequence

Region = tuple  # basic slices over the leading dims of a piece; () the whole piece


class MomentumProgress:
    """The momentum of one local piece of shape ``shape`` during one step: which parts are done."""

    def __init__(self, shape: Sequence[int]):
        self.shape = tuple(int(n) for n in shape)
        self.complete = False
        self.dim: int | None = None  # the dim along which the parts done lie
        self.done: list[tuple[int, int]] = []  # disjoint, sorted, adjacent ones merged; along ``dim``

    def claim(self, region: Region) -> tuple[list[Region], bool]:
        """The runtime is about to form the input of ``region``. Returns ``(catch_up, fuse)``:
        regions that need a momentum-only pass first (then all of the piece is done), and whether
        the forming pass updates ``region``'s momentum itself (True exactly when none of it is)."""
        if self.complete:
            return [], False
        slab = _slab(region, self.shape)
        if slab == "whole":
            if not self.done:
                self.complete = True
                return [], True
        elif slab == "empty":
            return [], False
        elif slab is not None and (self.dim is None or slab[0] == self.dim):
            dim, start, stop = slab
            if all(stop <= a or b <= start for a, b in self.done):  # none of it done: fuse it
                self.dim = dim
                self._add(start, stop)
                return [], True
            if any(a <= start and stop <= b for a, b in self.done):  # all of it done: read it
                return [], False
        return self.finish(), False  # a box, another dim or a partial overlap: bring it all up to date

    def finish(self) -> list[Region]:
        """The regions still pending (each to get a momentum-only pass); afterwards all is done."""
        if self.complete:
            return []
        self.complete = True
        if self.dim is None:
            return [()]
        head = (slice(None),) * self.dim
        gaps, at = [], 0
        for a, b in self.done + [(self.shape[self.dim], self.shape[self.dim])]:
            if at < a:
                gaps.append((*head, slice(at, a)))
            at = b
        return gaps

    def _add(self, start: int, stop: int) -> None:
        merged = []
        for a, b in sorted(self.done + [(start, stop)]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.done = merged
        if merged == [(0, self.shape[self.dim])]:
            self.complete = True


def _slab(region: Region, shape: tuple[int, ...]):
    """``"whole"``, ``"empty"``, ``(dim, start, stop)`` for a region that cuts one dim only, or None
    (a box, a strided slice, anything but basic slices)."""
    if len(region) > len(shape):
        return None
    cut = None
    for d, index in enumerate(region):
        if not isinstance(index, slice):
            return None
        start, stop, step = index.indices(shape[d])
        if step != 1:
            return None
        if stop <= start:
            return "empty"
        if (start, stop) == (0, shape[d]):
            continue
        if cut is not None:
            return None
        cut = (d, start, stop)
    if any(n == 0 for n in shape):
        return "empty"
    return "whole" if cut is None else cut
