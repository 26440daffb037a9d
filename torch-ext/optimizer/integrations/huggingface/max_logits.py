"""Per-query-head max attention logits recorded from Hugging Face attention modules (QK-clip's input).

transformers 5 computes attention logits inside its attention functions (eager, SDPA, flex) and
never hands them out. Every attention module does the same two things in its ``forward``::

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                eager_attention_forward)
    attn_output, attn_weights = attention_interface(self, query, key, value, attention_mask,
                                                    scaling=self.scaling, ...)

:class:`MaxLogitRecorder` hooks that dispatch, with no change to any model's code: in the module
namespace each recorded attention class looks ``ALL_ATTENTION_FUNCTIONS`` up in, it puts a
registry whose ``get_interface`` returns the same function wrapped (the model's own eager function
included: it is the ``default`` argument). The wrapper sees ``query`` ``[B, Hq, Lq, D]`` and
``key`` ``[B, Hkv, Lk, D]`` after RoPE (grouped-query keys not repeated yet), the mask the
implementation receives and the softmax ``scaling``, and computes each head's max of
``scaling * q . k`` over the visible (query, key) pairs with
:func:`optimizer.max_logits.eager_max_logits`, following each implementation's own rules:

* ``"eager"``: the additive float mask (a position is visible where the mask is above the dtype's
  minimum, what ``masking_utils`` writes for hidden ones); no mask: every pair;
* ``"sdpa"``: a boolean (True = attend) or float mask, or, without a mask, causal exactly when
  ``sdpa_attention_forward`` sets ``is_causal`` (``Lq > 1`` and the module's or the call's
  ``is_causal``; keys cropped to ``Lq`` as it does);
* ``"flex_attention"``: the ``BlockMask``'s ``mask_mod`` (or a tensor mask, as above).

Other implementations (flash attention, paged, hub kernels) are refused when the recorder is built.
Not included in the recorded value: additive biases (``position_bias``, ALiBi in the mask), a
``softcap``, attention sinks: QK-clip bounds ``scaling * q . k``, which is what it can scale.

Only training forwards are recorded: the module is in training mode and autograd is not running a
backward (gradient checkpointing's recomputation is skipped). The recorder keeps the running max
over every forward until it is called (gradient accumulation: all micro-batches of a step), then
returns ``{layer: [n_query_heads]}``, the same on every rank: max over the data-parallel group
(the default process group when one is initialised), heads gathered over ``tp_group``
(:func:`optimizer.max_logits.gather_max_logits`), and starts over.

Cost: one more ``q @ k^T`` per recorded attention call (``2 * B * H * Lq * Lk * D`` flops, in
chunks of queries; ``every=N`` records one step in N), in ``compute_dtype`` (float32 by default).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...max_logits import eager_max_logits, gather_max_logits
from ...tensors import is_dtensor
from .attention import attention_modules, query_heads

try:
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover - torch without flex attention
    BlockMask = ()

try:
    from transformers.modeling_utils import AttentionInterface
except ImportError as err:  # pragma: no cover - the package __init__ has failed first
    raise ImportError(f"optimizer.integrations.huggingface needs transformers 5 ({err})") from err

SUPPORTED_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")

# id(attention module) -> list of (weakref to recorder, layer key, fqn, the recorder's token)
_ACTIVE: dict[int, list] = {}
# id(globals dict) -> [globals dict, original registry, number of recorders using it]
_PATCHED: dict[int, list] = {}


class _RecordingInterface(AttentionInterface):
    """transformers' attention registry whose ``get_interface`` wraps what the original returns."""

    def __init__(self, inner):
        super().__init__()
        self._inner = inner
        self._local_mapping = inner._local_mapping  # the same registry, entry for entry

    def get_interface(self, attn_implementation, default):
        fn = self._inner.get_interface(attn_implementation, default)
        return functools.partial(_recorded_attention, fn, attn_implementation)


def _recorded_attention(fn, implementation, module, query, key, value, attention_mask=None, *args, **kwargs):
    entries = _ACTIVE.get(id(module))
    if entries:
        for ref, layer, fqn, _ in entries:
            recorder = ref()
            if recorder is not None:
                recorder._record(layer, fqn, implementation, module, query, key, attention_mask, kwargs)
    return fn(module, query, key, value, attention_mask, *args, **kwargs)


def _namespace(module: nn.Module) -> dict:
    return inspect.unwrap(type(module).forward).__globals__


def _patch(ns: dict) -> None:
    entry = _PATCHED.get(id(ns))
    if entry is None:
        original = ns["ALL_ATTENTION_FUNCTIONS"]
        ns["ALL_ATTENTION_FUNCTIONS"] = _RecordingInterface(original)
        _PATCHED[id(ns)] = [ns, original, 1]
    else:
        entry[2] += 1


def _unpatch(ns: dict) -> None:
    entry = _PATCHED.get(id(ns))
    if entry is None:
        return
    entry[2] -= 1
    if entry[2] == 0:
        ns["ALL_ATTENTION_FUNCTIONS"] = entry[1]
        del _PATCHED[id(ns)]


def _release(module_ids: list, namespaces: list, token: object) -> None:
    """Drop one recorder's hooks (its entries, by its token) and its share of the patched registries."""
    for mid in module_ids:
        entries = _ACTIVE.get(mid, [])
        entries[:] = [e for e in entries if e[3] is not token]
        if not entries:
            _ACTIVE.pop(mid, None)
    for ns in namespaces:
        _unpatch(ns)


def _visible_from_tensor_mask(mask: Tensor, lq: int, lk: int) -> Tensor:
    mask = mask[..., :lq, :lk] if mask.shape[-2] >= lq else mask[..., :lk]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min


class MaxLogitRecorder:
    """QK-clip's input from a Hugging Face model: per-query-head max logits of its training forwards.

    Args:
        model: the model (a PEFT or other wrapper is fine: attention modules are found inside).
        layers: the layer keys to record (default: every attention module); each must have exactly
            one attention module. The factory passes the layers QK-clip clips.
        every: record (and return logits) on every N-th call only; the others return None.
        dp_groups: the groups whose ranks see different batches (max-reduced). Default: the
            default process group when ``torch.distributed`` is initialised (DDP / FSDP under
            accelerate or Trainer), else none.
        tp_group: the tensor-parallel group when the attention sees only its local heads (rank
            order = head order); None otherwise.
        compute_dtype / chunk_size: passed to :func:`~optimizer.max_logits.eager_max_logits`.

    ``recorder()`` returns ``{layer: float32 tensor [n_query_heads]}`` (or None on a step it does
    not record), consuming the running max. Collective over the groups: call it on every rank once
    per optimizer step (``Muon.set_qk_logits_source(recorder)`` makes ``step()`` call it).
    ``remove()`` unhooks it.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: Iterable | None = None,
        every: int = 1,
        dp_groups: Sequence | None = None,
        tp_group=None,
        compute_dtype: torch.dtype = torch.float32,
        chunk_size: int | None = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"MaxLogitRecorder: every must be a positive int (record every N-th step), got {every!r}")
        self.every = every
        if dp_groups is None:
            dp_groups = (dist.group.WORLD,) if dist.is_available() and dist.is_initialized() else ()
        self.dp_groups = tuple(g for g in dp_groups if g is not None)
        self.tp_group = tp_group
        self._tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.compute_dtype = compute_dtype
        self.chunk_size = chunk_size
        by_layer = self._attention_by_layer(model, None if layers is None else set(layers))
        self.layers = sorted(by_layer)
        self._heads = {layer: query_heads(m) // self._tp for layer, (_, m) in by_layer.items()}
        self._device = {}
        for layer, (_, m) in by_layer.items():
            p = next(m.parameters(), None)
            self._device[layer] = torch.device("cpu") if p is None else (p.to_local() if is_dtensor(p) else p).device
        self._modules = [m for _, m in by_layer.values()]
        self._namespaces = []
        ref, token = weakref.ref(self), object()
        for layer, (fqn, m) in by_layer.items():
            _ACTIVE.setdefault(id(m), []).append((ref, layer, fqn, token))
            ns = _namespace(m)
            if not any(ns is seen for seen in self._namespaces):
                self._namespaces.append(ns)
                _patch(ns)
        self._step = 0
        self._local: dict = {}
        self._forwards = 0
        # a recorder dropped without remove() unhooks itself when collected
        self._finalizer = weakref.finalize(self, _release, [id(m) for m in self._modules], list(self._namespaces),
                                           token)

    def _attention_by_layer(self, model: nn.Module, wanted: set | None) -> dict:
        """``{layer: (fqn, attention module)}`` of the layers to record; every problem in one error."""
        found = [(fqn, layer, m) for fqn, layer, m in attention_modules(model) if wanted is None or layer in wanted]
        problems = []
        by_layer: dict = {}
        for fqn, layer, m in found:
            if layer is None:
                problems.append(f"'{fqn}' has no integer component in its name to key its layer by")
            elif layer in by_layer:
                problems.append(f"'{fqn}' and '{by_layer[layer][0]}' are both attention of layer {layer}")
            else:
                by_layer[layer] = (fqn, m)
            impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
            if impl not in SUPPORTED_IMPLEMENTATIONS:
                problems.append(f"'{fqn}' runs attention implementation {impl!r}; the recorder follows "
                                f"{list(SUPPORTED_IMPLEMENTATIONS)} (model.set_attn_implementation('sdpa'))")
            heads = query_heads(m)
            if heads % self._tp:
                problems.append(f"'{fqn}' has {heads} query heads, not divisible by the tensor-parallel degree "
                                f"{self._tp}")
        missing = sorted(wanted - set(by_layer), key=repr) if wanted is not None else []
        if missing:
            problems.append(f"no attention module for layers {missing}")
        if not found:
            problems.append(f"{type(model).__name__} has no attention module that dispatches through transformers' "
                            "ALL_ATTENTION_FUNCTIONS")
        if problems:
            raise ValueError("MaxLogitRecorder: " + "; ".join(problems)
                             + ". Pass qk_logits to step() yourself, or a logits source of your own.")
        return by_layer

    # ------------------------------------------------------------------ recording

    @property
    def recording(self) -> bool:
        """Whether the forwards of the current step are recorded."""
        return self._step % self.every == 0

    def remove(self) -> None:
        """Unhook the recorder (it records nothing afterwards)."""
        self._finalizer()  # runs _release once
        self._modules, self._namespaces = [], []

    @torch.compiler.disable
    def _record(self, layer, fqn: str, implementation: str, module: nn.Module, query: Tensor, key: Tensor,
                attention_mask, kwargs: dict) -> None:
        if not self.recording or not module.training or torch._C._current_graph_task_id() != -1:
            return  # another step, an evaluation forward, or recomputation during backward
        if implementation not in SUPPORTED_IMPLEMENTATIONS:
            raise ValueError(f"MaxLogitRecorder: '{fqn}' now runs attention implementation {implementation!r}; the "
                             f"recorder follows {list(SUPPORTED_IMPLEMENTATIONS)}")
        q = query.to_local() if is_dtensor(query) else query
        k = key.to_local() if is_dtensor(key) else key
        if q.shape[1] != self._heads[layer]:
            raise ValueError(
                f"MaxLogitRecorder: '{fqn}' ran with {q.shape[1]} query heads but has {self._heads[layer] * self._tp} "
                f"(tensor-parallel degree {self._tp}); with tensor parallelism pass tp_group"
            )
        lq, lk = q.shape[2], k.shape[2]
        mask: dict = {}
        if isinstance(BlockMask, type) and isinstance(attention_mask, BlockMask):
            mask["mask_mod"] = attention_mask.mask_mod
        elif isinstance(attention_mask, Tensor):
            mask["attn_mask"] = _visible_from_tensor_mask(attention_mask, lq, lk)
        elif attention_mask is None and implementation == "sdpa":
            is_causal = kwargs.get("is_causal")
            is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
            if lq > 1 and is_causal:  # sdpa_attention_forward's rule, keys cropped as it does
                mask["is_causal"] = True
                k = k[:, :, :lq]
        elif attention_mask is not None:
            raise ValueError(f"MaxLogitRecorder: '{fqn}' got an attention mask of type {type(attention_mask).__name__}")
        scaling = kwargs.get("scaling")
        with torch.no_grad():
            m = eager_max_logits(q.detach(), k.detach(), scale=scaling, chunk_size=self.chunk_size,
                                 compute_dtype=self.compute_dtype, **mask)
        previous = self._local.get(layer)
        self._local[layer] = m if previous is None else torch.maximum(previous, m)
        self._forwards += 1

    # ------------------------------------------------------------------ the step's values

    def __call__(self, *_unused) -> dict | None:
        """The step's ``{layer: [n_query_heads]}`` (the same on every rank), or None on a step not recorded.

        Collective over ``dp_groups`` and ``tp_group`` on recorded steps. Starts the next step.
        """
        recorded = self.recording
        local, forwards = self._local, self._forwards
        self._step += 1
        self._local, self._forwards = {}, 0
        if not recorded:
            return None
        if forwards == 0:
            raise RuntimeError(
                "MaxLogitRecorder: no training forward went through the recorded attention modules since the last "
                "step, so there are no logits for QK-clip. Run the forward in training mode (model.train()) before "
                "the optimizer step, keep the recorder (remove() unhooks it), and keep the attention "
                f"implementation one of {list(SUPPORTED_IMPLEMENTATIONS)}."
            )
        values = {layer: local.get(layer, torch.full((self._heads[layer],), float("-inf"), device=self._device[layer]))
                  for layer in self.layers}
        if self.dp_groups or self.tp_group is not None:
            values = gather_max_logits(values, tp_group=self.tp_group, dp_groups=self.dp_groups)
        return values
