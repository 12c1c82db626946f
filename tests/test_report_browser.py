"""The report in a real browser: headless Chromium (Debian's ``chromium``) driven by Playwright for Python.

``make test`` installs both (pip ``playwright`` from the test extra; ``apt-get install chromium`` in the Makefile's
venv recipe). Playwright's own browser download is not used: it launches the system's ``/usr/bin/chromium``.
One page load: every thumbnail decodes, nothing is logged as an error, and the counts shown are the sampler's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
from test_report import BUCKETS, make_photo_folder

from hf_arb import BucketBatchSampler, add_bucket_columns
from hf_arb.annotate.report import write_report

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        pytest.skip("no chromium on this machine: `make test` installs it (apt-get install chromium); "
                    "this test needs a real browser")
    return path


def test_report_loads_in_chromium_with_every_thumbnail_and_the_samplers_counts(tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: `make test` installs "
                                   "it with the test extra (pip install -e '.[test]')")
    chromium = _chromium()
    raw = datasets.load_dataset("imagefolder", data_dir=str(make_photo_folder(tmp_path / "imgs")), split="train")
    ds = add_bucket_columns(raw, BUCKETS, show_summary=False, max_upscale=6.0)
    page_path = write_report(ds, tmp_path / "report.html", k=2, batch_size=2, num_processes=1, leftover="fill")
    ids = np.asarray(ds["bucket"], dtype=np.int64)
    plan = BucketBatchSampler(ids, 2, num_replicas=1, rank=0, leftover="fill", buckets=BUCKETS,
                              log_report=False).report()

    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
            requests: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_path.resolve().as_uri(), wait_until="load")
            images = page.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.alt])")
            shown = page.evaluate("""() => {
                const get = f => document.querySelector(`#summary [data-field='${f}']`).textContent;
                const rows = Array.from(document.querySelectorAll('#buckets tr[data-bucket]')).map(tr => [
                    +tr.dataset.bucket, tr.querySelector("[data-field='rows']").textContent,
                    tr.querySelector("[data-field='steps']").textContent,
                    tr.querySelector("[data-field='repeated']").textContent]);
                return {steps: get('steps'), rows: get('rows'), used: get('rows_used'), dropped: get('rows_dropped'),
                        repeated: get('rows_repeated'), batch: get('global_batch'), buckets: rows};
            }""")
        finally:
            browser.close()

    assert not errors, errors
    assert all(u.startswith(("file:", "data:")) for u in requests), requests  # nothing fetched from outside
    kept_buckets = int((np.bincount(ids[ids >= 0], minlength=len(BUCKETS)) > 0).sum())
    assert len(images) == sum(min(2, int(c)) for c in np.bincount(ids[ids >= 0])) >= kept_buckets > 1
    assert all(complete and width > 0 for complete, width, _ in images), images

    def num(text: str) -> int:
        return int(text.replace(",", ""))

    assert num(shown["steps"]) == plan.steps and num(shown["rows"]) == plan.rows_total
    assert num(shown["used"]) == plan.rows_used and num(shown["dropped"]) == plan.rows_dropped
    assert num(shown["repeated"]) == plan.rows_repeated > 0 and num(shown["batch"]) == plan.global_batch_size
    counts = np.bincount(ids[ids >= 0], minlength=len(BUCKETS))
    for b, rows, steps, repeated in shown["buckets"]:
        assert num(rows) == counts[b] and num(steps) == plan.batches_per_bucket.get(b, 0)
    assert sum(num(r) for *_, r in shown["buckets"]) == plan.rows_repeated
