"""The ChatML chat template of the built-in tokenizer (Qwen2.5-style tools).

Rendering, per message (every tag trims whitespace; all text comes from explicit strings, so the
template renders the same under any Jinja whitespace settings):

- ``system``/``user``/other roles: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``
- with ``tools``: the first turn is a system turn holding the system message (or a default), a blank
  line, and the tool section (the tool JSON schemas inside ``<tools></tools>`` and the tool-call
  instructions), in Qwen2.5's order. ``chat_template(tools_first=True)`` (``model.tools_first``) writes
  the tool section first instead: the tools are the same for every task while a harness's system message
  may not be (Qwen Code appends a git snapshot with the task's commit hash), and what every task's prompt
  shares is forwarded once per micro-batch (``trainer.shared_prefix``), not once per sequence. Over 3
  ``make demo`` seeds each, mini-swe-agent (a fixed system message) gained +13.2 with the system first and
  +9.4 with the tools first (docs/experiments.md), so the system comes first by default.
- ``assistant``: ``<|im_start|>assistant\\n{content}`` then one block per tool call, each preceded by
  ``\\n`` unless it is the first block of a message without content, then ``<|im_end|>\\n``. A block
  is ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``; ARGS is the string verbatim
  when the arguments arrive as a (JSON) string, else ``json.dumps(args, ensure_ascii=False)``.
- ``tool``: each tool message is its own user turn:
  ``<|im_start|>user\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n``.
  (Qwen merges consecutive tool results into one turn; one turn each keeps the prefix property at
  every message boundary, not only after assistant turns.)
- ``add_generation_prompt``: ``<|im_start|>assistant\\n``.

Content may be a string, None, or a list of ``{"type": "text", "text": ...}`` parts (texts joined).
Nothing rendered for a message depends on later messages, so a prefix of the messages renders to a
prefix of the text: the token bridge in the proxy relies on it.
"""

# The tool section; a blank line separates it from the system message on either side.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)
SECTION_BREAK = "\n\n"
DEFAULT_SYSTEM = "You are a helpful assistant."

_SYSTEM_TEXT = (
    "{%- if messages and messages[0].role == 'system' -%}{{- text_of(messages[0].content) -}}"
    "{%- else -%}{{- " + repr(DEFAULT_SYSTEM) + " -}}{%- endif -%}"
)
_TOOL_SECTION = (
    "{{- " + repr(TOOLS_PREAMBLE) + " -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- " + repr(TOOLS_POSTAMBLE) + " -}}"
)
_TEMPLATE_HEAD = (
    "{%- macro text_of(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
)
_TEMPLATE_TAIL = (
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and tools and message.role == 'system' -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}{{- text_of(message.content) -}}"
    "{%- for call in (message.tool_calls or []) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' -}}{{- fn.name | tojson -}}{{- ', \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}"
    "{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' -}}{{- text_of(message.content) -}}"
    "{{- '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}{{- text_of(message.content) -}}{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def chat_template(tools_first: bool = False) -> str:
    """The built-in template; `tools_first` puts the tool section before the system message (module docstring)."""
    first, second = (_TOOL_SECTION, _SYSTEM_TEXT) if tools_first else (_SYSTEM_TEXT, _TOOL_SECTION)
    return _TEMPLATE_HEAD + first + "{{- " + repr(SECTION_BREAK) + " -}}" + second + _TEMPLATE_TAIL


CHAT_TEMPLATE = chat_template()  # the default layout: the system message first
