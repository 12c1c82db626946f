"""Fixtures shared by the whole test run.

``shared_artifact(name, build)`` builds an expensive artifact (tiny models, a training run, a dataset) once per
test run, even under ``pytest -n 2``: the first xdist worker that needs it builds it under a file lock in a
folder every worker of the run shares; the others wait and reuse it. ``build(folder)`` returns a
JSON-serialisable value (paths, statistics) that every caller receives.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A folder all xdist workers of this run share (the run's base temp; a worker's own base temp alone)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if worker_id != "master" else base) / "shared"
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def shared_artifact(shared_root: Path) -> Callable[[str, Callable[[Path], Any]], Any]:
    def get(name: str, build: Callable[[Path], Any]) -> Any:
        folder = shared_root / name
        done = shared_root / f"{name}.done.json"
        with FileLock(str(shared_root / f"{name}.lock")):
            if done.exists():
                return json.loads(done.read_text())
            folder.mkdir(parents=True, exist_ok=True)
            value = build(folder)
            done.write_text(json.dumps(value))
            return value

    return get
