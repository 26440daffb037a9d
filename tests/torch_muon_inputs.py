"""torch's own test inputs for ``torch.optim.Muon``, as the installed release defines them.

``tests/core/test_torch_optim_renewed.py`` (the port of torch's ``TestOptimRenewed``) runs every
input of ``torch.testing._internal.common_optimizers.optim_inputs_func_muon`` that the installed
torch defines, except the ones in :data:`CANNOT_RUN` (each with its reason, and a test that ours
really refuses it); an input a new release adds is run.  What changed between releases is a
report, not a failure:

    python tests/torch_muon_inputs.py      # the installed release's inputs against the recorded ones

prints each input (run, or cannot run and why) and what was added or removed since each release
recorded in :data:`RECORDED` (``.ci/run`` prints it in every compatibility run).
"""

from __future__ import annotations

import dataclasses

import torch

@dataclasses.dataclass(frozen=True)
class CannotRun:
    kwargs: dict  # the input's keywords, as torch's list gives them
    reason: str


#: inputs of torch's list that ours cannot run, and why (a test checks that ours refuses each one)
CANNOT_RUN = {
    "spectral_unclamped lr adjustment": CannotRun(
        {"adjust_lr_fn": "spectral_unclamped"},
        "adjust_lr_fn='spectral_unclamped' (new in torch 2.15: lr * sqrt(rows/cols), Bernstein's scaling without "
        "the clamp at 1) is not one of our adjust_lr modes; ours refuses it at construction, naming adjust_lr_fn",
    ),
}

#: ``optim_inputs_func_muon``'s descs (inputs) and ``optim_error_inputs_func_muon``'s (error inputs), as
#: the releases in the supported range define them (read from each release's
#: torch/testing/_internal/common_optimizers.py); 2.8 has no torch.optim.Muon.
_INPUTS_2_9 = (
    "default", "non-default lr", "Tensor lr", "non-default weight_decay", "non-default momentum",
    "passing alternative ns_steps", "passing alternative ns_coefficients",
)
_ERRORS_2_9 = (
    "invalid param type", "a param group cannot have duplicate parameters",
    "duplicate parameters should not occur across param groups either", "Tensor lr must be 1-element",
    "all optimizer params should be with/without names", "all optimizer param groups should be with/without names.",
    "only support 2D parameters", "only support `original` and `match_rms_adamw`",
    "does not support complex parameters",
)
RECORDED = {
    "2.10": {"inputs": _INPUTS_2_9, "error_inputs": _ERRORS_2_9},
    "2.11": {"inputs": _INPUTS_2_9, "error_inputs": _ERRORS_2_9},
    "2.13": {"inputs": _INPUTS_2_9, "error_inputs": _ERRORS_2_9},
    "2.15": {
        "inputs": _INPUTS_2_9 + ("match_rms_adamw lr adjustment", "spectral_unclamped lr adjustment"),
        "error_inputs": _ERRORS_2_9[:2] + ("warn on a bare unordered set of params",) + tuple(
            d if d != "only support `original` and `match_rms_adamw`" else "unsupported adjust_lr_fn"
            for d in _ERRORS_2_9[2:]),
    },
}

NO_TORCH_MUON = "torch.optim.Muon is new in torch 2.9: this release has no torch.optim.Muon and no test inputs for it"


def has_torch_muon() -> bool:
    return hasattr(torch.optim, "Muon")


def release() -> str:
    """The installed torch's release, ``major.minor`` (``2.15.0+cu130`` -> ``2.15``)."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def torch_inputs():
    """The installed torch's Muon inputs, fresh (a Tensor lr is mutated in place by schedulers)."""
    from torch.testing._internal.common_optimizers import optim_inputs_func_muon

    return optim_inputs_func_muon(device="cpu")


def torch_error_inputs():
    from torch.testing._internal.common_optimizers import optim_error_inputs_func_muon

    return optim_error_inputs_func_muon(device="cpu", dtype=torch.float32)


def input_descs() -> tuple[str, ...]:
    """Every input the installed torch defines (none before torch.optim.Muon existed)."""
    return tuple(i.desc for i in torch_inputs()) if has_torch_muon() else ()


def runnable_descs() -> tuple[str, ...]:
    """The inputs the port runs: all of torch's but :data:`CANNOT_RUN`."""
    return tuple(d for d in input_descs() if d not in CANNOT_RUN)


def report() -> str:
    """The installed release's inputs, and what changed against every recorded release."""
    lines = [f"torch {torch.__version__}: torch.optim.Muon's test inputs (torch.testing._internal.common_optimizers)"]
    if not has_torch_muon():
        return "\n".join(lines + [f"  {NO_TORCH_MUON}: the port (test_torch_optim_renewed.py) is skipped"])
    inputs = input_descs()
    errors = tuple(e.optimizer_error_input.desc for e in torch_error_inputs())
    for d in inputs:
        lines.append(f"  input {d!r}: " + (f"cannot run: {CANNOT_RUN[d].reason}" if d in CANNOT_RUN else "run"))
    lines.append(f"  error inputs: {len(errors)}, each run by test_errors")
    for rel, recorded in RECORDED.items():
        if rel == release():
            same = (inputs, errors) == (recorded["inputs"], recorded["error_inputs"])
            lines.append(f"  as recorded for {rel}" if same else f"  differs from what was recorded for {rel} (below)")
            if same:
                continue
        for kind, now in (("inputs", inputs), ("error_inputs", errors)):
            added = [d for d in now if d not in recorded[kind]]
            removed = [d for d in recorded[kind] if d not in now]
            if added or removed:
                lines.append(f"  {kind} compared with {rel}: only here {added}, only there {removed}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
