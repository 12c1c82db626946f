"""Wrap the lines ruff reports as too long (E501, ``[tool.ruff] line-length``) in the house style.

Run from the repository root after ``ruff check --fix .``: ``python scripts/wrap_long_lines.py [RUFF]`` (``RUFF``:
the ruff executable, default ``ruff``). In rounds, until nothing changes:

1. a comment line and a docstring line are re-flowed at a space (never inside double backquotes, a table row or a
   code example); a trailing comment moves to its own line above the code;
2. a code line is broken after its last comma that fits, the rest aligned under the opening bracket (the aligned
   continuation the code base uses);
3. a line that is one string literal (a part of an implicit concatenation) is split in two at a space;
4. what is left goes to ``ruff format --range`` (that statement only).

The lines it could not wrap are printed; wrap those by hand.
"""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

RUFF = sys.argv[1] if len(sys.argv) > 1 else "ruff"
WIDTH = int(re.search(r"line-length\s*=\s*(\d+)", Path("pyproject.toml").read_text()).group(1))
LITERAL = re.compile(r'^(\s*)([a-zA-Z_]+=)?(rf|fr|f|r|b)?"(.*)"(\)?,?|\))?\s*$')


def violations() -> dict[str, list[int]]:
    out = subprocess.run([RUFF, "check", ".", "--select", "E501", "--output-format", "json"], capture_output=True,
                         text=True).stdout
    found: dict[str, list[int]] = {}
    for v in json.loads(out or "[]"):
        found.setdefault(v["filename"], []).append(v["location"]["row"])
    return found


def docstring_rows(src: str) -> set[int]:
    rows: set[int] = set()
    src_lines = src.splitlines()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                fenced = False
                for row in range(first.lineno, first.end_lineno + 1):  # not the code examples between ``` fences
                    text = src_lines[row - 1].strip()
                    if text.startswith("```"):
                        fenced = not fenced
                    elif not fenced and not text.startswith(">>>"):
                        rows.add(row)
    return rows


def scan(src: str) -> tuple[dict[int, tuple[int, bool]], dict[int, list[tuple[int, int]]]]:
    """Comments (row -> (column, code before it)) and commas outside f-strings (row -> [(column, align column)])."""
    comments: dict[int, tuple[int, bool]] = {}
    commas: dict[int, list[tuple[int, int]]] = {}
    stack: list[int] = []
    lines = src.splitlines()
    fstring = 0
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        kind = tokenize.tok_name[tok.type]
        if kind == "FSTRING_START":
            fstring += 1
        elif kind == "FSTRING_END":
            fstring -= 1
        elif tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.start[1], bool(tok.line[:tok.start[1]].strip()))
        elif tok.type == tokenize.OP and not fstring:
            row, col = tok.start
            if tok.string in "([{":
                rest = lines[row - 1][col + 1:].split("#")[0].strip()
                stack.append(col + 1 if rest else -1)  # -1: a hanging bracket (nothing after it on its line)
            elif tok.string in ")]}" and stack:
                stack.pop()
            elif tok.string == "," and stack:
                commas.setdefault(row, []).append((col, stack[-1]))
    return comments, commas


def split_text(text: str, width: int) -> int | None:
    cut = text.rfind(" ", 0, width + 1)
    while cut > 0 and text[:cut].count("``") % 2:
        cut = text.rfind(" ", 0, cut)
    return cut if cut > len(text) - len(text.lstrip()) else None


def wrap(line: str, row: int, docs: set[int], comments: dict, commas: dict) -> list[str] | None:
    """The lines replacing ``line``, or None."""
    indent = line[: len(line) - len(line.lstrip())]
    if row in comments and not comments[row][1]:
        body = line.lstrip()[1:].lstrip()
        cut = split_text(body, WIDTH - len(indent) - 2)
        return [f"{indent}# {body[:cut]}", f"{indent}# {body[cut + 1:]}"] if cut else None
    if row in comments and not line[comments[row][0]:].startswith(("# noqa", "# type:", "# pragma")):
        col = comments[row][0]
        code = line[:col].rstrip()
        if len(code) <= WIDTH:
            return [indent + line[col:], code]
    if row in docs:
        if line.lstrip().startswith(("|", "```", ">>>")):
            return None
        cut = split_text(line, WIDTH)
        return [line[:cut], indent + line[cut + 1:]] if cut else None
    for col, align in sorted(commas.get(row, []), reverse=True):
        if (col + 1 <= WIDTH and line[col + 1:col + 2] == " " and line[col + 2:].strip()
                and not re.match(r"\s*\w+\s+in\s", line[col + 1:])):  # not inside a ``for a, b in`` target
            rest = line[col + 2:].lstrip()
            pad = align if align >= 0 else len(indent)
            if pad + len(rest) <= WIDTH and pad <= WIDTH * 2 // 3:  # deeper: the formatter's layout reads better
                return [line[:col + 1], " " * pad + rest]
    m = LITERAL.match(line)
    if m and '"' not in m.group(4).replace('\\"', ""):
        lead, kw, prefix = m.group(1), m.group(2) or "", m.group(3) or ""
        start = len(lead) + len(kw) + len(prefix) + 1
        for i in range(min(len(line) - 1, WIDTH - 2), start + 10, -1):
            if line[i] == " " and ("f" not in prefix or line[start:i].count("{") == line[start:i].count("}")):
                return [line[:i + 1] + '"', " " * (len(lead) + len(kw)) + prefix + '"' + line[i + 1:]]
    return None


def mergeable(carried: str, following: str) -> bool:
    """Whether the words carried from a docstring line can join the next line: same paragraph and indentation, not
    a section header, list item, table row, code example or the closing quotes."""
    indent = len(carried) - len(carried.lstrip())
    text = following.lstrip()
    return (bool(text) and len(following) - len(text) == indent and not text.startswith(('"""', "- ", "* ", "|", "```",
            ">>>", ":")) and not re.match(r"[A-Z][A-Za-z ]{0,30}:$", text.rstrip()) and not re.match(r"\d+\. ", text)
            and not carried.rstrip().endswith(":") and '"""' not in carried)


def one_round() -> bool:
    changed = False
    for path, rows in violations().items():
        src = Path(path).read_text()
        lines = src.splitlines()
        docs, (comments, commas) = docstring_rows(src), scan(src)
        left = []
        for row in sorted(rows, reverse=True):
            new = wrap(lines[row - 1], row, docs, comments, commas)
            if new and row in docs and row + 1 in docs and row < len(lines) and mergeable(new[1], lines[row]):
                lines[row - 1:row + 1] = [new[0], new[1] + " " + lines[row].lstrip()]
                changed = True
            elif new:
                lines[row - 1:row] = new
                changed = True
            else:
                left.append(row)
        Path(path).write_text("\n".join(lines) + ("\n" if src.endswith("\n") else ""))
    return changed


def main() -> None:
    for _ in range(20):
        if not one_round():
            break
    for path, rows in violations().items():  # the formatter, for what the rules above left
        src = Path(path).read_text()
        skip = docstring_rows(src) | {r for r, (_, code) in scan(src)[0].items() if not code}
        for row in sorted(set(rows) - skip, reverse=True):
            subprocess.run([RUFF, "format", "--range", f"{row}:1-{row + 1}:1", path], capture_output=True)
    for _ in range(20):
        if not one_round():
            break
    for path, rows in violations().items():
        for row in rows:
            print(f"{path}:{row}: still too long; wrap it by hand")


if __name__ == "__main__":
    main()
