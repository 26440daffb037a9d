"""The mesh-config matrix: every configs/*.toml x QK-clip on/off under torchrun.

Muon's variants (NorMuon + cautious weight decay) run on every config in the forked fast path,
and under torchrun on ``fsdp_tp`` once.

The attention-variant configs (fused QKV, MLA) run under torchrun with QK-clip on only,
as issue 12 asks: the off case adds no code path the on case skips (it only drops the
row scaling), and each torchrun case costs ~15-30 s of CI.  The forked fast path runs
them both ways.

Each case launches ``examples/train.py`` with the config's world size, as a
user would, trains a few steps on synthetic data and checks (``--check``) that
every parameter matches the single-device Muon run fed the same gradients and
qk_logits, and that the loss fell.  The summary JSON is checked here too, so a
silently skipped check cannot pass.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from examples.config import config_world_size
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


QK_ON_ONLY = {"fused_qkv", "mla"}
TORCHRUN_CASES = [pytest.param(c, qk, id=f"{_config_id(c)}-{'qk_on' if qk else 'qk_off'}")
                  for c in CONFIGS for qk in (True, False) if qk or _config_id(c) not in QK_ON_ONLY]


def test_attention_variant_configs_are_in_the_matrix():
    assert QK_ON_ONLY <= {_config_id(c) for c in CONFIGS}
    assert {c.id for c in TORCHRUN_CASES} >= {"fused_qkv-qk_on", "mla-qk_on"}


@pytest.mark.torchrun
@pytest.mark.parametrize("config, qk", TORCHRUN_CASES)
def test_config_under_torchrun_matches_single_device(config, qk, tmp_path):
    world_size = config_world_size(config)
    summary_path = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
        os.path.join(ROOT, "examples", "train.py"), "--config", config, "--check",
        "--summary-out", str(summary_path), "--steps", str(MATRIX_STEPS),
    ]
    if not qk:
        cmd.append("--no-qk-clip")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-6000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-6000:]
        pytest.fail(f"{_config_id(config)} timed out after {CASE_TIMEOUT_S}s (hang?)\n{out}")
    log = (proc.stdout + proc.stderr)[-8000:]
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}\n{log}"
    summary = json.loads(summary_path.read_text())
    _check_summary(summary, world_size, qk, MATRIX_STEPS)


def _check_summary(summary, world_size, qk, steps):
    assert summary["world_size"] == world_size, summary
    assert summary["steps"] == steps and len(summary["losses"]) == steps, summary
    assert summary["qk_clip"] == qk, summary
    assert summary["max_param_deviation"] <= summary["tolerance"], summary
    assert summary["last_loss"] < summary["first_loss"], summary
    assert summary["passed"], summary
    if qk and summary["config"] in QK_ON_ONLY:  # the threshold is low enough that heads are clipped
        assert sum(summary["heads_clipped"]) > 0, summary


# NorMuon and cautious weight decay (with weight decay on: the configs train without it).
VARIANTS = dict(normuon_beta2=0.95, cautious_wd=True)
VARIANT_WEIGHT_DECAY = 0.1
VARIANT_FLAGS = ["--normuon-beta2", "0.95", "--cautious-wd", "--weight-decay", str(VARIANT_WEIGHT_DECAY)]


@pytest.mark.torchrun
def test_normuon_under_torchrun_matches_single_device(tmp_path):
    """One NorMuon + cautious-WD case as a user launches it (FSDP over TP: v's rows interleaved
    by _StridedShard, the row-wise weights sharded on their last dim); the forked fast path
    below runs every config."""
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


@pytest.mark.parametrize("qk", [True, False], ids=["qk_on", "qk_off"])
@pytest.mark.parametrize("config", CONFIGS, ids=[_config_id(c) for c in CONFIGS])
def test_config_fast_path_forked_ranks(config, qk):
    """The same check with forked gloo ranks (seconds, not tens of seconds): for quick
    iteration (`pytest -m "not torchrun"`); the torchrun matrix above stays in CI."""
    world_size = config_world_size(config)
    summaries = run_ranks(_train_forked, world_size, config, qk, timeout=240)
    _check_summary(summaries[0], world_size, qk, FAST_STEPS)


@pytest.mark.parametrize("config", CONFIGS, ids=[_config_id(c) for c in CONFIGS])
def test_config_fast_path_normuon_cautious_wd(config):
    """Every mesh config with NorMuon and cautious weight decay: every parameter within 1e-5 of
    single-device Muon with the same options (fp32)."""
    world_size = config_world_size(config)
    summaries = run_ranks(_train_forked, world_size, config, True, VARIANTS, timeout=240)
    _check_summary(summaries[0], world_size, True, FAST_STEPS)
    assert summaries[0]["muon_options"] == VARIANTS and summaries[0]["weight_decay"] == VARIANT_WEIGHT_DECAY
