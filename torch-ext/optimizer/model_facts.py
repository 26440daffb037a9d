"""What a model's own modules say about its parameters: the facts :func:`optimizer.roles.decide` reads.

Every fact is keyed by the parameter object (``id``), so a tied weight (one object under two
names) carries the facts of every module that holds it. Each fact carries the words of the rule
that found it, for the role table.

* ``embedding``: ``nn.Embedding``/``EmbeddingBag`` modules, ``model.get_input_embeddings()``;
* ``head``: ``model.get_output_embeddings()``; everything of a Hugging Face task model outside its
  body (``base_model``, named by ``base_model_prefix``: ``lm_head``, ``score``, ``classifier``,
  ...); with ``example_inputs``, the weights that produce the logits (:mod:`optimizer.forward_trace`);
* ``conv``: ``torch.nn`` convolutions (``_ConvNd``: Conv1d/2d/3d, ConvTranspose1d/2d/3d, lazy
  ones), their weight-norm parametrisations included;
* ``adapter``: PEFT adapter weights (the sub-modules a tuner layer lists in ``adapter_layer_names``);
* ``experts``: 3-D weights of the expert-stack modules of transformers (its fused experts modules,
  ``use_experts_implementation``) and torchtitan (``GroupedExperts``); a 3-D tensor that neither
  its module nor its name calls an expert stack is not one (:func:`optimizer.roles.decide`);
* ``tensor``: weights whose module says they are not a matrix or a stack of matrices
  (``nn.Bilinear``'s ``[out, in1, in2]`` bilinear form);
* ``additive``: with ``example_inputs``, parameters added to (or concatenated with) activations;
* ``transposed`` / ``row_blocks``: how Muon reads a weight (GPT-2's ``Conv1D``, transposed
  experts; the fused rows of ``gate_up_proj`` experts, ``nn.MultiheadAttention``'s q/k/v
  ``in_proj_weight`` and the gate-stacked weights of ``nn.LSTM``/``nn.GRU``/``nn.RNN`` and their
  cells): see :mod:`optimizer.param_groups`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn

from .forward_trace import trace_roles


def _unwrap(model: nn.Module) -> nn.Module:
    """The model under a PEFT wrapper (``PeftModel.get_base_model()``), else ``model``."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        try:
            inner = get_base()
        except Exception:  # noqa: BLE001 - not PEFT's method after all
            return model
        if isinstance(inner, nn.Module):
            return inner
    return model


def _module_from(model: nn.Module, method: str) -> nn.Module | None:
    fn = getattr(model, method, None)
    if not callable(fn):
        return None
    try:
        m = fn()
    except (NotImplementedError, AttributeError, TypeError):
        return None
    return m if isinstance(m, nn.Module) else None


def _ids(module: nn.Module | None) -> set[int]:
    return set() if module is None else {id(p) for p in module.parameters()}


@dataclass(frozen=True)
class FusedRows:
    """Row blocks a module's own layout calls for: rows of several maps stacked in one weight."""

    spec: str  # the plain row-block spec (``row_blocks.py``)
    what: str  # which maps are stacked, for the role table
    gate_up: bool = False  # a fused MoE [gate; up] weight (``fused_gate_up`` chooses whether to split it)


# The gates stacked in an RNN weight's rows (torch's ``RNNBase.mode`` and cell classes)
_RNN_GATES = {"LSTM": ("i", "f", "g", "o"), "GRU": ("r", "z", "n"), "RNN_TANH": ("h",), "RNN_RELU": ("h",)}
_RNN_CELL_GATES = {nn.LSTMCell: _RNN_GATES["LSTM"], nn.GRUCell: _RNN_GATES["GRU"], nn.RNNCell: ("h",)}


def _type_named(module: nn.Module, module_name: str, class_name: str) -> bool:
    """isinstance against a class of a module that may not be imported (then nothing is one)."""
    mod = sys.modules.get(module_name)
    cls = getattr(mod, class_name, None) if mod is not None else None
    return isinstance(cls, type) and isinstance(module, cls)


class ModelFacts:
    """See the module docstring: ``{id(param): rule}`` per fact, and each parameter's other names."""

    def __init__(self, model: nn.Module, example_inputs=None):
        inner = _unwrap(model)
        self.embedding: dict[int, str] = {}
        self.head: dict[int, str] = {}
        self.conv: dict[int, str] = {}
        self.adapter: dict[int, str] = {}
        self.experts: dict[int, str] = {}
        self.tensor: dict[int, str] = {}
        self.additive: dict[int, str] = {}
        self.transposed: set[int] = set()
        self.row_blocks: dict[int, FusedRows] = {}
        self.aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.aliases.setdefault(id(p), []).append(name)
        for m in model.modules():
            self._module(m)
        for wrapper in {id(model): model, id(inner): inner}.values():
            _mark(self.embedding, _module_from(wrapper, "get_input_embeddings"), "model.get_input_embeddings()")
            _mark(self.head, _module_from(wrapper, "get_output_embeddings"), "model.get_output_embeddings()")
        self._outside_body(inner)
        if example_inputs is not None:
            heads, additive = trace_roles(model, example_inputs)
            for pid, rule in heads.items():
                self.head.setdefault(pid, rule)
            self.additive.update(additive)

    def with_aliases(self, pid: int, rule: str) -> str:
        """``rule``, naming the other names of a tied parameter."""
        names = self.aliases.get(pid, [])
        return rule if len(names) < 2 else f"{rule}; tied: also {', '.join(names[1:])}"

    def _module(self, m: nn.Module) -> None:
        kind = type(m).__name__
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            _mark(self.embedding, m, f"module {kind} (an nn.Embedding)")
        elif isinstance(m, nn.modules.conv._ConvNd):
            _mark(self.conv, m, f"module {kind} (an nn convolution: AdamW)")
        if _type_named(m, "peft.tuners.tuners_utils", "BaseTunerLayer"):
            for attr in getattr(m, "adapter_layer_names", ()):
                sub = getattr(m, attr, None)
                if isinstance(sub, nn.Module):
                    _mark(self.adapter, sub, f"PEFT adapter ({attr})")
        if _type_named(m, "transformers.pytorch_utils", "Conv1D"):
            w = getattr(m, "weight", None)
            if isinstance(w, nn.Parameter):
                self.transposed.add(id(w))
        if isinstance(m, nn.Bilinear):
            self.tensor[id(m.weight)] = f"module {kind}: [out, in1, in2] is a bilinear form, not a stack of matrices"
        if type(m).__name__ == "GroupedExperts" and type(m).__module__.startswith("torchtitan."):
            for p in m.parameters(recurse=False):
                if p.ndim == 3:
                    self.experts[id(p)] = f"torchtitan experts module {kind}"
        self._fused_rows(m)
        self._experts(m)

    def _outside_body(self, inner: nn.Module) -> None:
        """A Hugging Face task model is its body (``base_model``, named by ``base_model_prefix``)
        plus a task head: every parameter outside the body (lm_head, score, classifier, ...)."""
        prefix = getattr(inner, "base_model_prefix", None)
        body = getattr(inner, prefix, None) if isinstance(prefix, str) and prefix else None
        if isinstance(body, nn.Module) and body is not inner:
            for pid in _ids(inner) - _ids(body):
                self.head.setdefault(pid, f"outside the model's body (base_model_prefix {prefix!r})")

    def _fused_rows(self, m: nn.Module) -> None:
        """torch's modules whose weights stack the rows of several maps: ``nn.MultiheadAttention``'s
        ``in_proj_weight`` (q, k, v), the RNNs' ``weight_ih*``/``weight_hh*`` (one block per gate)."""
        kind = type(m).__name__
        if isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None:
            e = m.embed_dim
            self.row_blocks[id(m.in_proj_weight)] = FusedRows(f"blocks:{e},{e},{e}", f"q, k, v stacked ({kind})")
        gates = _RNN_GATES.get(getattr(m, "mode", None)) if isinstance(m, nn.RNNBase) else next(
            (g for cls, g in _RNN_CELL_GATES.items() if isinstance(m, cls)), None)
        if gates is None or len(gates) < 2:
            return
        h = m.hidden_size
        for pname, p in m.named_parameters(recurse=False):
            if pname.startswith(("weight_ih", "weight_hh")) and p.ndim == 2 and p.shape[0] == len(gates) * h:
                self.row_blocks[id(p)] = FusedRows("blocks:" + ",".join([str(h)] * len(gates)),
                                                   f"gates {', '.join(gates)} stacked ({kind})")

    def _experts(self, m: nn.Module) -> None:
        """transformers' fused experts (``use_experts_implementation``): [gate; up] rows, transposition."""
        if not hasattr(m, "is_transposed") or not hasattr(m, "has_gate"):
            return
        transposed = bool(getattr(m, "is_transposed", False))
        for pname, p in m.named_parameters(recurse=False):
            if p.ndim != 3:
                continue
            self.experts[id(p)] = f"transformers experts module {type(m).__name__}"
            if transposed:
                self.transposed.add(id(p))
            if pname == "gate_up_proj" and getattr(m, "has_gate", False) and getattr(m, "is_concatenated", False):
                out_features = p.shape[-1] if transposed else p.shape[-2]
                if out_features % 2 == 0:
                    half = out_features // 2
                    self.row_blocks[id(p)] = FusedRows(f"blocks:{half},{half}", "gate, up stacked (fused experts)",
                                                       gate_up=True)


def _mark(table: dict[int, str], module: nn.Module | None, rule: str) -> None:
    for pid in _ids(module):
        table.setdefault(pid, rule)
