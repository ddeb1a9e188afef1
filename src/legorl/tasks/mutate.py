"""AST mutation operators for synthetic bugs (``legorl tasks synth``).

Each operator finds sites in a module with the stdlib ``ast`` module and describes the bug as
byte-range edits of the original text, so a mutant differs from its source only in the edited
tokens (the gold patch is a one- or two-line diff) and keeps its formatting and comments.

Operators:

* ``compare``: ``<``/``<=``, ``>``/``>=``, ``==``/``!=``, ``is``/``is not``, ``in``/``not in``;
* ``boolean``: ``and``/``or``, a dropped ``not``;
* ``arithmetic``: ``+``/``-``, ``*``/``/``, ``//``/``/``, ``%``/``//`` (also in ``+=`` and friends);
* ``off_by_one``: a ``range()`` bound, a slice bound or a constant index moved by one;
* ``constant``: an integer (0 -> 1, 1 -> 0, n -> n + 1) or ``True``/``False`` flipped;
* ``swap_args``: the first two positional arguments of a call swapped;
* ``drop_branch``: an ``if`` without ``else`` replaced by ``pass``, or an ``else:`` block removed;
* ``drop_return``: a ``return <value>`` replaced by ``pass``;
* ``builtin``: ``min``/``max``, ``any``/``all``, ``startswith``/``endswith``, ``lower``/``upper``, ...

Sites that only select the interpreter or platform (``sys.version_info``, ``TYPE_CHECKING``,
``if __name__ == "__main__"``), docstrings, annotations and ``assert`` statements are skipped.
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass

OPERATORS = (
    "compare", "boolean", "arithmetic", "off_by_one", "constant", "swap_args", "drop_branch", "drop_return",
    "builtin",
)  # fmt: skip

_CMP = {
    ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"),
    ast.In: ("in", "not in"), ast.NotIn: ("not in", "in"),
}  # fmt: skip
_ARITH = {
    ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "/"), ast.Div: ("/", "//"),
    ast.FloorDiv: ("//", "/"), ast.Mod: ("%", "//"),
}  # fmt: skip
_BUILTINS = {"min": "max", "max": "min", "any": "all", "all": "any"}
_METHODS = {
    "startswith": "endswith", "endswith": "startswith", "lower": "upper", "upper": "lower",
    "lstrip": "rstrip", "rstrip": "lstrip", "find": "rfind", "rfind": "find", "index": "rindex",
    "rindex": "index", "split": "rsplit", "rsplit": "split", "isdigit": "isalpha", "isalpha": "isdigit",
}  # fmt: skip
# Calls whose arguments are not interchangeable values (swapping them only raises TypeError).
_NO_SWAP = {"isinstance", "issubclass", "getattr", "setattr", "hasattr", "delattr", "print", "super", "type"}
# Code that only picks the interpreter, platform or import path: mutating it tests nothing real.
_ENV_MARKERS = re.compile(
    rb"version_info|sys\.platform|os\.name|TYPE_CHECKING|\bPY2\b|\bPY3\b|PYPY|__name__|sys\.version|implementation"
)
_BLANK = b" \t\r\n\\()"


@dataclass(frozen=True)
class Mutation:
    """One bug: ``edits`` are (start, end, replacement) byte ranges of the original UTF-8 text."""

    operator: str
    path: str
    line: int  # 1-based first line the edit touches
    edits: tuple[tuple[int, int, bytes], ...]
    description: str  # for logs and reports, never for the agent

    def apply(self, source: str) -> str:
        data = source.encode("utf-8")
        for start, end, repl in sorted(self.edits, reverse=True):
            data = data[:start] + repl + data[end:]
        return data.decode("utf-8")

    @property
    def key(self) -> str:
        """A stable id for this mutation (path, operator and edits)."""
        h = hashlib.sha256(f"{self.path}|{self.operator}|{self.edits!r}".encode())
        return h.hexdigest()[:10]


class _Source:
    def __init__(self, text: str) -> None:
        self.data = text.encode("utf-8")
        self.starts = [0]
        for i, b in enumerate(self.data):
            if b == 0x0A:
                self.starts.append(i + 1)

    def off(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col  # ast columns are UTF-8 byte offsets

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.off(node.lineno, node.col_offset), self.off(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined,arg-type]

    def text(self, node: ast.AST) -> bytes:
        s, e = self.span(node)
        return self.data[s:e]

    def line_start(self, line: int) -> int:
        return self.starts[line - 1]

    def line_end(self, line: int) -> int:
        """Offset just past the newline ending ``line``."""
        return self.starts[line] if line < len(self.starts) else len(self.data)

    def find_token(self, start: int, end: int, expected: str) -> tuple[int, int] | None:
        """The operator between two operands: the gap minus parentheses, blanks and comments."""
        gap = re.sub(rb"#[^\n]*", lambda m: b" " * len(m.group()), self.data[start:end])
        i, j = 0, len(gap)
        while i < j and gap[i] in _BLANK:
            i += 1
        while j > i and gap[j - 1] in _BLANK:
            j -= 1
        if b" ".join(gap[i:j].split()) != expected.encode():
            return None
        return start + i, start + j


def _skip_zones(tree: ast.Module, src: _Source) -> list[tuple[int, int]]:
    """Byte ranges never mutated: environment checks, docstrings, annotations, asserts."""
    zones: list[tuple[int, int]] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.If, ast.IfExp, ast.While))
            and _ENV_MARKERS.search(src.text(node.test))
            or isinstance(node, ast.Assert)
        ):
            zones.append(src.span(node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.returns is not None:
                zones.append(src.span(node.returns))
            for a in (
                *node.args.posonlyargs,
                *node.args.args,
                *node.args.kwonlyargs,
                node.args.vararg,
                node.args.kwarg,
            ):
                if a is not None and a.annotation is not None:
                    zones.append(src.span(a.annotation))
        elif isinstance(node, ast.AnnAssign):
            zones.append(src.span(node.annotation))
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id.startswith("__") and t.id.endswith("__") for t in node.targets
        ):
            zones.append(src.span(node))  # __all__, __version__, ...
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                zones.append(src.span(body[0]))
    return zones


def _int_value(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)
            and type(node.operand.value) is int):  # fmt: skip
        return -node.operand.value
    return None


class _Finder:
    def __init__(self, text: str, path: str) -> None:
        self.src = _Source(text)
        self.path = path
        self.tree = ast.parse(text)
        self.zones = _skip_zones(self.tree, self.src)
        self.found: list[Mutation] = []
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(self.tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent

    def skipped(self, start: int, end: int) -> bool:
        return any(zs <= start and end <= ze for zs, ze in self.zones)

    def add(
        self, operator: str, node: ast.AST, edits: list[tuple[int, int, bytes]], description: str
    ) -> None:
        if not edits or any(self.skipped(s, e) for s, e, _ in edits):
            return
        if all(self.src.data[s:e] == r for s, e, r in edits):
            return
        self.found.append(Mutation(operator, self.path, node.lineno, tuple(edits), description))  # type: ignore[attr-defined]

    # ---- operators -----------------------------------------------------------------------------
    def compare(self, node: ast.Compare) -> None:
        left: ast.AST = node.left
        for op, right in zip(node.ops, node.comparators, strict=True):
            old, new = _CMP[type(op)]
            tok = self.src.find_token(self.src.span(left)[1], self.src.span(right)[0], old)
            if tok:
                self.add("compare", node, [(*tok, new.encode())], f"`{old}` -> `{new}`")
            left = right

    def boolop(self, node: ast.BoolOp) -> None:
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        for a, b in zip(node.values, node.values[1:], strict=False):
            tok = self.src.find_token(self.src.span(a)[1], self.src.span(b)[0], old)
            if tok:
                self.add("boolean", node, [(*tok, new.encode())], f"`{old}` -> `{new}`")

    def unary_not(self, node: ast.UnaryOp) -> None:
        start = self.src.span(node)[0]
        operand_start = self.src.span(node.operand)[0]
        head = self.src.data[start:operand_start]
        m = re.match(rb"not[ \t]*", head)
        if m and head[m.end() :].strip(b"( \t") == b"":
            self.add("boolean", node, [(start, start + m.end(), b"")], "dropped `not`")

    def binop(self, node: ast.BinOp) -> None:
        if type(node.op) not in _ARITH:
            return
        strs = [x for x in (node.left, node.right) if isinstance(x, (ast.Constant, ast.JoinedStr))
                and not isinstance(getattr(x, "value", 0), (int, float))]  # fmt: skip
        if strs:
            return  # string concatenation / %-formatting
        old, new = _ARITH[type(node.op)]
        tok = self.src.find_token(self.src.span(node.left)[1], self.src.span(node.right)[0], old)
        if tok:
            self.add("arithmetic", node, [(*tok, new.encode())], f"`{old}` -> `{new}`")

    def augassign(self, node: ast.AugAssign) -> None:
        if (
            type(node.op) not in _ARITH
            or isinstance(node.value, (ast.Constant, ast.JoinedStr))
            and isinstance(getattr(node.value, "value", 0), str)
        ):
            return
        old, new = _ARITH[type(node.op)]
        tok = self.src.find_token(self.src.span(node.target)[1], self.src.span(node.value)[0], old + "=")
        if tok:
            self.add("arithmetic", node, [(*tok, (new + "=").encode())], f"`{old}=` -> `{new}=`")

    def shift(self, node: ast.AST, delta: int) -> list[tuple[int, int, bytes]]:
        """Edits that move the value of expression ``node`` by ``delta`` (+1 / -1), minimally."""
        s, e = self.src.span(node)
        if (v := _int_value(node)) is not None:
            return [(s, e, str(v + delta).encode())]
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, (ast.Add, ast.Sub))
            and _int_value(node.right) is not None
        ):
            k = _int_value(node.right)
            assert k is not None
            k2 = k + delta if isinstance(node.op, ast.Add) else k - delta
            rs, re_ = self.src.span(node.right)
            if k2 == 0:
                return [(self.src.span(node.left)[1], e, b"")]  # `n - 1` -> `n`
            if k2 < 0:
                return []
            return [(rs, re_, str(k2).encode())]
        sign = b" + 1" if delta > 0 else b" - 1"
        if isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
            return [(e, e, sign)]
        return [(s, s, b"("), (e, e, b")" + sign)]

    def off_by_one(self, node: ast.AST) -> None:
        targets: list[ast.AST] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
            targets = [a for a in node.args[:2] if not isinstance(a, ast.Starred)]
        elif isinstance(node, ast.Slice):
            targets = [x for x in (node.lower, node.upper) if x is not None]
        elif isinstance(node, ast.Subscript) and _int_value(node.slice) is not None:
            targets = [node.slice]
        for t in targets:
            for delta in (1, -1):
                if edits := self.shift(t, delta):
                    what = "range bound" if isinstance(node, ast.Call) else "slice bound" if isinstance(node, ast.Slice) \
                        else "index"  # fmt: skip
                    self.add("off_by_one", t, edits, f"{what} {'+' if delta > 0 else '-'}1")

    def constant(self, node: ast.Constant) -> None:
        parent = self.parents.get(node)
        if isinstance(parent, (ast.Slice, ast.UnaryOp)) or (
            isinstance(parent, ast.Subscript) and parent.slice is node
        ):
            return  # off_by_one's sites
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "range":
            return
        s, e = self.src.span(node)
        if node.value is True or node.value is False:
            new = b"False" if node.value else b"True"
            self.add("constant", node, [(s, e, new)], f"`{node.value}` -> `{new.decode()}`")
        elif type(node.value) is int:
            v = node.value
            new_v = 1 if v == 0 else 0 if v == 1 else v + 1
            self.add("constant", node, [(s, e, str(new_v).encode())], f"{v} -> {new_v}")

    def swap_args(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in _NO_SWAP:
            return
        args = node.args
        if len(args) < 2 or any(isinstance(a, ast.Starred) for a in args[:2]):
            return
        a, b = args[0], args[1]
        ta, tb = self.src.text(a), self.src.text(b)
        if ta == tb or b"\n" in ta or b"\n" in tb:
            return
        (sa, ea), (sb, eb) = self.src.span(a), self.src.span(b)
        self.add("swap_args", node, [(sa, ea, tb), (sb, eb, ta)], "first two arguments swapped")

    def drop_branch(self, node: ast.If) -> None:
        s, e = self.src.span(node)
        if not node.orelse:
            if node.end_lineno - node.lineno <= 4:  # type: ignore[operator]
                self.add("drop_branch", node, [(s, e, b"pass")], "`if` block removed")
            return
        first = node.orelse[0]
        if isinstance(first, ast.If) and self.src.data[self.src.span(first)[0] :].startswith(b"elif"):
            return
        for line in range(node.body[-1].end_lineno + 1, first.lineno + 1):  # type: ignore[operator]
            text = self.src.data[self.src.line_start(line) : self.src.line_end(line)]
            if re.match(rb"[ \t]*else[ \t]*:", text):
                if not re.match(rb"[ \t]*else[ \t]*:[ \t]*(#[^\n]*)?\r?\n?$", text):
                    return  # `else: x` on one line: leave it
                end_line = node.orelse[-1].end_lineno
                if end_line - line > 6:  # type: ignore[operator]
                    return  # keep the gold patch small
                tail = self.src.data[
                    self.src.off(end_line, node.orelse[-1].end_col_offset) : self.src.line_end(end_line)
                ]  # type: ignore[arg-type]
                if tail.strip() and not tail.strip().startswith(b"#"):
                    return
                self.add("drop_branch", node.orelse[0], [(self.src.line_start(line), self.src.line_end(end_line), b"")],  # type: ignore[arg-type]
                         "`else` block removed")  # fmt: skip
                return

    def drop_return(self, node: ast.Return) -> None:
        if node.value is None or (isinstance(node.value, ast.Constant) and node.value.value is None):
            return
        if node.end_lineno - node.lineno > 2:  # type: ignore[operator]
            return  # keep the gold patch small
        s, e = self.src.span(node)
        self.add("drop_return", node, [(s, e, b"pass")], "`return` replaced by `pass`")

    def builtin(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Name) and f.id in _BUILTINS:
            s, e = self.src.span(f)
            self.add("builtin", node, [(s, e, _BUILTINS[f.id].encode())], f"`{f.id}` -> `{_BUILTINS[f.id]}`")
        elif isinstance(f, ast.Attribute) and f.attr in _METHODS:
            e = self.src.span(f)[1]
            s = e - len(f.attr.encode())
            if self.src.data[s:e] == f.attr.encode():
                self.add(
                    "builtin",
                    node,
                    [(s, e, _METHODS[f.attr].encode())],
                    f"`.{f.attr}` -> `.{_METHODS[f.attr]}`",
                )

    def run(self) -> list[Mutation]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Compare):
                self.compare(node)
            elif isinstance(node, ast.BoolOp):
                self.boolop(node)
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                self.unary_not(node)
            elif isinstance(node, ast.BinOp):
                self.binop(node)
            elif isinstance(node, ast.AugAssign):
                self.augassign(node)
            elif isinstance(node, ast.Constant):
                self.constant(node)
            elif isinstance(node, ast.If):
                self.drop_branch(node)
            elif isinstance(node, ast.Return):
                self.drop_return(node)
            if isinstance(node, ast.Call):
                self.swap_args(node)
                self.builtin(node)
            if isinstance(node, (ast.Call, ast.Slice, ast.Subscript)):
                self.off_by_one(node)
        self.found.sort(key=lambda m: (m.edits[0][0], m.operator, m.edits))
        return self.found


def find_mutations(
    source: str, path: str = "<string>", operators: tuple[str, ...] | None = None
) -> list[Mutation]:
    """Every candidate mutation of ``source`` (a module's text), in source order.

    A candidate is not yet known to be a bug: ``mutant_ok`` checks that it parses and changes the
    AST, and ``legorl tasks synth`` that a test notices it. Raises ``SyntaxError`` if ``source``
    does not parse."""
    found = _Finder(source, path).run()
    if operators is not None:
        unknown = set(operators) - set(OPERATORS)
        if unknown:
            raise ValueError(f"unknown mutation operators {sorted(unknown)}; known: {list(OPERATORS)}")
        found = [m for m in found if m.operator in operators]
    return found


def mutant_ok(source: str, mutated: str) -> str | None:
    """None when ``mutated`` parses and differs from ``source`` in its AST; else the reason
    (``syntax`` or ``equivalent``)."""
    try:
        new = ast.parse(mutated)
    except SyntaxError:
        return "syntax"
    if ast.dump(new) == ast.dump(ast.parse(source)):
        return "equivalent"
    return None
