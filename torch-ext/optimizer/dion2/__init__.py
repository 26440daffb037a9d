"""Dion2 and NorDion2 (arXiv 2512.16928; microsoft/dion): each step orthogonalises only the top
fraction of a matrix's rows or columns, chosen by L1 norm, and decays their momentum.

    rule.py           the rule as pure functions of local tensors (selection, update, error feedback)
    step.py           the Dion2 half of a step: each parameter of a Dion2 group (plain tensors here,
                      DTensors through parallel/execution/dion2_step.py)
    checks.py         what a Dion2 group refuses, found before anything changes
    constructors.py   optimizer.Dion2 / NorDion2 / Dion3: dion's keywords mapped onto Muon's groups

The selection on a mesh (exact, moving O(rows) per matrix) is parallel/planning|execution/
dion2_selection.py; docs/dion2.md says what is built and what is next.  Nothing is imported here:
constructors.py imports muon.py, which imports checks.py and step.py.
"""
