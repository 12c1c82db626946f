"""tests/conftest.py's shared_artifact: built once per run, the same value for every caller."""

from __future__ import annotations

from pathlib import Path


def test_shared_artifact_builds_once(shared_artifact, shared_root: Path) -> None:
    calls: list[Path] = []

    def build(folder: Path) -> dict[str, str]:
        calls.append(folder)
        (folder / "payload.txt").write_text("x")
        return {"path": str(folder / "payload.txt")}

    name = f"probe-{id(calls)}"
    first = shared_artifact(name, build)
    second = shared_artifact(name, build)
    assert first == second and len(calls) == 1
    assert Path(first["path"]).read_text() == "x" and Path(first["path"]).is_relative_to(shared_root)
