"""A seeded, procedurally generated training corpus for the built-in tokenizer.

The text imitates what a coding agent reads and writes: small Python modules and
tests, pytest output, unified diffs, shell commands, JSON tool calls, problem
statements and agent reasoning. It is generated from a fixed seed with
``random.Random`` only, so the corpus (and hence the tokenizer) is identical on
every machine and Python version: nothing is read from disk or the stdlib.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

# Bump when the generators change: part of the tokenizer cache key via the text hash anyway,
# but kept explicit so a reader sees when the corpus recipe moved.
CORPUS_VERSION = 3

_NOUNS = [
    "user",
    "item",
    "order",
    "config",
    "parser",
    "token",
    "node",
    "graph",
    "cache",
    "record",
    "buffer",
    "matrix",
    "vector",
    "account",
    "session",
    "request",
    "response",
    "event",
    "queue",
    "task",
    "worker",
    "file",
    "path",
    "line",
    "word",
    "count",
    "value",
    "key",
    "index",
    "result",
    "error",
    "message",
    "price",
    "total",
    "score",
    "name",
    "date",
    "time",
    "window",
    "stack",
    "tree",
    "leaf",
    "edge",
]
_VERBS = [
    "get",
    "set",
    "parse",
    "load",
    "save",
    "compute",
    "build",
    "find",
    "update",
    "delete",
    "merge",
    "split",
    "render",
    "validate",
    "normalize",
    "count",
    "sort",
    "filter",
    "apply",
    "read",
    "write",
    "format",
    "reset",
    "check",
    "resolve",
    "encode",
    "decode",
    "flatten",
    "group",
    "sum",
]
_ADJ = ["empty", "negative", "large", "unicode", "nested", "missing", "duplicate", "invalid", "zero", "long"]
_PKGS = ["mathlib", "textkit", "inventory", "shopcart", "dateparse", "graphs", "tinydb", "csvtools"]
_TYPES = ["int", "str", "float", "bool", "list[int]", "dict[str, int]", "list[str]", "None"]
_EXC = ["ValueError", "KeyError", "TypeError", "IndexError", "ZeroDivisionError", "AssertionError"]
_REASON = [
    "Let me look at the file first.",
    "I'll start by exploring the repository structure.",
    "Now let me run the tests to see what fails.",
    "The bug is in `{fn}`: it does not handle the {adj} case.",
    "Let me check how `{fn}` is used elsewhere.",
    "I need to fix the off-by-one error in `{fn}`.",
    "The tests pass now. Let me double check the edge cases.",
    "Let me search for `{fn}` in the codebase.",
    "I see the problem. The function returns the wrong value when the input is {adj}.",
    "Now I'll edit `{mod}.py` to fix this.",
    "Let me verify the fix by running the failing test again.",
    "The change looks good. I'm done.",
]
_WORDS_TEXT = """
the a an to of and in that is for it with as on be this by are or from at not you your we can will
if when then should must would could function file test tests code value values return returns error
errors bug fix fixes fixed change changes repository module class method argument arguments input
output expected actual behavior behaviour result results case cases edge empty list string number
integer python command run running check checks make sure only each every all some any new old
current previous following instead because before after while until also still already now first
next last please task agent assistant user tool call calls response message system prompt shell
terminal directory working environment issue report steps reproduce description details solution
implement implementation update updated add added remove removed replace replaced create created
edit edited read write written missing wrong correct correctly properly incorrect raises raised
exception handle handled handling default parameter parameters option options config configuration
version line lines source path name names type types object objects dictionary key keys index data
format print output logs log see look find search open show use used using need needs want know
think understand understanding problem
"""
_WORDS = _WORDS_TEXT.split()  # a text block reads better than a 200-item list literal

_PROBLEMS = [
    "`{fn}` returns the wrong result for {adj} input.",
    "Calling `{fn}()` with a {adj} {noun} raises `{exc}` instead of returning a default.",
    "The `{cls}` class does not {verb} its {noun} correctly.",
    "{cls}.{verb}_{noun} should ignore {adj} values, but it currently counts them.",
]


def _ident(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _cls(rng: random.Random) -> str:
    return rng.choice(_NOUNS).capitalize() + rng.choice(["Manager", "Store", "Parser", "Builder", ""])


def _expr(rng: random.Random, args: list[str]) -> str:
    a = rng.choice(args) if args else str(rng.randint(0, 99))
    ops = [
        f"{a} + {rng.randint(1, 9)}",
        f"len({a})",
        f"sorted({a})",
        f"[x for x in {a} if x > {rng.randint(0, 5)}]",
        f"{a}.get('{rng.choice(_NOUNS)}', None)",
        f"sum({a}) / max(len({a}), 1)",
        f'f"{{{a}}}: {rng.choice(_NOUNS)}"',
        f"{a} * 2 if {a} else 0",
        f"{{k: v for k, v in {a}.items() if v}}",
    ]
    return rng.choice(ops)


def python_function(rng: random.Random, indent: str = "") -> str:
    name = _ident(rng)
    args = rng.sample(_NOUNS, rng.randint(0, 3))
    sig = ", ".join(f"{a}: {rng.choice(_TYPES)}" for a in args)
    ret = rng.choice(_TYPES)
    body = [
        f"{indent}def {name}({sig}) -> {ret}:",
        (f'{indent}    """{rng.choice(_VERBS).capitalize()} the {rng.choice(_NOUNS)}s."""'),
    ]
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        var = rng.choice(_NOUNS)
        if kind < 0.3 and args:
            body.append(f"{indent}    if {rng.choice(args)} is None:")
            body.append(f'{indent}        raise {rng.choice(_EXC)}("{rng.choice(_NOUNS)} must not be None")')
        elif kind < 0.5 and args:
            body.append(f"{indent}    for {var}_i in range(len({rng.choice(args)})):")
            body.append(f"{indent}        {var} = {_expr(rng, args)}")
        else:
            body.append(f"{indent}    {var} = {_expr(rng, args)}")
            args = [*args, var]
    body.append(f"{indent}    return {_expr(rng, args)}")
    return "\n".join(body) + "\n"


def python_module(rng: random.Random) -> str:
    parts = [f'"""{rng.choice(_VERBS).capitalize()} helpers for {rng.choice(_NOUNS)}s."""\n']
    parts.append(
        rng.choice(
            [
                "import os\n",
                "import re\n",
                "from __future__ import annotations\n",
                "from dataclasses import dataclass\n",
                "import json\nimport sys\n",
            ]
        )
    )
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.35:
            cls = _cls(rng)
            parts.append(
                f"\n\nclass {cls}:\n    def __init__(self, {rng.choice(_NOUNS)}=None):\n"
                f"        self._{rng.choice(_NOUNS)} = {{}}\n\n" + python_function(rng, "    ")
            )
        else:
            parts.append("\n\n" + python_function(rng))
    return "".join(parts)


def pytest_file(rng: random.Random, mod: str) -> str:
    lines = ["import pytest\n", f"from {mod} import {_ident(rng)}, {_ident(rng)}\n"]
    for _ in range(rng.randint(2, 4)):
        fn = _ident(rng)
        lines.append(f"\n\ndef test_{fn}_{rng.choice(_ADJ)}():\n")
        lines.append(f"    assert {fn}({rng.randint(0, 9)}) == {rng.randint(0, 99)}\n")
        if rng.random() < 0.4:
            lines.append(f"    with pytest.raises({rng.choice(_EXC)}):\n        {fn}(None)\n")
    return "".join(lines)


def pytest_output(rng: random.Random, mod: str) -> str:
    n = rng.randint(2, 12)
    failed = rng.randint(0, min(3, n))
    dots = "".join(rng.choice(".F") if i < failed * 2 else "." for i in range(n))
    out = [
        "============================= test session starts ==============================",
        f"platform linux -- Python 3.{rng.randint(10, 13)}.{rng.randint(0, 9)}, pytest-8.{rng.randint(0, 4)}.0",
        "rootdir: /testbed",
        f"collected {n} items",
        "",
        f"tests/test_{mod}.py {dots}" + " " * rng.randint(1, 30) + "[100%]",
        "",
    ]
    if failed:
        fn = _ident(rng)
        exc = rng.choice(_EXC)
        out += [
            "=================================== FAILURES ===================================",
            f"________________________________ test_{fn} _________________________________",
            "",
            f"    def test_{fn}():",
            f">       assert {fn}({rng.randint(0, 9)}) == {rng.randint(0, 9)}",
            f"E       {exc}: {rng.choice(_NOUNS)}",
            "",
            f"tests/test_{mod}.py:{rng.randint(3, 90)}: {exc}",
            "=========================== short test summary info ============================",
            f"FAILED tests/test_{mod}.py::test_{fn} - {exc}: {rng.choice(_NOUNS)}",
            (
                f"========================= {failed} failed, {n - failed} passed in {rng.random():.2f}s "
                "========================="
            ),
        ]
    else:
        out.append(
            f"============================== {n} passed in {rng.random():.2f}s =============================="
        )
    return "\n".join(out) + "\n"


def unified_diff(rng: random.Random, mod: str) -> str:
    old = python_function(rng).splitlines()
    new = list(old)
    i = rng.randrange(1, len(new))
    new[i] = new[i].replace(rng.choice(_NOUNS), rng.choice(_NOUNS)) + rng.choice(["", "  # fixed", " + 1"])
    start = rng.randint(1, 120)
    hunk = [
        f"diff --git a/{mod}.py b/{mod}.py",
        (f"index {rng.getrandbits(28):07x}..{rng.getrandbits(28):07x} 100644"),
        f"--- a/{mod}.py",
        f"+++ b/{mod}.py",
        f"@@ -{start},{len(old)} +{start},{len(new)} @@",
    ]
    for a, b in zip(old, new, strict=True):
        hunk += [f" {a}"] if a == b else [f"-{a}", f"+{b}"]
    return "\n".join(hunk) + "\n"


def shell_command(rng: random.Random, mod: str) -> str:
    fn = _ident(rng)
    return rng.choice(
        [
            "ls -la",
            f"ls {rng.choice(_PKGS)}/",
            f"cat {mod}.py",
            f'grep -rn "{fn}" .',
            f"grep -rn 'def {fn}' --include=*.py",
            f"sed -n '{rng.randint(1, 40)},{rng.randint(41, 90)}p' {mod}.py",
            f"sed -i 's/{rng.choice(_NOUNS)}/{rng.choice(_NOUNS)}/g' {mod}.py",
            f"nl -ba {mod}.py | head -50",
            "python -m pytest -q",
            f"python -m pytest tests/test_{mod}.py -x -q",
            "git status",
            "git diff",
            "find . -name '*.py' | head -20",
            f"python -c 'import {mod}; print({mod}.{fn}(3))'",
            f"cat <<'EOF' > {mod}.py\n{python_function(rng)}EOF",
            "cd /testbed && ls",
            "pip list | grep pytest",
            f"wc -l {mod}.py",
            f"head -n 30 {mod}.py",
            f"tail -n {rng.randint(5, 40)} {mod}.py",
        ]
    )


def tool_call_json(rng: random.Random, mod: str) -> str:
    args: dict[str, object] = {"command": shell_command(rng, mod)}
    name = "bash"
    if rng.random() < 0.2:
        name = rng.choice(["str_replace_editor", "read_file", "write_file", "submit"])
        args = {"path": f"/testbed/{mod}.py", "old_str": _ident(rng), "new_str": _ident(rng)}
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def problem_statement(rng: random.Random) -> str:
    text = rng.choice(_PROBLEMS).format(
        fn=_ident(rng),
        adj=rng.choice(_ADJ),
        noun=rng.choice(_NOUNS),
        exc=rng.choice(_EXC),
        cls=_cls(rng),
        verb=rng.choice(_VERBS),
    )
    return (
        f"{text}\n\nSteps to reproduce:\n\n```python\n>>> {_ident(rng)}({rng.randint(-5, 50)})\n"
        f"{rng.randint(0, 100)}\n```\n\nExpected {rng.randint(0, 100)}. Please fix it so the tests pass.\n"
    )


def agent_turn(rng: random.Random, mod: str) -> str:
    reason = rng.choice(_REASON).format(fn=_ident(rng), adj=rng.choice(_ADJ), mod=mod)
    return (
        reason
        + "\n\n"
        + (tool_call_json(rng, mod) if rng.random() < 0.7 else f"```bash\n{shell_command(rng, mod)}\n```")
    )


def prose(rng: random.Random) -> str:
    """Loose English (instructions, explanations): words, punctuation and inline code."""
    sentences = []
    for _ in range(rng.randint(2, 6)):
        words = rng.choices(_WORDS, k=rng.randint(5, 16))
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), f"`{_ident(rng)}`")
        sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", ",", ":", "?", "!"]))
    return " ".join(sentences) + "\n"


def builtin_task_text(rng: random.Random) -> str:
    """A built-in task's identifiers in use: statement, module and the commands an agent runs on it.

    A real tokenizer has whole tokens for common code identifiers; this gives the built-in one the
    same for the built-in suite's vocabulary (`feet_to_inches`, `triangular`), so copying a name
    from a problem statement into a command is one token, not a dozen byte pieces.
    """
    from legorl.tasks.builtin import FAMILIES, HELPERS, WORDS

    bug = FAMILIES[rng.choice(sorted(FAMILIES))](rng)
    names, helper_src, _call = rng.choice(HELPERS)
    helper = helper_src.format(g=rng.choice(names))
    path = f"pkg_{rng.choice(WORDS)}{rng.randint(10, 99)}/{bug.module}.py"
    return (
        f"`{bug.f2p[0]}` returns a wrong value.\n\n{helper}\n\n{bug.code}\n"
        f"$ cat $(grep -rl 'def {bug.func}' .)\n$ sed -i 's|{bug.bad}|{bug.good}|' {path}\n"
    )


def _chunks(rng: random.Random) -> Iterator[str]:
    mod = f"{rng.choice(_PKGS)}/{rng.choice(_NOUNS)}s"
    makers = [
        lambda: python_module(rng),
        lambda: pytest_file(rng, mod.replace("/", ".")),
        lambda: pytest_output(rng, mod.split("/")[-1]),
        lambda: unified_diff(rng, mod),
        lambda: "$ " + shell_command(rng, mod) + "\n",
        lambda: agent_turn(rng, mod),
        lambda: problem_statement(rng),
        lambda: prose(rng),
        lambda: builtin_task_text(rng),
    ]
    weights = [4, 2, 2, 2, 2, 3, 1, 2, 2]
    for maker in rng.choices(makers, weights=weights, k=rng.randint(3, 8)):
        yield maker()


def generate_corpus(n_documents: int = 3000, seed: int = 0) -> list[str]:
    """Return ``n_documents`` synthetic agent-like documents; same args, same text, everywhere."""
    rng = random.Random(seed)
    return ["\n".join(_chunks(rng)) for _ in range(n_documents)]
