"""The policy's named architectures (`PolicyConfig.preset`, libs.policy).

Plain data, without torch, so that a recipe or a setting naming a preset is checked when it
is read (apps.launcher.recipe) without loading torch into the command line:

    POLICY_PRESETS["tiny"]["hidden_size"]    # 128
"""

from __future__ import annotations

from typing import Any

from libs.tokenizer import ByteTokenizer

BYTE_VOCAB_SIZE = ByteTokenizer().vocab_size

# Named architectures, as `AutoConfig.for_model` arguments. `vocab_size` is the preset's
# default and is overridden by `PolicyConfig.vocab_size` to match another tokenizer.
POLICY_PRESETS: dict[str, dict[str, Any]] = {
    # The embedded default: 821K params (Llama-style, GQA, tied embeddings) over the byte
    # vocabulary; about 1 ms per decoded token per sequence on one CPU core.
    "tiny": {
        "model_type": "llama",
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        # RoPE, no position parameters: room for tool episodes (coding openings are ~2K).
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    # Agents' warm starts made on one GPU (`[warm_start] preset` of a recipe): tiny's Llama
    # shape at 12 layers of 768 (head dim 64, a power of two for the paged engine's
    # kernels), 76M params over a 1,024-token BPE vocabulary.
    "agent-75m": {
        "model_type": "llama",
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    # About 0.5B parameters over the byte vocabulary, for the loop on one GPU with the
    # embedded tokenizer: the Qwen2.5-0.5B layer shape, 33 layers (492M params).
    "byte-0.5b": {
        "model_type": "qwen2",
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 33,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    # The Qwen2.5-3B layer shape over the byte vocabulary (2.77B params, 5.5 GB in bf16),
    # random init: the size at which the weight path must keep up (issue #29).
    "byte-3b": {
        "model_type": "qwen2",
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    # The Qwen2.5-7B layer shape over the byte vocabulary (6.5B params: 13 GB in bf16, ~104 GB
    # with fp32 master weights, AdamW state and gradients, before activations), random init:
    # a model whose training is sharded over several cards, and whose versions the weight path
    # must move (issue #33).
    "byte-7b": {
        "model_type": "qwen2",
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    # Mixture of experts for the CPU: the Qwen3-MoE layer shape at the tiny preset's size,
    # 8 experts with 2 routed per token in every layer (1.4M params, ~0.5M active).
    "tiny-moe": {
        "model_type": "qwen3_moe",
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 384,
        "moe_intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    # Mixture of experts for one GPU: the Qwen3-MoE layer shape (qk-norm, 8 of 48 experts
    # routed per token in all 16 layers) over the byte vocabulary, 949M params, ~0.19B active.
    "moe-1b": {
        "model_type": "qwen3_moe",
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "moe_intermediate_size": 384,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 48,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    # The shape of Qwen2.5-0.5B (494M params with its 151,936-token vocabulary), for a GPU
    # run from random init; pair with that tokenizer or set vocab_size to your own.
    "qwen2-0.5b": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
}
