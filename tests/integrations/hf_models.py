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


# ---------------------------------------------------------------- beyond language models (issue 30: roles)


def vit_config(**kw):
    from transformers import ViTConfig

    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
                patch_size=4, num_channels=3, num_labels=5)
    base.update(kw)
    return ViTConfig(**base)


def vit_cls(seed=0):
    from transformers import ViTForImageClassification

    return _seeded(lambda: ViTForImageClassification(vit_config()), seed)


def vit_base(seed=0):
    from transformers import ViTModel

    return _seeded(lambda: ViTModel(vit_config()), seed)


def clip(seed=0):
    """A CLIP dual encoder: text and vision towers, their projections, logit_scale."""
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, max_position_embeddings=16, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, image_size=16, patch_size=4),
                     projection_dim=24)
    return _seeded(lambda: CLIPModel(cfg), seed)


def whisper(seed=0):
    """Whisper: a Conv1d stem (conv1, conv2) before the encoder, tied decoder embeddings and proj_out."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                        max_source_positions=8, max_target_positions=8, decoder_start_token_id=1, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    return _seeded(lambda: WhisperForConditionalGeneration(cfg), seed)


def wav2vec2(seed=0):
    """wav2vec2 for CTC: a Conv1d feature encoder and a weight-normed grouped positional conv."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    cfg = Wav2Vec2Config(vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                         num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, feat_extract_norm="group")
    return _seeded(lambda: Wav2Vec2ForCTC(cfg), seed)


def dac(seed=0):
    """The Descript audio codec: convolutions and Snake activations with a learned alpha [1, C, 1]."""
    from transformers import DacConfig, DacModel

    cfg = DacConfig(encoder_hidden_size=4, downsampling_ratios=[2, 2], decoder_hidden_size=16, n_codebooks=2,
                    codebook_size=16, codebook_dim=4, hidden_size=16)
    return _seeded(lambda: DacModel(cfg), seed)
