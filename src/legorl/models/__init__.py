"""Built-in tokenizer and tiny model recipes."""

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

__all__ = [
    "IM_END",
    "IM_START",
    "PAD",
    "TOOL_TOKENS",
    "ModelSpec",
    "build_model",
    "build_tokenizer",
    "load_model",
    "load_or_build",
    "load_tokenizer",
    "render_tool_call_text",
    "save_model",
]
