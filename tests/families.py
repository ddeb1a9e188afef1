"""Checkpoints of the major model families built on the spot (no downloads), shared by tests and bench/families.py.

Each family is a chat template written here from its documented tool-call syntax (the role markup is ChatML's for
all but gpt-oss: only the calls matter), a small byte-level BPE with the family's special tokens, and, for a whole
checkpoint directory, a tiny random config (and weights) of the family's architecture as transformers has it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast


def scaffold(calls: str, end: str = "<|im_end|>", before: str = "''", after: str = "''") -> str:
    """ChatML turns closed by `end`; an assistant's tool calls as `before`, `calls` once per call (a Jinja
    fragment seeing the call as `f` and its arguments as `args`), `after`."""
    return (
        "{%- macro open(role) %}{{- '<|im_start|>' + role + '\\n' }}{%- endmacro %}"
        "{%- if tools %}{{- open('system') + '# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}"
        "{%- endfor %}{{- '\\n</tools>" + end + "\\n' }}{%- endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'assistant' %}{{- open('assistant') + (m.content or '') }}"
        "{%- if m.tool_calls %}{{- " + before + " }}{%- for tc in m.tool_calls %}"
        "{%- set f = tc.function if tc.function is defined else tc %}{%- set args = f.arguments %}" + calls
        + "{%- endfor %}{{- " + after + " }}{%- endif %}{{- '" + end + "\\n' }}"
        "{%- else %}{{- open(m.role) + m.content + '" + end + "\\n' }}{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- open('assistant') }}{%- endif %}"
    )


def _value() -> str:  # a parameter as the tag formats write it: strings raw, the rest as JSON
    return "(v if v is string else v | tojson)"


HARMONY_TEMPLATE = (  # gpt-oss: every turn a message; a call is a commentary message to functions.NAME
    "{%- if tools %}{{- '<|start|>developer<|message|># Tools\\n' }}{%- for t in tools %}{{- (t | tojson) + '\\n' }}"
    "{%- endfor %}{{- '<|end|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if m.content %}{{- '<|start|>assistant<|channel|>' + ('commentary' if m.tool_calls else 'final') "
    "+ '<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- for tc in m.tool_calls or [] %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + f.name + ' <|constrain|>json<|message|>' "
    "+ (f.arguments | tojson) + '<|call|>' }}{%- endfor %}"
    "{%- elif m.role == 'tool' %}{{- '<|start|>functions.tool to=assistant<|channel|>commentary<|message|>' "
    "+ m.content + '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

# format -> (template, special tokens (the eos first), the end of the assistant's tool-call text, whether
# the format writes text and several calls)
FAMILIES = {
    "hermes": (scaffold("{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (args | tojson) "
                        "+ '}\\n</tool_call>' }}"), ["<|im_end|>", "<tool_call>", "</tool_call>"], "<|im_end|>", True),
    "qwen3_coder": (scaffold("{{- '\\n<tool_call>\\n<function=' + f.name + '>\\n' }}{%- for k, v in args.items() %}"
                             "{{- '<parameter=' + k + '>\\n' + " + _value() + " + '\\n</parameter>\\n' }}"
                             "{%- endfor %}{{- '</function>\\n</tool_call>' }}"),
                    ["<|im_end|>", "<tool_call>", "</tool_call>"], "<|im_end|>", True),
    "llama3_json": (scaffold("{{- '{\"name\": \"' + f.name + '\", \"parameters\": ' + (args | tojson) + '}' }}",
                             end="<|eot_id|>"), ["<|eot_id|>", "<|python_tag|>"], "<|eot_id|>", False),
    "mistral": (scaffold("{{- '[TOOL_CALLS]' + f.name + '[ARGS]' + (args | tojson) }}", end="</s>"),
                ["</s>", "[TOOL_CALLS]", "[ARGS]"], "</s>", True),
    "mistral_v3": (scaffold("{{- (', ' if not loop.first else '') + '{\"name\": \"' + f.name + '\", \"arguments\": ' "
                            "+ (args | tojson) + '}' }}", end="</s>", before="'[TOOL_CALLS]['", after="']'"),
                   ["</s>", "[TOOL_CALLS]"], "</s>", True),
    "deepseek": (scaffold("{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + f.name + '\\n```json\\n' "
                          "+ (args | tojson) + '\\n```<｜tool▁call▁end｜>' }}", end="<｜end▁of▁sentence｜>",
                          before="'<｜tool▁calls▁begin｜>'", after="'<｜tool▁calls▁end｜>'"),
                 ["<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                  "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"], "<｜end▁of▁sentence｜>", True),
    "deepseek_v31": (scaffold("{{- '<｜tool▁call▁begin｜>' + f.name + '<｜tool▁sep｜>' + (args | tojson) "
                              "+ '<｜tool▁call▁end｜>' }}", end="<｜end▁of▁sentence｜>",
                              before="'<｜tool▁calls▁begin｜>'", after="'<｜tool▁calls▁end｜>'"),
                     ["<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                      "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"], "<｜end▁of▁sentence｜>", True),
    "glm45": (scaffold("{{- '\\n<tool_call>' + f.name + '\\n' }}{%- for k, v in args.items() %}{{- '<arg_key>' + k "
                       "+ '</arg_key>\\n<arg_value>' + " + _value() + " + '</arg_value>\\n' }}{%- endfor %}"
                       "{{- '</tool_call>' }}"),
              ["<|im_end|>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
              "<|im_end|>", True),
    "kimi_k2": (scaffold("{{- '<|tool_call_begin|>functions.' + f.name + ':' + (loop.index0 | string) "
                         "+ '<|tool_call_argument_begin|>' + (args | tojson) + '<|tool_call_end|>' }}",
                         before="'<|tool_calls_section_begin|>'", after="'<|tool_calls_section_end|>'"),
                ["<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>"], "<|im_end|>", True),
    "harmony": (HARMONY_TEMPLATE, ["<|return|>", "<|end|>", "<|start|>", "<|message|>", "<|channel|>",
                                   "<|constrain|>", "<|call|>"], "<|call|>", True),  # gpt-oss's eos: <|return|>
    "minimax_m2": (scaffold("{{- '<invoke name=\"' + f.name + '\">\\n' }}{%- for k, v in args.items() %}"
                            "{{- '<parameter name=\"' + k + '\">' + " + _value() + " + '</parameter>\\n' }}"
                            "{%- endfor %}{{- '</invoke>\\n' }}", end="[e~[", before="'\\n<minimax:tool_call>\\n'",
                            after="'</minimax:tool_call>'"), ["[e~[", "<minimax:tool_call>", "</minimax:tool_call>"],
                   "[e~[", True),
}
DETECTED = {"mistral_v3": "mistral", "deepseek_v31": "deepseek"}  # template variants of one format


def build_tokenizer(template: str, special: list[str]) -> PreTrainedTokenizerFast:
    """A small byte-level BPE (every string round-trips) with the family's markers as special tokens (ChatML's
    too), its eos `special[0]`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["bash ls -la cat README.md write a.json"] * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    chatml = [t for t in ("<|im_start|>", "<|im_end|>") if t not in special]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [*special, *chatml]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special[0], clean_up_tokenization_spaces=False)
    fast.chat_template = template
    return fast


# SmolLM2-135M-Instruct's template, verbatim: ChatML with a default system prompt; no tools, no tool calls.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
NO_TOOLS = "chatml_no_tools"  # a family whose template renders no tools: legorl renders them, `tagged` reads calls

# ---- tiny random models of each family's architecture --------------------------------------------------------
_SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 2048}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
_ARCH: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "qwen3": lambda: transformers.Qwen3Config(**_SMALL, head_dim=16),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_SMALL, **_MOE, head_dim=16, num_experts=4),
    "llama": lambda: transformers.LlamaConfig(**_SMALL),
    "mistral": lambda: transformers.MistralConfig(**_SMALL, sliding_window=None),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **_SMALL, **_MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**_SMALL, **_MOE, n_routed_experts=4, n_shared_experts=1,
                                                   first_k_dense_replace=1, head_dim=16),
    "gpt_oss": lambda: transformers.GptOssConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                                 sliding_window=32, layer_types=["sliding_attention",
                                                                                 "full_attention"]),
    "minimax_m2": lambda: transformers.MiniMaxM2Config(**_SMALL, num_local_experts=4, num_experts_per_tok=2,
                                                       head_dim=16),
}
# family -> the architecture its checkpoints have (Kimi-K2 is a DeepSeek-V3; SmolLM2 a Llama)
ARCHITECTURE = {"hermes": "qwen3", "qwen3_coder": "qwen3_moe", "llama3_json": "llama", "mistral": "mistral",
                "mistral_v3": "mistral", "deepseek": "deepseek_v3", "deepseek_v31": "deepseek_v3",
                "glm45": "glm4_moe", "kimi_k2": "deepseek_v3", "harmony": "gpt_oss", "minimax_m2": "minimax_m2",
                NO_TOOLS: "llama"}
# extra generation stop tokens, as the family's generation_config.json lists them (gpt-oss ends a call on <|call|>)
_GENERATION_EOS = {"harmony": ["<|return|>", "<|call|>"]}


def family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The family's tokenizer with its chat template (ChatML tokens and SmolLM2's template for NO_TOOLS)."""
    if family == NO_TOOLS:
        return build_tokenizer(SMOLLM2_TEMPLATE, ["<|im_end|>", "<|im_start|>", "<|endoftext|>"])
    template, special, _, _ = FAMILIES[family]
    return build_tokenizer(template, special)


def tiny_config(family: str, vocab_size: int) -> transformers.PretrainedConfig:
    cfg = _ARCH[ARCHITECTURE[family]]()
    cfg.vocab_size = vocab_size
    return cfg


def save_checkpoint(path: Path, family: str, weights: bool = True,
                    tokenizer: PreTrainedTokenizerFast | None = None) -> Path:
    """A checkpoint directory as save_pretrained writes it: tokenizer and template, config, generation config and
    (with `weights`) a tiny random model of the family's architecture, fp32."""
    tok = tokenizer if tokenizer is not None else family_tokenizer(family)
    tok.save_pretrained(path)
    cfg = tiny_config(family, len(tok))
    if weights:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    else:
        cfg.save_pretrained(path)
    eos = [tok.eos_token_id, *tok.convert_tokens_to_ids(_GENERATION_EOS.get(family, []))]
    GenerationConfig(eos_token_id=eos).save_pretrained(path)
    return path
