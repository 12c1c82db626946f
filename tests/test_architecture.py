"""The package's shape (docs/code_map.md): stage folders on floors, each importing only its own floor and the ones
below; no import circle; no module importing another module's private name; folders split by concept (at most 15
modules directly in any folder but families/, at most 10 files at the package's top, every module of sampling/ named
by its folder's docstring); and no private accelerate internals reached from our code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hf_arb"
#: modules (``*.py``, ``__init__`` included) a folder may hold directly: more means it holds several concepts, which
#: go into subfolders (issue 33: the cap replaces a 400-line cap per module, which split files by length, not concept)
MAX_MODULES = 15
#: folders allowed more: families/ holds one module per model family by design
MODULE_CAP_EXEMPT = {"families": "one module per model family"}
#: folders over the cap while another change splits them (drop the entry when it lands)
MODULE_CAP_PENDING: dict[str, str] = {}  # folders over the cap while a split is under way (none now)
#: the floors, lowest first: a module may import its own floor and the ones below, never one above
FLOORS = ("ground", "buckets", "images", "sampling", "annotate", "families", "packing", "train", "cli", "testing")
#: stage folders that share a floor named in :data:`FLOORS`: one clip (video/) is the same level of concern as one image
#: (images/), and reads an image by its header as a 1-frame clip
SAME_FLOOR = {"video": "images"}
#: every stage folder: the floors' own and those sharing one
STAGE_FOLDERS = (*FLOORS[1:], *SAME_FLOOR)
#: imports that run inside a function and point "up", each with its reason
ALLOWED_LAZY = {("hf_arb.sampling", "hf_arb.packing.sampler")}  # hf_arb.sampling.PackBatchSampler, a 0.1 path
#: what ``testing/`` may import besides the ground floor, each with its reason (docs/code_map.md): a tiny Qwen-Image
#: edit model is built and saved with the processor and the saver a trained one is (the Qwen2-VL processor without
#: torchvision, the Hub layout stock diffusers loads), not with copies of them
TESTING_MAY_IMPORT = {"hf_arb.families.qwenimage_edit"}


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


def _crowded_folders(root: Path) -> dict[str, int]:
    """Folders under ``root`` holding more than :data:`MAX_MODULES` modules directly, with their count."""
    counts = {str(d.relative_to(root)): len(list(d.glob("*.py"))) for d in [root, *root.rglob("*")]
              if d.is_dir() and d.name != "__pycache__"}
    return {d: n for d, n in counts.items() if n > MAX_MODULES}


def test_no_folder_holds_more_than_fifteen_modules() -> None:
    crowded = {
        d: n for d, n in _crowded_folders(PKG).items() if d not in MODULE_CAP_EXEMPT and d not in MODULE_CAP_PENDING
    }
    assert not crowded, f"folders with more than {MAX_MODULES} modules (split them into concept subfolders): {crowded}"


def test_folder_cap_sees_a_crowded_folder(tmp_path: Path) -> None:
    (tmp_path / "flat").mkdir()
    for i in range(MAX_MODULES + 1):
        (tmp_path / "flat" / f"m{i}.py").write_text("")
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.py").write_text("")
    assert _crowded_folders(tmp_path) == {"flat": MAX_MODULES + 1}


def test_every_sampling_module_is_named_in_its_folders_docstring() -> None:
    """Each folder of sampling/ says what it owns: its ``__init__`` docstring names every module it holds."""
    missing = []
    for init in (PKG / "sampling").rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        pkg = _module_name(init)
        missing += [f"{pkg}.{p.stem}" for p in init.parent.glob("*.py")
                    if p.name != "__init__.py" and f"{pkg}.{p.stem}`" not in doc]
        missing += [f"{pkg}.{d.name}" for d in init.parent.iterdir()
                    if (d / "__init__.py").exists() and f"{pkg}.{d.name}`" not in doc]
    assert not missing, f"modules not named in their folder's __init__ docstring: {missing}"


def test_no_private_accelerate_internals() -> None:
    banned = re.compile(r"_getframe|_shared_state|\._dataloaders|_PYTORCH_DATALOADER_KWARGS")
    hits = [f"{p.relative_to(PKG.parent)}:{i}" for p in PKG.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if banned.search(line)]
    assert not hits, hits


def floor(module: str) -> int:
    """The floor of a module: its stage folder's place in :data:`FLOORS` (top-level files are the ground floor)."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in STAGE_FOLDERS):
        return FLOORS.index(SAME_FLOOR.get(parts[1], parts[1]))
    return 0


def test_lower_floors_never_import_upper_ones() -> None:
    upward = sorted(
        f"{a} (floor {FLOORS[floor(a)]}) imports {b} (floor {FLOORS[floor(b)]})"
        for a, targets in _graph().items()
        if a != "hf_arb.__main__"
        for b in targets
        if floor(b) > floor(a)
    )
    assert not upward, upward


def test_floor_check_sees_an_upward_import() -> None:
    assert floor("hf_arb.buckets.sets") < floor("hf_arb.images.fitting") < floor("hf_arb.train.cache.latents")
    assert floor("hf_arb.rng") == 0 and floor("hf_arb.cli") == FLOORS.index("cli")
    assert floor("hf_arb.video.metadata") == floor("hf_arb.images.sizes") < floor("hf_arb.sampling.sampler")


def test_testing_imports_only_the_ground_floor_and_its_listed_exceptions() -> None:
    """``testing/`` sits outside the house (tests, docs and demos use it): it imports the ground floor and only the
    modules :data:`TESTING_MAY_IMPORT` names with their reason."""
    graph = _graph()
    used = {b for a, targets in graph.items() if a.startswith("hf_arb.testing") for b in targets
            if floor(b) != 0 and not b.startswith("hf_arb.testing")}
    assert used <= TESTING_MAY_IMPORT, sorted(used - TESTING_MAY_IMPORT)
    assert TESTING_MAY_IMPORT <= used, "drop the exceptions testing/ no longer needs"


def test_every_stage_folder_says_what_it_owns_and_may_import() -> None:
    for name in STAGE_FOLDERS:
        doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text())) or ""
        assert doc and ("May import" in doc or "Imports no other floor" in doc), name


def _listed(doc: str, package: str, name: str) -> bool:
    """Whether a folder's docstring names its module or subfolder ``name``: the dotted name (as ``:mod:`~a.b.c```
    writes it) or ````name```` (``name.py``, ``name/``) in double backquotes."""
    return bool(re.search(rf"\b{re.escape(package)}\.{name}\b", doc) or re.search(rf"``{name}(\.py|/)?``", doc))


def test_every_module_is_listed_in_its_folders_docstring() -> None:
    """Each folder's ``__init__`` docstring says what it owns: it names every module and subfolder directly in it,
    at any depth (the package root's are drawn in docs/code_map.md)."""
    missing = []
    for init in sorted(PKG.rglob("__init__.py")):
        folder, package = init.parent, _module_name(init)
        members = sorted([p.stem for p in folder.glob("*.py") if not p.stem.startswith("__")]
                         + [d.name for d in folder.iterdir() if (d / "__init__.py").is_file()])
        if folder == PKG:
            code_map = (PKG.parent / "docs" / "code_map.md").read_text()
            missing += [f"docs/code_map.md: {m}" for m in members if not re.search(rf"\b{m}(\.py|/)", code_map)]
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        missing += [f"{package}.{m}" for m in members if not _listed(doc, package, m)]
    assert not missing, f"name these in their folder's __init__ docstring: {missing}"


def test_module_listing_check_sees_a_missing_module() -> None:
    assert _listed("- :mod:`~hf_arb.train.args` — flags", "hf_arb.train", "args")
    assert _listed("(+ ``latent_dataset``)", "hf_arb.train", "latent_dataset")
    assert not _listed("- :mod:`~hf_arb.train.args_extra`; the ``args`` of main", "hf_arb.train", "arg")
    assert not _listed("hf_arb.sampling.args", "hf_arb.train", "args")


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


#: release 0.1's flat modules of hf_arb.sampling, before the concept subfolders
FLAT_SAMPLING_0_1 = ("batch_sizes", "cursor", "feistel", "index", "layout", "plan", "plan_views", "ragged", "report",
                     "restore", "state", "stream", "stream_buffer", "stream_collate", "stream_plan", "sync",
                     "tier_files", "tier_plan", "tier_random", "tier_report", "tier_schedule", "tier_state",
                     "tier_stream", "tier_stream_random", "tiers")


def test_every_flat_sampling_path_of_0_1_imports_its_new_module_with_a_warning() -> None:
    """``import hf_arb.sampling.tier_plan`` (and every other flat 0.1 module of sampling/ that moved into a subfolder)
    gives the very module at the new path, and a DeprecationWarning naming it; names imported from the old path are
    the new module's."""
    import importlib
    import sys
    import warnings

    from hf_arb.moved import MOVED

    for name in FLAT_SAMPLING_0_1:
        old = f"hf_arb.sampling.{name}"
        assert not (PKG / "sampling" / f"{name}.py").exists() and old in MOVED, old
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        new = MOVED[old]
        assert module is importlib.import_module(new), old
        assert [w for w in caught if issubclass(w.category, DeprecationWarning) and new in str(w.message)], old
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from hf_arb.sampling.cursor import StepCursor
        from hf_arb.sampling.stream import BucketedStream
        from hf_arb.sampling.tier_plan import Tiers
    from hf_arb.sampling import BucketedStream as new_stream
    from hf_arb.sampling import Tiers as new_tiers
    from hf_arb.sampling.resume.cursor import StepCursor as new_cursor
    assert Tiers is new_tiers and BucketedStream is new_stream and StepCursor is new_cursor


def test_the_xdist_group_override_is_isolated_and_still_applies() -> None:
    """tests/conftest.py's one override of a private method of another library (xdist's ``_split_scope``) lives in
    tests/_xdist_groups.py alone, with its reason, and the xdist installed still has the method it overrides."""
    import sys

    tests = PKG.parent / "tests"
    sys.path.insert(0, str(tests))
    try:
        import _xdist_groups
    finally:
        sys.path.remove(str(tests))
    users = sorted(p.name for p in tests.glob("*.py") if _xdist_groups.SPLIT_SCOPE in p.read_text()
                   and p.name not in ("_xdist_groups.py", "test_architecture.py"))
    assert not users, users
    _xdist_groups.check()


#: tests of the run's mode (issue #33): outside the data sources (train/sources/, whose factory picks the mode)
#: and argument validation, the script and train/ ask the source instead
MODE_FLAG_TESTS = re.compile(r"args\.packing|args\.streaming|args\.resolution_schedule|reference_image_column"
                             r"|stream is None|getattr\(\w+, \"(?:packing|streaming|resolutions|locate|masked_loss)\""
                             r"|len\(args\.resolutions\)|args\.(?:masked_loss|alpha_mask|mask_column|mask_dir)"
                             r"|args\.with_prior_preservation|getattr\(\w+, \"with_prior_preservation\"")
#: where the mode flags may be read: the sources (their factory and constructors) and argument validation (flags/: the
#: parser and its checks, upstream's aliases, and the flags a checkpoint records and compares on resume)
MODE_FLAG_OWNERS = ("hf_arb/train/sources/", "hf_arb/train/flags/")


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
    probe.write_text('if args.packing:\n    pass\nlocate = getattr(sampler, "locate", None)\nif stream is None: pass\n'
                     'if args.masked_loss: pass\n')
    assert len(_mode_flag_tests([probe])) == 4


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
