"""Dion2 and NorDion2 through the Hugging Face integration (issue 40): ``build_muon`` /
``MuonFactory`` take Muon's ``dion2_fraction`` / ``dion2_ef_decay`` (and ``normuon_beta2`` for
NorDion2) as they take every Muon option, passed through.

* One step of a tiny Llama (random weights from a config, no download; float64) against the
  float64 reference written from the formulas (``tests/dion2_reference.py``): for every matrix of
  the Muon group the slices that moved are exactly the reference's chosen ones (every other slice
  is exactly ``W (1 - lr wd)``), the momentum is the reference's bit for bit, the weights within
  the Newton–Schulz bound (``tests/tolerances.py``); the AdamW part is untouched by Dion2.
* transformers' Trainer saves and resumes a NorDion2 run (``optimizer.pt`` read with
  ``weights_only=True``, as Trainer does): the resumed run equals the uninterrupted one bit for bit
  (losses, parameters, ``momentum_buffer``, ``normuon_v``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import dion2_reference as ref  # noqa: E402
import hf_models  # noqa: E402
from test_hf_trainer import Repeats, args, losses, muon_of  # noqa: E402
from tolerances import newton_schulz_atol, normuon_rtol, unit_roundoff  # noqa: E402
from transformers import Trainer  # noqa: E402

from optimizer.integrations.huggingface import MuonFactory, build_muon  # noqa: E402
from optimizer.newton_schulz import zeropower_via_newtonschulz  # noqa: E402
from optimizer.settings import DION2, kind_of  # noqa: E402

LR, WD = 0.02, 0.1
NS = dict(ns_coefficients="polar_express", ns_method="classic", ns_kernels="torch", ns_steps=5)
VARIANTS = {
    "dion2": dict(dion2_fraction=0.25, dion2_ef_decay=0.9),
    "nordion2": dict(dion2_fraction=0.5, dion2_ef_decay=0.8, normuon_beta2=0.9),
}


def _orth(x):
    """The reference's orthogonalisation: the project's classic fp64 iteration with the group's coefficients."""
    return zeropower_via_newtonschulz(x.contiguous(), ns_steps=NS["ns_steps"], coefficients=NS["ns_coefficients"],
                                      compute_dtype=torch.float64, method="classic", ns_kernels="torch")


def _moved(before, after, dim):
    moved = (after != before * (1 - LR * WD)).reshape(-1, *after.shape[-2:])
    along = moved.any(dim=-1) if dim == -2 else moved.any(dim=-2)
    return [torch.nonzero(row).flatten().tolist() for row in along]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_build_muon_builds_dion2_and_a_step_matches_the_formulas(variant):
    model = hf_models.llama_lm().double()
    opt = build_muon(model, lr=LR, weight_decay=WD, adjust_lr="spectral_norm", compute_dtype=torch.float64,
                     **NS, **VARIANTS[variant])
    muon = [g for g in opt.param_groups if g["use_muon"]]
    assert muon and all(kind_of(g) == DION2 for g in muon)
    assert all(g[k] == v for g in muon for k, v in VARIANTS[variant].items())
    assert all("dion2_fraction" not in g for g in opt.param_groups if not g["use_muon"])

    ids = Repeats()[0]["input_ids"][None]
    model(input_ids=ids, labels=ids).loss.backward()
    names = {p: n for n, p in model.named_parameters()}
    before = {p: p.detach().clone() for g in muon for p in g["params"]}
    grads = {p: p.grad.clone() for p in before}
    opt.step()
    nor = "normuon_beta2" in VARIANTS[variant]
    u64 = unit_roundoff(torch.float64)
    for p, w in before.items():
        r = ref.step(w, grads[p], torch.zeros_like(w), fraction=VARIANTS[variant]["dion2_fraction"],
                     ef_decay=VARIANTS[variant]["dion2_ef_decay"], lr=LR, weight_decay=WD, adjust_lr="spectral_norm",
                     orthogonalize=_orth, row_state=torch.zeros(*w.shape[:-1], 1, dtype=w.dtype) if nor else None,
                     beta2=VARIANTS[variant].get("normuon_beta2"))
        name = names[p]
        assert _moved(w, p.detach(), r.dim) == r.chosen, f"{name}: the slices that moved"
        assert torch.equal(opt.state[p]["momentum_buffer"], r.momentum), f"{name}: momentum"
        k = len(r.chosen[0])
        k_shape = (k, w.shape[-1]) if r.dim == -2 else (w.shape[-2], k)
        ns_atol = newton_schulz_atol(k_shape, torch.float64, ns_steps=NS["ns_steps"],
                                     coefficients=NS["ns_coefficients"], method="classic")
        scale, adjusted = float(r.update.abs().max()), ref.adjust(LR, w.shape, "spectral_norm")
        hat_rtol = normuon_rtol(k, w.shape[-1], torch.float64, VARIANTS[variant]["normuon_beta2"])[0] if nor else 0
        atol = 2 * u64 * float(w.abs().max() + adjusted * scale) + adjusted * (2 * ns_atol + hat_rtol * scale)
        torch.testing.assert_close(p.detach(), r.weight, atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")
        assert ("normuon_v" in opt.state[p]) == nor, name


def test_trainer_resumes_a_nordion2_run_bit_identically(tmp_path):
    """Trainer with MuonFactory building NorDion2: save at step 2, resume from the checkpoint
    (``optimizer.pt`` read with ``weights_only=True``), and the resumed run is the uninterrupted one."""
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "compute_dtype": torch.float32, **VARIANTS["nordion2"]}

    def trainer(out):
        return Trainer(model=hf_models.llama_lm(), args=args(out, save_strategy="steps", save_steps=2),
                       train_dataset=Repeats(), optimizer_cls_and_kwargs=(MuonFactory, kwargs))

    full = trainer(tmp_path / "full")
    full.train()
    assert all(kind_of(g) == DION2 for g in muon_of(full).param_groups if g["use_muon"])
    ckpt = tmp_path / "full" / "checkpoint-2"
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)  # what Trainer does on resume
    group = [g for g in saved["param_groups"] if g["use_muon"]][0]
    assert {k: group[k] for k in VARIANTS["nordion2"]} == VARIANTS["nordion2"]
    state = [saved["state"][i] for i in group["params"]]
    assert state and all({"momentum_buffer", "normuon_v"} <= set(s) for s in state)

    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 4 and len(losses(full)) == 4
    assert losses(resumed) == losses(full)
    for (n, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), n
    sa, sb = muon_of(full).state_dict()["state"], muon_of(resumed).state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for key, value in sa[k].items():
            assert torch.equal(value, sb[k][key]) if torch.is_tensor(value) else value == sb[k][key]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("WANDB_DISABLED", "true")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
