"""The package's shape (docs/code_map.md): stage folders on floors, each importing only its own floor and the ones
below; no import circle; no module importing another module's private name; no module too long to read in one
sitting; at most 10 files at the package's top; and no private accelerate internals reached from our code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hf_arb"
MAX_LINES = 400
#: the floors, lowest first: a module may import its own floor and the ones below, never one above
FLOORS = ("ground", "buckets", "images", "sampling", "annotate", "families", "packing", "train", "cli", "testing")
#: imports that run inside a function and point "up", each with its reason
ALLOWED_LAZY = {("hf_arb.sampling", "hf_arb.packing.sampler")}  # hf_arb.sampling.PackBatchSampler, a 0.1 path


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
    assert graph["hf_arb.cli.app"] >= {"hf_arb.cli.annotate", "hf_arb.cli.buckets"}  # the graph sees lazy imports
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


def floor(module: str) -> int:
    """The floor of a module: its stage folder's place in :data:`FLOORS` (top-level files are the ground floor)."""
    parts = module.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 2 or (len(parts) == 2 and parts[1] in FLOORS) else 0


def test_lower_floors_never_import_upper_ones() -> None:
    upward = sorted(f"{a} (floor {FLOORS[floor(a)]}) imports {b} (floor {FLOORS[floor(b)]})"
                    for a, targets in _graph().items() if a != "hf_arb.__main__" for b in targets if floor(b) > floor(a))
    assert not upward, upward


def test_floor_check_sees_an_upward_import() -> None:
    assert floor("hf_arb.buckets.sets") < floor("hf_arb.images.fitting") < floor("hf_arb.train.latents")
    assert floor("hf_arb.rng") == 0 and floor("hf_arb.cli") == FLOORS.index("cli")


def test_every_stage_folder_says_what_it_owns_and_may_import() -> None:
    for name in FLOORS[1:]:
        doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text())) or ""
        assert doc and ("May import" in doc or "Imports no other floor" in doc), name


def test_top_level_holds_at_most_ten_files() -> None:
    files = sorted(p.name for p in PKG.glob("*.py"))
    assert len(files) <= 10, files


def _private_uses(path: Path) -> list[str]:
    """``from hf_arb... import _name`` and ``obj._name`` on another object, for a module that does not define it."""
    tree = ast.parse(path.read_text())
    own = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
           and n.value.id in ("self", "cls") and isinstance(n.ctx, ast.Store)}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hf_arb")):
            hits += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                     if a.name.startswith("_") and not a.name.startswith("__")]
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
              and isinstance(node.value, ast.Name) and node.value.id not in ("self", "cls") and node.attr not in own):
            hits.append(f"{path.name}:{node.lineno} reads {node.value.id}.{node.attr}")
    return hits


def test_no_module_uses_another_modules_private_name() -> None:
    script = PKG.parent / "train_text_to_image_arb.py"
    hits = [h for p in [*PKG.rglob("*.py"), script] for h in _private_uses(p)]
    hits = [h for h in hits if "._asdict" not in h and "._replace" not in h and "._fields" not in h]  # namedtuple API
    assert not hits, hits


def test_private_use_check_finds_one(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from hf_arb.images.geometry import _hidden\nx = sampler._epoch\n")
    assert len(_private_uses(probe)) == 2


def test_every_moved_path_imports_the_same_module_with_a_deprecation_warning() -> None:
    """Release 0.1's module paths (docs/api.md, "Moved paths") still import, for one release: the same module object
    as the new path, and a DeprecationWarning that names the new path."""
    import importlib
    import sys
    import warnings

    from hf_arb.moved import MOVED

    bad = []
    for old, new in MOVED.items():
        sys.modules.pop(old, None)  # ask the finder again even if an earlier test imported the old path
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        if module is not importlib.import_module(new) or not any(
                issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught):
            bad.append(old)
    assert not bad, bad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from hf_arb.packing import PackBatchSampler as new_packs
        from hf_arb.sampling import PackBatchSampler
        from hf_arb.testing.tiny import save_tiny_sd as new_save
        from hf_arb.tiny import save_tiny_sd
    assert save_tiny_sd is new_save and PackBatchSampler is new_packs
    assert len(MOVED) >= 40


#: tests of the run's mode (issue #33): outside the data sources (train/sources/, whose factory picks the mode)
#: and argument validation, the script and train/ ask the source instead
MODE_FLAG_TESTS = re.compile(r"args\.packing|args\.streaming|args\.resolution_schedule|reference_image_column"
                             r"|stream is None|getattr\(\w+, \"(?:packing|streaming|resolutions|locate)\""
                             r"|len\(args\.resolutions\)")
#: where the mode flags may be read: the sources (their factory and constructors) and the argument parser/checks
MODE_FLAG_OWNERS = ("hf_arb/train/sources/", "hf_arb/train/args.py", "hf_arb/train/arg_checks.py")


def _mode_flag_tests(paths: list[Path]) -> list[str]:
    hits = []
    for p in paths:
        name = p.relative_to(PKG.parent).as_posix() if p.is_relative_to(PKG.parent) else p.name
        if not name.startswith(MODE_FLAG_OWNERS):
            hits += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(p.read_text().splitlines(), 1)
                     if MODE_FLAG_TESTS.search(line)]
    return hits


def test_only_the_data_sources_test_the_mode_flags() -> None:
    """The script and train/ never test --packing, --streaming, the tier schedule or reference columns (nor whether
    a stream is running): they ask the run's data source (hf_arb.train.sources), built once from the flags."""
    script = PKG.parent / "train_text_to_image_arb.py"
    hits = _mode_flag_tests([script, *sorted((PKG / "train").rglob("*.py"))])
    assert not hits, "mode flags tested outside hf_arb/train/sources/ and the argument checks:\n" + "\n".join(hits)
    owners = [p for p in (PKG / "train" / "sources").glob("*.py") if MODE_FLAG_TESTS.search(p.read_text())]
    assert owners, "the pattern no longer matches the sources' own flag reads"


def test_mode_flag_check_finds_one(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("if args.packing:\n    pass\nlocate = getattr(sampler, \"locate\", None)\nif stream is None: pass\n")
    assert len(_mode_flag_tests([probe])) == 3


def test_train_holds_at_most_fifteen_modules_and_its_docstrings_name_them() -> None:
    """train/ stays readable: at most 15 modules directly (the data sources are a subpackage), and the __init__
    docstrings of train/ and train/sources/ name every module of their folder."""
    for folder, most in ((PKG / "train", 15), (PKG / "train" / "sources", 15)):
        modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
        assert len(modules) + 1 <= most, (folder.name, modules)
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        unnamed = [m for m in modules if f".{m}`" not in doc]
        assert not unnamed, f"{folder.name}/__init__.py's docstring does not name {unnamed}"


def test_train_loop_takes_at_most_five_parameters() -> None:
    """The loop gets one prepared run (and few other things), not a dozen loose parameters."""
    tree = ast.parse((PKG.parent / "train_text_to_image_arb.py").read_text())
    loop = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train_loop")
    assert len(loop.args.args) + len(loop.args.kwonlyargs) <= 5, ast.unparse(loop.args)
