"""Every command and snippet in README.md and docs/ runs as written (offline, on tiny stand-ins).

The marker convention, the substitution table and the starting files are documented in tests/_doc_snippets.py
(and summarised in README.md, "Development"). Runnable blocks of all pages run in one process, once per test run
(``shared_artifact``); each page is reported by its own test. Training commands (``runnable: slow``) run in the
slow test: when it is selected, the same process then runs each page that has some again from its start, in a
workdir and a namespace of its own (one interpreter's imports for both, not two).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _doc_snippets import (
    CODE_LANGS,
    ROOT,
    SUBSTITUTIONS,
    extract_blocks,
    pages,
    substitute,
)

ALL_BLOCKS = [b for p in pages() for b in extract_blocks(p)]
CODE_BLOCKS = [b for b in ALL_BLOCKS if b.lang in CODE_LANGS]
RUN_PAGES = sorted({b.page for b in CODE_BLOCKS if b.runnable})
SLOW_PAGES = sorted({b.page for b in CODE_BLOCKS if b.slow})


def test_every_code_block_is_marked() -> None:
    unmarked = [f"{b.id} ({b.lang}): {b.source.splitlines()[0][:60]}" for b in CODE_BLOCKS if b.marker is None]
    assert not unmarked, ("code blocks without `<!-- runnable -->` or `<!-- not runnable: <reason> -->` on the line "
                          "before the fence (see tests/_doc_snippets.py):\n" + "\n".join(unmarked))
    no_reason = [b.id for b in CODE_BLOCKS if b.marker == "not runnable" and len(b.reason) < 4]
    assert not no_reason, f"say why these cannot run: {no_reason}"
    assert len([b for b in CODE_BLOCKS if b.runnable or b.slow]) >= 25


def test_marker_parser(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("intro\n\n<!-- runnable -->\n\n```python\nx = 1\n```\n\n```bash\nls\n```\n\n"
                    "<!-- not runnable: needs 8 GPUs -->\n````bash\n```\n````\n\n```text\nout\n```\n"
                    "<!-- runnable: slow -->\n  ```sh\n  echo hi\n  ```\n")
    blocks = extract_blocks(page, root=tmp_path)
    assert [(b.lang, b.marker, b.reason) for b in blocks] == [
        ("python", "runnable", ""), ("bash", None, ""), ("bash", "not runnable", "needs 8 GPUs"), ("text", None, ""),
        ("sh", "runnable: slow", "")]
    assert blocks[0].source == "x = 1\n" and blocks[2].source == "```\n" and blocks[4].source == "echo hi\n"
    assert blocks[0].line == 5


def test_every_substitution_is_used() -> None:
    """No dead rows in the documented table: each rewrite changes at least one runnable block."""
    assets = {k: f"<{k}>" for k in ("naruto", "tiny_sd", "tiny_flux", "pushed")}
    runnable = [b.source for b in CODE_BLOCKS if b.runnable or b.slow]
    unused = [pat for pat, _, _ in SUBSTITUTIONS if not any(re.search(pat, s) for s in runnable)]
    assert not unused, f"substitutions that rewrite no runnable block (remove them from the table): {unused}"
    assert substitute("load_dataset('lambdalabs/naruto-blip-captions')", assets) == "load_dataset('<naruto>')"


def test_quickstart_trains_offline_as_written() -> None:
    """docs/quickstart.md opens with an offline step (issue 34, item 10): its blocks build a tiny model and photos,
    annotate, train and load the output, all ``runnable`` (every ``make test``) and untouched by the substitution
    table, so the page's start runs exactly as a reader types it."""
    assets = {k: f"<{k}>" for k in ("naruto", "tiny_sd", "tiny_flux", "pushed")}
    page = [b for b in CODE_BLOCKS if b.page == "docs/quickstart.md"]
    train = next(i for i, b in enumerate(page) if "train_text_to_image_arb.py" in b.source)
    offline = page[:train + 2]  # up to the block that loads the trained output
    assert all(b.runnable for b in offline if "pip install" not in b.source), [b.id for b in offline]
    assert all(substitute(b.source, assets) == b.source for b in offline), "the offline step must run as written"
    assert "hf_arb.testing" in offline[1].source and ".from_pretrained(" in offline[-1].source


def test_readme_documents_the_substitution_table() -> None:
    readme = (ROOT / "README.md").read_text()
    for pattern, replacement, why in SUBSTITUTIONS:
        row = f"| `{pattern}` | `{replacement}` | {why} |".replace("|bf16", "\\|bf16")
        assert row in readme, f"README.md, 'Docs that run': add or update the row\n{row}"


def test_runner_reports_every_kind_of_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The runner cannot pass a broken block: an exception, a doctest mismatch, an hf-arb error, a shell error."""
    import _run_doc_blocks

    blocks = {"ok.py": ("python", "x = 2\n"), "uses-x.py": ("python", ">>> x + 1\n3\n"),
              "bad-doctest": ("python", ">>> x + 1\n4\n"), "raises": ("python", "1 / 0\n"),
              "cli-error": ("bash", "hf-arb buckets --preset novelai\nhf-arb buckets --resolution 0\n"),
              "shell-error": ("bash", "echo fine\nfalse\n"), "cli-ok": ("bash",
                                                                        "hf-arb buckets --preset sdxl  # a comment\n")}
    plan = [{"page": name, "workdir": str(tmp_path), "blocks": [{"id": name, "lang": lang, "source": src}]}
            for name, (lang, src) in blocks.items()]
    plan[1]["blocks"].insert(0, plan.pop(0)["blocks"][0])  # x is defined by the page's earlier block
    res = _run_doc_blocks.run(plan)
    assert {k for k, v in res.items() if v["ok"]} == {"ok.py", "uses-x.py", "cli-ok"}
    assert "NameError" in res["bad-doctest"]["error"]  # pages do not share a namespace
    assert "ZeroDivisionError" in res["raises"]["error"]
    assert "exited with status 2" in res["cli-error"]["error"] and "bash exited with 1" in res["shell-error"]["error"]
    two = _run_doc_blocks.run([{"page": "p", "workdir": str(tmp_path), "blocks": [
        {"id": "a", "lang": "python", "source": "x = 2\n"}, {"id": "b", "lang": "python", "source": ">>> x + 1\n4\n"},
        {"id": "c", "lang": "python", "source": "pass\n"}]}])
    assert "Expected:\n    4\nGot:\n    3" in two["b"]["error"] and two["c"]["error"] == "not run: b failed first"
    assert _run_doc_blocks._hf_arb_commands("hf-arb a \\\n  --b 1  # c\nhf-arb d\n") == [["a", "--b", "1"], ["d"]]
    assert _run_doc_blocks._hf_arb_commands("hf-arb a | head\n") is None
    assert _run_doc_blocks._hf_arb_commands("RAY_ADDRESS=auto hf-arb a\n") is None
    launch = _run_doc_blocks._one_process_launch
    assert launch("accelerate launch t.py \\\n  --a 1  # c\n") == ["t.py", "--a", "1"]
    assert launch("accelerate launch --num_processes 2 t.py\n") is None and launch("python t.py\n") is None
    lead = _run_doc_blocks._leading_python_c  # opening `python -c` lines run in the runner's process
    rest = "X=1 torchrun t.py \\\n  --y 1\n"
    assert lead('python -c "a; b"  # c\n' + rest) == (["a; b"], rest)
    assert lead('python -c "x" > out\n')[0] == lead('python -c "$X"\n')[0] == lead("echo\npython -c x\n")[0] == []
    with pytest.raises(RuntimeError, match="exited with status 4"):
        _run_doc_blocks._run_bash('python -c "import sys; sys.exit(4)"\n')
    (tmp_path / "t.py").write_text("import sys\nsys.exit(0 if sys.argv[1:] == ['--ok'] else 3)\n")
    _run_doc_blocks._run_script([str(tmp_path / "t.py"), "--ok"])
    with pytest.raises(RuntimeError, match="exited with status 3"):
        _run_doc_blocks._run_script([str(tmp_path / "t.py"), "--bad"])


def test_a_launch_after_shell_lines_runs_in_the_runners_process(tmp_path: Path, monkeypatch) -> None:
    """A block of shell lines that end in one ``accelerate launch`` (docs/video.md's ``mkdir && cp`` before its
    run, docs/training.md's caption loop): the lines run in bash, then the launch in the runner's process (the
    imports paid once), as a shell runs them in turn; a line that could change the launch's folder or environment
    keeps the whole block in bash."""
    import _run_doc_blocks

    tail = _run_doc_blocks._trailing_launch
    assert tail("mkdir -p m && cp a m/\nfor f in m/*; do echo \"$f\" > \"${f%.png}.txt\"; done\n"
                "accelerate launch t.py \\\n  --a 1  # c\n") == (
        "mkdir -p m && cp a m/\nfor f in m/*; do echo \"$f\" > \"${f%.png}.txt\"; done\n", ["t.py", "--a", "1"])
    for changes in ("cd m", "export A=1", "A=1", "mkdir m && cd m", "for f in a; do set -x; done", "exit 0",
                    "source env.sh", "python - <<'EOF'\nprint(1)\nEOF"):
        assert tail(f"{changes}\naccelerate launch t.py --a 1\n") is None, changes
    assert tail("accelerate launch t.py\n") is None and tail("echo\naccelerate launch --cpu t.py\n") is None
    assert tail("echo\naccelerate launch t.py $X\n") is None and tail("accelerate launch t.py\necho\n") is None
    (tmp_path / "t.py").write_text("import os, sys\nopen('pid', 'w').write(str(os.getpid()))\n"
                                   "sys.exit(0 if os.path.exists('made') and sys.argv[1:] == ['--ok'] else 5)\n")
    monkeypatch.chdir(tmp_path)
    _run_doc_blocks._run_bash("mkdir -p sub && touch made\naccelerate launch t.py \\\n  --ok\n")
    assert (tmp_path / "pid").read_text() == str(os.getpid())  # in this process, after the shell's line
    (tmp_path / "made").unlink()
    with pytest.raises(RuntimeError, match="exited with status 5"):  # the launch's own exit status
        _run_doc_blocks._run_bash("true\naccelerate launch t.py --ok\n")
    (tmp_path / "pid").unlink()
    with pytest.raises(RuntimeError, match="bash exited with 1"):  # a failing line stops the block before the launch
        _run_doc_blocks._run_bash("touch made && false\naccelerate launch t.py --ok\n")
    assert (tmp_path / "made").exists() and not (tmp_path / "pid").exists()


# ------------------------------------------------------------------------------------------- running
def _build_assets(root: Path) -> dict[str, str]:
    """The stand-ins of the substitution table and the starting files (``_doc_snippets.FILES``)."""
    import datasets
    import numpy as np
    from _photos import save_photo

    from hf_arb import BucketSet, add_bucket_columns
    from hf_arb.testing.tiny import save_tiny_flux, save_tiny_imagefolder, save_tiny_sd

    naruto = save_tiny_imagefolder(root / "naruto", per_size=8)
    pushed = root / "pushed"
    ds = add_bucket_columns(datasets.load_dataset("imagefolder", data_dir=naruto, split="train"), BucketSet.sdxl(),
                            show_summary=False)
    ds.to_parquet(str(pushed / "data" / "train-00000-of-00001.parquet"))
    rng = np.random.default_rng(0)
    n = 2000
    datasets.Dataset.from_dict({"url": [f"https://example.com/{i}.jpg" for i in range(n)],
                                "WIDTH": rng.integers(200, 4000, n), "HEIGHT": rng.integers(200, 4000, n)}
                               ).to_parquet(str(root / "laion_meta.parquet"))
    save_photo(root / "photo.jpg", "coffee.png", "JPEG")
    return {"naruto": naruto, "pushed": str(pushed), "tiny_sd": save_tiny_sd(root / "tiny-sd"),
            "tiny_flux": save_tiny_flux(root / "tiny-flux"),
            "laion_meta": str(root / "laion_meta.parquet"), "photo": str(root / "photo.jpg")}


def _workdir(root: Path, page: str, assets: dict[str, str]) -> Path:
    d = root / page.replace("/", "_").replace(".md", "")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    (d / "my_images").symlink_to(assets["naruto"], target_is_directory=True)
    shutil.copy(assets["photo"], d / "photo.jpg")
    (d / "laion_meta.parquet").symlink_to(assets["laion_meta"])
    for script in ("train_text_to_image_arb.py", "train_text_to_image_lora_arb.py"):
        (d / script).symlink_to(ROOT / script)
    return d


#: the result keys of the slow pass's blocks: ``SLOW + block id`` (the runnable blocks also run in the fast pass)
SLOW = "slow:"


def _plan(root: Path, page_names: list[str], assets: dict[str, str], *, slow: bool) -> list[dict[str, Any]]:
    """One entry per page, run from its start: its runnable blocks, and its slow ones too when ``slow`` (then the
    block ids carry :data:`SLOW` and the workdirs are under ``root/slow``)."""
    key, base = (SLOW, root / "slow") if slow else ("", root)
    return [{"page": page, "workdir": str(_workdir(base, page, assets)),
             "blocks": [{"id": key + b.id, "lang": b.lang, "source": substitute(b.source, assets)}
                        for b in CODE_BLOCKS if b.page == page and (b.runnable or (slow and b.slow))]}
            for page in page_names]


def _run(root: Path, page_names: list[str], assets: dict[str, str], *, slow_pages: list[str]) -> dict[str, Any]:
    """The runnable blocks of ``page_names``, then every block (runnable and slow) of ``slow_pages``, each page
    from its start, in one driver process."""
    plan = _plan(root, page_names, assets, slow=False) + _plan(root, slow_pages, assets, slow=True)
    (root / "plan.json").write_text(json.dumps(plan, indent=1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                        os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "MPLBACKEND": "Agg", "ACCELERATE_USE_CPU": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_run_doc_blocks.py"), str(root / "plan.json"),
                           str(root / "results.json")], env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    (root / "log.txt").write_text(proc.stderr)
    if proc.returncode != 0:
        return {"__driver__": {"ok": False, "error": proc.stderr[-6000:]}}
    return {**json.loads((root / "results.json").read_text()), "__log__": str(root / "log.txt")}


@pytest.fixture(scope="session")
def doc_assets(shared_artifact) -> dict[str, str]:
    return shared_artifact("doc-snippet-assets", _build_assets)


@pytest.fixture(scope="session")
def doc_results(request: pytest.FixtureRequest, shared_artifact, doc_assets: dict[str, str]) -> dict[str, Any]:
    """Every runnable block of every page, run once per test run (all xdist workers share the results); and the
    slow pages' blocks (runnable and slow) when the slow test is selected (``-m "not slow"`` skips them)."""
    slow = any(item.name == "test_training_commands_run_as_written" for item in request.session.items)
    name = "doc-snippet-run-with-slow" if slow else "doc-snippet-run"
    return shared_artifact(name, lambda root: _run(root, RUN_PAGES, doc_assets, slow_pages=SLOW_PAGES if slow else []))


def _assert_page_ok(results: dict[str, Any], page: str, slow: bool = False) -> None:
    assert "__driver__" not in results, results.get("__driver__")
    blocks = [b for b in CODE_BLOCKS if b.page == page and (b.runnable or (slow and b.slow))]
    key = SLOW if slow else ""
    failed = [f"{b.id}:\n{results[key + b.id]['error']}" for b in blocks if not results[key + b.id]["ok"]]
    assert not failed, "\n\n".join(failed) + f"\n(output of the run: {results.get('__log__')})"


@pytest.mark.xdist_group("doc-snippets")  # one worker: the others would only wait on the shared run's lock
@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_runs_as_written(page: str, doc_results: dict[str, Any]) -> None:
    _assert_page_ok(doc_results, page)


@pytest.mark.slow
@pytest.mark.xdist_group("doc-snippets")
def test_training_commands_run_as_written(doc_results: dict[str, Any]) -> None:
    """The ``runnable: slow`` blocks (training commands), each page from its start (in the shared run's process,
    after the runnable pass, in workdirs of their own)."""
    for page in SLOW_PAGES:
        _assert_page_ok(doc_results, page, slow=True)
