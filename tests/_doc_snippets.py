"""Run the docs as written: extract the fenced code blocks of README.md and docs/*.md and their markers.

**Markers.** Every fenced block whose language is one of :data:`CODE_LANGS` carries an HTML comment on the last
non-blank line before its opening fence (invisible on GitHub and in the mkdocs site):

* ``<!-- runnable -->`` — run by ``tests/test_doc_snippets.py`` on every ``make test`` (offline, tiny data);
* ``<!-- runnable: slow -->`` — a training command, run by the slow test only;
* ``<!-- not runnable: <reason> -->`` — why it cannot run offline on a CPU (GPUs, a cluster, a Hub push, a fragment
  of your own loop, …).

A code block with neither fails the test, so a new snippet is never forgotten. Output blocks (``text``, ``json`` or
no language) need no marker. ``docs/api.md`` and ``docs/cli.md`` are generated (``docs/gen_reference.py``) and skipped.

**How blocks run.** The runnable blocks of one page run in order in one fresh folder, sharing one Python namespace
(a later block may use what an earlier one defined, as a reader would). ``python`` blocks are executed; blocks of
``>>>`` lines run as doctests (output compared, whitespace normalised). A ``bash`` block made only of ``hf-arb``
commands runs each through ``hf_arb.cli.app`` (what the ``hf-arb`` console script calls) in the same process;
any other ``bash`` block runs in ``bash -euo pipefail`` with the venv's ``bin`` first on ``PATH`` (a one-process
``accelerate launch`` that is the whole block, or ends it after shell lines that leave its folder and environment
alone, runs in the runner's process: tests/_run_doc_blocks.py).

**The fixture.** Before a block runs, :data:`SUBSTITUTIONS` rewrite it (every rewrite is listed here, with why): Hub
ids become local tiny stand-ins built once per test run (``shared_artifact``), and training sizes shrink to CPU
seconds. The folder starts with the files in :data:`FILES`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: fenced-block languages that are code a reader could run, and so must carry a marker
CODE_LANGS = frozenset({"python", "py", "bash", "sh", "shell", "console"})
#: pages whose blocks are checked and run (generated pages excluded)
GENERATED = frozenset({"api.md", "cli.md"})

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^<!--\s*(?P<kind>runnable(?::\s*slow)?|not runnable:\s*(?P<reason>.*?))\s*-->$")

#: ``(pattern, replacement, why)``: applied in order (``re.sub``) to every runnable block before it runs.
#: ``{name}`` in a replacement is the path of the stand-in ``name`` (see ``build_assets`` in the test).
SUBSTITUTIONS: tuple[tuple[str, str, str], ...] = (
    # Hub ids -> local stand-ins (no network in tests)
    (r"lambdalabs/naruto-blip-captions", "{naruto}",
     "an imagefolder of 40 real photos (5 aspect ratios) with a `text` caption column (hf_arb.testing.tiny)"),
    (r"stable-diffusion-v1-5/stable-diffusion-v1-5", "{tiny_sd}", "hf_arb.testing.tiny.save_tiny_sd"),
    (r"black-forest-labs/FLUX\.1-dev", "{tiny_flux}", "hf_arb.testing.tiny.save_tiny_flux"),
    (r"\bme/my-data\b", "{pushed}",
     "what hf_arb.push_to_hub uploads (Parquet with the bucket feature) for my_images, as a local folder"),
    (r"/mnt/laion/buckets", "{pushed}", "the same annotated Parquet folder stands in for the engine's output"),
    (r"\bme/naruto-encoded\b", "encoded-naruto",
     "the folder the page's hf-arb encode block wrote, which push_encoded uploads (tests/test_encoded.py pushes it "
     "through the fake Hub and loads it back identically)"),
    # CPU-sized buckets and training
    (r"--preset budget --resolution 1024\b", "--preset budget --resolution 128", "5 buckets of ~128² px, not 1 MP"),
    (r"(?<!pixart )--resolution[ =]512\b", "--resolution 128", "the same for the training commands"),
    (r"--max_train_steps[ =]\d+", "--max_train_steps 2", "two optimizer steps"),
    (r"--checkpointing_steps[ =]\d+", "--checkpointing_steps 1", "a checkpoint is written"),
    (r"--mixed_precision[ =]\"?(?:fp16|bf16)\"?", "--mixed_precision no", "half precision needs a GPU"),
    (r"--validation_epochs[ =]\d+", "--validation_epochs 1", "validation runs once"),
    (r"\bnum_workers=\d+", "num_workers=0", "no DataLoader worker processes (2 shared cores)"),
    (r"for epoch in range\(\d+\):", "for epoch in range(1):", "one pass over the data"),
)

#: files every page's folder starts with: ``name -> what it is``
FILES = {
    "my_images/": "the imagefolder behind {naruto} (40 real photos + metadata.jsonl captions)",
    "photo.jpg": "a real photo (scikit-image's coffee, 600x400)",
    "laion_meta.parquet": "2,000 rows of url / WIDTH / HEIGHT metadata, no images",
    "train_text_to_image_arb.py, train_text_to_image_lora_arb.py": "links to the scripts of this checkout",
}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    marker: str | None  # "runnable", "runnable: slow", "not runnable", or None
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.marker == "runnable"

    @property
    def slow(self) -> bool:
        return self.marker == "runnable: slow"


def pages() -> list[Path]:
    """README.md and every docs page except the generated ones."""
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED)]


def extract_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """Every fenced block of ``path`` with its language and marker (``None`` when unmarked); ``page`` is the path
    relative to ``root``."""
    lines = path.read_text().splitlines()
    page = str(path.relative_to(root))
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        info = m.group("info").strip()
        j = i + 1
        while j < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        body = "\n".join(ln.removeprefix(indent) for ln in lines[i + 1:j])
        prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mk = _MARKER.match(prev)
        marker = reason = None
        if mk:
            kind = mk.group("kind")
            marker = "not runnable" if kind.startswith("not") else "runnable: slow" if "slow" in kind else "runnable"
            reason = (mk.group("reason") or "").strip()
        blocks.append(Block(page, i + 1, info.split()[0].lower() if info else "", body + "\n", marker, reason or ""))
        i = j + 1
    return blocks


def substitute(source: str, assets: dict[str, str]) -> str:
    """``source`` with every :data:`SUBSTITUTIONS` rewrite applied; ``{name}`` → ``assets[name]``."""
    for pattern, replacement, _ in SUBSTITUTIONS:
        source = re.sub(pattern, lambda _m, r=replacement: r.format(**assets), source)
    return source
