"""The package's shape: no import cycles between hf_arb modules, no module too long to read in one sitting,
and no private accelerate internals reached from our code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hf_arb"
MAX_LINES = 420
#: imports that run inside a function, allowed to point "up": a convenience alias and its reason
ALLOWED_LAZY = {("hf_arb.buckets", "hf_arb.schema")}  # BucketSet.from_dataset = schema.buckets_from_dataset


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported hf_arb module, at module level?) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    top_level = {id(n) for n in tree.body}
    for node in tree.body:  # imports under `if TYPE_CHECKING:` are for type checkers only
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            top_level |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [f"{mod}.{a.name}" for a in node.names]
            targets = [n for n in names if (PKG.parent / Path(*n.split("."))).with_suffix(".py").exists()] or [mod]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t.startswith("hf_arb") and t != me:
                out.append((t, id(node) in top_level))
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        me = _module_name(path)
        if me == "hf_arb":  # the package root's lazy re-exports point at everything by design
            continue
        edges = graph.setdefault(me, set())
        for target, top in _imports(path):
            if target == "hf_arb" or (not top and (me, target) in ALLOWED_LAZY):
                continue
            edges.add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycles() -> None:
    graph = _graph()
    assert graph["hf_arb.cli"] >= {"hf_arb.annotate_cli", "hf_arb.cli_buckets"}  # the graph sees lazy imports
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_modules_are_short() -> None:
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_no_private_accelerate_internals() -> None:
    banned = re.compile(r"_getframe|_shared_state|\._dataloaders|_PYTORCH_DATALOADER_KWARGS")
    hits = [f"{p.relative_to(PKG.parent)}:{i}" for p in PKG.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if banned.search(line)]
    assert not hits, hits
