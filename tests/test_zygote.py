"""tests/_zygote.py, the suite's pre-imported Python for single-process script runs: a child it forks starts as a fresh
``python`` would (compared with a real one, the state read back, not kept by hand), ends as a fresh one ends, and an
import-time variable reaches its libraries (a server per import-time environment)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import _zygote as zygote
import pytest

#: what a script sees of its process, and how it ends (``sys.argv[1]``)
PROBE = r"""
import atexit, json, os, signal, sys, time
atexit.register(lambda: print("atexit ran", flush=True))
g = globals()
state = {"argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "env": dict(os.environ), "name": __name__,
         "file": g.get("__file__"), "builtins": type(g["__builtins__"]).__name__, "flags": repr(sys.flags),
         "signals": {s: repr(signal.getsignal(getattr(signal, s)))
                     for s in ("SIGINT", "SIGTERM", "SIGPIPE", "SIGCHLD", "SIGHUP", "SIGUSR1", "SIGALRM")},
         "streams": [[s.isatty(), s.line_buffering, s.encoding, s.errors] for s in (sys.stdout, sys.stderr)],
         "umask": os.umask(0o22), "main_is_me": sys.modules["__main__"].__dict__ is g,
         "main": sorted((k, type(v).__name__ if k == "__loader__" else repr(v)) for k, v in g.items()
                        if k.startswith("__") and k != "__file__")}
print(json.dumps(state))
print("to stderr", file=sys.stderr)
end = sys.argv[1]
if end == "exit3":
    sys.exit(3)
if end == "message":
    sys.exit("bye")
if end == "raise":
    raise ValueError("boom")
if end == "ctrl-c":
    raise KeyboardInterrupt
if end.startswith("SIG"):
    os.kill(os.getpid(), getattr(signal, end))
    time.sleep(30)
"""
ENDS = ["ok", "exit3", "message", "raise", "ctrl-c", "SIGINT", "SIGTERM", "SIGKILL"]


def _compare(fresh: subprocess.CompletedProcess, forked: subprocess.CompletedProcess) -> None:
    assert forked.returncode == fresh.returncode, (forked.stderr[-2000:], fresh.stderr[-2000:])
    assert forked.stdout == fresh.stdout  # the process state (JSON) and the atexit line, where it ran
    if "Traceback" in fresh.stderr:  # the same error, after a traceback (ours starts with the server's frames)
        assert "Traceback (most recent call last)" in forked.stderr
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]
        assert forked.stderr.splitlines()[0] == fresh.stderr.splitlines()[0] == "to stderr"
    else:
        assert forked.stderr == fresh.stderr


@pytest.mark.slow  # the full preload: shares its server with test_fault_train's runs (its group, its environment)
@pytest.mark.xdist_group(zygote.GROUP)
def test_a_forked_script_starts_and_ends_as_in_a_fresh_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "folder" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    env = zygote.script_env()
    for end in ENDS:
        args = [str(script), end, "x y"]
        fresh = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                               timeout=120)
        forked = zygote.run(args, env=env, cwd=tmp_path, timeout=120)
        _compare(fresh, forked)
        if end == "ok":
            state = json.loads(forked.stdout.splitlines()[0])
            assert state["argv"] == args and state["path"][0] == str(script.parent) and state["cwd"] == str(tmp_path)
            assert state["name"] == "__main__" and state["main_is_me"]
    assert (fresh.returncode, forked.returncode) == (-9, -9)  # SIGKILL, the last: the process itself died
    # python -c: sys.argv[0] '-c', sys.path[0] '', no __file__
    for end in ("ok", "raise", "SIGTERM"):
        args = ["-c", PROBE, end]
        _compare(subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                                timeout=120), zygote.run(args, env=env, cwd=tmp_path, timeout=120))
    # and every preloaded module was there before the child ran (the point of the server)
    code = f"import sys; print(all(m in sys.modules for m in {zygote.PRELOAD!r}))"
    assert zygote.run(["-c", code], env=env, cwd=tmp_path).stdout == "True\n"


def test_an_import_time_variable_reaches_the_child_through_its_own_server(tmp_path: Path) -> None:
    """huggingface_hub reads HF_HUB_OFFLINE once, at import (as diffusers and transformers do their variables): a
    request whose import-time environment differs gets its own server, whose libraries saw its value. A light
    preload: what is shown is the keying, the same for any preload."""
    preload = ("huggingface_hub.constants",)
    code = "import huggingface_hub.constants as c; print(c.HF_HUB_OFFLINE)"
    env = zygote.script_env()
    before = zygote.server_count()
    try:
        got = {value: zygote.run(["-c", code], env={**env, "HF_HUB_OFFLINE": value}, preload=preload).stdout
               for value in ("1", "0", "1")}
        assert got == {"1": "True\n", "0": "False\n"}
        assert zygote.server_count() == min(before + 2, zygote.MAX_SERVERS)  # the least recently used evicted
        fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env={**env, "HF_HUB_OFFLINE": "0"}).stdout
        assert fresh == got["0"]
        # a variable no library reads at import changes per test: it does not start a server, and the child sees it
        n = zygote.server_count()
        show = "import os; print(os.environ['PYTEST_CURRENT_TEST'])"
        assert zygote.run(["-c", show], env={**env, "HF_HUB_OFFLINE": "0", "PYTEST_CURRENT_TEST": "t"},
                          preload=preload).stdout == "t\n"
        assert zygote.server_count() == n
    finally:
        zygote.stop(preload)


def test_a_timeout_kills_the_child_and_the_server_serves_on(tmp_path: Path) -> None:
    preload = ("json",)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            zygote.run(["-c", "import time; print('started', flush=True); time.sleep(60)"], preload=preload,
                       timeout=2)
        assert zygote.run(["-c", "print('next')"], preload=preload).stdout == "next\n"
        # interpreter options are not served: a real subprocess
        assert zygote.run(["-X", "utf8", "-c", "import sys; print(sys.flags.utf8_mode)"],
                          preload=preload).stdout == "1\n"
    finally:
        zygote.stop(preload)
