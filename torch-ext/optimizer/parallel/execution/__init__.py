"""The runtime of parallel Muon: it moves tensors between ranks and calls the rule's stages.

- ``pipeline.py``      the drivers: the chunked pipeline, the units a rank holds whole, the gather baseline;
- ``chunk_stages.py``  a chunk's four stages: gather, orthogonalize, scatter (and replica exchange), update;
- ``move_stages.py``   the same stages for a chunk of moved experts;
- ``dion2_selection.py`` Dion2's exact top-k on a mesh: partial norms to owners, masks back (not wired in yet);
- ``buffers.py``       a chunk in flight, and the flat buffers seen as padded blocks (index kernels);
- ``stats.py``         what the last step's pipeline did (seconds per stage, bytes, collectives).
"""
