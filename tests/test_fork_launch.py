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
