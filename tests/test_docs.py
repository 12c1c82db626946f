"""The docs stay true to the code: generated references are current, every public name is documented, links resolve."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))
import gen_reference  # noqa: E402

LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_api_reference_documents_every_public_name():
    import hf_arb

    api = (ROOT / "docs" / "api.md").read_text()
    for name in hf_arb.__all__:
        if name != "__version__":
            assert f"`{name}`" in api, f"hf_arb.{name} is missing from docs/api.md"
    for modname in gen_reference.MODULES:
        for name in gen_reference.public_names(importlib.import_module(modname)):
            assert f"### `{name}`" in api, f"{modname}.{name} is missing from docs/api.md"


def test_every_package_module_is_in_the_reference():
    pkg = ROOT / "hf_arb"
    modules = {"hf_arb." + ".".join(p.relative_to(pkg).with_suffix("").parts)
               for p in pkg.rglob("*.py") if not p.stem.startswith("_")}
    undocumented = modules - set(gen_reference.MODULES) - {"hf_arb.cli", "hf_arb.cli.annotate", "hf_arb.cli.buckets"}
    assert not undocumented, f"add {sorted(undocumented)} to docs/gen_reference.py MODULES"


@pytest.mark.slow
def test_generated_reference_is_current(monkeypatch, capsys):
    """``python docs/gen_reference.py --check``, in this process (its modules are imported here anyway; the
    ``--help`` pages it compares still run as commands)."""
    monkeypatch.setattr(sys, "argv", ["gen_reference.py", "--check"])
    monkeypatch.chdir(ROOT)
    try:
        gen_reference.main()
    except SystemExit as e:
        pytest.fail(f"gen_reference.py --check exited with {e.code}: {capsys.readouterr().err[-2000:]}")


def test_presets_table_in_buckets_md_is_current():
    """docs/buckets.md's table of every preset is what the code builds now (fast; the slow check covers all files)."""
    from hf_arb import PRESETS

    doc = (ROOT / "docs" / "buckets.md").read_text()
    assert gen_reference.buckets_md(doc) == doc, (
        "docs/buckets.md presets table is stale: run python docs/gen_reference.py"
    )
    table = doc[doc.index(gen_reference.PRESETS_BEGIN):doc.index(gen_reference.PRESETS_END)]
    assert {row.split("|")[1].strip() for row in table.splitlines()[3:]} == set(PRESETS)  # every preset has a row


@pytest.mark.parametrize("page", sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]), ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.name} links to {target}, which does not exist"


def _resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` is a module, or an attribute path under the longest importable module prefix."""
    import warnings

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # the 0.1 paths code_map mentions on purpose
                obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_name_the_code_map_mentions_exists():
    """docs/code_map.md names real things: every dotted ``hf_arb...`` name imports (a module, or a name in one), and
    every ``family.<method>`` it shows is a member of the Family adapter."""
    from hf_arb.families.base import Family

    text = (ROOT / "docs" / "code_map.md").read_text()
    names = sorted(set(re.findall(r"\bhf_arb(?:\.\w+)+", text)))
    assert len(names) >= 20 and not [n for n in names if not _resolves(n)], [n for n in names if not _resolves(n)]
    members = re.findall(r"`family\.(\w+)", text)
    assert members and not [m for m in members if not hasattr(Family, m)], members
    assert not _resolves("hf_arb.families.base.Family.loss") and _resolves("hf_arb.families.base.Family.training_loss")


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and re.search(r"^make test$", ci, re.M)


@pytest.mark.slow
def test_mkdocs_site_builds_strict(tmp_path):
    """`make docs`: the site builds offline in strict mode (a broken link or missing page fails)."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "sampler" / "index.html").exists()


def test_annotate_options_table_is_generated_from_the_parser():
    """docs/annotate.md's option table is the parser's (issue 24, item 11): every preset and metric the CLI takes."""
    from hf_arb import PRESETS
    from hf_arb.buckets.matching import METRICS

    doc = (ROOT / "docs" / "annotate.md").read_text()
    assert gen_reference.annotate_md(doc) == doc, (
        "docs/annotate.md options table is stale: run python docs/gen_reference.py"
    )
    table = doc[doc.index(gen_reference.OPTIONS_BEGIN):doc.index(gen_reference.OPTIONS_END)]
    preset_row = next(r for r in table.splitlines() if r.startswith("| `--preset "))
    assert preset_row.split("`")[1] == "--preset " + "\\|".join(PRESETS) and len(PRESETS) == 10
    metric_row = next(r for r in table.splitlines() if r.startswith("| `--metric "))
    assert all(m in metric_row.split("`")[1].split("\\|") or m in metric_row for m in METRICS)


def _heading_anchor(heading: str) -> str:
    """The anchor mkdocs and GitHub give a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


CONTENTS_PAGES = sorted(p for p in (ROOT / "docs").glob("*.md") if "\nContents: " in p.read_text())


@pytest.mark.parametrize("page", CONTENTS_PAGES, ids=lambda p: p.name)
def test_contents_line_lists_every_section_once_in_order(page):
    """A page's "Contents:" paragraph links each of its ``##`` sections exactly once, in the page's order (issue 34,
    item 10: training.md's listed SDXL, resume, cached latents, ... twice and left Flux.2, LoRA, streaming out)."""
    text = page.read_text()
    links = re.findall(r"\]\(#([^)\s]+)\)", text.split("\nContents: ", 1)[1].split("\n\n", 1)[0])
    twice = sorted({a for a in links if links.count(a) > 1})
    assert not twice, f"{page.name}: the Contents line repeats {twice}"
    headings = [_heading_anchor(h) for h in re.findall(r"^## (.+)$", re.sub(r"```.*?```", "", text, flags=re.S),
                                                        re.M)]
    assert links == headings, f"{page.name}: Contents {links} != sections {headings}"
    assert len(CONTENTS_PAGES) >= 2


def test_every_testing_builder_is_in_the_api_reference():
    """Every public function of hf_arb.testing (the tiny models the docs and tests build) is in its module's
    ``__all__`` and has an entry in docs/api.md (issue 34, item 10: save_tiny_flux_kontext had none)."""
    import inspect
    import pkgutil

    import hf_arb.testing

    api = (ROOT / "docs" / "api.md").read_text()
    missing, unlisted = [], []
    for info in pkgutil.iter_modules(hf_arb.testing.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"hf_arb.testing.{info.name}")
        assert module.__name__ in gen_reference.MODULES, module.__name__
        public = set(gen_reference.public_names(module))
        for name, obj in vars(module).items():
            if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module.__name__:
                continue
            if name not in public:
                unlisted.append(f"{module.__name__}.{name}")
            if f"### `{name}`" not in api:
                missing.append(f"{module.__name__}.{name}")
    assert not unlisted, f"add to the module's __all__: {unlisted}"
    assert not missing, f"missing from docs/api.md (run python docs/gen_reference.py): {missing}"
