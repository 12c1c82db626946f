"""Run documentation blocks page by page (see tests/_doc_snippets.py); used by tests/test_doc_snippets.py.

Usage: ``python tests/_run_doc_blocks.py PLAN.json RESULTS.json``. ``PLAN.json`` holds
``[{"page", "workdir", "blocks": [{"id", "lang", "source"}]}]`` (blocks already substituted); ``RESULTS.json`` gets
``{block id: {"ok": bool, "seconds": float, "error": str}}``. A page stops at its first failing block (the later
ones are reported as not run). One process runs every page, so the heavy imports are paid once.
"""

from __future__ import annotations

import contextlib
import doctest
import json
import os
import re
import shlex
import subprocess
import sys
import time
import traceback
from typing import Any


def _hf_arb_commands(source: str) -> list[list[str]] | None:
    """The argv of each command when ``source`` is only ``hf-arb`` commands (comments, ``\\`` continuations); else
    None (the block needs a real shell)."""
    commands = []
    for line in source.replace("\\\n", " ").splitlines():
        try:
            argv = shlex.split(line, comments=True)
        except ValueError:
            return None
        if not argv:
            continue
        if argv[0] != "hf-arb" or any(tok in {"|", "&&", "||", ";", ">", "<", "&"} for tok in argv):
            return None
        if any(c in line.split("#")[0] for c in "$`"):
            return None  # shell expansion
        commands.append(argv[1:])
    return commands


def _one_process_launch(source: str) -> list[str] | None:
    """``[script, *args]`` when ``source`` is one ``accelerate launch <script>.py ...`` command without launcher
    options (one process: what ``accelerate launch`` starts on a CPU machine); else None."""
    argv = shlex.split(source.replace("\\\n", " "), comments=True)
    if argv[:2] != ["accelerate", "launch"] or len(argv) < 3 or not argv[2].endswith(".py"):
        return None
    if any(tok in {"|", "&&", "||", ";", ">", "<", "&"} for tok in argv) or any(c in source for c in "$`"):
        return None
    return argv[2:]


#: shell commands that change what a later command of the same script sees (its folder, its environment, or whether
#: it runs at all): a block whose lines before its launch use one runs whole in bash (:func:`_trailing_launch`)
_SHELL_STATE = frozenset({"cd", "pushd", "popd", "export", "source", ".", "unset", "alias", "umask", "ulimit", "exec",
                          "exit", "return", "set", "shopt", "trap", "declare", "typeset", "readonly", "local", "eval",
                          "builtin", "command", "enable", "hash"})
#: tokens after which a new command starts
_COMMAND_START = frozenset({";", "&", "|", "&&", "||", "(", ")", "{", "}", "then", "do", "else", "elif", "if", "while",
                            "until", "!", ";;", "|&"})


def _changes_shell_state(script: str) -> bool:
    """Whether ``script`` may change the folder or environment of the commands after it (a command of
    :data:`_SHELL_STATE` or a variable assignment in command position); True when it cannot be tokenized."""
    lexer = shlex.shlex(script.replace("\\\n", " ").replace("\n", " ;\n"), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return True
    first = True
    for tok in tokens:
        if first and (tok in _SHELL_STATE or re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\[.*\])?\+?=", tok)):
            return True
        first = tok in _COMMAND_START
    return False


def _trailing_launch(source: str) -> tuple[str, list[str]] | None:
    """``(prefix, [script, *args])`` when ``source`` ends with a one-process ``accelerate launch`` command
    (:func:`_one_process_launch`: a line of its own, unindented, with its ``\\`` continuations) after plain shell
    lines that do not change its folder or environment (no ``cd``, ``export``, assignments, ``exit``, ...): the
    prefix then runs in bash and the launch in this process, as a shell runs them one after the other; else None."""
    lines = source.rstrip("\n").split("\n")
    start = len(lines) - 1
    while start > 0 and lines[start - 1].endswith("\\"):
        start -= 1
    prefix, last = "\n".join(lines[:start]), "\n".join(lines[start:]) + "\n"
    if not prefix.strip() or not last.startswith("accelerate launch ") or prefix.rstrip().endswith("\\"):
        return None
    argv = _one_process_launch(last)
    if argv is None or "<<" in prefix or _changes_shell_state(prefix):
        return None
    return prefix + "\n", argv


def _run_script(argv: list[str]) -> None:
    """Run a training script in this process, as ``python script args`` would (the imports are paid once per run of
    the docs, not once per command)."""
    import runpy

    saved = sys.argv
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"`accelerate launch {shlex.join(argv)}` exited with status {e.code}") from e
    finally:
        sys.argv = saved


def _leading_python_c(source: str) -> tuple[list[str], str]:
    """The code of each ``python -c "..."`` command that opens ``source`` (a line of its own, no shell operators or
    expansions) and the rest of the block: those run in this process, as their own ``__main__``, since a fresh
    interpreter would pay the imports again."""
    codes: list[str] = []
    lines = source.splitlines(keepends=True)
    while lines:
        line = lines[0].strip()
        if line.endswith("\\") or any(c in line for c in "$`"):
            break
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)  # operators become tokens of their own
        lexer.whitespace_split = True
        try:
            argv = list(lexer)
        except ValueError:
            break
        if not argv:
            lines.pop(0)
            continue
        if argv[0] not in ("python", "python3") or len(argv) != 3 or argv[1] != "-c":
            break
        codes.append(argv[2])
        lines.pop(0)
    return codes, "".join(lines)


def _run_python_c(code: str) -> None:
    saved = sys.argv
    sys.argv = ["-c"]
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - `python -c`, as written
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"`python -c {shlex.quote(code)}` exited with status {e.code}") from e
    finally:
        sys.argv = saved


def _run_shell(source: str) -> None:
    """``source`` in ``bash -euo pipefail`` with the venv's ``bin`` first on ``PATH``."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", source], env=env, capture_output=True, text=True,
                          check=False)
    sys.stdout.write(proc.stdout[-3000:])
    if proc.returncode != 0:
        raise RuntimeError(f"bash exited with {proc.returncode}:\n{proc.stderr[-4000:]}")


def _run_bash(source: str) -> None:
    codes, source = _leading_python_c(source)
    for code in codes:
        _run_python_c(code)
    if not source.strip():
        return
    launch = _one_process_launch(source)
    if launch is not None:
        _run_script(launch)
        return
    commands = _hf_arb_commands(source)
    if commands is None:
        tail = _trailing_launch(source)
        _run_shell(source if tail is None else tail[0])
        if tail is not None:
            _run_script(tail[1])
        return
    from hf_arb.cli.app import main

    for argv in commands:
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse errors
            rc = e.code if isinstance(e.code, int) else 1
        if rc:
            raise RuntimeError(f"`hf-arb {shlex.join(argv)}` exited with status {rc}")


def _run_python(source: str, name: str, ns: dict[str, Any]) -> None:
    if source.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(source, ns, name, name, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
        out: list[str] = []
        runner.run(test, out=out.append, clear_globs=False)
        if runner.failures:
            raise AssertionError("doctest failed:\n" + "".join(out)[-4000:])
        return
    exec(compile(source, name, "exec"), ns)  # noqa: S102 - running the docs is the point


def run(plan: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    start_dir = os.getcwd()
    for page in plan:
        os.chdir(page["workdir"])
        ns: dict[str, Any] = {"__name__": "__main__"}
        failed = None
        for block in page["blocks"]:
            if failed:
                results[block["id"]] = {"ok": False, "seconds": 0.0, "error": f"not run: {failed} failed first"}
                continue
            t0 = time.perf_counter()
            try:
                if block["lang"] in ("python", "py"):
                    _run_python(block["source"], block["id"], ns)
                else:
                    _run_bash(block["source"])
                results[block["id"]] = {"ok": True, "seconds": time.perf_counter() - t0, "error": ""}
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt):
                    raise
                failed = block["id"]
                results[block["id"]] = {"ok": False, "seconds": time.perf_counter() - t0,
                                        "error": "".join(traceback.format_exception(e))[-6000:]}
            print(f"== {block['id']}: {'ok' if results[block['id']]['ok'] else 'FAILED'} "
                  f"({results[block['id']]['seconds']:.1f} s)", flush=True)
        os.chdir(start_dir)
    return results


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    with contextlib.redirect_stdout(sys.stderr):  # block output goes to stderr; stdout stays clean
        res = run(plan)
    with open(sys.argv[2], "w") as f:
        json.dump(res, f, indent=1)
