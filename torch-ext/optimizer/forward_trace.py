"""Roles seen in one forward: the weights that produce the logits, the parameters added to activations.

Names and module types cannot say which layer is a plain model's output layer (``head``,
``fc``, ``proj``...) or that a free ``[N, D]`` parameter is a position table. One forward on
example inputs can: :func:`trace_roles` runs it (eval mode, gradients on, no backward, every
module's training flag restored) and walks the autograd graph back from the outputs.

* **Producing the logits**: from each logits tensor, back through parameter-free operations
  (normalisation, scaling, products of two activations as in CLIP's similarity), to the first
  matrix product, convolution or lookup whose operand is a parameter: that parameter produces
  the logits (CLIP's ``text_projection``/``visual_projection``, a ``head`` or ``fc``), and the walk
  stops there. Logits are: a tensor the forward returns (also inside a tuple or list), and the
  entries of a returned mapping (a transformers ``ModelOutput``) whose key contains "logits"
  (``logits``, ``logits_per_image``, ``start_logits``), MoE ``router_logits`` excepted. A base
  model returning hidden states has no logits, so nothing is marked.
* **Added to activations**: a parameter that reaches an addition, subtraction or concatenation
  through views, slices and expands, when another operand of that operation is not a parameter
  (an activation): ``x + self.pos[:, :L]``, ``torch.cat([cls, x])``.

Only parameters that require gradients appear in the graph. The model must be a plain (not
sharded) one: a DTensor parameter is refused, since a sharded forward is collective and its
autograd graph goes through the sharding's own functions; trace an unsharded copy (the meta
device works) and pass the roles on by name (docs/param_roles.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from .tensors import is_dtensor

# autograd nodes (class names without the trailing overload number) that multiply by a weight
_PRODUCTS = frozenset({"MmBackward", "AddmmBackward", "BmmBackward", "BaddbmmBackward", "MvBackward",
                       "AddmvBackward", "LinearBackward", "MatmulBackward", "ConvolutionBackward",
                       "ConvolutionBackwardOverrideable", "EmbeddingBackward", "EmbeddingBagBackward",
                       "_EmbeddingBagBackward"})
# nodes that only move, cast or select elements of their first input
_PASS_THROUGH = frozenset({"TBackward", "TransposeBackward", "PermuteBackward", "ViewBackward",
                           "UnsafeViewBackward", "ReshapeAliasBackward", "ExpandBackward", "ToCopyBackward",
                           "CloneBackward", "SqueezeBackward", "UnsqueezeBackward", "SliceBackward",
                           "SelectBackward", "AliasBackward", "AsStridedBackward", "IndexBackward"})
_JOINS = {"AddBackward": "added to", "SubBackward": "subtracted from", "CatBackward": "concatenated with"}
_OVERLOAD = re.compile(r"\d+$")


def trace_roles(model: nn.Module, example_inputs) -> tuple[dict[int, str], dict[int, str]]:
    """``({id(param): rule} producing the logits, {id(param): rule} added to activations)``.

    ``example_inputs``: a dict (``model(**inputs)``), a tuple or list (``model(*inputs)``) or a
    tensor (``model(inputs)``)."""
    sharded = [n for n, p in model.named_parameters() if is_dtensor(p)]
    if sharded:
        raise ValueError(
            f"example_inputs: {sharded[0]!r} is a DTensor; the roles' traced forward needs an unsharded model. "
            "Trace an unsharded copy (e.g. on the meta device) with optimizer.param_groups.param_roles(copy, "
            "example_inputs=...) and pass the roles by name: is_muon=lambda n, p: roles[n] == 'matrix'."
        )
    params = {id(p): p for p in model.parameters()}
    outputs = _run(model, example_inputs)
    logits = [t.grad_fn for t in _logits(outputs)]
    every = [t.grad_fn for t in _tensors(outputs)]
    heads = {pid: f"produces the logits (traced forward: {op})" for pid, op in _producers(logits, params).items()}
    return heads, _joined(every, params)


def _run(model: nn.Module, example_inputs):
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # no dropout, no batch-norm statistics update
    try:
        with torch.enable_grad():
            if isinstance(example_inputs, Mapping):
                return model(**example_inputs)
            if isinstance(example_inputs, (tuple, list)):
                return model(*example_inputs)
            return model(example_inputs)
    finally:
        for m, training in modes:
            m.training = training


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.grad_fn is not None else []
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors(v)]
    return []


def _logits(out) -> list[torch.Tensor]:
    if isinstance(out, Mapping):
        return [t for k, v in out.items() if "logits" in str(k) and "router" not in str(k) for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _logits(v)]
    return _tensors(out)


def _kind(fn) -> str:
    return _OVERLOAD.sub("", type(fn).__name__)


def _param_of(fn, params: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The parameter a graph branch is, through element-moving nodes only, or None."""
    while fn is not None and _kind(fn) in _PASS_THROUGH:
        fn = fn.next_functions[0][0] if fn.next_functions else None
    variable = getattr(fn, "variable", None)  # an AccumulateGrad node holds its leaf
    return variable if variable is not None and id(variable) in params else None


def _producers(starts: list, params: dict[int, torch.Tensor]) -> dict[int, str]:
    found, stack, seen = {}, list(starts), set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        branches = [nf for nf, _ in fn.next_functions]
        if _kind(fn) in _PRODUCTS:
            weights = [p for p in (_param_of(nf, params) for nf in branches) if p is not None]
            if weights:
                for p in weights:
                    found.setdefault(id(p), _kind(fn))
                continue  # the layer producing this path's output: stop here
        stack.extend(branches)
    return found


def _joined(starts: list, params: dict[int, torch.Tensor]) -> dict[int, str]:
    found, stack, seen = {}, list(starts), set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        branches = [nf for nf, _ in fn.next_functions]
        verb = _JOINS.get(_kind(fn))
        if verb is not None and len(branches) >= 2:
            operands = [None if nf is None else _param_of(nf, params) for nf in branches]
            if any(p is None for p in operands):  # at least one operand is not a parameter: an activation
                for p in operands:
                    if p is not None:
                        found.setdefault(id(p), f"{verb} activations (traced forward)")
        stack.extend(nf for nf in branches if nf is not None)
    return found
