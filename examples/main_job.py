"""The main job: Muon, NorMuon, Dion2 and AdamW on real text, on a sharded mesh, checked against one device.

    torchrun --nproc-per-node 4 examples/main_job.py [--config configs/main.toml]
        [--steps N] [--out-dir runs/main_job] [--tolerance 1e-5]

(``scripts/demo.sh`` runs exactly this.)  The example transformer learns to
predict the next byte of the CPython standard library's source and docs
(``examples/data.py``) on the config's mesh (FSDP2 over TP on 4 ranks for
``configs/main.toml``), four times, with the same model init, batches, steps and
learning-rate schedule:

1. **Muon** for the hidden matrices, AdamW for the rest, QK-clip per
   ``[qk_clip]`` (on in ``configs/main.toml``), at ``[train] lr``.  Its first ``[compare] check_steps`` steps run in lockstep with
   single-device Muon on rank 0 fed the same full gradients and ``qk_logits``;
   the largest deviation of any parameter is reported.
2. **NorMuon** (Muon with ``normuon_beta2=0.95``, ``examples.train.NORMUON_BETA2``), the same
   otherwise, at ``[compare] normuon_lr`` (no such run without it), checked the same way.
3. **Dion2** (Muon with ``dion2_fraction=DION2_FRACTION``, ``examples.train.DION2_FRACTION``, and
   Muon's ``adjust_lr``), QK-clip off (Muon refuses it with Dion2), at ``[compare] dion2_lr`` (no
   such run without it), checked against single-device Dion2.
4. **AdamW** (``torch.optim.AdamW``) for every parameter at ``[compare] adamw_lr``.

The runs take turns, one step each, so that a busy machine slows them alike
and their step times can be compared.

The learning rates are the best of the sweeps recorded in
``examples/results/lr_sweep.json`` and ``lr_sweep_dion2.json`` (``examples/lr_sweep.py``).  Rank 0 prints a
line every ``log_every`` steps, then a table (validation loss at equal steps and
at equal training seconds, step time, tokens/s, QK-clip, the agreement check),
and writes to ``--out-dir``: ``main_job.png`` (loss against steps and against
seconds), ``main_job.md`` (the table) and ``main_job.json`` (everything).

Exit status 1 when the Muon, NorMuon or Dion2 run deviates from the same optimizer on one device by more than
``--tolerance`` or a run's training or validation loss did not fall; 2 on a bad
config or argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make `examples` and `optimizer` importable
    _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [_ROOT, os.path.join(_ROOT, "torch-ext")]

from examples import report  # noqa: E402
from examples.config import ConfigError, RunConfig, load_config  # noqa: E402
from examples.train import DEFAULT_TOLERANCE, DION2_FRACTION, NORMUON_BETA2, Run, check  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "main.toml")
MUON_LABEL, NORMUON_LABEL, DION2_LABEL, ADAMW_LABEL = "Muon", "NorMuon", "Dion2", "AdamW"


def with_lr(cfg: RunConfig, lr: float) -> RunConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=lr))


def compare(cfg: RunConfig, steps: int | None = None, log=print) -> dict[str, dict]:
    """Train the Muon run, the NorMuon run (with ``[compare] normuon_lr``), the Dion2 run (with
    ``[compare] dion2_lr``) and the AdamW run on this rank, taking turns step by step (so that
    all see the same machine load); their summaries by label.

    Collective: every rank of the config's world must call it.
    """
    qk = f"QK-clip at {cfg.qk_clip.threshold:g}" if cfg.qk_clip.enabled else "QK-clip off"
    check_steps = cfg.compare.check_steps
    log(f"{MUON_LABEL}: Muon for matrices + AdamW for the rest, {qk}, lr {cfg.train.lr:g}; its first "
        f"{check_steps} steps are checked against single-device Muon")
    runs = [Run(cfg, steps, cfg.qk_clip.enabled, log=log, optimizer="muon", check_steps=check_steps,
                label=MUON_LABEL)]
    if cfg.compare.normuon_lr is not None:
        log(f"{NORMUON_LABEL}: the same with NorMuon (beta2 {NORMUON_BETA2:g}), lr {cfg.compare.normuon_lr:g}, "
            "checked against single-device NorMuon")
        runs.append(Run(with_lr(cfg, cfg.compare.normuon_lr), steps, cfg.qk_clip.enabled, log=log,
                        optimizer="normuon", check_steps=check_steps, label=NORMUON_LABEL))
    if cfg.compare.dion2_lr is not None:
        log(f"{DION2_LABEL}: Muon's groups with dion2_fraction {DION2_FRACTION:g} (Muon's adjust_lr), "
            f"QK-clip off (as in its lr sweep), lr {cfg.compare.dion2_lr:g}, checked against single-device Dion2")
        runs.append(Run(with_lr(cfg, cfg.compare.dion2_lr), steps, False, log=log, optimizer="dion2",
                        check_steps=check_steps, label=DION2_LABEL))
    log(f"{ADAMW_LABEL}: torch.optim.AdamW for every parameter, lr {cfg.compare.adamw_lr:g}")
    runs.append(Run(with_lr(cfg, cfg.compare.adamw_lr), steps, False, log=log, optimizer="adamw", check_steps=0,
                    label=ADAMW_LABEL))
    log(f"(the {len(runs)} runs take turns, a step each)")
    while not all(r.done for r in runs):
        for r in runs:
            if not r.done:
                r.step()
    return {r.label: r.summary() for r in runs}


def acceptance_problems(runs: dict[str, dict], tolerance: float) -> list[str]:
    """Why the job failed (empty when it passed): the Muon (and NorMuon) run must have been
    checked against single-device Muon and be within ``tolerance``; every run's
    training and validation loss must have fallen."""
    problems = []
    for label, s in runs.items():
        problems += check(s, tolerance, require_reference=(s["optimizer"] != "adamw"))
        if len(s["evals"]) < 2:
            problems.append(f"{label}: validation loss was measured {len(s['evals'])} times; "
                            "set [train] eval_every so that it is measured during training")
    return problems


def write_outputs(runs: dict[str, dict], cfg: RunConfig, out_dir: str, tolerance: float,
                  command: str, wall_s: float) -> dict[str, str]:
    """The figure, the table and the JSON summary; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"main_job.{k}") for k in ("png", "md", "json")}
    muon = runs[MUON_LABEL]
    mesh = " × ".join(f"{n} {d}" for n, d in muon["mesh"].items()) or "1 process"
    title = (f"Byte-level LM on the CPython stdlib ({muon['corpus']['python']}), {cfg.name}: {mesh}, "
             f"{muon['steps']} steps × {muon['tokens_per_step']} tokens; "
             + ", ".join(f"{label} lr {s['lr']:g}" for label, s in runs.items()))
    report.plot(runs, paths["png"], title)
    rows = report.comparison_rows(runs, tolerance)
    with open(paths["md"], "w") as f:
        f.write(report.markdown_table(rows) + "\n")
    summary = {
        "command": command,
        "config": dataclasses.asdict(cfg) | {"placements": None},
        "hardware": report.hardware(),
        "world_size": muon["world_size"],
        "job_wall_s": wall_s,
        "tolerance": tolerance,
        "table": rows,
        "runs": runs,
    }
    with open(paths["json"], "w") as f:
        json.dump(summary, f, indent=1)
    return paths


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="a configs/*.toml with [data] source = \"stdlib\" "
                    "and eval_every > 0 (default: configs/main.toml)")
    ap.add_argument("--steps", type=int, default=None, help="override [train] steps (the schedule follows)")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "main_job"),
                    help="where main_job.png/.md/.json go (default: runs/main_job)")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                    help="largest allowed |param - single-device Muon| after the checked steps")
    return ap.parse_args(argv)


def _validate(args, cfg: RunConfig) -> str | None:
    if args.steps is not None and args.steps < 1:
        return f"--steps must be >= 1, got {args.steps}"
    if not args.tolerance >= 0:
        return f"--tolerance must be >= 0, got {args.tolerance}"
    if cfg.data.source != "stdlib":
        return f"{cfg.name}: the main job trains on text; set [data] source = \"stdlib\""
    if not cfg.train.eval_every:
        return f"{cfg.name}: the main job compares validation loss; set [train] eval_every > 0"
    if cfg.compare.check_steps < 1:
        return f"{cfg.name}: [compare] check_steps must be >= 1 (the single-device agreement check)"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # Gathering FSDP-over-TP parameters ((_StridedShard, Shard)) for the agreement
    # check takes two all-gathers, and DTensor says so on every rank; the check's
    # speed does not matter, the job's output does.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    launched = "WORLD_SIZE" in os.environ  # torchrun
    world = int(os.environ["WORLD_SIZE"]) if launched else 1
    try:
        cfg = load_config(args.config, world_size=world)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problem = _validate(args, cfg)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if launched:
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    problems = []
    try:
        rank = dist.get_rank() if launched else 0
        log = print if rank == 0 else (lambda *_: None)
        start = time.perf_counter()
        runs = compare(cfg, steps=args.steps, log=log)
        wall_s = time.perf_counter() - start
        problems = acceptance_problems(runs, args.tolerance)
        if rank == 0:
            launcher = [f"torchrun --nproc-per-node {world}"] if launched else ["python"]
            command = " ".join(launcher + ["examples/main_job.py", *(sys.argv[1:] if argv is None else argv)])
            paths = write_outputs(runs, cfg, args.out_dir, args.tolerance, command, wall_s)
            print()
            print(report.text_table(report.comparison_rows(runs, args.tolerance)))
            print(f"\n{wall_s:.0f} s for the {len(runs)} runs; figure {paths['png']}, table {paths['md']}, "
                  f"summary {paths['json']}")
            for p in problems:
                print(f"CHECK FAILED: {p}")
            if not problems:
                checked = [label for label, s in runs.items() if s["check_steps"]]
                worst = max(runs[label]["max_param_deviation"] for label in checked)
                print(f"passed: {', '.join(checked)} on {world} ranks match the same optimizer on one device over "
                      f"their first {runs[MUON_LABEL]['check_steps']} steps (max deviation {worst:.1e} <= "
                      f"{args.tolerance:g}); every loss fell")
        if launched:
            dist.barrier()  # tear down together (see examples/train.py)
    finally:
        if launched:
            dist.destroy_process_group()
    return 1 if problems else 0


if __name__ == "__main__":
    from examples.torchrun_exit import exit_process

    exit_process(main())
