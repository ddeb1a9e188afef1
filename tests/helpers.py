"""Small builders shared by several test modules (tests/ is on sys.path under pytest's default import mode)."""

from __future__ import annotations

import torch
import transformers


def tiny_qwen3(seed: int = 0, **config: object) -> transformers.Qwen3ForCausalLM:
    """A 2-layer Qwen3 with a 300-token vocabulary, deterministic in `seed`; `config` overrides fields."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**{
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "tie_word_embeddings": True, **config,
    })
    return transformers.Qwen3ForCausalLM(cfg)
