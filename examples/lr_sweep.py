"""The learning-rate sweep behind the main job's two learning rates.

    python examples/lr_sweep.py [--config configs/main.toml] [--lrs 0.001,0.002,...]
        [--jobs 2] [--out examples/results/lr_sweep.json]

Trains the main job's model on the main job's data with each optimizer
("muon": Muon + AdamW for non-matrix parameters, QK-clip as configured; "normuon":
the same with NorMuon, beta2 ``examples.train.NORMUON_BETA2``; "dion2": the same with
Dion2, fraction ``examples.train.DION2_FRACTION``, QK-clip off; "adamw":
torch.optim.AdamW for everything) at every learning rate of one shared grid,
with everything else exactly as in the main job (init, batches, steps, warmup,
cosine schedule, weight decay, QK-clip threshold), and picks for each optimizer
the learning rate with the lowest final validation loss.  The result goes to
``--out`` (JSON, with the command, the grid, every run's validation curve and
step time, the corpus fingerprint and the hardware) and a Markdown table next to
it; ``configs/main.toml`` then takes ``[train] lr`` (Muon), ``[compare] normuon_lr``
and ``[compare] adamw_lr`` from it, and ``[compare] dion2_lr`` from Dion2's own sweep
(``--optimizers dion2 --out examples/results/lr_sweep_dion2.json``; Dion2 is not in the
default list) (``tests/end_to_end/test_main_job.py`` checks that they agree).

``--merge OLD.json`` keeps OLD's results for the optimizers this sweep does not run
(same grid, settings and corpus required), so that one optimizer can be re-swept
when only its code changed; the record says which results came from where.

Each run is a single process: the optimizer's arithmetic on one device is the
same as on the mesh (that is what the main job's agreement check verifies), the
global batch is the same, and single-process runs are cheaper, so ``--jobs``
of them run side by side (one thread each).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make `examples` and `optimizer` importable
    _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [_ROOT, os.path.join(_ROOT, "torch-ext")]

from examples import report  # noqa: E402
from examples.config import ConfigError, MeshConfig, RunConfig, load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "main.toml")
DEFAULT_OUT = os.path.join(ROOT, "examples", "results", "lr_sweep.json")
# Factors of 2 around the usual range for both (Muon's matched-RMS learning rate
# is on AdamW's scale).
DEFAULT_LRS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032)
OPTIMIZERS = ("muon", "normuon", "dion2", "adamw")
# What a sweep runs unless --optimizers says otherwise (Dion2's sweep has its own record,
# examples/results/lr_sweep_dion2.json).
DEFAULT_OPTIMIZERS = ("muon", "normuon", "adamw")
# Optimizers that run without QK-clip (AdamW has none; Muon refuses it with Dion2 groups).
NO_QK_CLIP = ("dion2", "adamw")


def single_process(cfg: RunConfig) -> RunConfig:
    """The config on one process: same model, data and schedule, no mesh."""
    return dataclasses.replace(cfg, mesh=MeshConfig(), placements=None)


def run_one(config_path: str, optimizer: str, lr: float, steps: int | None) -> dict:
    """One sweep point in this process (a worker); a JSON-able record."""
    import torch

    from examples.train import train

    torch.set_num_threads(1)
    uses_qk_clip = optimizer not in NO_QK_CLIP
    cfg = single_process(load_config(config_path))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=lr))
    s = train(cfg, steps=steps, use_qk_clip=(uses_qk_clip and cfg.qk_clip.enabled), optimizer=optimizer,
              check_steps=0, label=f"{optimizer}@{lr:g}", log=lambda *_: None)
    final = s["evals"][-1]["val_loss"]
    return {
        "optimizer": optimizer,
        "lr": lr,
        "final_val_loss": final if math.isfinite(final) else None,  # None: diverged
        "evals": s["evals"],
        "last_train_loss": s["last_loss"],
        "mean_step_time_s": s["mean_step_time_s"],
        "heads_clipped": sum(s["heads_clipped"]),
        "corpus": s.get("corpus"),
    }


def best_lrs(results: list[dict], grid: list[float]) -> dict[str, dict]:
    """Per optimizer: the lr with the lowest final validation loss, and whether it
    lies on the edge of the grid (then the grid should be widened)."""
    best = {}
    for opt in sorted({r["optimizer"] for r in results}):
        finite = [r for r in results if r["optimizer"] == opt and r["final_val_loss"] is not None]
        if not finite:
            best[opt] = {"lr": None, "final_val_loss": None, "at_edge": True}
            continue
        winner = min(finite, key=lambda r: r["final_val_loss"])
        best[opt] = {"lr": winner["lr"], "final_val_loss": winner["final_val_loss"],
                     "at_edge": winner["lr"] in (min(grid), max(grid))}
    return best


def markdown(record: dict) -> str:
    grid = record["grid"]
    rows = [("lr", *record["optimizers"])]
    by = {(r["optimizer"], r["lr"]): r for r in record["results"]}
    for lr in grid:
        cells = []
        for opt in record["optimizers"]:
            r = by.get((opt, lr))
            v = None if r is None else r["final_val_loss"]
            cell = "–" if r is None else ("diverged" if v is None else f"{v:.4f}")
            cells.append(f"**{cell}**" if record["best"][opt]["lr"] == lr else cell)
        rows.append((f"{lr:g}", *cells))
    return report.markdown_table(rows) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--lrs", default=",".join(f"{x:g}" for x in DEFAULT_LRS),
                    help="comma-separated learning rates, the same grid for every optimizer")
    ap.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS), help=f"comma-separated subset of {OPTIMIZERS}")
    ap.add_argument("--steps", type=int, default=None, help="override [train] steps")
    ap.add_argument("--jobs", type=int, default=2, help="runs side by side (one thread each)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="JSON record; a .md table is written next to it")
    ap.add_argument("--merge", default=None,
                    help="an earlier record whose results for the optimizers not swept now are kept")
    return ap.parse_args(argv)


def sweep_settings(cfg: RunConfig, steps: int | None) -> dict:
    """What every point of a sweep shares (the record's ``settings``)."""
    from examples.train import NORMUON_BETA2

    return {"steps": steps or cfg.train.steps, **{k: dataclasses.asdict(v) for k, v in (
        ("model", cfg.model), ("train", cfg.train), ("data", cfg.data), ("qk_clip", cfg.qk_clip))},
        "normuon_beta2": NORMUON_BETA2}


def _same(section: str, old, new) -> bool:
    """A recorded settings section equals today's: the same values for what it recorded (the lr
    aside: the sweep varies it), and what was added to the section since at its default, which is
    what the earlier runs had (the examples' later features default to the old behaviour)."""
    if not isinstance(old, dict):
        return old == new
    from examples.config import DataConfig, QKClipSettings, TrainConfig
    from examples.model import ModelArgs

    defaults = dataclasses.asdict({"model": ModelArgs, "train": TrainConfig, "data": DataConfig,
                                   "qk_clip": QKClipSettings}[section]())
    skip = {"lr"} if section == "train" else set()
    return set(old) <= set(new) and all(old[k] == new[k] for k in old if k not in skip) and \
        all(new[k] == defaults[k] for k in set(new) - set(old))


def merged(old: dict, optimizers: list[str], grid: list[float], settings: dict) -> tuple[list[dict], dict]:
    """``old``'s results for the optimizers not in ``optimizers`` (refused if its grid or settings
    differ), and where they came from."""
    if old["grid"] != grid:
        raise ValueError(f"--merge: its grid {old['grid']} is not this sweep's {grid}")
    differ = sorted(k for k in settings if k in old["settings"] and not _same(k, old["settings"][k], settings[k]))
    if differ:
        raise ValueError(f"--merge: its settings differ from this sweep's in {differ}")
    kept = [o for o in old["optimizers"] if o not in optimizers]
    results = [r for r in old["results"] if r["optimizer"] in kept]
    source = {"command": old["command"], "hardware": old["hardware"], "wall_s": old["wall_s"]}
    return results, {o: old.get("sources", {}).get(o, source) for o in kept}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config)
        grid = sorted(float(x) for x in args.lrs.split(","))
        optimizers = [o.strip() for o in args.optimizers.split(",")]
    except (ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for problem in (
        [f"unknown optimizer {o!r}; choose from {OPTIMIZERS}" for o in optimizers if o not in OPTIMIZERS]
        + [f"learning rates must be > 0, got {x:g}" for x in grid if not x > 0]
        + ([f"--jobs must be >= 1, got {args.jobs}"] if args.jobs < 1 else [])
        + ([f"--steps must be >= 1, got {args.steps}"] if args.steps is not None and args.steps < 1 else [])
        + ([f"{cfg.name}: the sweep compares validation loss; needs [data] source = \"stdlib\" and "
            "[train] eval_every > 0"] if cfg.data.source != "stdlib" or not cfg.train.eval_every else [])
    ):
        print(f"error: {problem}", file=sys.stderr)
        return 2

    settings = sweep_settings(cfg, args.steps)
    kept, sources, old_corpus = [], {}, None
    if args.merge:
        try:
            with open(args.merge) as f:
                old = json.load(f)
            kept, sources = merged(old, optimizers, grid, settings)
            old_corpus = old["corpus"]
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    points = [(o, lr) for o in optimizers for lr in grid]
    print(f"sweeping {len(points)} runs ({', '.join(optimizers)} x lr {', '.join(f'{x:g}' for x in grid)}) "
          f"of {args.steps or cfg.train.steps} steps, {args.jobs} at a time"
          + (f"; keeping {', '.join(sources)} from {args.merge}" if sources else ""))
    start = time.perf_counter()
    results = []
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no state shared with this one
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        futures = {pool.submit(run_one, os.path.abspath(args.config), o, lr, args.steps): (o, lr)
                   for o, lr in points}
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            results.append(r)
            v = r["final_val_loss"]
            print(f"  {r['optimizer']:>7} lr {r['lr']:<7g} final val loss "
                  f"{'diverged' if v is None else f'{v:.4f}'}  ({r['mean_step_time_s'] * 1e3:.0f} ms/step)")
    command = " ".join(["python", "examples/lr_sweep.py", *(argv if argv is not None else sys.argv[1:])])
    hardware = {k: v for k, v in report.hardware().items() if k != "threads_per_rank"} | {
        "jobs": args.jobs, "threads_per_run": 1}
    wall_s = time.perf_counter() - start
    everyone = [o for o in OPTIMIZERS if o in optimizers or o in sources]
    corpus = results[0]["corpus"]
    if sources and old_corpus != corpus:
        print(f"error: --merge: {args.merge} was trained on another corpus ({old_corpus}, now {corpus})",
              file=sys.stderr)
        return 2
    results = [{k: v for k, v in r.items() if k != "corpus"} for r in results] + kept
    results.sort(key=lambda r: (everyone.index(r["optimizer"]), r["lr"]))
    record = {
        "command": command,
        "config": os.path.relpath(os.path.abspath(args.config), ROOT),
        "settings": settings,
        "criterion": "lowest validation loss after the last step",
        "grid": grid,
        "optimizers": everyone,
        "best": best_lrs(results, grid),
        "results": results,
        "corpus": corpus,
        "hardware": hardware,
        "wall_s": wall_s,
        "sources": {**sources, **{o: {"command": command, "hardware": hardware, "wall_s": wall_s} for o in optimizers}},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    md_path = os.path.splitext(args.out)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(markdown(record))
    print(markdown(record))
    for opt, b in record["best"].items():
        edge = "  (on the edge of the grid: widen it)" if b["at_edge"] else ""
        print(f"best {opt}: lr {b['lr']:g}{edge}" if b["lr"] is not None else f"best {opt}: every run diverged")
    print(f"{record['wall_s']:.0f} s; wrote {args.out} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
