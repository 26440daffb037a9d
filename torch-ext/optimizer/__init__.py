"""Muon with parallel Newton–Schulz for DTensor parameters (FSDP2, HSDP, TP, solver placements).

    from optimizer import Muon, get_default_muon_param_groups
    opt = Muon(get_default_muon_param_groups(model), lr=2e-2, weight_decay=0.1)
"""

from .attention_layouts import FusedQKV, MLAHeads
from .dion2.constructors import Dion2, Dion3, NorDion2
from .max_logits import eager_max_logits, gather_max_logits
from .muon import Muon
from .newton_schulz import zeropower_via_newtonschulz
from .param_groups import get_default_muon_param_groups, param_role_table
from .qk_clip import QKClipConfig
from .row_blocks import HeadBlocks, SplitQKV
from .settings import MuonSettings

__all__ = [
    "Dion2",
    "Dion3",
    "FusedQKV",
    "HeadBlocks",
    "MLAHeads",
    "Muon",
    "MuonSettings",
    "NorDion2",
    "QKClipConfig",
    "SplitQKV",
    "eager_max_logits",
    "gather_max_logits",
    "get_default_muon_param_groups",
    "param_role_table",
    "zeropower_via_newtonschulz",
]
__version__ = "0.1.0"
