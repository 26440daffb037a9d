"""Parallel Muon: who orthogonalises what, and the runtime that moves the pieces.

- ``plan``     the step plan (pure: shapes, placements and the mesh's rank grid in; owners,
               chunks and every piece's place in every buffer out), computed once and cached;
- ``owners``   longest-job-first owner assignment and chunk cutting (pure numbers);
- ``runtime``  the four stages (gather, orthogonalize, scatter, update) over the plan's chunks,
               calling the update rule's stages (``optimizer.rule``) on every piece;
- ``stats``    what the last step's pipeline did (seconds per stage, bytes, collectives).
"""
