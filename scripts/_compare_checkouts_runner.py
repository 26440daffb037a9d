"""Are two checkouts bit for bit the same optimizer?  Train every mesh config with each, compare.

    python scripts/compare_checkouts.py --baseline ../baseline-checkout [--steps 6] [--configs fsdp_tp,ep]

For a refactor that must not change results: in each checkout (this one and ``--baseline``, e.g.
``git worktree add ../base <commit>``), every ``configs/*.toml`` is trained for a few steps on
forked gloo ranks (that checkout's ``tests/harness.py``) with QK-clip on and off and with both
distributed modes, and every parameter and every optimizer state tensor (gathered whole) is
saved.  The two checkouts then have to agree exactly: ``torch.equal`` on every tensor.  Each
checkout runs in its own process with its own package first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _rank_run(rank, world, config_path, steps, qk, mode):
    import logging

    from torch.distributed.tensor import DTensor

    # DTensor's note that gathering an FSDP-over-TP tensor takes two all-gathers
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    from examples.config import load_config
    from examples.train import Run

    cfg = load_config(config_path)
    run = Run(cfg, steps, qk, mode, log=lambda *a, **k: None, check_steps=0)
    while not run.done:
        run.step()

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    names = {id(p): n for n, p in run.model.named_parameters()}
    params = {n: whole(p.detach()).clone() for n, p in run.model.named_parameters()}
    state = {}
    for p, entry in run.opt.state.items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                state[f"{names[id(p)]}:{key}"] = whole(value).clone()
    return {"params": params, "state": state, "losses": run.losses} if rank == 0 else None


def collect(steps: int, configs: list[str], out: str) -> None:
    """In the checkout this file's copy of the package comes from: run every case, save the results."""
    sys.path[:0] = [str(ROOT / "torch-ext"), str(ROOT), str(ROOT / "tests")]
    torch.set_num_threads(1)
    from examples.config import load_config
    from harness import run_ranks

    results = {}
    for name in configs:
        path = ROOT / "configs" / f"{name}.toml"
        cfg = load_config(str(path))
        world = cfg.world_size
        for qk in (False, True):
            for mode in ("parallel", "gather"):
                key = f"{name}|qk={qk}|{mode}"
                results[key] = run_ranks(_rank_run, world, str(path), steps, qk, mode, timeout=300)[0]
                print(key, "done", flush=True)
    torch.save(results, out)


def compare(a: dict, b: dict) -> list[str]:
    problems = []
    for case in sorted(set(a) | set(b)):
        if case not in a or case not in b:
            problems.append(f"{case}: only in one checkout")
            continue
        for part in ("params", "state"):
            for key in sorted(set(a[case][part]) | set(b[case][part])):
                x, y = a[case][part].get(key), b[case][part].get(key)
                if x is None or y is None or x.dtype != y.dtype or not torch.equal(x, y):
                    diff = (x.double() - y.double()).abs().max().item() if x is not None and y is not None and \
                        x.shape == y.shape else "n/a"
                    problems.append(f"{case} {part} {key}: differs (max |diff| {diff})")
        if a[case]["losses"] != b[case]["losses"]:
            problems.append(f"{case}: losses differ")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="the other checkout (its scripts/compare_checkouts.py is not needed)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--configs", default=None, help="comma-separated config names (default: every configs/*.toml "
                    "but main, which needs the stdlib corpus and is the slowest)")
    ap.add_argument("--collect", default=None, help=argparse.SUPPRESS)  # internal: the per-checkout run
    args = ap.parse_args(argv)
    configs = args.configs.split(",") if args.configs else sorted(
        p.stem for p in (ROOT / "configs").glob("*.toml") if p.stem != "main")
    if args.collect:
        collect(args.steps, configs, args.collect)
        return 0
    if not args.baseline:
        ap.error("--baseline is required")
    with tempfile.TemporaryDirectory() as tmp:
        outs = []
        for tree in (ROOT, Path(args.baseline).resolve()):
            out = os.path.join(tmp, f"{len(outs)}.pt")
            # this file runs inside the other checkout too: paths come from --collect's ROOT, so
            # copy it there under a temporary name
            runner = tree / "scripts" / "_compare_checkouts_runner.py"
            runner.write_text(Path(__file__).read_text())
            try:
                cmd = [sys.executable, str(runner), "--collect", out, "--steps", str(args.steps),
                       "--configs", ",".join(configs)]
                subprocess.run(cmd, check=True, cwd=tree, env={**os.environ, "OMP_NUM_THREADS": "1"})
            finally:
                runner.unlink()
            outs.append(out)
        a, b = (torch.load(o, weights_only=False) for o in outs)
    problems = compare(a, b)
    tensors = sum(len(r["params"]) + len(r["state"]) for r in a.values())
    print(json.dumps({"cases": len(a), "tensors compared": tensors, "differing": len(problems)}))
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
