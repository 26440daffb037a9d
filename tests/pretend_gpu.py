"""Pretend, on CPU tensors under Triton's interpreter, to be where ``ns_kernels="auto"`` takes the
kernels (a supported CUDA GPU): the option resolves to the kernels, and the products' own
``"auto"`` decides as on an H100 (symmetric products on the kernels from two tile rows up,
general ones on torch, which is cuBLAS there). The launches themselves keep the interpreter's
tiles. For tests of *what runs where*; the numbers are the interpreter's."""

from __future__ import annotations


def pretend_auto_takes_the_kernels(monkeypatch) -> None:
    from optimizer import kernels, newton_schulz
    from optimizer.kernels import backend

    def take(mode, *args, **kwargs):
        return "torch" if mode == "torch" else "triton"

    monkeypatch.setattr(newton_schulz, "resolve_kernels", take)  # ns_kernels.resolve, as the option sees it
    monkeypatch.setattr(kernels, "resolve", take)  # each product's backend
    monkeypatch.setattr(backend, "device_key", lambda device: ((9, 0), 132))  # the tile rule's view: an H100
