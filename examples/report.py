"""The main job's comparison: numbers at equal steps and equal wall time, a table, a figure.

Pure functions of the run summaries that :func:`examples.train.train` returns
(``evals``: validation loss with the step and the training seconds elapsed when
it was measured; ``losses`` and ``step_times_s`` per step).  Validation loss at a
time between two evaluations is interpolated linearly in elapsed seconds.
"""

from __future__ import annotations

import math
import os
import platform
import sys
from bisect import bisect_left

import torch

QUARTERS = (0.25, 0.5, 0.75, 1.0)


def interpolate(xs: list[float], ys: list[float], x: float) -> float | None:
    """Piecewise-linear ``y(x)`` through the points (``xs`` increasing); None outside them."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    i = bisect_left(xs, x)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def val_loss_at(summary: dict, *, step: int | None = None, seconds: float | None = None) -> float | None:
    """Validation loss at a step (an evaluated one) or at elapsed training seconds."""
    evals = summary["evals"]
    if step is not None:
        return next((e["val_loss"] for e in evals if e["step"] == step), None)
    return interpolate([e["elapsed_s"] for e in evals], [e["val_loss"] for e in evals], seconds)


def first_reaching(summary: dict, target: float, key: str) -> float | None:
    """The ``key`` ("step" or "elapsed_s") at which validation loss first falls to
    ``target``, interpolated between evaluations; None if it never does."""
    evals = summary["evals"]
    for prev, cur in zip(evals, evals[1:]):
        if cur["val_loss"] <= target:
            if prev["val_loss"] <= target:
                return prev[key]
            frac = (prev["val_loss"] - target) / (prev["val_loss"] - cur["val_loss"])
            return prev[key] + frac * (cur[key] - prev[key])
    return evals[0][key] if evals and evals[0]["val_loss"] <= target else None


def total_seconds(summary: dict) -> float:
    return sum(summary["step_times_s"])


def comparison_points(runs: dict[str, dict]) -> tuple[list[int], list[float]]:
    """Evaluated steps near each quarter of the run, and quarters of the shorter
    run's training time (at its end the longer run is mid-schedule)."""
    steps = min(s["steps"] for s in runs.values())
    evaluated = sorted(set.intersection(*({e["step"] for e in s["evals"]} for s in runs.values())) - {0})
    step_points = sorted({min(evaluated, key=lambda x: abs(x - q * steps)) for q in QUARTERS}) if evaluated else []
    shortest = min(total_seconds(s) for s in runs.values())
    return step_points, [q * shortest for q in QUARTERS]


def _seconds(t: float) -> str:
    return f"{t:.0f} s" if t >= 10 else f"{t:.2g} s"


def _fmt(x: float | None, spec: str = ".3f", none: str = "–") -> str:
    return none if x is None else format(x, spec)


def comparison_rows(runs: dict[str, dict], tolerance: float) -> list[tuple[str, ...]]:
    """Table rows (first row: header), one column per run, in the order given.

    The first run is the one compared against the last ("steps to reach the
    other's final validation loss").
    """
    labels = list(runs)
    summaries = list(runs.values())
    step_points, time_points = comparison_points(runs)
    rows = [("", *labels)]
    rows.append(("peak learning rate", *(f"{s['lr']:g}" for s in summaries)))
    first_eval = [s["evals"][0]["val_loss"] for s in summaries]
    rows.append(("val loss before training", *(_fmt(v) for v in first_eval)))
    for step in step_points:
        rows.append((f"val loss @ step {step}", *(_fmt(val_loss_at(s, step=step)) for s in summaries)))
    for t in time_points:
        rows.append((f"val loss @ {_seconds(t)}", *(_fmt(val_loss_at(s, seconds=t)) for s in summaries)))
    target_label, target = labels[-1], summaries[-1]["evals"][-1]["val_loss"]
    rows.append((f"steps to {target_label}'s final val loss ({target:.3f})",
                 *(_fmt(first_reaching(s, target, "step"), ".0f", "not reached") for s in summaries)))
    rows.append((f"seconds to {target_label}'s final val loss",
                 *(_fmt(first_reaching(s, target, "elapsed_s"), ".1f", "not reached") for s in summaries)))
    rows.append(("training time (s)", *(f"{total_seconds(s):.1f}" for s in summaries)))
    rows.append(("mean step time (ms)", *(f"{s['mean_step_time_s'] * 1e3:.0f}" for s in summaries)))
    rows.append(("tokens/s", *(f"{s['tokens_per_step'] / s['mean_step_time_s']:.0f}" for s in summaries)))
    rows.append(("QK-clip: heads clipped (steps with a clip)",
                 *((f"{sum(s['heads_clipped'])} ({sum(1 for c in s['heads_clipped'] if c)})" if s["qk_clip"]
                    else "off") for s in summaries)))
    rows.append(("max QK logit: first step / highest / last step",
                 *(f"{s['max_qk_logit'][0]:.1f} / {max(s['max_qk_logit']):.1f} / {s['max_qk_logit'][-1]:.1f}"
                   for s in summaries)))
    rows.append((f"largest deviation from the same optimizer on one device (tolerance {tolerance:g})",
                 *((f"{s['max_param_deviation']:.1e} ({s['check_steps']} steps)" if s["check_steps"] else "not run")
                   for s in summaries)))
    return rows


def markdown_table(rows: list[tuple[str, ...]]) -> str:
    header, *body = rows
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def text_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (training losses are per batch, noisy)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(runs: dict[str, dict], path: str, title: str) -> None:
    """Training (moving average) and validation loss against steps and against seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for (label, s), color in zip(runs.items(), colors):
        steps = list(range(1, len(s["losses"]) + 1))
        seconds, t = [], 0.0
        for dt in s["step_times_s"]:
            t += dt
            seconds.append(t)
        smooth = moving_average(s["losses"], max(len(steps) // 30, 1))
        val_steps = [e["step"] for e in s["evals"]]
        val_secs = [e["elapsed_s"] for e in s["evals"]]
        vals = [e["val_loss"] for e in s["evals"]]
        for ax, x, vx in ((axes[0], steps, val_steps), (axes[1], seconds, val_secs)):
            ax.plot(x, smooth, color=color, alpha=0.45, lw=1, label=f"{label} train (moving avg)")
            ax.plot(vx, vals, color=color, marker="o", ms=3.5, lw=1.8, label=f"{label} validation")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training seconds (forward + backward + optimizer step)")
    axes[0].set_ylabel("loss (nats per byte)")
    # The first steps fall from ~6 nats to ~2.7 within a few dozen steps; the
    # comparison happens below the first evaluation after step 0.
    first_evals = [s["evals"][1]["val_loss"] for s in runs.values() if len(s["evals"]) > 1]
    top = max(first_evals) + 0.15 if first_evals else None
    for ax in axes:
        ax.grid(alpha=0.3)
        if top is not None and math.isfinite(top):
            ax.set_ylim(top=min(top, ax.get_ylim()[1]))
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def hardware() -> dict:
    """What the run ran on (for the README)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "threads_per_rank": torch.get_num_threads(),
    }


# ------------------------------------------------------------------ the recorded run in the docs


def recorded_blocks(results_dir: str) -> dict[str, str]:
    """The Markdown blocks that show the recorded main job and sweep (``scripts/gen_docs.py`` puts
    each between its markers, ``<!-- main-job-table -->`` ... ``<!-- /main-job-table -->``, in
    README.md and docs/)."""
    import json

    with open(os.path.join(results_dir, "main_job.json")) as f:
        job = json.load(f)
    with open(os.path.join(results_dir, "lr_sweep.md")) as f:
        sweep_table = f.read()
    with open(os.path.join(results_dir, "lr_sweep_dion2.md")) as f:
        dion2_sweep_table = f.read()
    hw = job["hardware"]
    hardware = (f"Hardware: {hw['cpu']}, {hw['cpu_count']} cores, {hw['platform']}; torch {hw['torch']}, "
                f"CPython {hw['python']}; gloo, {job['world_size']} ranks with {hw['threads_per_rank']} thread "
                f"each. The {len(job['runs'])} runs together took {job['job_wall_s']:.0f} s.")
    return {
        "main-job-table": markdown_table(comparison_rows(job["runs"], job["tolerance"])),
        "main-job-hardware": hardware,
        "lr-sweep-table": sweep_table,
        "lr-sweep-dion2-table": dion2_sweep_table,
    }


if __name__ == "__main__":
    # python examples/report.py: refresh the docs' tables from examples/results/ after a new run
    # (the same as python scripts/gen_docs.py, which regenerates every generated block)
    import runpy

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.argv = [os.path.join(_root, "scripts", "gen_docs.py")]
    runpy.run_path(sys.argv[0], run_name="__main__")
