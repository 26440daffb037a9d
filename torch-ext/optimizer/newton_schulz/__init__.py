"""Newton–Schulz orthogonalisation (the "zeroth power" of a matrix), in one package.

Muon replaces each matrix update ``G = U S V^T`` by (approximately) ``U V^T``: normalise
``X = G / ||G||_F`` (every singular value in (0, 1]), then repeat ``X <- a X + (b A + c A^2) X``
with ``A = X X^T``, the odd polynomial ``a s + b s^3 + c s^5`` on every singular value; in the
classic form, or in the Gram form on the m x m Gram matrix with restarts. docs/newton_schulz.md.

    coefficients.py     the coefficient tables (named, past their end, their norm safety)
    restarts.py         where the Gram form restarts, per table and dtype; fp16's value bound
    forms.py            which form runs, in which dtype, and its FLOPs (newton_schulz_flops)
    flops.py            the FLOP model per form and restart plan
    products.py         the products the iteration is written on: torch's or the Triton kernels'
    iteration.py        the iteration, once per form (classic; Gram with its segment factor)
    whole.py            whole matrices: zeropower_via_newtonschulz
    cut.py              one matrix cut over the ranks of a group (ns_split)
    cut_rows.py         row statistics of a cut matrix (NorMuon)
    implementation.py   the ns_kernels option resolved once (what runs the products and stages)
    group.py            NewtonSchulz: a group's options and implementation, called by the owner

Everything but cut.py is a pure function of its inputs: no process groups, no optimizer state.
Import what you use from its module; this package's own name exports only the public call.
"""

from .whole import zeropower_via_newtonschulz

__all__ = ["zeropower_via_newtonschulz"]
