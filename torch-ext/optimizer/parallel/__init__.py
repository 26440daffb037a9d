"""Parallel Muon: who orthogonalises what (``planning/``), and the runtime that does it (``execution/``).

- ``planning/``   pure: shapes, placements and the mesh's rank grid in, the step plan out (who
                  owns which unit, every buffer offset, which units are cut over k ranks or moved),
                  computed once per step context and cached;
- ``execution/``  the pipeline that runs a plan: gather, orthogonalize, scatter, update, per chunk,
                  calling the update rule's stages (``optimizer.rule.MatrixStep``) on every piece.

The Newton–Schulz iteration of one unit cut over k ranks is ``optimizer.newton_schulz.cut``.
"""
