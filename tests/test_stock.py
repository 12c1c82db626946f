"""The stock interpreter (tests/_stock.py) really runs without hf_arb: the property the "loads in stock diffusers"
tests rely on. Its jobs are isolated from each other, and a failing job fails the test with its traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _stock import StockJobError, job_result, run_job

ROOT = Path(__file__).resolve().parent.parent


def test_import_hf_arb_fails_in_the_stock_interpreter() -> None:
    with pytest.raises(StockJobError, match=r"ModuleNotFoundError: import of hf_arb halted"):
        run_job("import hf_arb")
    with pytest.raises(StockJobError, match=r"ModuleNotFoundError: No module named 'hf_arb.families'"):
        run_job("from hf_arb.families import base")
    env = job_result("import json, os, sys\n"
                     "print('RESULT' + json.dumps({'cwd': os.getcwd(), 'path': sys.path, 'argv': sys.argv[1:],"
                     " 'env': {k: os.environ.get(k) for k in ('PYTHONPATH', 'HF_HUB_OFFLINE')}}))", ["a", "b"])
    assert env["cwd"] == "/" and env["argv"] == ["a", "b"]
    assert env["env"] == {"PYTHONPATH": None, "HF_HUB_OFFLINE": "1"}
    assert not [p for p in env["path"] if p and Path(p).resolve() in (ROOT, ROOT / "tests")]


def test_a_job_that_unblocks_hf_arb_is_refused() -> None:
    with pytest.raises(StockJobError, match=r"the job loaded hf_arb modules \['hf_arb'"):
        run_job("import sys\ndel sys.modules['hf_arb']\nimport hf_arb")
    with pytest.raises(StockJobError, match="import of hf_arb halted"):  # blocked again for the next job
        run_job("import hf_arb")


def test_a_failing_job_reports_its_traceback_and_jobs_do_not_share_state() -> None:
    with pytest.raises(StockJobError) as err:
        run_job("x = 1\nprint('before')\ndef f():\n    raise ValueError('boom')\nf()")
    assert "Traceback" in str(err.value) and "ValueError: boom" in str(err.value) and "before" in str(err.value)
    with pytest.raises(StockJobError, match="NameError: name 'x' is not defined"):
        run_job("print(x)")
    assert json.loads(run_job("import json\nprint(json.dumps([1, 2]))")) == [1, 2]
    count = "import json, sys\nprint(json.dumps([len(sys.path), len(sys.meta_path), sys.argv[1:]]))"
    before = json.loads(run_job(count))
    run_job("import sys\nsys.path.insert(0, '/x')\nsys.meta_path.insert(0, object())\nsys.argv.append('y')")
    assert json.loads(run_job(count)) == before and before[2] == []
