"""A ``torchrun --nproc_per_node N`` stand-in for the suite's multi-process runs: import once, fork the ranks.

``python tests/_fork_launch.py --nproc_per_node N --master_addr A --master_port P script.py [args...]``

torchrun starts each rank as a fresh interpreter, and each pays the imports of torch, diffusers, transformers,
accelerate, datasets and peft again: about 10 CPU-s per process on a 2-core test machine, most of a tiny run's cost
(measured 2026-11-27: a 4-step tiny SD run took 15 CPU-s, 12 of them imports). This launcher imports that stack
once (no tensor op runs here, so no thread pool exists to be copied), then ``os.fork()``s one child per rank with the
environment torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ...: the env:// contract of
``torch.distributed.init_process_group``, which accelerate reads), and runs the script in it as ``__main__`` with
``sys.argv`` and ``sys.path[0]`` as ``python script.py`` sets them. The ranks are real processes with their own gloo
process group; what differs from torchrun is only that their imports were paid once, before the fork.

Like torchrun: the children write to this process's stdout/stderr; when a rank fails, the others are stopped
(SIGTERM, then SIGKILL after 10 s) and the launcher exits 1 naming it; a signal to the launcher is passed on.

Several launches in one: a ``script`` ending in ``.json`` is a list of stages (``launch_stages`` in
tests/_train_fixtures.py writes one): ``{"preload": [modules], "stages": [{"name", "script", "args", "nproc", "cwd",
"log"}, ...]}``. The launcher imports ``preload`` (default :data:`PRELOAD`) once, then runs the stages in turn, each on
fresh ranks forked from it (a new process per rank and stage: a stage that resumes the previous stage's checkpoint is
a real restart), each with a process group of its own (stage 0 on ``--master_port``, the next on a free port),
``nproc`` ranks (default ``--nproc_per_node``), working directory ``cwd`` and, with ``log``, the ranks' output in
that file. A failing stage stops the launch (exit 1, naming it, with its log's tail). A launch imports the stack once
(~16 CPU-s with the whole :data:`PRELOAD`, ~5 with torch, accelerate and hf_arb alone); a stage costs a fork.

Not used where the launcher itself is the subject: the docs' commands run ``torchrun`` as written
(tests/test_doc_snippets.py), and the signal tests (tests/test_signals.py) send signals through a real torchrun.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import traceback
import uuid

#: imported before the fork: what every rank of the suite's scripts imports anyway (the costly part of start-up)
PRELOAD = ("torch", "torch.distributed", "numpy", "pyarrow", "accelerate", "datasets", "transformers", "peft",
           "diffusers", "diffusers.models.unets", "diffusers.models.autoencoders", "diffusers.models.transformers",
           "diffusers.optimization", "hf_arb")


def _run_rank(script: str, args: list[str], env: dict[str, str]) -> int:
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
    for stream in (sys.stdout, sys.stderr):  # torchrun starts its workers with `python -u`
        stream.reconfigure(line_buffering=True)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL if s == signal.SIGTERM else signal.default_int_handler)
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a rank's uncaught error: printed as the interpreter would, exit 1
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc_per_node", type=int, required=True)
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, required=True)
    p.add_argument("--preload", default=",".join(PRELOAD), help="modules to import before the fork (comma-separated)")
    p.add_argument("script", help="the script every rank runs, or a JSON list of stages (the module docstring)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for its workers, before torch loads
    if a.script.endswith(".json"):
        spec = json.loads(open(a.script).read())
        preload, stages = spec.get("preload", a.preload.split(",")), spec["stages"]
    else:
        preload, stages = a.preload.split(","), [{"name": a.script, "script": a.script, "args": a.args}]
    for name in filter(None, preload):
        importlib.import_module(name)
    # the imports' objects into the collector's permanent generation (Python's advice before fork without exec): the
    # collections of the ranks and their DataLoader workers then never walk, and so never copy, those shared pages
    gc.freeze()
    for i, stage in enumerate(stages):
        if _SIGNALLED:
            return 1
        port = a.master_port if i == 0 else _free_port()
        failed = _launch(stage["script"], stage.get("args", []), stage.get("nproc", a.nproc_per_node), a.master_addr,
                         port, stage.get("cwd"), stage.get("log"))
        if failed is not None:
            if len(stages) > 1:
                tail = open(stage["log"], errors="replace").read()[-6000:] if stage.get("log") else ""
                print(f"{tail}\n_fork_launch: stage {stage.get('name', i)!r} failed (rank {failed[0]} exited with "
                      f"{failed[1]}); later stages not run", file=sys.stderr, flush=True)
            return 1
    return 0


#: the signals the launcher passed on to its ranks
_SIGNALLED: list[int] = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def _die_with(parent: int) -> None:
    """A rank is killed when the launcher dies (Linux's ``PR_SET_PDEATHSIG``), as torchrun's agent takes its workers
    down: a test's timeout kills the launcher with SIGKILL, which it cannot pass on, and the ranks would otherwise
    train on as orphans. Where ``prctl`` is missing nothing changes."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (AttributeError, OSError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)

def _launch(script: str, args: list[str], n: int, addr: str, port: int, cwd: str | None,
            log: str | None) -> tuple[int, int] | None:
    """Fork ``n`` ranks running ``script``; wait for them all; ``(rank, exit code)`` of the first that failed."""
    run_id = uuid.uuid4().hex
    children: dict[int, int] = {}  # pid -> rank
    parent = os.getpid()
    for rank in range(n):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
               "ROLE_NAME": "default", "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "GROUP_WORLD_SIZE": "1",
               "ROLE_WORLD_SIZE": str(n), "MASTER_ADDR": addr, "MASTER_PORT": str(port),
               "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
        pid = os.fork()
        if pid == 0:
            _die_with(parent)
            if cwd:
                os.chdir(cwd)
            if log:  # the rank's output (fds 1 and 2) appended to the stage's log
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
            code = _run_rank(script, args, env)
            os._exit(code)
        children[pid] = rank

    def forward(signum, _frame):  # a signal to the launcher reaches every rank, as torchrun passes it on
        _SIGNALLED.append(signum)  # and no later stage starts
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed: list[tuple[int, int]] = []
    while children:
        pid, status = os.wait()
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed.append((rank, code))
            print(f"_fork_launch: rank {rank} exited with {code}; stopping the other ranks", file=sys.stderr,
                  flush=True)
            _stop(children)
    signal.alarm(0)  # _stop's SIGKILL timer, should a rank have failed
    return failed[0] if failed else None


def _stop(children: dict[int, int]) -> None:
    """SIGTERM to the ranks still running; SIGKILL to those left 10 s later (the wait loop reaps them)."""
    def kill(signum: int) -> None:
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    kill(signal.SIGTERM)
    signal.signal(signal.SIGALRM, lambda *_: kill(signal.SIGKILL))
    signal.alarm(10)


if __name__ == "__main__":
    sys.exit(main())
