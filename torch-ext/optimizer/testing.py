"""Watchers for checking the optimizer's promises on your own setup.

* :class:`HostSyncs` — records what in a block of code waits for the device: the
  synchronising aten ops (``.item()``/``int()``/``float()``/``bool()`` become
  ``_local_scalar_dense``; ``nonzero``, ``equal``, ``is_nonzero``; copies to the CPU from
  another device) and the Python calls that read tensor data without dispatching on CPU
  (``tolist``, ``numpy``, ``cpu``).  On CUDA, ``torch.cuda.set_sync_debug_mode`` is the
  ground truth; this is its proxy on machines without a GPU.
* :class:`LiveBytes` — the peak bytes of tensor storages allocated inside a block and
  still alive (each storage counted once, however many views), on any device.
* :func:`overlap_seconds` — how long two sets of profiler intervals overlap (e.g.
  all-to-alls on a communication stream or thread and matmuls on the compute one).
* :func:`torch_muon_newton_schulz` — run ``torch.optim.Muon``'s Newton–Schulz in another
  dtype, for like-for-like comparisons (torch computes it in bf16, dividing by a bf16 norm).

Used by the tests, ``benchmarks/peak_memory.py`` and ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset({
    "aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default", "aten.is_nonzero.default",
})


class HostSyncs(TorchDispatchMode):
    """``with HostSyncs() as s: ...`` then ``s.events``: one entry per host read, in order."""

    READS = ("tolist", "numpy", "cpu")

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        kwargs = kwargs or {}
        if name in SYNC_OPS:
            self.events.append(name)
        elif name.startswith("aten._to_copy") or name.startswith("aten.copy_"):
            src = args[1] if name.startswith("aten.copy_") else args[0]
            dst = kwargs.get("device") if name.startswith("aten._to_copy") else args[0].device
            if isinstance(src, torch.Tensor) and dst is not None and torch.device(dst).type == "cpu" \
                    and src.device.type != "cpu":
                self.events.append(f"{name} to cpu")
        return func(*args, **kwargs)

    def __enter__(self):
        self._saved = {n: getattr(torch.Tensor, n) for n in self.READS}
        for n, fn in self._saved.items():
            def read(t, *a, _n=n, _fn=fn, **k):
                self.events.append(_n)
                return _fn(t, *a, **k)
            setattr(torch.Tensor, n, read)
        return super().__enter__()

    def __exit__(self, *exc):
        for n, fn in self._saved.items():
            setattr(torch.Tensor, n, fn)
        return super().__exit__(*exc)


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: ...`` then ``m.peak``: the most bytes of storages allocated in the
    block that were alive at once (a weak reference notices when each is freed)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size


def overlap_seconds(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """Total time (in the intervals' unit) during which some interval of ``a`` and some of
    ``b`` both run: the length of (union of a) ∩ (union of b)."""

    def union(intervals):
        out = []
        for s, e in sorted(intervals):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out

    ua, ub = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(ua) and j < len(ub):
        s, e = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        total += max(0.0, e - s)
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def torch_muon_zeropower(dtype: torch.dtype):
    """``torch.optim.Muon``'s Newton–Schulz, line for line, with its bf16 cast changed to ``dtype``."""

    def zeropower(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        ortho = grad.to(dtype, copy=True)  # copy: div_ below must not touch the momentum buffer
        if grad.size(0) > grad.size(1):
            ortho = ortho.T
        ortho.div_(ortho.norm().clamp(min=eps))
        for _ in range(ns_steps):
            gram = ortho @ ortho.T
            gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
        if grad.size(0) > grad.size(1):
            ortho = ortho.T
        return ortho

    return zeropower


@contextlib.contextmanager
def torch_muon_newton_schulz(dtype: torch.dtype | None):
    """Inside the block, ``torch.optim.Muon`` orthogonalises in ``dtype`` (None: as shipped, bf16).

    Torch always computes in bf16, which a CPU runs ~100x slower than fp32 and which rounds the
    normalising norm to bf16; comparing this package's fp32 Muon with torch's in fp32 is like
    for like.  :func:`torch_muon_zeropower` is the copy (a test checks it against torch's own
    in bf16).
    """
    import torch.optim._muon as torch_muon

    if dtype is None or dtype == torch.bfloat16:
        yield
        return
    original = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = torch_muon_zeropower(dtype)
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = original
