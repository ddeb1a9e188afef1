"""Every wire format the proxy serves, by the name its calls are recorded under (`LLMCall.wire_format`): what
reads a stored request body back with the proxy's own parser (the dashboard, the demonstration report)."""

from __future__ import annotations

from legorl.proxy.anthropic_messages import AnthropicMessages
from legorl.proxy.gemini import Gemini
from legorl.proxy.openai_chat import OpenAIChat
from legorl.proxy.openai_responses import OpenAIResponses
from legorl.proxy.wire import WireFormat

FORMATS: dict[str, type[WireFormat]] = {f.name: f for f in (OpenAIChat, OpenAIResponses, AnthropicMessages, Gemini)}
