"""The built-in byte-level BPE tokenizer, trained deterministically and offline.

Byte-level means every string round-trips through encode/decode exactly, which the
proxy needs (sampled ids are decoded to text and later re-rendered around). The
tokenizer is trained with the `tokenizers` library on `legorl.models.corpus` and
cached under ``cache_dir/tokenizer-<hash>/`` where the hash covers the corpus text
and every training setting, so two machines build the same vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from legorl.models.chat_template import CHAT_TEMPLATE, chat_template
from legorl.models.corpus import CORPUS_VERSION, generate_corpus

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
# Added but not special: decode(skip_special_tokens=True) keeps them, and a tool call costs one id each.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_CORPUS_DOCS = 1000
_CORPUS_SEED = 0
_TRAINER_VERSION = 1  # bump when the training recipe below changes


def render_tool_call_text(name: str, arguments: str | dict[str, Any]) -> str:
    """The exact text of one ``<tool_call>`` block as the chat template renders it.

    String arguments are inserted verbatim (they are already JSON text); dicts are rendered as
    ``json.dumps(arguments, ensure_ascii=False)``, which is what the template's ``tojson`` does.
    """
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return (
        f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'
    )


def _settings(vocab_size: int, template: str) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "special": SPECIAL_TOKENS,
        "tool": TOOL_TOKENS,
        "corpus_version": CORPUS_VERSION,
        "docs": _CORPUS_DOCS,
        "seed": _CORPUS_SEED,
        "trainer_version": _TRAINER_VERSION,
        "template": template,  # the saved copy holds it: one cache directory per layout
    }


def _train(corpus: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


def _wrap(tok: Tokenizer, template: str) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        extra_special_tokens=[IM_START],  # so all_special_tokens / skip_special_tokens know it
        clean_up_tokenization_spaces=False,  # would break byte-exact round trips
        model_max_length=1 << 20,
    )
    fast.chat_template = template
    return fast


def build_tokenizer(cache_dir: Path | str, vocab_size: int = 4096, tools_first: bool = False,
                    ) -> PreTrainedTokenizerFast:
    """Load the built-in tokenizer from ``cache_dir``, training (and caching) it on first use. `tools_first`:
    its chat template writes the tool section before the system message (``model.tools_first``)."""
    template = chat_template(tools_first)
    corpus = generate_corpus(_CORPUS_DOCS, seed=_CORPUS_SEED)
    h = hashlib.sha256(json.dumps(_settings(vocab_size, template), sort_keys=True).encode())
    for doc in corpus:
        h.update(doc.encode())
    path = Path(cache_dir) / f"tokenizer-{h.hexdigest()[:16]}"
    if (path / "tokenizer.json").exists():
        return load_tokenizer(path)
    fast = _wrap(_train(corpus, vocab_size), template)
    # Write to a temp dir and rename so a concurrent builder never sees a half-written cache.
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    fast.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process won the race; its files are identical
        shutil.rmtree(tmp, ignore_errors=True)
    return load_tokenizer(path) if path.exists() else fast


def is_builtin(tokenizer: Any) -> bool:
    """Whether `tokenizer` is the built-in one (its added tokens are exactly the built-in's)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {t.content for t in added.values()} == set(SPECIAL_TOKENS + TOOL_TOKENS)


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerFast:
    """A tokenizer from a local directory. The built-in tokenizer gets its default template when the directory
    has none (copies saved before templates were saved, which wrote the system message first); any other
    keeps what its directory holds, so a checkpoint without a template is an error where a chat format is
    needed (models/chat_format.py), never silently ChatML."""
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.chat_template is None and is_builtin(tok):
        tok.chat_template = CHAT_TEMPLATE
    return tok
