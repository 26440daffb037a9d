"""A step of Muon around the update rule: what it caches, how the ranks agree, and the Muon half.

``rule/`` is the update rule of one matrix on local tensors (momentum, Newton–Schulz, NorMuon,
the update, QK-clip's scaling); this folder is what a step does with it for all parameters:

- ``context.py``      the step's cache (rebuilt when its key changes: parameters, layouts, which
                      have gradients, settings), and the step's three calls around the agreement;
- ``agreement.py``    this rank's facts before the one all-reduce, and the verdict after it;
- ``muon_update.py``  the Muon half of a step: each Muon parameter's ``rule.MatrixStep`` and its
                      momentum, run over the cached plan by ``parallel/execution``.
"""
