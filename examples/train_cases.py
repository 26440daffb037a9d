"""Several ``examples/train.py`` runs in one torchrun launch, each checked as train.py checks it.

    torchrun --standalone --nproc-per-node N examples/train_cases.py CASES.json RESULTS.json [--device cpu|cuda]
    python examples/train_cases.py --outcomes CASES.json RESULTS.json    # one line per case: NAME ok|FAILED (why)

A launch pays every rank's start-up (Python, torch, DTensor: ~9 s of a CPU core per rank, more
than a few training steps of the example configs), so the config matrix runs the cases of one
world size in one launch (tests/end_to_end/test_config_matrix.py). ``CASES.json`` is an object
``{"name": [train.py arguments...], ...}``; every case needs the launch's world size. Each case
runs through train.py's own ``main(argv)``, one after another, as ``torchrun ... examples/train.py
ARGS`` would run it (argument parsing, config, training, the check, the summary), in the process
group this launcher makes once: ``main`` finds it made and leaves it for the next case.

Rank 0 rewrites ``RESULTS.json`` after every case, ``{"name": exit status}`` in the cases' order,
so a case that failed its check (status 1; the others still run) and a launch that died (the case
it died in and those after it are missing) are both named. Exit status: 0 when every case
returned 0, else 1. ``--outcomes`` reads them back, one line per case (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

if __package__ in (None, ""):  # run as a script: make `examples` and `optimizer` importable
    _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [_ROOT, os.path.join(_ROOT, "torch-ext")]


def run_cases(cases: dict[str, list[str]], results_path: str, device: str = "cpu") -> int:
    """Run every case's ``train.main(argv)`` in one process group; returns 0 when all returned 0.
    Collective: every rank of the launch calls it with the same cases."""
    import torch
    import torch.distributed as dist

    from examples import train

    if device == "cuda":
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timedelta(minutes=5), device_id=local)
    else:
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    results: dict[str, int] = {}
    try:
        for name, argv in cases.items():
            results[name] = int(train.main(argv))
            if dist.get_rank() == 0:
                print(f"== case {name}: exit status {results[name]}", flush=True)
                with open(results_path, "w") as f:
                    json.dump(results, f, indent=1)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0 if all(code == 0 for code in results.values()) else 1


def outcomes(cases: dict[str, list[str]], results: dict[str, int]) -> list[str]:
    """``NAME ok`` or ``NAME FAILED (why)`` per case, in the cases' order."""
    lines = []
    for name in cases:
        code = results.get(name)
        why = ("" if code == 0 else " FAILED (not finished: the launch stopped in it or before it)" if code is None
               else f" FAILED (exit status {code})")
        lines.append(f"{name}{why or ' ok'}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", help='JSON file: {"name": [train.py arguments...], ...}')
    ap.add_argument("results", help="JSON file rank 0 writes: {name: exit status} of the cases run so far")
    ap.add_argument("--outcomes", action="store_true",
                    help="print each case's outcome from RESULTS (no launch, no torchrun)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="the process group's device: gloo on cpu, NCCL on cuda (the cases' --device must match)")
    args = ap.parse_args(argv)
    if args.outcomes:
        with open(args.cases) as f:
            cases = json.load(f)
        results = {}
        if os.path.exists(args.results):
            with open(args.results) as f:
                results = json.load(f)
        print("\n".join(outcomes(cases, results)))
        return 0
    if "WORLD_SIZE" not in os.environ:
        print("error: examples/train_cases.py runs under torchrun (one process group for every case)",
              file=sys.stderr)
        return 2
    with open(args.cases) as f:
        cases = json.load(f)
    if not isinstance(cases, dict) or not all(isinstance(a, list) and all(isinstance(x, str) for x in a)
                                              for a in cases.values()):
        print(f"error: {args.cases} must hold an object of name -> list of train.py arguments", file=sys.stderr)
        return 2
    return run_cases(cases, args.results, args.device)


if __name__ == "__main__":
    from examples.torchrun_exit import exit_process

    exit_process(main())
