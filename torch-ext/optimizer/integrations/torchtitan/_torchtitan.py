"""torchtitan itself, imported in one place, with the message that says how to install it."""

try:
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.models.common.attention import BaseAttention, FlexAttention, FusedQKVLinear, \
        ScaledDotProductAttention
except ImportError as err:  # pragma: no cover - exercised only where torchtitan is missing
    raise ImportError(
        "optimizer.integrations.torchtitan needs torchtitan 0.3 (pip install torchtitan==0.3.0; install "
        "torch first and keep it as a constraint so nothing pulls another torch build). The rest of the "
        f"`optimizer` package works without it. ({err})"
    ) from err

__all__ = ["BaseAttention", "FlexAttention", "FusedQKVLinear", "OptimizersContainer", "ParamGroupConfig",
           "ScaledDotProductAttention", "canonical_fqn"]
