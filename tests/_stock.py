"""A "stock" Python interpreter, one per test process, where ``import hf_arb`` fails: the tests that prove an
output loads and generates in plain diffusers without hf_arb send it their code instead of starting a fresh
interpreter each (torch + diffusers imports cost each one ~5 CPU seconds).

The server starts on the first job (``run_job``) and stops at the end of the test session (tests/conftest.py
``pytest_sessionfinish``; also at exit). It runs with ``sys.modules["hf_arb"] = None`` (hf_arb is installed in
editable mode, so a bare ``import hf_arb`` would otherwise find it), without PYTHONPATH, in ``/``, with
HF_HUB_OFFLINE=1. A job is source code plus a list of string arguments (the job's ``sys.argv[1:]``); it runs in a
fresh namespace and its ``print`` output is returned. A job that raises, or that leaves any hf_arb module loaded,
fails the calling test with the job's traceback (``StockJobError``; after the latter the interpreter exits); a
job that kills the interpreter fails it with the interpreter's log tail; the next job then starts a new one.
After each job, ``sys.argv``, ``sys.path`` and ``sys.meta_path`` are restored and the modules that diffusers'
``custom_pipeline`` / transformers' ``trust_remote_code`` load from a folder are dropped, so a later job loads its
own folder's file. tests/test_stock.py checks the blocking, the
isolation of jobs and the error path.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

#: The server: reads one JSON job per line on stdin, answers one JSON line on the file descriptor it was started
#: with as stdout (its own stdout and stderr go to the log, so stray output cannot break the protocol).
SERVER = r"""
import contextlib, gc, io, json, os, sys, traceback
sys.modules["hf_arb"] = None  # any `import hf_arb` now raises ImportError
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # stray prints (C code, progress bars) go to the log, not into the answers
DYNAMIC = ("diffusers_modules", "transformers_modules")
for line in sys.stdin:
    job = json.loads(line)
    sys.modules["hf_arb"] = None
    out, scope, argv = io.StringIO(), {"__name__": "__main__"}, sys.argv
    finders, path = list(sys.meta_path), list(sys.path)
    sys.argv = ["stock-job", *job["argv"]]
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(job["code"], "<stock job>", "exec"), scope)
        loaded = sorted(m for m, v in sys.modules.items() if m.split(".")[0] == "hf_arb" and v is not None)
        answer = {"ok": not loaded, "stdout": out.getvalue(), "exits": bool(loaded),
                  "error": f"the job loaded hf_arb modules {loaded}" if loaded else ""}
    except BaseException:
        answer = {"ok": False, "stdout": out.getvalue(), "error": traceback.format_exc(), "exits": False}
    finally:
        sys.argv, sys.meta_path[:], sys.path[:] = argv, finders, path
    del scope
    for name in [m for m in sys.modules if m.split(".")[0] in DYNAMIC]:
        del sys.modules[name]
    gc.collect()
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
    if answer["exits"]:
        break  # hf_arb got in: this interpreter is no longer stock; the next job starts a new one
"""


class StockJobError(AssertionError):
    """A stock-interpreter job raised (the message is its traceback) or the interpreter died (its log tail)."""


class _Server:
    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["HF_HUB_OFFLINE"] = "1"
        self.log = tempfile.NamedTemporaryFile(prefix="hf_arb_stock_", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, cwd="/")
        self.buffer = b""

    def log_tail(self, start: int) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")[-3000:]

    def ask(self, code: str, argv: Sequence[str], timeout: float) -> dict[str, Any]:
        start = os.path.getsize(self.log.name)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write((json.dumps({"code": code, "argv": list(argv)}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # died earlier: reported below
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    tail = self.log_tail(start)
                    self.stop()
                    raise StockJobError(f"stock job timed out after {timeout} s; log:\n{tail}")
                if not sel.select(left):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    code_ = self.proc.wait()
                    raise StockJobError(f"the stock interpreter died (exit {code_}); log:\n{self.log_tail(start)}")
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # the server's loop ends at EOF
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)


_server: _Server | None = None


def run_job(code: str, argv: Sequence[str] = (), timeout: float = 300) -> str:
    """Run ``code`` in this test process's stock interpreter (started on first use) with ``sys.argv[1:] = argv``;
    returns what it printed. Raises StockJobError (failing the test) with the traceback if the job raised."""
    global _server
    if _server is None or not _server.alive():
        if _server is not None:
            _server.stop()
        _server = _Server()
    answer = _server.ask(code, [str(a) for a in argv], timeout)
    if answer["exits"]:
        stop()
    if not answer["ok"]:
        raise StockJobError(f"stock job failed:\n{answer['error']}\nits output:\n{answer['stdout'][-2000:]}")
    return answer["stdout"]


def job_result(code: str, argv: Sequence[str] = (), timeout: float = 300) -> Any:
    """``run_job``, then the JSON the job printed after ``RESULT`` (the convention of the tests' stock scripts)."""
    out = run_job(code, argv, timeout)
    assert "RESULT" in out, f"the stock job printed no RESULT line:\n{out[-2000:]}"
    return json.loads(out.split("RESULT", 1)[1])


def stop() -> None:
    """Stop this test process's stock interpreter, if it runs."""
    global _server
    if _server is not None:
        _server.stop()
        _server = None


atexit.register(stop)
