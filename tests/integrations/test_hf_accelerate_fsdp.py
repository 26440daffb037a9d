"""accelerate's own FSDP2 prepare path with ``optimizer.Muon`` (issue 23), on CPU over gloo, against one process.

On 2 and 4 forked ranks: a tiny random-init Hugging Face model, ``build_muon(model, ...)`` built before
``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...)).prepare(model, opt)`` as
accelerate requires (it shards the model with ``fully_shard``, then switches the optimizer's groups to the
sharded DTensor parameters: ``fsdp2_switch_optimizer_parameters``), a few training steps with every rank
on its own slice of one fixed global batch. Each slice has the same number of tokens, so FSDP's averaged
gradient is the whole batch's gradient; every parameter, gathered with ``full_tensor()``, must equal a
plain one-process run of the same model and optimizer on the whole batch (same init,
``compute_dtype=torch.float32``), to fp32 reductions in another order. The first step's gradients are
compared too: Muon's update (and nearly AdamW's) is invariant to the gradient's scale, so a data-parallel
sum in place of a mean would not show in the parameters.

Measured (max |distributed - one process| after 3 steps, all parameters and the Muon-updated ones; first
step's gradients; the gloo reductions are deterministic, so these do not vary from run to run):

==================================  =====  ==========  ======  ================
case                                ranks  parameters  Muon    first-step grads
==================================  =====  ==========  ======  ================
llama, FSDP                         2      1.2e-7      1.1e-7  2.6e-8
llama, FSDP                         4      1.9e-7      9.3e-8  3.7e-8
mixtral (fused experts), FSDP       2      1.1e-6      1.6e-7  3.7e-8
mixtral (fused experts), FSDP       4      8.6e-7      1.2e-7  4.5e-8
llama, FSDP, QK-clip                4      1.8e-7      9.9e-8  3.7e-8
llama, HSDP 2 x 2 mesh, QK-clip     4      2.2e-7      9.7e-8  3.4e-8
==================================  =====  ==========  ======  ================

The largest, mixtral's, are in its AdamW-updated router weights (``mlp.gate``), whose gradients are
~1e-4: Adam's ``m / sqrt(v)`` turns their last-bit differences into ~1e-6 of update over 3 steps.
Tolerance: atol 2e-6 on parameters, 2e-7 on gradients. QK-clip clips 8, 5, 1 heads in the 3 steps,
the same in both runs. Tests of the test (below): one rank's slice shifted by one sequence puts every
parameter off (max 0.12) and the gradients (0.14); one weight left out of the step, every parameter
(max 0.03). (Not kept as tests: a data-parallel sum in place of the mean moves the parameters by only
2.5e-4, since Muon is scale-invariant, but the gradients by 0.16; a recorder that does not reduce over
the ranks makes ``Muon.step`` raise "qk_logits differ between ranks".)

The shim. accelerate 1.15 gates FSDP to accelerators in one place: ``AcceleratorState.__init__`` turns
the process's distributed type into ``DistributedType.FSDP`` (and keeps the plugin) only when it is one
of ``MULTI_GPU`` / ``MULTI_NPU`` / ``MULTI_XPU`` / ... ; a CPU process (``Accelerator(cpu=True)`` with a
process group: ``DistributedType.MULTI_CPU``) keeps ``MULTI_CPU``, silently ignores the plugin, and
``prepare`` wraps the model in DDP. :func:`_fsdp_on_cpu` wraps ``AcceleratorState.__init__`` to take that
branch for ``MULTI_CPU`` too (the same three assignments). It must act inside the constructor, not after
it: ``Accelerator.__init__`` goes on to validate a ``ParallelismConfig`` against ``is_fsdp2`` (a 2-D
mesh is refused for ``MULTI_CPU``). Nothing else is patched: from there on ``Accelerator.prepare`` runs
its FSDP2 path unchanged (``_prepare_fsdp2`` -> ``fsdp2_prepare_model`` -> ``fully_shard`` on the default
CPU mesh or the ``ParallelismConfig``'s CPU mesh -> ``fsdp2_switch_optimizer_parameters``). In
particular no ``set_force_sum_reduction_for_comms`` is needed: FSDP2 reduce-scatters fp32 gradients
with ``ReduceOp.AVG`` unless a gradient divide factor is set (accelerate sets none; torchtitan does,
which is what needs ``PREMUL_SUM``, which gloo lacks), and gloo has AVG. The shim is applied in the
forked ranks only (each rank is a process of its own), so nothing is patched in the pytest process.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_models  # noqa: E402
from harness import run_ranks  # noqa: E402

from optimizer.integrations.huggingface import MaxLogitRecorder, build_muon  # noqa: E402

SEQ = 12
BATCH = 8  # global batch: 4 sequences per rank on 2 ranks, 2 on 4
STEPS = 3
PARAM_TOL = {"atol": 2e-6, "rtol": 0.0}
GRAD_TOL = {"atol": 2e-7, "rtol": 0.0}


def global_batch() -> torch.Tensor:
    """Sequences repeating a random 4-token motif (no padding: every sequence has SEQ - 1 targets)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, hf_models.VOCAB, (BATCH, 4), generator=g).repeat(1, SEQ // 4)


def scaled(build):
    """q/k weights x6: attention logits large enough for a QK-clip threshold to bite (as test_hf_trainer)."""
    model = build()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(6.0)
    return model


def qk_threshold(build) -> float:
    """Half the largest max logit of the initial model on the whole batch: some heads are clipped."""
    model = scaled(build)
    recorder = MaxLogitRecorder(model)
    model(input_ids=global_batch())
    threshold = 0.5 * max(float(v.max()) for v in recorder().values())
    recorder.remove()
    return threshold


def muon_options(qk_clip):
    options = {"lr": 0.02, "weight_decay": 0.1, "compute_dtype": torch.float32}
    if qk_clip is not None:
        options["qk_clip"] = qk_clip
    return options


def train(model, opt, ids, backward, gathered, sabotage=None):
    """STEPS steps on ``ids``; returns the first step's gradients and each step's number of clipped heads."""
    muon = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps it
    grads, clipped = None, []
    for step in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        backward(loss)
        if step == 0:
            grads = {n: gathered(p.grad).detach().clone() for n, p in model.named_parameters()}
        if sabotage == "skip_one_param":  # test of the test: one weight never updated
            model.get_parameter("model.layers.0.mlp.down_proj.weight").grad = None
        opt.step()
        opt.zero_grad()
        report = muon.qk_clip_report
        clipped.append(None if report is None else int(report.total_clipped))
    return grads, clipped


def one_process(build, qk_clip):
    model = scaled(build)
    opt = build_muon(model, **muon_options(qk_clip))
    grads, clipped = train(model, opt, global_batch(), lambda loss: loss.backward(), lambda t: t)
    if qk_clip is not None:
        opt.qk_logits_recorder.remove()
    return {n: p.detach() for n, p in model.named_parameters()}, grads, clipped


def _fsdp_on_cpu():
    """The shim (see the module docstring): a CPU process with an FSDP plugin is an FSDP process."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    # A fresh accelerate state in this rank: the parent pytest process may hold one from an earlier test
    # (accelerate keeps it in class-level shared dicts, which fork copies).
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    original = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # what AcceleratorState.__init__ does for MULTI_GPU & co. (mixed precision stays "no" here)
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = __init__


def _rank(rank, world_size, build, qk_clip, mesh, sabotage):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig
    from torch.distributed.tensor import DTensor

    os.environ["OMP_NUM_THREADS"] = "1"  # else accelerate's MULTI_CPU setup resets torch's thread count
    _fsdp_on_cpu()
    model = scaled(build)
    opt = build_muon(model, **muon_options(qk_clip))  # before prepare, as accelerate requires
    accelerator = Accelerator(
        cpu=True,
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap"),
        parallelism_config=None if mesh is None else ParallelismConfig(**mesh),
    )
    assert accelerator.is_fsdp2
    model, opt = accelerator.prepare(model, opt)

    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values())
    # the optimizer now holds exactly the model's sharded parameters
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in params.values()}
    placements = {str(p.placements) for p in params.values()}

    ids = global_batch()
    share = BATCH // world_size
    start = rank * share
    if sabotage == "wrong_slice" and rank == world_size - 1:  # test of the test: one rank's data is off
        start -= 1
    grads, clipped = train(model, opt, ids[start:start + share], accelerator.backward,
                           lambda t: t.full_tensor(), sabotage)
    if qk_clip is not None:
        opt.optimizer.qk_logits_recorder.remove()
    return {n: p.full_tensor().detach() for n, p in params.items()}, grads, clipped, placements


def deviations(build, world_size, qk=False, mesh=None, sabotage=None):
    qk_clip = qk_threshold(build) if qk else None
    want, want_grads, want_clipped = one_process(build, qk_clip)
    results = run_ranks(_rank, world_size, build, qk_clip, mesh, sabotage, timeout=120)
    return want, want_grads, want_clipped, results


CASES = {  # id: (model, ranks, QK-clip, ParallelismConfig sizes, expected placements)
    "llama-fsdp2": (hf_models.llama_lm, 2, False, None, "(Shard(dim=0),)"),
    "llama-fsdp4": (hf_models.llama_lm, 4, False, None, "(Shard(dim=0),)"),
    "mixtral-fsdp2": (hf_models.mixtral, 2, False, None, "(Shard(dim=0),)"),
    "mixtral-fsdp4": (hf_models.mixtral, 4, False, None, "(Shard(dim=0),)"),
    "llama-fsdp4-qkclip": (hf_models.llama_lm, 4, True, None, "(Shard(dim=0),)"),
    "llama-hsdp2x2-qkclip": (hf_models.llama_lm, 4, True, {"dp_replicate_size": 2, "dp_shard_size": 2},
                             "(Replicate(), Shard(dim=0))"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_accelerate_fsdp2_prepare_matches_one_process(case):
    build, world_size, qk, mesh, placement = CASES[case]
    want, want_grads, want_clipped, results = deviations(build, world_size, qk, mesh)
    for params, grads, clipped, placements in results:
        assert placements == {placement}
        for name, ref in want_grads.items():
            torch.testing.assert_close(grads[name], ref, **GRAD_TOL, msg=lambda m, name=name: f"grad of {name}: {m}")
        for name, ref in want.items():
            torch.testing.assert_close(params[name], ref, **PARAM_TOL, msg=lambda m, name=name: f"{name}: {m}")
        # QK-clip: the recorder max-reduces every rank's logits over the world, so each step clips the
        # heads the one-process run clips
        assert clipped == want_clipped
    if qk:
        assert want_clipped[0] > 0 and all(c is not None for c in want_clipped)


@pytest.mark.parametrize("sabotage", ["wrong_slice", "skip_one_param"])
def test_the_comparison_fails_when_a_rank_trains_on_other_data_or_a_weight_is_not_stepped(sabotage):
    """Test of the test: one rank's slice shifted by one sequence, or one weight left out of the step."""
    want, want_grads, _, results = deviations(hf_models.llama_lm, 2, sabotage=sabotage)
    params, grads = results[0][:2]
    worst = max(float((params[n] - want[n]).abs().max()) for n in want)
    assert worst > 100 * PARAM_TOL["atol"], worst
    with pytest.raises(AssertionError):
        for name, ref in want.items():
            torch.testing.assert_close(params[name], ref, **PARAM_TOL)
    if sabotage == "wrong_slice":  # the averaged gradient is not the whole batch's
        assert max(float((grads[n] - want_grads[n]).abs().max()) for n in want) > 100 * GRAD_TOL["atol"]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
