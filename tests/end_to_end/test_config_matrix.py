"""The mesh-config matrix: every configs/*.toml x QK-clip on/off under torchrun.

Muon's variants (NorMuon + cautious weight decay) run on every config in the forked fast path,
and under torchrun on ``fsdp_tp`` once.

The Dion2 configs (``[muon] dion2_fraction``): Dion2 on HSDP with QK-clip off (a config that
turns it off runs with QK-clip off only), NorDion2 on FSDP+TP with QK-clip on (under torchrun with
it on only, like the attention variants below); their summaries must say that the optimizer had
Dion2 groups (``group_kinds``), so a ``[muon]`` option that did not reach it cannot pass.

The attention-variant configs (fused QKV, MLA) run under torchrun with QK-clip on only,
as issue 12 asks: the off case adds no code path the on case skips (it only drops the
row scaling), and each torchrun case costs ~15-30 s of CI.  The forked fast path runs
them both ways.

Each case runs ``examples/train.py``'s ``main`` with the config's world size under torchrun, with
the arguments a user would give it, trains a few steps on synthetic data and checks (``--check``)
that every parameter matches the single-device Muon run fed the same gradients and qk_logits, and
that the loss fell.  The summary JSON is checked here too, so a silently skipped check cannot
pass.  Cases of one world size share a torchrun launch (``examples/train_cases.py``; see "the
torchrun launches" below); the NorMuon + cautious-WD case launches ``examples/train.py`` itself,
so its own process-group start, teardown and exit stay under test.

    CONFIG_MATRIX_CASES=fsdp_tp-qk_on pytest tests/end_to_end/test_config_matrix.py -m torchrun   # one case
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from examples.config import config_world_size, load_config
from harness import run_ranks
from repo import REPO

ROOT = str(REPO)
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))
CASE_TIMEOUT_S = 420
# Enough steps for momentum, several QK-clips and a clearly falling loss; the
# configs' own 24 steps are for the demo.
MATRIX_STEPS = 12
FAST_STEPS = 4


def _config_id(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


QK_ON_ONLY = {"fused_qkv", "mla", "nordion2_fsdp_tp"}


def _qk_clip_enabled(config: str) -> bool:
    """Whether a config turns QK-clip on ([qk_clip] enabled); one that does not runs with it off only."""
    return load_config(config).qk_clip.enabled


def _dion2(config: str) -> dict:
    """A config's [muon] group options (Dion2, NorDion2): {} for Muon."""
    return load_config(config).muon.group_options()


TORCHRUN_CASES = [pytest.param(c, qk, id=f"{_config_id(c)}-{'qk_on' if qk else 'qk_off'}")
                  for c in CONFIGS for qk in (True, False)
                  if (qk or _config_id(c) not in QK_ON_ONLY) and (not qk or _qk_clip_enabled(c))]

# NorMuon and cautious weight decay (with weight decay on: the configs train without).
VARIANTS = dict(normuon_beta2=0.95, cautious_wd=True)
VARIANT_WEIGHT_DECAY = 0.1
VARIANT_FLAGS = ["--normuon-beta2", "0.95", "--cautious-wd", "--weight-decay", str(VARIANT_WEIGHT_DECAY)]


def test_attention_variant_configs_are_in_the_matrix():
    assert QK_ON_ONLY <= {_config_id(c) for c in CONFIGS}
    assert {c.id for c in TORCHRUN_CASES} >= {"fused_qkv-qk_on", "mla-qk_on"}


def test_dion2_and_nordion2_configs_are_in_the_matrix():
    """Issue 40: a Dion2 case and a NorDion2 case, on two meshes, under torchrun."""
    dion2 = {_config_id(c): _dion2(c) for c in CONFIGS if _dion2(c).get("dion2_fraction") is not None}
    assert any("normuon_beta2" not in o for o in dion2.values()), dion2  # Dion2
    assert any("normuon_beta2" in o for o in dion2.values()), dion2  # NorDion2
    meshes = {load_config(os.path.join(ROOT, "configs", f"{name}.toml")).mesh for name in dion2}
    assert len(meshes) >= 2, dion2
    assert {"dion2_hsdp-qk_off", "nordion2_fsdp_tp-qk_on"} <= {c.id for c in TORCHRUN_CASES}


# ------------------------------------------------------------------ the torchrun launches
#
# A launch's start-up (every rank importing torch and DTensor: ~3 s of a CPU core per rank with
# bytecode cached, ~9 s without) costs more than a case's training, so the cases of one world size
# share one launch (at most LAUNCH_MAX_CASES cases: the 14 cases of 4 ranks in one launch cost 23 s
# of CPU less than in three, 2026-11-28; examples/train_cases.py runs each through train.py's own
# main(argv), in order, in the launch's one process group; its summary is the same to the bit as a
# launch of its own). The test is parametrized by launch: one test item per launch, so pytest-xdist
# runs each launch once, anywhere, and `-p no:xdist` runs them in turn. Every case's checks run and
# a failure names its case. One case alone: CONFIG_MATRIX_CASES=fsdp_tp-qk_on (comma-separated case
# ids) makes the launches of those cases only.
LAUNCH_MAX_CASES = 16


def _launch_timeout_s(n_cases: int) -> int:
    """A hang's bound: a launch's first case as a launch of its own was given, and 150 s for each
    further case (a case takes 15-80 s on 2 loaded cores, the launch's start-up 20-40 s)."""
    return CASE_TIMEOUT_S + 150 * (n_cases - 1)


def _all_cases() -> dict[str, tuple[str, list[str]]]:
    """Every torchrun case of the matrix: id -> (config, train.py's flags besides the config's)."""
    return {c.id: (c.values[0], [] if c.values[1] else ["--no-qk-clip"]) for c in TORCHRUN_CASES}


def _selected_cases() -> dict[str, tuple[str, list[str]]]:
    cases = _all_cases()
    chosen = [c.strip() for c in os.environ.get("CONFIG_MATRIX_CASES", "").split(",") if c.strip()]
    unknown = [c for c in chosen if c not in cases]
    if unknown:
        raise pytest.UsageError(f"CONFIG_MATRIX_CASES: unknown case(s) {unknown}; the cases are {sorted(cases)}")
    return {c: v for c, v in cases.items() if c in chosen} if chosen else cases


def _launches(cases: dict[str, tuple[str, list[str]]]) -> list[list[str]]:
    """The cases of each world size in as few launches of at most LAUNCH_MAX_CASES as there can be,
    as even as they can be (case ids, in the matrix's order within a launch)."""
    by_world: dict[int, list[str]] = {}
    for case_id, (config, _) in cases.items():
        by_world.setdefault(config_world_size(config), []).append(case_id)
    launches = []
    for ids in by_world.values():
        n = -(-len(ids) // LAUNCH_MAX_CASES)
        launches += [ids[i::n] for i in range(n)]
    return launches


def test_launches_hold_every_case_once_each_of_one_world_size():
    cases = _all_cases()
    worlds = {case_id: config_world_size(config) for case_id, (config, _) in cases.items()}
    launches = _launches(cases)
    assert sorted(c for launch in launches for c in launch) == sorted(cases)
    assert all(0 < len(launch) <= LAUNCH_MAX_CASES for launch in launches)
    assert all(len({worlds[c] for c in launch}) == 1 for launch in launches)
    per_world = [list(worlds.values()).count(w) for w in set(worlds.values())]
    assert len(launches) == sum(-(-n // LAUNCH_MAX_CASES) for n in per_world)  # as few as there can be


@pytest.mark.torchrun
@pytest.mark.parametrize("launch", [pytest.param(ids, id="+".join(ids), marks=pytest.mark.timeout(_launch_timeout_s(len(ids)) + 60))
                                    for ids in _launches(_selected_cases())])
def test_config_under_torchrun_matches_single_device(launch, tmp_path):
    cases = _all_cases()
    world_size = config_world_size(cases[launch[0]][0])
    summaries = {case_id: tmp_path / f"{case_id}.json" for case_id in launch}
    # each case's train.py arguments, as a user would type them after `torchrun ... examples/train.py`
    argvs = {case_id: ["--config", cases[case_id][0], "--check", "--summary-out", str(summaries[case_id]),
                       "--steps", str(MATRIX_STEPS), *cases[case_id][1]] for case_id in launch}
    cases_path, results_path = tmp_path / "cases.json", tmp_path / "results.json"
    cases_path.write_text(json.dumps(argvs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           os.path.join(ROOT, "examples", "train_cases.py"), str(cases_path), str(results_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    timeout = _launch_timeout_s(len(launch))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        returncode, stdout = proc.returncode, proc.stdout
        log = f"torchrun exited {proc.returncode}\n" + (proc.stdout + proc.stderr)[-8000:]
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        returncode, log = None, f"the launch timed out after {timeout}s (hang?)\n{stdout[-6000:]}"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    failures = []
    stopped_in = next((case_id for case_id in launch if case_id not in results), None)
    for case_id in launch:
        if case_id == stopped_in:
            failures.append(f"{case_id}: not finished: the launch stopped in it (the log below says why)")
        elif case_id not in results:
            failures.append(f"{case_id}: not run: the launch stopped in {stopped_in}")
        elif results[case_id] != 0:
            failures.append(f"{case_id}: train.py's main returned {results[case_id]}; its output ends:\n"
                            + _case_output(stdout, case_id)[-3000:])
        else:
            try:
                summary = json.loads(summaries[case_id].read_text())
                _check_summary(summary, world_size, "--no-qk-clip" not in cases[case_id][1], MATRIX_STEPS,
                               cases[case_id][0])
            except (AssertionError, OSError, ValueError) as e:
                failures.append(f"{case_id}: {type(e).__name__}: {e}")
    assert not failures, "failed case(s) of this launch:\n" + "\n".join(failures) + f"\n\n{log}"
    assert returncode == 0, log


def _case_output(stdout: str, case_id: str) -> str:
    """What a launch printed for one case: the lines after the previous case's closing line
    (examples/train_cases.py's "== case NAME: exit status N") up to its own."""
    end = stdout.find(f"== case {case_id}: exit status")
    start = stdout.rfind("== case ", 0, max(end, 0))
    return stdout[(stdout.find("\n", start) + 1) if start >= 0 else 0:end if end >= 0 else None]


def _check_summary(summary, world_size, qk, steps, config=None):
    assert summary["world_size"] == world_size, summary
    if config is not None:  # the config's [muon] options reached the optimizer (and only Dion2 makes Dion2 groups)
        options = _dion2(config)
        assert summary["muon_group_options"] == options, summary["muon_group_options"]
        dion2 = options.get("dion2_fraction") is not None
        assert summary["group_kinds"] == (["AdamW", "Dion2"] if dion2 else ["AdamW", "Muon"]), summary["group_kinds"]
    assert summary["steps"] == steps and len(summary["losses"]) == steps, summary
    assert summary["qk_clip"] == qk, summary
    assert summary["max_param_deviation"] <= summary["tolerance"], summary
    assert summary["last_loss"] < summary["first_loss"], summary
    assert summary["passed"], summary
    if qk and summary["config"] in QK_ON_ONLY:  # the threshold is low enough that heads are clipped
        assert sum(summary["heads_clipped"]) > 0, summary


@pytest.mark.torchrun
def test_normuon_under_torchrun_matches_single_device(tmp_path):
    """One NorMuon + cautious-WD case as a user launches it, `torchrun examples/train.py` itself (FSDP
    over TP: v's rows interleaved by _StridedShard, the row-wise weights sharded on their last dim);
    the forked fast path below runs every config. The one matrix case launched through train.py's
    own start and end (its process group, its exit), which the shared launches above do not run."""
    config = os.path.join(ROOT, "configs", "fsdp_tp.toml")
    summary_path = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={config_world_size(config)}",
           os.path.join(ROOT, "examples", "train.py"), "--config", config, "--check", "--summary-out",
           str(summary_path), "--steps", str(MATRIX_STEPS), *VARIANT_FLAGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    summary = json.loads(summary_path.read_text())
    _check_summary(summary, config_world_size(config), True, MATRIX_STEPS)
    assert summary["muon_options"] == VARIANTS and summary["weight_decay"] == VARIANT_WEIGHT_DECAY


def _train_forked(rank, world_size, config, qk, muon_options=None):
    import dataclasses

    from examples.config import load_config
    from examples.train import DEFAULT_TOLERANCE, check, train

    cfg = load_config(config, world_size=world_size)
    if muon_options:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, weight_decay=VARIANT_WEIGHT_DECAY))
    summary = train(cfg, steps=FAST_STEPS, use_qk_clip=qk, log=lambda *_: None, muon_options=muon_options)
    summary["tolerance"] = DEFAULT_TOLERANCE
    summary["passed"] = not check(summary, DEFAULT_TOLERANCE)
    return summary


# The forked fast path's cases of one config: QK-clip on and off, and NorMuon + cautious weight
# decay (QK-clip on), each a train() of its own, one after another in one launch (a launch's first
# run pays DTensor's cold caches: one launch per config, not three, saved 24 s of CPU in all, 2026-11-28).
# A config that turns QK-clip off (the Dion2 ones) runs the cases without it.
FAST_CASES = {"qk_on": (True, None), "qk_off": (False, None), "normuon_cautious_wd": (True, VARIANTS)}


def _fast_cases(config: str) -> dict:
    if _qk_clip_enabled(config):
        return FAST_CASES
    return {case: (False, options) for case, (qk, options) in FAST_CASES.items() if case != "qk_on"}


def _train_cases_forked(rank, world_size, config):
    return {case: _train_forked(rank, world_size, config, qk, options)
            for case, (qk, options) in _fast_cases(config).items()}


@pytest.mark.parametrize("config", CONFIGS, ids=[_config_id(c) for c in CONFIGS])
def test_config_fast_path_forked_ranks(config):
    """The same checks with forked gloo ranks (seconds, not tens of seconds), QK-clip on and off, for
    quick iteration (`pytest -m "not torchrun"`; the torchrun matrix above stays in CI); and every
    mesh config with NorMuon and cautious weight decay: every parameter within 1e-5 of single-device
    Muon with the same options (fp32). Every case is checked; a failure names its case."""
    world_size = config_world_size(config)
    summaries = run_ranks(_train_cases_forked, world_size, config, timeout=240)[0]
    failures = []
    for case, (qk, options) in _fast_cases(config).items():
        summary = summaries[case]
        try:
            _check_summary(summary, world_size, qk, FAST_STEPS, config)
            if options:
                assert summary["muon_options"] == options and summary["weight_decay"] == VARIANT_WEIGHT_DECAY, summary
        except AssertionError as e:
            failures.append(f"{_config_id(config)}-{case}: {e}")
    assert not failures, "failed case(s):\n" + "\n".join(failures)
