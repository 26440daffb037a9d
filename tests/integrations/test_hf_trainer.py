"""transformers' Trainer and an accelerate loop with optimizer.Muon through MuonFactory / build_muon:
training, save + resume_from_checkpoint (Trainer reads optimizer.pt with weights_only=True) continuing
bit-identically with row-block specs in the groups, and QK-clip with no change to the loop (the
recorder is handed to ``Muon.set_qk_logits_source``)."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_models  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_optimizer import is_optimizer_factory  # noqa: E402

from optimizer import Muon  # noqa: E402
from optimizer.integrations.huggingface import MaxLogitRecorder, MuonFactory, build_muon  # noqa: E402
from optimizer.attention_layouts import FusedQKV  # noqa: E402
from optimizer.row_blocks import SplitQKV, from_checkpoint, spec_to_plain  # noqa: E402

SEQ = 12


class Repeats(torch.utils.data.Dataset):
    """Token sequences that repeat a short random motif: next-token loss falls quickly."""

    def __init__(self, n=16, seed=0, vocab=hf_models.VOCAB):
        g = torch.Generator().manual_seed(seed)
        motifs = torch.randint(3, vocab, (n, 4), generator=g)
        self.ids = motifs.repeat(1, SEQ // 4)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.ids[i]}


class Labelled(Repeats):
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": int(self.ids[i, 0]) % 3}


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=1,
                save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                dataloader_num_workers=0, lr_scheduler_type="constant")
    base.update(kw)
    return TrainingArguments(**base)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def muon_of(trainer) -> Muon:
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps it
    assert isinstance(opt, Muon)
    return opt


def test_muon_factory_is_a_trainer_factory():
    assert is_optimizer_factory(MuonFactory)  # Trainer calls MuonFactory()(model, **kwargs)


@pytest.mark.parametrize("build", [hf_models.llama_lm, hf_models.lora_seq_cls], ids=["llama_lm", "lora_seq_cls"])
def test_trainer_trains(build, tmp_path):
    model = build()
    data = Labelled() if build is hf_models.lora_seq_cls else Repeats()
    trainer = Trainer(model=model, args=args(tmp_path, max_steps=6),
                      train_dataset=data,
                      optimizer_cls_and_kwargs=(MuonFactory, {"lr": 0.02, "weight_decay": 0.01,
                                                              "adamw_options": {"lr": 0.01},
                                                              "compute_dtype": "float32"}))
    trainer.train()
    seen = losses(trainer)
    assert len(seen) == 6 and seen[-1] < seen[0], seen
    opt = muon_of(trainer)
    assert opt.compute_dtype == torch.float32
    assert {g["lr"] for g in opt.param_groups if not g["use_muon"]} == {0.01}
    # Trainer's no-decay rule on the AdamW part (LoRA trains no norm or bias: no such group there)
    no_decay = {n for g in opt.param_groups if not g["use_muon"] and g["weight_decay"] == 0.0
                for n in g["param_names"]}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert no_decay == trainable - set(Trainer.get_decay_parameter_names(None, model))
    assert bool(no_decay) == (build is hf_models.llama_lm)


def test_resume_from_checkpoint_is_bit_identical_with_row_blocks(tmp_path):
    """Row-block specs of every plain form in the Muon group; the checkpoint holds them as plain values,
    Trainer's weights_only load reads it, and the resumed run equals the uninterrupted one bit for bit
    (losses, parameters, optimizer state). (A dense model: transformers 5.24's Trainer does not resume
    fused-expert MoE weights, see test_moe_optimizer_checkpoint_loads_weights_only.)"""
    layer = "model.layers.0."
    blocks = {
        layer + "self_attn.q_proj.weight": "heads:8",
        layer + "mlp.up_proj.weight": "blocks:16,48",
        layer + "self_attn.o_proj.weight": spec_to_plain(FusedQKV(2, 1, 8, "concat")),  # 32 rows
        "model.layers.1.self_attn.o_proj.weight": spec_to_plain(SplitQKV(FusedQKV(2, 1, 8, "grouped"), per_head=True)),
    }
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "muon_row_blocks": blocks, "compute_dtype": torch.float32}

    def trainer(out):
        return Trainer(model=hf_models.llama_lm(), args=args(out, save_strategy="steps", save_steps=2),
                       train_dataset=Repeats(), optimizer_cls_and_kwargs=(MuonFactory, kwargs))

    full = trainer(tmp_path / "full")
    full.train()
    assert [g for g in muon_of(full).param_groups if g["use_muon"]][0]["muon_row_blocks"] == blocks
    ckpt = tmp_path / "full" / "checkpoint-2"
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)  # what Trainer does on resume
    group = [g for g in saved["param_groups"] if g["use_muon"]][0]
    assert from_checkpoint(group["muon_row_blocks"], group["param_names"]) == {
        n: blocks.get(n) for n in group["param_names"]}  # one plain string (or None) per parameter

    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 4 and len(losses(full)) == 4
    assert losses(resumed) == losses(full)  # steps 1-2 from the checkpoint's log, 3-4 trained again
    for (n, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), n
    sa, sb = muon_of(full).state_dict()["state"], muon_of(resumed).state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for key, value in sa[k].items():
            assert torch.equal(value, sb[k][key]) if torch.is_tensor(value) else value == sb[k][key]


def test_moe_optimizer_checkpoint_loads_weights_only(tmp_path):
    """Mixtral: the automatic 'blocks:I,I' of the fused gate_up_proj survive Trainer's optimizer.pt
    (weights_only) and load into a freshly built optimizer. transformers 5.24's Trainer itself does not
    resume MoE models: save_pretrained writes experts per expert (block_sparse_moe.experts.N.w1) and
    _load_from_checkpoint loads them with load_state_dict(strict=False), without converting back
    (huggingface/transformers#48805), so the fused experts keep their fresh values."""
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "compute_dtype": torch.float32}
    full = Trainer(model=hf_models.mixtral(), args=args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2),
                   train_dataset=Repeats(), optimizer_cls_and_kwargs=(MuonFactory, kwargs))
    full.train()
    saved = torch.load(tmp_path / "checkpoint-2" / "optimizer.pt", weights_only=True)
    group = [g for g in saved["param_groups"] if g["use_muon"]][0]
    blocks = {n: b for n, b in from_checkpoint(group["muon_row_blocks"], group["param_names"]).items() if b}
    assert blocks == {f"model.layers.{i}.mlp.experts.gate_up_proj": "blocks:24,24" for i in range(2)}
    fresh = MuonFactory()(hf_models.mixtral(), **kwargs)
    fresh.load_state_dict(saved)
    assert fresh.state_dict()["state"].keys() == muon_of(full).state_dict()["state"].keys()


def _scaled_llama():
    model = hf_models.llama_lm()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "q_proj" in n or "k_proj" in n:
                p.mul_(6.0)
    return model


def test_trainer_clips_with_no_qk_logits_in_the_loop(tmp_path):
    """QK-clip under Trainer, which calls optimizer.step() with no arguments: the recorder is the
    optimizer's logits source.  With lr = wd = 0 only QK-clip moves the weights, so every q/k row
    must be scaled exactly as Kimi K2's rule, computed here from the logits the step used, says:
    query rows of head h by sqrt(gamma_h), key rows of kv head j by sqrt(min over its query heads),
    gamma_h = min(1, threshold / S_h)."""
    model = _scaled_llama()
    rec = MaxLogitRecorder(model)
    batch = Repeats()[0]
    model(input_ids=batch["input_ids"][None])
    threshold = 0.5 * max(float(v.max()) for v in rec().values())
    rec.remove()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    used = []

    class Capturing(MuonFactory):  # Trainer's factory, recording what the source hands to step()
        def __call__(self, model, **kwargs):
            opt = super().__call__(model, **kwargs)
            recorder = opt.qk_logits_recorder
            opt.set_qk_logits_source(lambda: used.append(recorder()) or used[-1])
            return opt

    trainer = Trainer(model=model, args=args(tmp_path, max_steps=1), train_dataset=Repeats(),
                      optimizer_cls_and_kwargs=(Capturing, {"lr": 0.0, "weight_decay": 0.0, "qk_clip": threshold}))
    trainer.train()
    opt = muon_of(trainer)
    assert opt.qk_clip_report is not None and opt.qk_clip_report.total_clipped > 0
    assert len(used) == 1 and set(used[0]) == {0, 1}
    cfg = model.config
    head_dim, group = cfg.hidden_size // cfg.num_attention_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    for layer, logits in used[0].items():
        gamma = torch.clamp(threshold / logits.double(), max=1.0)
        q_scale = gamma.sqrt().repeat_interleave(head_dim)
        k_scale = gamma.view(-1, group).amin(dim=1).sqrt().repeat_interleave(head_dim)
        for proj, scale in (("q_proj", q_scale), ("k_proj", k_scale)):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            want = (before[name].double() * scale[:, None]).float()
            torch.testing.assert_close(dict(model.named_parameters())[name].detach(), want, rtol=1e-6, atol=1e-7)
        v = f"model.layers.{layer}.self_attn.v_proj.weight"
        assert torch.equal(dict(model.named_parameters())[v].detach(), before[v])  # values untouched
    opt.qk_logits_recorder.remove()


def test_accelerate_loop_clips_with_step_without_arguments():
    """accelerate: prepare(model, build_muon(...)), then opt.step() as the loop always calls it."""
    from accelerate import Accelerator

    model = _scaled_llama()
    opt = build_muon(model, lr=0.0, weight_decay=0.0, qk_clip=1.0)
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    batch = Repeats()[0]
    out = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None])
    accelerator.backward(out.loss)
    opt.step()
    opt.zero_grad()
    inner = opt.optimizer
    assert inner.qk_clip_report is not None and inner.qk_clip_report.total_clipped > 0
    inner.qk_logits_recorder.remove()


def test_accelerate_loop_trains():
    from accelerate import Accelerator

    model = hf_models.mixtral()
    opt = build_muon(model, lr=0.02, weight_decay=0.0)
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    data = Repeats()
    ids = torch.stack([data[i]["input_ids"] for i in range(8)])
    seen = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        seen.append(float(loss))
    assert seen[-1] < seen[0], seen


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("WANDB_DISABLED", "true")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
