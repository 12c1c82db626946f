"""`make demo` has its own light install (issue 34): torch, the project and its `demo` extra, without the ray and
spark extras, a Java runtime or Chromium (those are `make test`'s); README and scripts/demo.py state one time."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("ray", "spark", "apt-get", "chromium", "jre", "java")
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def recipe(target: str, venv: Path) -> str:
    """What ``make TARGET VENV=venv`` would run (``make -n``: nothing is run)."""
    # under `make test` the outer make's MAKEFLAGS/MAKELEVEL would make this one print "Entering directory" lines
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    return subprocess.run(["make", "-n", "--no-print-directory", target, f"VENV={venv}"], cwd=ROOT,
                          capture_output=True, text=True, check=True, env=env).stdout


def test_demo_installs_only_its_extra(tmp_path: Path) -> None:
    demo = recipe("demo", tmp_path / "fresh")
    installs = [line for line in demo.splitlines() if "pip install" in line]
    assert len(installs) == 2 and "torch==" in installs[0] and '-e ".[demo]"' in installs[1], demo
    assert not [w for w in HEAVY if w in demo.lower()], demo  # no ray/spark extras, no JRE, no Chromium
    assert demo.strip().splitlines()[-1] == f"{tmp_path / 'fresh'}/bin/python scripts/demo.py"
    full = recipe("test", tmp_path / "fresh")  # the heavy extras stay with the suite
    assert "ray,spark" in full and "chromium" in full and "default-jre-headless" in full


def test_a_venv_made_by_make_test_is_reused_by_the_demo(tmp_path: Path) -> None:
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").touch()
    (venv / ".installed-demo").touch()  # what `make test`'s install leaves
    demo = recipe("demo", venv)
    assert "pip install" not in demo and demo.strip() == f"{venv}/bin/python scripts/demo.py", demo


#: import name → distribution name, for the demo's third-party imports outside the core dependencies
DIST = {"skimage": "scikit-image", "matplotlib": "matplotlib", "tensorboard": "tensorboard"}


def test_the_demo_extra_holds_what_the_demo_imports_beyond_the_core() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[<>=\[; ]", req, maxsplit=1)[0].lower()  # noqa: E731
    core = {name(r).replace("-", "_") for r in meta["dependencies"]}
    demo_extra = {name(r) for r in meta["optional-dependencies"]["demo"]}
    local = {p.stem for p in (ROOT / "scripts").glob("*.py")} | {"hf_arb"}
    used = {"skimage"}  # hf_arb.testing.tiny.save_tiny_imagefolder's sample photos
    for script in (ROOT / "scripts").glob("demo*.py"):
        tree = ast.parse(script.read_text())
        used |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        used |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                 and n.level == 0}
        if "--report_to\", \"tensorboard\"" in script.read_text():
            used.add("tensorboard")  # the training runs log to TensorBoard
    third = {m for m in used - local - set(sys.stdlib_module_names) if m not in core and m not in {"PIL", "numpy"}}
    assert "tensorboard" in third and "matplotlib" in third, third
    assert {DIST[m] for m in third} <= demo_extra, (third, demo_extra)
    assert not {"ray", "pyspark", "playwright"} & demo_extra


def test_readme_and_the_demo_script_state_one_time() -> None:
    readme = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("make demo"))
    script = ast.get_docstring(ast.parse((ROOT / "scripts" / "demo.py").read_text())) or ""
    said = re.search(r"about (\d+) minutes", readme)
    assert said, readme
    assert f"about {said.group(1)} minutes" in script.split("\n\n")[0], script.split("\n\n")[0]
