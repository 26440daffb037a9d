"""Whether the installed torchtitan can run on the installed torch: one rule for every test that
needs it (tests/integrations/test_torchtitan.py, the torchtitan snippets of the docs)."""

from __future__ import annotations

import torch
import torch.distributed.fsdp


def unsupported_reason() -> str | None:
    """Why torchtitan cannot run on this torch release, or None where it can. torchtitan 0.3.0
    imports ``torch.distributed.fsdp.DataParallelMeshDims``, which torch 2.10 and 2.11 lack."""
    if not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
        return (f"torchtitan 0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims, which torch "
                f"{torch.__version__} lacks: torchtitan does not support this release")
    return None
