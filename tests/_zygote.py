"""A pre-imported Python that forks one child per ``python script.py ...`` / ``python -c CODE ...`` a test runs.

``run([script_or_-c, *args], env=..., cwd=..., timeout=...)`` returns what ``subprocess.run([sys.executable, ...],
capture_output=True, text=True, ...)`` would, but the child is forked from a server that already imported the stack
(:data:`PRELOAD`: torch, diffusers, transformers, accelerate, datasets, peft, hf_arb's training modules): a fresh
interpreter pays ~16 CPU-s for those imports on the 2-core test machine (measured 2026-11-27), a fork ~0.

The child is a real process of its own (its own pid, signals, exit status, ``atexit``): a test may SIGKILL it or
send it SIGTERM / SIGINT. Before the request's code runs it gets what a fresh ``python`` would have: the request's
``sys.argv``, ``sys.path[0]`` (the script's folder, ``''`` for ``-c``), environment (exactly: ``os.environ`` is
replaced), working directory, stdout/stderr (files the client reads back), stdin, the interpreter's default signal
handlers (SIGINT raises KeyboardInterrupt, SIGTERM kills; an inherited SIG_IGN kept), fresh ``random`` /
``numpy.random`` seeds; torch's default generator is untouched, as no tensor op ran before the fork
(tests/_fork_launch.py's care). The code runs as ``__main__`` at the server's module level, so an uncaught
exception, ``SystemExit`` or KeyboardInterrupt ends the child exactly as the interpreter ends a script (traceback
and status 1; the exit code; death by SIGINT). Differences from a fresh interpreter, none of which the callers test:
the preloaded modules are in ``sys.modules`` before the code runs (so where *what is imported* is the subject, e.g.
"--help never imports torch", tests keep a real fresh process), a traceback starts with one frame of this file,
the preloaded objects are frozen (``gc.freeze()``: a child's collections skip them, so its exit costs ~0.7 CPU-s
instead of ~3.2 of copied pages), and the parent process is the server.

Import-time environment. Libraries read some variables once, at import (``HF_HUB_OFFLINE``, ``HF_HOME``,
``OMP_NUM_THREADS``, ``PYTHONPATH``, ``PYTHONHASHSEED``, ...). A server is started with a request's environment and
serves only requests whose environment equals it except for :data:`NOT_READ_AT_IMPORT`; another environment gets a
server of its own (at most :data:`MAX_SERVERS` per test process, the least recently used is stopped). Interpreter
options (``-X``, ``-m``, ...) are not served: those requests run in a real subprocess. tests/test_zygote.py compares a
child with a fresh interpreter, and shows an import-time variable reaching the child's libraries.

One server per test process (each xdist worker), started at the first request, stopped when the process exits (or,
if it dies, when the server sees its parent gone).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _fork_launch

#: imported before the fork: tests/_fork_launch.py's list plus the training script's own modules
PRELOAD = (*_fork_launch.PRELOAD, "hf_arb.train.models", "hf_arb.train.outputs", "hf_arb.train.progress",
           "hf_arb.train.sources", "hf_arb.train.flags.args", "hf_arb.train.signals", "safetensors.torch")
#: variables that differ between requests of one test process and that no library reads at import
NOT_READ_AT_IMPORT = frozenset({"PYTEST_CURRENT_TEST"})
MAX_SERVERS = 3
#: the xdist group of the suite's users of the full :data:`PRELOAD` (test_fault_train's checkpoint runs, which the
#: others join): one worker starts one server for all of them (~16 CPU-s) instead of one per worker
GROUP = "fault_ckpt"
ROOT = Path(__file__).resolve().parents[1]
#: seconds a server may take to import :data:`PRELOAD` (~1 min on a loaded 2-core machine)
START_TIMEOUT = 600


# ------------------------------------------------------------------------------------------------ client
class _Server:
    def __init__(self, env: dict[str, str], preload: tuple[str, ...]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="hf_arb_zygote_"))
        self.address = str(self.folder / "socket")
        log = open(self.folder / "server.log", "wb")  # noqa: SIM115 - the server's own output, for a failed start
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", self.address, ",".join(preload)], env=env,
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=self.folder)
        log.close()

    def connect(self) -> socket.socket:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.address)
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.folder / "server.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"the zygote did not start (exit {self.proc.poll()}):\n{log}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for name in ("socket", "server.log"):
            (self.folder / name).unlink(missing_ok=True)
        self.folder.rmdir()


#: this test process's servers, least recently used first
_SERVERS: dict[tuple, _Server] = {}
#: the CPU seconds (user + system) of the children this process's servers ran, by request (for measurements)
CHILD_CPU: list[float] = []


def _key(env: dict[str, str], preload: tuple[str, ...]) -> tuple:
    return (preload, tuple(sorted((k, v) for k, v in env.items() if k not in NOT_READ_AT_IMPORT)))


def server_count() -> int:
    """How many servers this process has running (tests/test_zygote.py: one per import-time environment)."""
    return len(_SERVERS)


def _server(env: dict[str, str], preload: tuple[str, ...]) -> _Server:
    key = _key(env, preload)
    server = _SERVERS.pop(key, None)
    if server is None or server.proc.poll() is not None:
        while len(_SERVERS) >= MAX_SERVERS:
            _SERVERS.pop(next(iter(_SERVERS))).stop()
        server = _Server({k: v for k, v in env.items() if k not in NOT_READ_AT_IMPORT}, preload)
    _SERVERS[key] = server  # most recently used last
    return server


def stop(preload: tuple[str, ...] | None = None) -> None:
    """Stop this process's servers (those of one ``preload`` only, if given)."""
    for key in [k for k in _SERVERS if preload is None or k[0] == preload]:
        _SERVERS.pop(key).stop()


atexit.register(stop)


#: this process's environment when the suite imported this module: fixtures that set variables for their own
#: clusters later (``ray_cluster``, ``spark``) must not key a second full server (:func:`script_env`)
_BASE_ENV = dict(os.environ)


def script_env() -> dict[str, str]:
    """The environment of the suite's single-process script runs (``python train_text_to_image_arb.py ...``): this
    process's as the suite started it (:data:`_BASE_ENV`), offline, with this tree's hf_arb and script first on the
    path, and no launcher's variables. One environment, so they share one server."""
    env = {**_BASE_ENV, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return {k: v for k, v in env.items() if k not in ("ACCELERATE_DYNAMO_BACKEND", "TORCHELASTIC_RUN_ID")}


def run(args: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float | None = None, preload: tuple[str, ...] = PRELOAD) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)``
    with ``args`` = ``[script, *argv]`` or ``["-c", code, *argv]``, forked from a pre-imported server. Other
    interpreter options run in a real subprocess. On a timeout the child is killed and TimeoutExpired raised."""
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    if not args or (args[0].startswith("-") and args[0] != "-c") or not hasattr(os, "fork"):
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd,
                              timeout=timeout)
    server = _server(env, preload)
    with tempfile.TemporaryDirectory(prefix="hf_arb_zygote_run_") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = {"args": args, "env": env, "cwd": cwd, "stdout": str(out), "stderr": str(err)}
        with server.connect() as sock:
            sock.sendall(json.dumps(request).encode() + b"\n")
            reader = sock.makefile("rb")
            pid = json.loads(reader.readline())["pid"]
            sock.settimeout(timeout)
            try:
                line = reader.readline()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                    os.kill(pid, signal.SIGKILL)  # as subprocess.run does on a timeout; the server reaps it
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout or 0.0,
                                                out.read_bytes(), err.read_bytes()) from None
            except BaseException:  # Ctrl-C in the test: the child must not run on with the server waiting on it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                raise
            if not line:
                raise RuntimeError(f"the zygote server stopped while running {args[:2]}")
            done = json.loads(line)
        CHILD_CPU.append(done["cpu"])
        return subprocess.CompletedProcess([sys.executable, *args], done["returncode"],
                                           out.read_text(errors="replace"), err.read_text(errors="replace"))


# ------------------------------------------------------------------------------------------------ server
#: the server's signal handlers before it imported anything (the interpreter's defaults, given what it inherited)
_START_HANDLERS: dict[int, object] = {}


def _serve(address: str, preload: str) -> dict:
    """Import ``preload``, then answer requests; returns only in a forked child, with its request."""
    import importlib

    parent = os.getppid()  # before the imports: a test process that dies during them must not leave us behind
    _fork_launch._die_with(parent)  # killed with the test process (PR_SET_PDEATHSIG), also while we wait on a child
    for signum in signal.valid_signals():  # as this interpreter started: what a fresh one started here would have
        handler = signal.getsignal(signum)
        if handler is not None:
            _START_HANDLERS[signum] = handler
    for name in filter(None, preload.split(",")):
        importlib.import_module(name)
    import gc

    gc.freeze()  # the preloaded objects: never scanned by a child's collections, so their pages stay shared
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".tmp")
    listener.listen()
    os.replace(address + ".tmp", address)  # clients connect once the imports are done
    listener.settimeout(5)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test process died without stopping us
                sys.exit(0)
            continue
        conn.settimeout(None)
        with conn:
            request = json.loads(conn.makefile("rb").readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                return request
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            _, status, usage = os.wait4(pid, 0)
            try:
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status),
                                         "cpu": usage.ru_utime + usage.ru_stime}).encode() + b"\n")
            except OSError:  # the client gave up (its timeout)
                pass


def _become(request: dict) -> tuple[str, list[str]]:
    """In the child: the process state a fresh ``python`` would start the request with; returns (kind, argv)."""
    import random

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    for signum, handler in _START_HANDLERS.items():  # default_int_handler for SIGINT, unless started ignoring it
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    args = request["args"]
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        return "code", args[1]
    sys.argv = list(args)
    sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
    return "script", args[0]


def _main_globals(**attrs: object) -> dict:
    """A new ``__main__`` module as the interpreter makes it for a script or ``-c`` (``__builtins__`` the module)."""
    import builtins
    import types

    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __package__=None, __spec__=None, __annotations__={}, **attrs)
    sys.modules["__main__"] = main
    return main.__dict__


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--serve":
    _KIND, _WHAT = _become(_serve(sys.argv[2], sys.argv[3]))
    # From here on this is the request's process. Its code runs at this module's level, so an uncaught exception,
    # SystemExit or KeyboardInterrupt ends it as the interpreter ends a script.
    if _KIND == "code":
        import importlib.machinery

        exec(compile(_WHAT, "<string>", "exec"), _main_globals(__loader__=importlib.machinery.BuiltinImporter))
    else:
        import importlib.machinery

        _PATH = os.path.abspath(_WHAT)  # as __main__.__file__ of `python script.py` (absolute since Python 3.9)
        with open(_PATH, "rb") as _SOURCE:
            _CODE = compile(_SOURCE.read(), _PATH, "exec")
        exec(_CODE, _main_globals(__file__=_PATH, __cached__=None,
                                  __loader__=importlib.machinery.SourceFileLoader("__main__", _PATH)))
