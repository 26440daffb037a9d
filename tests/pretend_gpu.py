"""Pretend, on CPU tensors under Triton's interpreter, to be where ``ns_kernels="auto"`` takes the
kernels (a supported CUDA GPU): ``"auto"`` considers the kernels on the CPU (where, under the
interpreter, they can run), and the tile rule sees an H100, so the products' own ``"auto"``
decides as there (symmetric products on the kernels from two tile rows up, general ones on torch,
which is cuBLAS there) and the kernels launch with an H100's tiles, run by the interpreter. For
tests of *what runs where*. Call it before the optimizer (or the call) resolves ``ns_kernels``:
the decision is kept."""

from __future__ import annotations


def pretend_auto_takes_the_kernels(monkeypatch) -> None:
    from optimizer.kernels import backend, environment

    monkeypatch.setattr(backend, "auto_takes_kernels", lambda device: True)  # what "auto" looks at
    monkeypatch.setattr(environment, "device_key", lambda device: ((9, 0), 132))  # the tile rule's view: an H100
