"""tests/_fork_launch.py, the suite's torchrun stand-in: its ranks see the environment torchrun gives its workers
(the variable names are read from a real torchrun launch, not kept by hand), and a failing rank fails the launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
#: torchrun's agent-side variables a forked rank has no use for (no agent store, no per-rank error file or log dir)
AGENT_ONLY = {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
              "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_TIMER_FILE", "TORCHELASTIC_HEALTH_CHECK_PORT",
              "TORCHINDUCTOR_CACHE_DIR", "TORCH_CPP_LOG_LEVEL", "TORCHELASTIC_SIGNALS_TO_HANDLE", "PYTHONUNBUFFERED"}

SCRIPT = """
import json, os, sys
rank = os.environ["RANK"]
json.dump({"env": {k: v for k, v in os.environ.items() if k not in json.loads(sys.argv[2])},
           "argv": sys.argv[1:], "path0": sys.path[0]}, open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w"))
sys.exit(int(sys.argv[3]) if rank == "1" else 0)
"""


def _launch(launcher: list[str], tmp: Path, code: int = 0) -> subprocess.CompletedProcess:
    script = tmp / "show_env.py"
    script.write_text(SCRIPT)
    from test_train import free_port

    return subprocess.run([sys.executable, *launcher, "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                           "--master_port", str(free_port()), str(script), str(tmp), json.dumps(sorted(os.environ)),
                           str(code)], capture_output=True, text=True, timeout=120, env={**os.environ})


@pytest.mark.slow  # a real torchrun (its launcher imports torch) and the fork launcher, ~10 CPU-s
def test_ranks_see_torchruns_worker_environment(tmp_path: Path) -> None:
    real, fork = tmp_path / "real", tmp_path / "fork"
    real.mkdir(), fork.mkdir()
    assert _launch(["-m", "torch.distributed.run"], real).returncode == 0
    assert _launch([str(HERE / "_fork_launch.py"), "--preload", ""], fork).returncode == 0
    for rank in (0, 1):
        want, got = (json.loads((d / f"rank{rank}.json").read_text()) for d in (real, fork))
        names = set(want["env"]) - AGENT_ONLY
        assert names <= set(got["env"]), f"set these as torchrun does: {sorted(names - set(got['env']))}"
        for name in names - {"TORCHELASTIC_RUN_ID", "MASTER_PORT"}:
            assert got["env"][name] == want["env"][name], name
        assert got["argv"][2:] == want["argv"][2:] and got["path0"] == str(fork)


def test_a_failing_rank_fails_the_launch(tmp_path: Path) -> None:
    proc = _launch([str(HERE / "_fork_launch.py"), "--preload", ""], tmp_path, code=3)
    assert proc.returncode == 1 and "rank 1 exited with 3" in proc.stderr


STAGE = """
import json, os, sys
out = os.path.join(sys.argv[1], f"{sys.argv[2]}.rank{os.environ['RANK']}.json")
json.dump({"pid": os.getpid(), "cwd": os.getcwd(), "world": os.environ["WORLD_SIZE"], "port": os.environ["MASTER_PORT"],
           "seen": sorted(os.listdir(sys.argv[1]))}, open(out, "w"))
sys.stdout.write(f"stage {sys.argv[2]} rank {os.environ['RANK']}\\n")  # one write: the ranks' lines never interleave
sys.exit(int(sys.argv[3]) if os.environ["RANK"] == "1" else 0)
"""


def test_stages_run_in_turn_on_fresh_ranks_and_a_failing_stage_stops_the_launch(tmp_path: Path) -> None:
    """A JSON stage list: each stage on new processes of its own size, port, working directory and log, after the
    previous stage ended; a failing stage fails the launch, names itself with its log's tail, and later ones never
    run."""
    from test_train import free_port

    script, cwd = tmp_path / "stage.py", tmp_path / "elsewhere"
    script.write_text(STAGE)
    cwd.mkdir()
    stages = [{"name": "a", "script": str(script), "nproc": 2, "args": [str(tmp_path), "a", "0"]},
              {"name": "b", "script": str(script), "nproc": 3, "args": [str(tmp_path), "b", "0"], "cwd": str(cwd),
               "log": str(tmp_path / "b.log")},
              {"name": "c", "script": str(script), "nproc": 2, "args": [str(tmp_path), "c", "4"],
               "log": str(tmp_path / "c.log")},
              {"name": "d", "script": str(script), "nproc": 2, "args": [str(tmp_path), "d", "0"]}]
    (tmp_path / "stages.json").write_text(json.dumps({"preload": [], "stages": stages}))
    port = free_port()
    proc = subprocess.run([sys.executable, str(HERE / "_fork_launch.py"), "--nproc_per_node", "2", "--master_port",
                           str(port), str(tmp_path / "stages.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "stage 'c' failed (rank 1 exited with 4)" in proc.stderr and "stage c rank 1" in proc.stderr  # its log
    # c's rank 0 is stopped when rank 1 fails, perhaps before or while it writes (as torchrun stops it): not read
    runs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.rank*.json") if p.stem != "c.rank0"}
    assert sorted(runs) == ["a.rank0", "a.rank1", "b.rank0", "b.rank1", "b.rank2", "c.rank1"]
    assert len({r["pid"] for r in runs.values()}) == 6  # a new process per rank and stage
    assert {r["world"] for k, r in runs.items() if k.startswith("b")} == {"3"}
    assert {r["cwd"] for k, r in runs.items() if k.startswith("b")} == {str(cwd)}
    assert runs["a.rank0"]["port"] == str(port) != runs["b.rank0"]["port"]
    assert {"a.rank0.json", "a.rank1.json"} <= set(runs["b.rank0"]["seen"])  # b started after a had ended
    assert "stage a rank 0" in proc.stdout and "stage b" not in proc.stdout
    assert sorted((tmp_path / "b.log").read_text().splitlines()) == [f"stage b rank {r}" for r in range(3)]


def test_ranks_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """A test's timeout kills the launcher with SIGKILL, which it cannot pass on: its ranks die with it (as torchrun's
    workers go down with their agent) instead of training on as orphans."""
    import signal
    import time

    script = tmp_path / "sleep.py"
    script.write_text("import os, sys, time\nopen(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write("
                      "str(os.getpid()))\ntime.sleep(60)\n")
    from test_train import free_port

    launcher = subprocess.Popen([sys.executable, str(HERE / "_fork_launch.py"), "--preload", "", "--nproc_per_node",
                                 "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script),
                                 str(tmp_path)])
    pids_files = [tmp_path / "0", tmp_path / "1"]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pids_files):
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.05)
    ranks = [int(p.read_text()) for p in pids_files]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()

    def alive(pid: int) -> bool:  # a zombie (dead, not yet reaped by init) counts as gone
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in ranks), ranks
