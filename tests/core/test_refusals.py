"""A refused call leaves the optimizer exactly as it was (issue 38), at every point where Muon
refuses input: construction, ``add_param_group``, ``load_state_dict`` and ``step()``.

The refused inputs, each with the call that corrects it:

* ``view_blocks``: a ``muon_row_blocks`` spec that fits the stored rows of a ``muon_transposed``
  weight but not the rows of its ``[out, in]`` view, which is what the spec describes;
* ``torch_style``: a group without ``use_muon`` whose AdamW half is refused (``betas=(0.9, 1.0)``,
  a complex tensor) while its Muon half would pass;
* ``short_names``: ``param_names`` shorter than ``params``;
* ``raising_blocks`` / ``junk_blocks``: a callable ``muon_row_blocks`` that raises, or returns an int;
* ``bad_option``: ``momentum=1.5``, ``nesterov='no'``, ``weight_decay=nan``, ``lr=-0.1``,
  ``ns_steps=0``, ``adjust_lr='bogus'``;
* ``kernels``: ``ns_kernels='triton'`` where the kernels cannot run (float64: they take fp16,
  bf16 and fp32).

After every refusal the parameters, every state tensor and ``param_groups`` are compared with a
copy taken before the call (``Snapshot``), the error must be a ``ValueError`` that names what to
fix, and the corrected call must then succeed and step.  Points that a kind cannot reach are
listed in ``NOT_APPLICABLE`` with why.  Options set in place and checked at ``step()`` on several
ranks: tests/core/test_in_place_options.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.nn import Parameter

from optimizer import Muon

# float64 Newton–Schulz: where the Triton kernels cannot run (the ``kernels`` case)
H = dict(lr=0.02, ns_method="classic", compute_dtype=torch.float64)


def _raises_zero_division(name, shape):
    return [slice(0, shape[0] // 0)]


def _returns_an_int(name, shape):
    return 3


def _two_blocks(name, shape):
    return [slice(0, shape[0] // 2), slice(shape[0] // 2, shape[0])]


BAD_OPTIONS = [("momentum", 1.5), ("nesterov", "no"), ("weight_decay", math.nan), ("lr", -0.1), ("ns_steps", 0),
               ("adjust_lr", "bogus")]


# --------------------------------------------------------------------------- the optimizer and its copy


def _params(seed=0):
    """``w`` [8, 6]; ``t`` stored [6, 12] = [in, out], read as [12, 6]; ``b`` a vector."""
    g = torch.Generator().manual_seed(seed)
    return (Parameter(torch.randn(8, 6, generator=g)), Parameter(torch.randn(6, 12, generator=g)),
            Parameter(torch.randn(6, generator=g)))


def _groups(w, t, b, muon=None, adamw=None):
    return [{"params": [w, t], "param_names": ["w", "t"], "use_muon": True, "muon_transposed": {"t": True},
             **(muon or {})},
            {"params": [b], "param_names": ["b"], "use_muon": False, **(adamw or {})}]


def _step(opt, seed):
    g = torch.Generator().manual_seed(100 + seed)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    opt.step()


def _built():
    """An optimizer two steps in (momentum, AdamW moments and steps in its state)."""
    w, t, b = _params()
    opt = Muon(_groups(w, t, b), **H)
    for i in range(2):
        _step(opt, i)
    return opt


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(
            _same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a is b or a == b


class Snapshot:
    """Everything a refused call must leave as it was: every parameter's values, every state
    tensor (by parameter), and ``param_groups`` (their number, keys, values and parameter objects)."""

    def __init__(self, opt: Muon):
        self.params = [(p, p.detach().clone()) for g in opt.param_groups for p in g["params"]]
        self.state = {p: copy.deepcopy(dict(s)) for p, s in opt.state.items()}
        self.groups = [({k: copy.deepcopy(v) for k, v in g.items() if k != "params"}, list(g["params"]))
                       for g in opt.param_groups]

    def assert_unchanged(self, opt: Muon) -> None:
        for p, before in self.params:
            assert torch.equal(p.detach(), before), "a parameter changed"
        assert set(opt.state) == set(self.state), "state entries added or removed"
        for p, before in self.state.items():
            assert _same(dict(opt.state[p]), before), f"the state of a {tuple(p.shape)} parameter changed"
        assert len(opt.param_groups) == len(self.groups), "param_groups added or removed"
        for group, (options, params) in zip(opt.param_groups, self.groups):
            assert group["params"] == params and all(a is b for a, b in zip(group["params"], params))
            assert _same({k: v for k, v in group.items() if k != "params"}, options), "a group's options changed"


def _refused(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- the cases


def _construction(kind: str, value=None):
    """(refused constructor call, corrected constructor call, words the error must contain)."""
    w, t, b = _params()
    m, v = Parameter(torch.randn(4, 4)), Parameter(torch.randn(4))
    if kind == "view_blocks":  # t's stored rows are 6, its [out, in] rows 12
        return (lambda: Muon(_groups(w, t, b, {"muon_row_blocks": {"t": "blocks:2,4"}}), **H),
                lambda: Muon(_groups(w, t, b, {"muon_row_blocks": {"t": "blocks:4,8"}}), **H), "'t' has 12 rows")
    if kind == "torch_style":
        return (lambda: Muon([{"params": [m, v], "betas": (0.9, 1.0)}], **H),
                lambda: Muon([{"params": [m, v], "betas": (0.9, 0.99)}], **H), r"betas\[1\]")
    if kind == "torch_style_complex":
        z = Parameter(torch.randn(4, dtype=torch.complex64))
        return (lambda: Muon([{"params": [("m", m), ("z", z)]}], **H),
                lambda: Muon([{"params": [("m", m), ("v", v)]}], **H), "'z' is complex")
    if kind == "short_names":
        return (lambda: Muon([{"params": [w, m], "param_names": ["w"], "use_muon": True}], **H),
                lambda: Muon([{"params": [w, m], "param_names": ["w", "m"], "use_muon": True}], **H),
                "2 params but 1 param_names")
    if kind in ("raising_blocks", "junk_blocks"):
        bad = _raises_zero_division if kind == "raising_blocks" else _returns_an_int
        return (lambda: Muon(_groups(w, t, b, {"muon_row_blocks": {"w": bad}}), **H),
                lambda: Muon(_groups(w, t, b, {"muon_row_blocks": {"w": _two_blocks}}), **H),
                "'w': the callable muon_row_blocks spec")
    if kind == "bad_option":
        key, bad = value
        good = 0.05 if key == "lr" else None
        return (lambda: Muon(_groups(w, t, b, {key: bad}), **H),
                lambda: Muon(_groups(w, t, b, {} if good is None else {key: good}), **H), rf"param_groups\[0\] {key}`")
    if kind == "kernels":
        return (lambda: Muon(_groups(w, t, b, {"ns_kernels": "triton"}), **H),
                lambda: Muon(_groups(w, t, b, {"ns_kernels": "torch"}), **H),
                "ns_kernels='triton' cannot run")
    raise AssertionError(kind)


def _added_group(kind: str, value=None):
    """(refused group, corrected group, words the error must contain), for ``_built()``'s optimizer."""
    m, v = Parameter(torch.randn(4, 4)), Parameter(torch.randn(4))
    t2 = Parameter(torch.randn(6, 10))  # stored [in, out]: 10 rows as Muon reads it
    muon = {"params": [m, t2], "param_names": ["m", "t2"], "use_muon": True, "muon_transposed": {"t2": True}}
    if kind == "view_blocks":
        return ({**muon, "muon_row_blocks": {"t2": "blocks:2,4"}}, {**muon, "muon_row_blocks": {"t2": "blocks:4,6"}},
                "'t2' has 10 rows")
    if kind == "torch_style":
        return ({"params": [("m", m), ("v", v)], "betas": (0.9, 1.0)},
                {"params": [("m", m), ("v", v)], "betas": (0.9, 0.99)}, r"betas\[1\]")
    if kind == "torch_style_complex":
        z = Parameter(torch.randn(4, dtype=torch.complex64))
        return {"params": [("m", m), ("z", z)]}, {"params": [("m", m), ("v", v)]}, "'z' is complex"
    if kind == "short_names":
        return {**muon, "param_names": ["m"]}, muon, "2 params but 1 param_names"
    if kind in ("raising_blocks", "junk_blocks"):
        bad = _raises_zero_division if kind == "raising_blocks" else _returns_an_int
        return ({**muon, "muon_row_blocks": {"m": bad}}, {**muon, "muon_row_blocks": {"m": _two_blocks}},
                "'m': the callable muon_row_blocks spec")
    if kind == "bad_option":
        key, bad = value
        return {**muon, key: bad}, dict(muon), rf"param_groups\[2\] {key}`"
    if kind == "kernels":
        return {**muon, "ns_kernels": "triton"}, {**muon, "ns_kernels": "torch"}, "ns_kernels='triton' cannot run"
    raise AssertionError(kind)


def _in_place(kind: str, value=None):
    """(change to ``_built()``'s groups, undo, words the step's error must contain)."""
    if kind == "view_blocks":
        return lambda gs: gs[0].__setitem__("muon_row_blocks", {"t": "blocks:2,4"}), \
            lambda gs: gs[0].__setitem__("muon_row_blocks", None), "'t' has 12 rows"
    if kind == "torch_style":  # the AdamW half: its betas set in place
        return lambda gs: gs[1].__setitem__("betas", (0.9, 1.0)), \
            lambda gs: gs[1].__setitem__("betas", (0.9, 0.95)), r"param_groups\[1\] betas\[1\]"
    if kind == "short_names":
        return lambda gs: gs[0]["param_names"].pop(), lambda gs: gs[0]["param_names"].append("t"), \
            "2 params but 1 param_names"
    if kind in ("raising_blocks", "junk_blocks"):
        bad = _raises_zero_division if kind == "raising_blocks" else _returns_an_int
        return lambda gs: gs[0].__setitem__("muon_row_blocks", {"w": bad}), \
            lambda gs: gs[0].__setitem__("muon_row_blocks", None), "'w': the callable muon_row_blocks spec"
    if kind == "bad_option":
        key, bad = value
        saved = {}
        return (lambda gs: (saved.setdefault(key, gs[0][key]), gs[0].__setitem__(key, bad)),
                lambda gs: gs[0].__setitem__(key, saved[key]), rf"param_groups\[0\] {key}`")
    if kind == "kernels":
        return lambda gs: gs[0].__setitem__("ns_kernels", "triton"), lambda gs: gs[0].pop("ns_kernels"), \
            "ns_kernels='triton' cannot run"
    raise AssertionError(kind)


def _checkpoint(kind: str, value=None):
    """(edit of ``_built()``'s state dict, words the load's error must contain)."""
    if kind == "view_blocks":  # saved with blocks this optimizer does not declare
        return lambda sd: sd["param_groups"][0].__setitem__("muon_row_blocks", [None, "blocks:2,4"]), \
            "'t' was orthogonalised with muon_row_blocks"
    if kind == "torch_style":
        return lambda sd: sd["param_groups"][1].__setitem__("betas", (0.9, 1.0)), r"param_groups\[1\] betas\[1\]"
    if kind == "short_names":
        return lambda sd: sd["param_groups"][0]["param_names"].pop(), "only this optimizer has 't'"
    if kind == "bad_option":
        key, bad = value
        return lambda sd: sd["param_groups"][0].__setitem__(key, bad), rf"param_groups\[0\] {key}`"
    raise AssertionError(kind)


KINDS = ["view_blocks", "torch_style", "torch_style_complex", "short_names", "raising_blocks", "junk_blocks",
         *[("bad_option", kv) for kv in BAD_OPTIONS], "kernels"]
POINTS = ["construction", "add_param_group", "step", "load_state_dict"]
NOT_APPLICABLE = {
    # step: a parameter list edited in place is not an option; only options are checked per step
    ("step", "torch_style_complex"),
    # load_state_dict: a checkpoint holds no callables (they have no plain form, row_blocks.py) and the
    # loading optimizer keeps its own row blocks (compared with the checkpoint's: the view_blocks case)
    ("load_state_dict", "raising_blocks"), ("load_state_dict", "junk_blocks"),
    # load_state_dict: ns_kernels is the loading optimizer's own (test_a_checkpoint_keeps_the_machines_ns_kernels)
    ("load_state_dict", "kernels"),
    # load_state_dict: tensors come from the live optimizer; torch-style splitting happens at add only
    ("load_state_dict", "torch_style_complex"),
}
CASES = [(point, kind) for point in POINTS for kind in KINDS
         if (point, kind if isinstance(kind, str) else kind[0]) not in NOT_APPLICABLE]


def _case_id(case):
    point, kind = case
    return f"{point}-{kind if isinstance(kind, str) else f'{kind[1][0]}={kind[1][1]!r}'}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_a_refused_call_leaves_everything_as_it_was_and_the_corrected_call_succeeds(case):
    point, kind = case
    kind, value = (kind, None) if isinstance(kind, str) else kind
    if point == "construction":
        refused, corrected, match = _construction(kind, value)
        _refused(refused, match)
        opt = corrected()  # the same parameters, in a corrected call
        _step(opt, 0)
        return
    opt = _built()
    if point == "add_param_group":
        bad, good, match = _added_group(kind, value)
        snapshot = Snapshot(opt)
        _refused(lambda: opt.add_param_group(bad), match)
        snapshot.assert_unchanged(opt)
        opt.add_param_group(good)
        assert len(opt.param_groups) > len(snapshot.groups)
    elif point == "step":
        change, undo, match = _in_place(kind, value)
        change(opt.param_groups)
        snapshot = Snapshot(opt)  # as the user left it: the step itself changes nothing
        g = torch.Generator().manual_seed(7)
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.randn(p.shape, generator=g)
        _refused(opt.step, match)
        snapshot.assert_unchanged(opt)
        undo(opt.param_groups)
    else:
        edit, match = _checkpoint(kind, value)
        saved = copy.deepcopy(opt.state_dict())
        edit(saved)
        snapshot = Snapshot(opt)
        _refused(lambda: opt.load_state_dict(saved), match)
        snapshot.assert_unchanged(opt)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _step(opt, 5)


# --------------------------------------------------------------------------- item by item


def test_a_torch_style_group_is_added_whole_or_not_at_all():
    """The issue's case: the Muon half of a torch-style group stayed when its AdamW half was refused,
    and the corrected group then failed with "some parameters appear in more than one parameter group"."""
    opt = _built()
    m, v = Parameter(torch.randn(4, 4)), Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        opt.add_param_group({"params": [("m", m), ("v", v)], "betas": (0.9, 1.0)})
    assert [p for g in opt.param_groups for p in g["params"] if p is m] == []
    opt.add_param_group({"params": [("m", m), ("v", v)], "betas": (0.9, 0.99)})
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, True, False]
    assert opt.param_groups[2]["params"] == [m] and opt.param_groups[3]["params"] == [v]


@pytest.mark.parametrize("error", [ZeroDivisionError, TypeError, KeyError, RuntimeError, AssertionError])
def test_whatever_a_row_blocks_callable_raises_is_refused_by_name(error):
    def spec(name, shape):
        raise error("the user's own bug")

    opt = _built()
    snapshot = Snapshot(opt)
    m = Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=rf"'m': the callable muon_row_blocks spec .* raised {error.__name__}"):
        opt.add_param_group({"params": [m], "param_names": ["m"], "use_muon": True, "muon_row_blocks": spec})
    snapshot.assert_unchanged(opt)


@pytest.mark.parametrize("junk", [3, None, "0:2", {"a": slice(0, 2)}, [slice("a", 2)], [slice(0, 4, 0)],
                                  [torch.tensor([0.0, 1.0])], [torch.tensor([True, False, True, False])]],
                         ids=["int", "None", "str", "dict", "str_slice", "zero_step", "float_rows", "bool_rows"])
def test_row_blocks_a_callable_returns_must_be_slices_or_integer_rows(junk):
    opt = _built()
    snapshot = Snapshot(opt)
    m = Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="'m'"):
        opt.add_param_group({"params": [m], "param_names": ["m"], "use_muon": True,
                             "muon_row_blocks": lambda name, shape: junk})
    snapshot.assert_unchanged(opt)


def test_an_unnamed_short_param_names_group_is_refused_before_torch_adds_it():
    w = Parameter(torch.randn(4, 4))
    opt = Muon([{"params": [w], "use_muon": True}])
    m, n = Parameter(torch.randn(4, 4)), Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="all optimizer param groups should be with/without names"):
        opt.add_param_group({"params": [m, n], "param_names": ["m"], "use_muon": True})  # torch's own rule
    assert len(opt.param_groups) == 1
    opt.state_dict()  # still works (the issue: every later state_dict() raised)


# --------------------------------------------------------------------------- ns_kernels: the machine's choice


def test_a_checkpoint_keeps_the_machines_ns_kernels():
    """A checkpoint saved with ns_kernels='triton' loads into an optimizer built with 'torch' on a
    machine where the kernels cannot run (here: float64), keeps 'torch' and steps; one saved with
    'auto' (no key: the default) leaves a loading optimizer's 'triton' as it is."""
    w, t, b = _params()
    opt = Muon(_groups(w, t, b, {"ns_kernels": "torch"}), **H)
    _step(opt, 0)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["ns_kernels"] = "triton"  # as a GPU machine saves it
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["ns_kernels"] == "torch"
    _step(opt, 1)

    w2, t2, b2 = _params()
    other = Muon(_groups(w2, t2, b2, {"ns_kernels": "triton"}), **{**H, "compute_dtype": torch.float32})  # they run
    saved = copy.deepcopy(other.state_dict())
    del saved["param_groups"][0]["ns_kernels"]  # 'auto'
    other.load_state_dict(saved)
    assert other.param_groups[0]["ns_kernels"] == "triton"
    # and the other options still come from the checkpoint, as torch's optimizers restore them
    saved["param_groups"][0]["lr"] = 0.123
    other.load_state_dict(saved)
    assert other.param_groups[0]["lr"] == 0.123 and other.param_groups[0]["ns_kernels"] == "triton"
