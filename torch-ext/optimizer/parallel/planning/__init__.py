"""The step plan, pure: shapes, placements and the mesh's rank grid in, plain data out.

- ``plan.py``           ``build_plan``: one rank's plan of a step; ``world_jobs``/``world_view`` for analysis;
- ``plan_data.py``      what planning takes in (``PlanParam``, ``PlanSettings``) and what a plan holds;
- ``plan_inputs.py``    a ``PlanParam`` from a Muon parameter and its group's options (costs, cuts, wire dtype);
- ``process_groups.py`` the rank sets a plan may need, created collectively at construction;
- ``world.py``          the part every rank computes alike: units, owners, cuts, chunks;
- ``owners.py``         longest-job-first owners and chunk cutting (pure numbers);
- ``rank_view.py``      one rank's view of a pattern: groups, pieces, blocks, regions;
- ``rank_chunk.py``     one rank's part of a chunk: packs, owned units, updates, offsets;
- ``expert_moves.py``   experts held whole that move to less loaded ranks;
- ``dion2_selection.py`` Dion2's selection: each member's slices by global index, owners, the exchange's sizes;
- ``cut_geometry.py``   one unit cut over k ranks: which indices form each block;
- ``cut_model.py``      which k a unit may take, on which groups, at what cost per member;
- ``cut_choice.py``     which units are cut and who owns them; ``cut_packing.py``: two k's in one class;
- ``cut_cost.py``, ``cut_hardware.py``  the cut iteration's cost model and the figures it assumes.
"""
