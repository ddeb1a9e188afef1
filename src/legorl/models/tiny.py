"""Tiny Qwen3 (dense or MoE) recipes that train and sample on a CPU in seconds.

The model is a stock ``transformers`` Qwen3 so the same code paths (trainer, engines,
save/load, vLLM later) serve real checkpoints unchanged. Weights are initialised from
``spec.seed`` only, and built models are cached by spec hash, so runs are reproducible.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from legorl.config import ModelConfig
from legorl.models.tokenizer import IM_END, build_tokenizer, load_tokenizer

ATTN_IMPLEMENTATION = "sdpa"  # works on CPU in fp32 and handles padded batches


class ModelSpec(ModelConfig):
    """The built-in tiny model's recipe: the ``model`` section's dimensions (their defaults are the
    config's) plus what a run config does not set. Frozen: built models are cached by ``key()``."""

    model_config = ConfigDict(frozen=True)

    head_dim: int = 32
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    moe: bool = False  # Qwen3-MoE: every layer's MLP becomes num_experts experts, top-k routed
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128

    def key(self) -> str:
        """Stable hash of the recipe (``path``, ``name``: where a model is loaded from, not how one is built;
        ``tools_first`` is the tokenizer's, whose hash names the cache directory too)."""
        blob = json.dumps(self.model_dump(exclude={"path", "name", "tools_first"}), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_config(cls, model: ModelConfig, **recipe: Any) -> ModelSpec:
        """The spec of a run's ``model`` section, with recipe keys (``moe``, ``head_dim``, ...) as given."""
        return cls(**model.model_dump(), **recipe)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        unknown = set(d) - set(cls.model_fields)
        if unknown:
            raise ValueError(f"unknown ModelSpec fields {sorted(unknown)}; valid: {list(cls.model_fields)}")
        return cls(**d)


def _config(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> Qwen3Config | Qwen3MoeConfig:
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),  # no unused rows: every sampled id decodes to text
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "tie_word_embeddings": spec.tie_word_embeddings,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
    }
    if not spec.moe:
        return Qwen3Config(**common)
    return Qwen3MoeConfig(
        **common,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        norm_topk_prob=True,
    )


def build_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A randomly initialised fp32 model; same spec + tokenizer -> same weights, bit for bit."""
    config = _config(spec, tokenizer)
    config._attn_implementation = ATTN_IMPLEMENTATION
    cls = Qwen3MoeForCausalLM if spec.moe else Qwen3ForCausalLM
    # fork_rng: seed the init without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = cls(config)
    return model.to(torch.float32).eval()


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path | str) -> None:
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def load_model(path: Path | str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model + tokenizer from a LOCAL directory (never the hub)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} is not a model directory (no config.json); "
            "pass a local checkpoint dir or leave model_path unset to build one"
        )
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION, local_files_only=True
    )
    return model.eval(), load_tokenizer(path)


def load_or_build(
    model_path: str | Path | None, spec: ModelSpec, cache_dir: Path | str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``model_path`` when it is a local directory, else build the spec'd tiny model (cached)."""
    if model_path is not None:
        if not Path(model_path).is_dir():
            raise FileNotFoundError(
                f"model_path {model_path!r} is not a local directory (hub downloads are not supported here)"
            )
        return load_model(model_path)
    cache_dir = Path(cache_dir)
    tokenizer = build_tokenizer(cache_dir, spec.vocab_size, spec.tools_first)
    # Keyed by spec and tokenizer (its cache dir name is the tokenizer hash).
    path = cache_dir / f"model-{spec.key()}-{Path(tokenizer.name_or_path).name}"
    if (path / "config.json").exists():
        return load_model(path)
    model = build_model(spec, tokenizer)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    save_model(model, tokenizer, tmp)
    try:
        tmp.rename(path)
    except OSError:  # a concurrent builder finished first; identical content
        shutil.rmtree(tmp, ignore_errors=True)
    return model, tokenizer
