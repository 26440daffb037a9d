"""Tiny random-init Hugging Face models for the HF integration tests (built from configs, no downloads).

Each builder seeds torch, so two calls give the same weights. Importing this module needs
transformers; the test modules skip themselves where it is missing.
"""

from __future__ import annotations

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertConfig,
    DeepseekV3Config,
    GPT2Config,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

transformers.logging.set_verbosity_error()

VOCAB = 96


def _seeded(build, seed=0):
    torch.manual_seed(seed)
    model = build()
    model.train()
    return model


def llama_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return LlamaConfig(**base)


def llama_lm(attn="sdpa", seed=0, **kw):
    return _seeded(lambda: AutoModelForCausalLM.from_config(llama_config(**kw), attn_implementation=attn), seed)


def llama_seq_cls(seed=0):
    return _seeded(lambda: AutoModelForSequenceClassification.from_config(llama_config(num_labels=3)), seed)


def gpt2_config(**kw):
    base = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return GPT2Config(**base)


def gpt2_lm(seed=0):
    return _seeded(lambda: AutoModelForCausalLM.from_config(gpt2_config()), seed)


def gpt2_seq_cls(seed=0):
    return _seeded(lambda: AutoModelForSequenceClassification.from_config(gpt2_config(num_labels=3)), seed)


def bert_seq_cls(seed=0, attn="sdpa"):
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, num_labels=3)
    return _seeded(lambda: AutoModelForSequenceClassification.from_config(cfg, attn_implementation=attn), seed)


def qwen3_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    base.update(kw)
    return Qwen3Config(**base)


def qwen3_lm(seed=0):
    return _seeded(lambda: AutoModelForCausalLM.from_config(qwen3_config()), seed)


def qwen3_moe(seed=0, attn="sdpa"):
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    return _seeded(lambda: AutoModelForCausalLM.from_config(cfg, attn_implementation=attn), seed)


def mixtral(seed=0, attn="sdpa"):
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_local_experts=4,
                        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, tie_word_embeddings=False)
    return _seeded(lambda: AutoModelForCausalLM.from_config(cfg, attn_implementation=attn), seed)


def deepseek_v3_config(q_lora_rank=16, **kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, num_hidden_layers=2,
                first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
                kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64,
                tie_word_embeddings=False)
    base.update(kw)
    return DeepseekV3Config(**base)


def deepseek_v3(seed=0, attn="sdpa", **kw):
    return _seeded(lambda: AutoModelForCausalLM.from_config(deepseek_v3_config(**kw), attn_implementation=attn), seed)


def gpt_oss(seed=0):
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_local_experts=4,
                       num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, layer_types=["full_attention"], tie_word_embeddings=False)
    return _seeded(lambda: AutoModelForCausalLM.from_config(cfg, attn_implementation="eager"), seed)


def lora_seq_cls(seed=0):
    """Llama sequence classifier with LoRA on q/v/gate and `score` + one hidden module in modules_to_save."""
    from peft import LoraConfig, get_peft_model

    model = llama_seq_cls(seed)
    torch.manual_seed(seed + 1)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"],
                                            modules_to_save=["score", "down_proj"], task_type="SEQ_CLS"))


def lora_lm(seed=0):
    """Llama LM with LoRA on q_proj and a trainable copy of lm_head (modules_to_save)."""
    from peft import LoraConfig, get_peft_model

    model = llama_lm(seed=seed)
    torch.manual_seed(seed + 1)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"],
                                            task_type="CAUSAL_LM"))
