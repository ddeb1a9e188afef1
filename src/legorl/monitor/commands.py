"""What an agent's tool call does: read, search, edit, test, submit or other.

Works for any harness: bash commands (mini-swe-agent's `bash`, Claude Code's
`Bash`, Codex's `shell`) are split into simple commands and classified one by
one; structured tools (Claude Code's Read/Edit/Write/Grep/Glob, Codex's
`apply_patch`, SWE-agent/OpenHands editors) are classified by name.

    >>> classify_command("cd /repo && sed -i 's/a/b/' src/x.py && cat src/x.py").kinds
    ['edit', 'read']
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

KINDS = ("read", "search", "edit", "test", "submit", "other")
# When one call does several things, the call is counted once under the strongest kind.
_PRIORITY = {"submit": 0, "edit": 1, "test": 2, "read": 3, "search": 4, "other": 5}

SUBMIT_MARKERS = ("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "MINI_SWE_AGENT_FINAL_OUTPUT")

_READERS = {"cat", "nl", "head", "tail", "less", "more", "bat", "view", "od", "xxd", "hexdump", "wc", "file",
            "stat", "diff", "cmp", "awk", "gawk", "column", "jq", "strings"}
_SEARCHERS = {"grep", "egrep", "fgrep", "rg", "ag", "ack", "find", "ls", "tree", "fd", "fdfind", "locate",
              "which", "whereis", "du", "pwd", "realpath", "dirname", "basename"}
_EDITORS = {"patch", "apply_patch", "applypatch", "mv", "cp", "rm", "touch", "truncate", "ed", "ex", "dos2unix"}
_TESTERS = {"pytest", "py.test", "tox", "nox", "unittest", "nosetests", "trial", "jest", "mocha", "vitest",
            "ctest", "rspec", "phpunit"}
_PYTHONS = re.compile(r"^(python|python3|python3\.\d+|pypy3?)$")
_WRAPPERS = {"sudo", "time", "nice", "env", "command", "exec", "timeout", "stdbuf", "nohup", "xargs", "then",
             "do", "else", "!", "{", "("}
_PATHLIKE = re.compile(r"^[\w./~+@-]*[\w~@/-]$")
_PYPATH = re.compile(r"(?:open|Path)\(\s*['\"]([^'\"]+)['\"]")
_PYWRITE = re.compile(r"\.write(?:_text|_bytes|lines)?\(|open\([^)]*['\"][wa]b?\+?['\"]|shutil\.(copy|move)")
_PATCH_FILE = re.compile(r"^\*\*\* (?:Update|Add|Delete) File: (.+)$|^\+\+\+ (?:b/)?(\S+)", re.MULTILINE)


@dataclass
class Action:
    """One thing a tool call does. `paths` are the files it names; `all_files` marks a whole-tree check."""

    kind: str
    paths: list[str] = field(default_factory=list)
    all_files: bool = False  # e.g. `git diff` or a test run: looks at every edited file


@dataclass
class Classified:
    """A whole tool call: its simple actions in order, and the one kind it counts as."""

    tool: str
    actions: list[Action]
    valid: bool = True  # arguments parsed and carried what the tool needs
    command: str | None = None

    @property
    def kinds(self) -> list[str]:
        return [a.kind for a in self.actions]

    @property
    def kind(self) -> str:
        if not self.actions:
            return "other"
        return min((a.kind for a in self.actions), key=_PRIORITY.__getitem__)


_OPS = {"&&", "||", ";", "|", "\n", "&", "(", ")", "|&", ";;"}
_REDIR_OPS = {">", ">>", ">&", "&>", ">|", "&>>", "<", "<<<"}
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1[^\n]*\n(.*?)(?:^\s*\2\s*$|\Z)", re.MULTILINE | re.DOTALL)


@dataclass
class _Simple:
    words: list[str]
    redirects: list[str]  # files written by > or >>
    stdin_text: str = ""  # a here-document fed to this command


def _tokens(text: str) -> list[str]:
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|<>()\n")
    lex.whitespace = " \t\r"
    try:
        return list(lex)
    except ValueError:  # unbalanced quotes: fall back to whitespace
        return re.findall(r"&&|\|\||[;|\n]|[^\s;|&]+", text)


def split_commands(command: str) -> list[_Simple]:
    """A shell command line as simple commands (pipes, lists and here-documents understood)."""
    bodies: list[str] = []

    def cut(m: re.Match[str]) -> str:
        bodies.append(m.group(3))
        return f"<<{m.group(2)}\n"

    text = _HEREDOC.sub(cut, command)
    out: list[_Simple] = []
    cur = _Simple([], [])
    toks = _tokens(text)
    i = 0
    while i < len(toks):
        t = toks[i]
        if t in _OPS:
            if cur.words or cur.redirects:
                out.append(cur)
            cur = _Simple([], [])
        elif t == "<<":
            cur.stdin_text = bodies.pop(0) if bodies else ""
            i += 1  # the delimiter word
        elif t in _REDIR_OPS:
            target = toks[i + 1] if i + 1 < len(toks) else ""
            if t.startswith((">", "&>")) and target and target not in ("/dev/null",) and not target.isdigit():
                cur.redirects.append(target)
            i += 1
        elif t.isdigit() and i + 1 < len(toks) and toks[i + 1] in _REDIR_OPS:
            pass  # the fd of 2>&1
        else:
            cur.words.append(t)
        i += 1
    if cur.words or cur.redirects:
        out.append(cur)
    return out


def _pathish(arg: str) -> bool:
    return (not arg.startswith("-") and ("/" in arg or "." in arg.lstrip("."))
            and _PATHLIKE.match(arg) is not None and not arg.startswith("http"))


def _paths(args: list[str]) -> list[str]:
    return [a for a in args if _pathish(a)]


def _strip_wrappers(words: list[str]) -> list[str]:
    i = 0
    while i < len(words):
        w = words[i]
        if re.match(r"^[A-Za-z_]\w*=", w):
            i += 1  # FOO=bar cmd
        elif w in _WRAPPERS:
            i += 1
            if w == "timeout" and i < len(words) and re.match(r"^[\d.]+[smh]?$", words[i]):
                i += 1
            while w in ("env", "nice", "stdbuf", "xargs") and i < len(words) and words[i].startswith("-"):
                i += 1
        else:
            break
    return words[i:]


def _python_action(args: list[str], stdin_text: str) -> Action:
    if "-m" in args:
        at = args.index("-m")
        mod = args[at + 1] if at + 1 < len(args) else ""
        if mod in ("pytest", "unittest", "nose", "nose2", "tox", "doctest"):
            return Action("test", _paths(args[at + 2:]), all_files=True)
        if mod in ("py_compile", "compileall"):
            return Action("read", _paths(args[at + 2:]))
        return Action("other", _paths(args[at + 2:]))
    code = args[args.index("-c") + 1] if "-c" in args and args.index("-c") + 1 < len(args) else stdin_text
    if code or "-c" in args or args[:1] == ["-"]:
        return Action("edit", _PYPATH.findall(code)) if _PYWRITE.search(code) else Action("other")
    scripts = _paths(args)
    if scripts and re.search(r"(^|/)(test_[^/]*|[^/]*_test|runtests|run_tests)\.py$", scripts[0]):
        return Action("test", scripts, all_files=True)
    return Action("other", scripts[:1])


def _simple(c: _Simple) -> Action | None:
    """Classify one simple command."""
    words = _strip_wrappers(c.words)
    if any(m in w for w in c.words for m in SUBMIT_MARKERS):
        return Action("submit")
    if not words:
        return Action("edit", c.redirects) if c.redirects else None
    cmd, args = words[0].rsplit("/", 1)[-1], words[1:]
    if cmd in ("cd", "pushd", "popd", "export", "set", "source", ".", "true", "false", "clear", "fi", "done",
               "if", "for", "while", "exit", "sleep"):
        return None
    if cmd in ("echo", "printf", "cat", "tee") and (c.redirects or cmd == "tee"):
        return Action("edit", c.redirects + (_paths(args) if cmd == "tee" else []))
    opts = [a for a in args if a.startswith("-")]
    rest = [a for a in args if not a.startswith("-")]
    if cmd == "sed":
        in_place = any(o.startswith("-i") or o == "--in-place" for o in opts)
        files = _paths(rest[0 if "-e" in opts else 1:])
        return Action("edit" if in_place else "read", files)
    if cmd == "perl" and any(o.startswith("-i") or (o.startswith("-p") and "i" in o) for o in opts):
        return Action("edit", _paths(rest[1:]))
    if cmd in ("awk", "gawk") and "inplace" in args:
        return Action("edit", _paths(rest[1:]))
    if cmd == "git":
        sub = rest[0] if rest else ""
        files = _paths(rest[1:])
        if sub in ("diff", "show", "log", "blame"):
            return Action("read", files, all_files=sub == "diff" and not files)
        if sub in ("grep", "ls-files", "status"):
            return Action("search", files)
        if sub in ("apply", "checkout", "restore", "stash", "am", "mv", "rm"):
            return Action("edit", files)
        return Action("other")
    if cmd in _EDITORS:
        return Action("edit", _paths(args) or ([] if not c.stdin_text else _patch_paths(c.stdin_text)))
    if cmd in _TESTERS or (cmd in ("make", "npm", "yarn", "pnpm") and "test" in args) or \
            (cmd in ("go", "cargo") and args[:1] == ["test"]):
        return Action("test", _paths(args), all_files=True)
    if _PYTHONS.match(cmd):
        return _python_action(args, c.stdin_text)
    if cmd in ("grep", "egrep", "fgrep", "rg", "ag", "ack"):
        return Action("search", _paths(rest[1:]))
    if cmd in _SEARCHERS:
        return Action("search", _paths(args))
    if cmd in _READERS:
        return Action("read", _paths(rest[1:] if cmd in ("awk", "gawk", "jq") else args))
    return Action("other", c.redirects)


@functools.lru_cache(maxsize=65536)
def classify_command(command: str, tool: str = "bash") -> Classified:
    """Classify a shell command line: each simple command in order."""
    if any(m in command for m in SUBMIT_MARKERS):
        return Classified(tool=tool, actions=[Action("submit")], command=command)
    actions = [a for a in (_simple(c) for c in split_commands(command)) if a is not None]
    return Classified(tool=tool, actions=actions or [Action("other")], command=command)


def _args(arguments: str | dict[str, Any]) -> dict[str, Any] | None:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except (json.JSONDecodeError, TypeError):
        return None
    return value if isinstance(value, dict) else None


def _patch_paths(patch: str) -> list[str]:
    return [a or b for a, b in _PATCH_FILE.findall(patch)]


# Structured tools of Claude Code, Codex, SWE-agent / OpenHands, keyed by lower-case name.
_FILE_KEYS = ("file_path", "path", "notebook_path", "filename")
_TOOL_KIND = {
    "read": "read", "view": "read", "view_image": "read", "notebookread": "read", "read_file": "read",
    "edit": "edit", "multiedit": "edit", "write": "edit", "notebookedit": "edit", "write_file": "edit",
    "create_file": "edit", "replace": "edit", "str_replace": "edit", "insert": "edit",
    "grep": "search", "glob": "search", "ls": "search", "list_dir": "search", "list_directory": "search",
    "search": "search", "find_file": "search", "search_file": "search", "search_dir": "search",
    "codebase_search": "search", "file_search": "search",
    "submit": "submit", "finish": "submit", "task_complete": "submit",
}
_SHELL_TOOLS = {"bash", "shell", "execute_bash", "run_command", "exec_command", "local_shell", "terminal",
                "run_shell_command", "container.exec"}
_SHELL_KEYS = ("command", "cmd", "commands", "script")
_EDITOR_TOOLS = {"str_replace_editor", "str_replace_based_edit_tool", "edit_file", "text_editor"}


def classify_tool_call(name: str, arguments: str | dict[str, Any]) -> Classified:
    """Classify one tool call of any harness from its name and JSON arguments (the result is shared: don't mutate)."""
    if isinstance(arguments, str):
        return _classify_cached(name, arguments)
    return _classify(name, arguments)


@functools.lru_cache(maxsize=65536)
def _classify_cached(name: str, arguments: str) -> Classified:
    return _classify(name, arguments)


def _classify(name: str, arguments: str | dict[str, Any]) -> Classified:
    args = _args(arguments)
    low = name.lower()
    if args is None:
        return Classified(tool=name, actions=[Action("other")], valid=False)
    if low in _EDITOR_TOOLS:  # {"command": "view" | "create" | "str_replace" | "insert" | "undo_edit", "path": ...}
        path = next((str(args[k]) for k in _FILE_KEYS if isinstance(args.get(k), str)), None)
        sub = str(args.get("command", "view"))
        return Classified(name, [Action("read" if sub == "view" else "edit", [path] if path else [])],
                          valid=path is not None)
    if low in _SHELL_TOOLS or (low not in _TOOL_KIND and any(k in args for k in _SHELL_KEYS)):
        cmd = next((args[k] for k in _SHELL_KEYS if k in args), None)
        if isinstance(cmd, list):  # Codex: ["bash", "-lc", "..."] or ["apply_patch", "*** Begin Patch ..."]
            words = [str(w) for w in cmd]
            if words and words[0] in ("apply_patch", "applypatch"):
                return Classified(name, [Action("edit", _patch_paths(" ".join(words[1:])))], command=" ".join(words))
            cmd = words[-1] if len(words) >= 3 and words[1] in ("-lc", "-c") else shlex.join(words)
        if not isinstance(cmd, str) or not cmd.strip():
            return Classified(tool=name, actions=[Action("other")], valid=False)
        if cmd.lstrip().startswith(("apply_patch", "*** Begin Patch")):
            return Classified(name, [Action("edit", _patch_paths(cmd))], command=cmd)
        out = classify_command(cmd, tool=name)
        return out
    if low in ("apply_patch", "applypatch", "patch"):
        patch = next((v for v in args.values() if isinstance(v, str)), "")
        return Classified(name, [Action("edit", _patch_paths(patch))], valid=bool(patch))
    path = next((str(args[k]) for k in _FILE_KEYS if isinstance(args.get(k), str)), None)
    paths = [path] if path else []
    kind = _TOOL_KIND.get(low)
    if kind is None:
        return Classified(name, [Action("other", paths)])
    if kind == "search" and not paths:
        paths = [str(args[k]) for k in ("pattern", "glob") if isinstance(args.get(k), str) and "/" in args[k]]
    valid = kind not in ("read", "edit") or bool(paths)
    return Classified(name, [Action(kind, paths)], valid=valid)


def same_file(a: str, b: str) -> bool:
    """Do two path spellings name the same file? (`/repo/src/x.py` vs `./src/x.py` vs `x.py`)"""
    pa = [p for p in a.replace("\\", "/").split("/") if p not in ("", ".")]
    pb = [p for p in b.replace("\\", "/").split("/") if p not in ("", ".")]
    if not pa or not pb:
        return False
    n = min(len(pa), len(pb))
    return pa[-n:] == pb[-n:]
