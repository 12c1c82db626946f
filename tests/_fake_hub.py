"""A local stand-in for the Hugging Face Hub at the ``HfApi`` boundary (test helper).

No Hub is reachable here, so ``FakeHub.install(monkeypatch)`` replaces ``HfApi`` and ``HfFileSystem`` where
``datasets`` (5.x) and ``hf_arb.annotate.hub`` look them up. Every commit operation is recorded in
``FakeHub.commits`` and applied to a folder per repository (``FakeHub.repo_dir(repo_id)``): what would land on
the Hub lands there, so ``datasets.load_dataset(folder)`` shows what a user would get from ``load_dataset(repo_id)``.

Behaviour mirrored from the real services, as ``datasets.arrow_dataset.push_to_hub`` uses them:
``repo_info`` raises ``RepositoryNotFoundError`` before ``create_repo``; ``preupload_lfs_files`` takes the file's
content *at that moment* (datasets deletes the temporary Parquet file right after); ``create_commit`` applies
adds and deletes atomically and returns an object with ``oid``; ``hf_hub_download`` raises
``RemoteEntryNotFoundError`` for a missing file.
"""

from __future__ import annotations

import glob as _glob
import hashlib
import io
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fsspec import AbstractFileSystem
from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError


def _not_found(cls: type, message: str, url: str) -> Exception:
    """A huggingface_hub HTTP error with a real 404 response object, as the client raises it."""
    import importlib

    from huggingface_hub.errors import Response  # the HTTP library huggingface_hub is built on

    http = importlib.import_module(Response.__module__.split(".")[0])
    return cls(message, response=http.Response(404, request=http.Request("GET", url)))


def _read_add(op: CommitOperationAdd) -> bytes:
    src = op.path_or_fileobj
    if isinstance(src, (bytes, bytearray)):
        return bytes(src)
    if isinstance(src, (str, os.PathLike)):
        return Path(src).read_bytes()
    pos = src.tell()
    data = src.read()
    src.seek(pos)
    return data


class FakeHub:
    """Repositories as folders under ``root``; every commit recorded."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.heads: dict[str, str] = {}  # repo_id -> commit sha
        self.staged: dict[tuple[str, str], bytes] = {}
        self.commits: list[dict[str, Any]] = []
        self.calls: list[str] = []

    def repo_dir(self, repo_id: str) -> Path:
        return self.root / repo_id.replace("/", "--")

    # ------------------------------------------------------------------ the fake API
    def api(self, *args: Any, **kwargs: Any) -> FakeApi:
        return FakeApi(self)

    def install(self, monkeypatch: Any) -> FakeHub:
        import datasets.arrow_dataset
        import datasets.dataset_dict
        import datasets.iterable_dataset

        import hf_arb.annotate.hub

        hub = self

        class _FS(FakeHfFileSystem):
            pass

        _FS.hub = hub
        for mod in (datasets.arrow_dataset, datasets.dataset_dict, datasets.iterable_dataset):
            if hasattr(mod, "HfApi"):
                monkeypatch.setattr(mod, "HfApi", self.api)
            if hasattr(mod, "HfFileSystem"):
                monkeypatch.setattr(mod, "HfFileSystem", _FS)
        monkeypatch.setattr(hf_arb.annotate.hub, "HfApi", self.api)
        return self

    # ------------------------------------------------------------------ inspection
    def operations(self, repo_id: str | None = None) -> list[Any]:
        return [op for c in self.commits if repo_id in (None, c["repo_id"]) for op in c["operations"]]


class FakeApi:
    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub

    def _require(self, repo_id: str) -> Path:
        d = self.hub.repo_dir(repo_id)
        if repo_id not in self.hub.heads:
            raise _not_found(RepositoryNotFoundError, f"404: {repo_id} not found", f"https://fake.hub/api/datasets/{repo_id}")
        return d

    def repo_info(self, repo_id: str, repo_type: str | None = None, revision: str | None = None, **_: Any) -> Any:
        self.hub.calls.append("repo_info")
        self._require(repo_id)
        return SimpleNamespace(id=repo_id, sha=self.hub.heads[repo_id])

    def create_repo(self, repo_id: str, repo_type: str | None = None, private: bool | None = None,
                    exist_ok: bool = False, **_: Any) -> Any:
        self.hub.calls.append("create_repo")
        self.hub.repo_dir(repo_id).mkdir(parents=True, exist_ok=True)
        self.hub.heads.setdefault(repo_id, "0" * 40)
        return SimpleNamespace(repo_id=repo_id)

    def create_branch(self, *args: Any, **kwargs: Any) -> None:
        self.hub.calls.append("create_branch")

    def preupload_lfs_files(self, repo_id: str, additions: list[CommitOperationAdd], **_: Any) -> None:
        self.hub.calls.append("preupload_lfs_files")
        self._require(repo_id)
        for op in additions:
            self.hub.staged[(repo_id, op.path_in_repo)] = _read_add(op)

    def create_commit(self, repo_id: str, operations: list[Any], commit_message: str | None = None,
                      repo_type: str | None = None, revision: str | None = None, parent_commit: str | None = None,
                      **kwargs: Any) -> Any:
        self.hub.calls.append("create_commit")
        d = self._require(repo_id)
        if parent_commit is not None and parent_commit != self.hub.heads[repo_id]:
            raise AssertionError(f"parent_commit {parent_commit} is not the head {self.hub.heads[repo_id]}")
        digest = hashlib.sha1(self.hub.heads[repo_id].encode())
        for op in operations:
            if isinstance(op, CommitOperationAdd):
                key = (repo_id, op.path_in_repo)
                data = self.hub.staged.pop(key) if key in self.hub.staged else _read_add(op)
                dest = d / op.path_in_repo
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
                digest.update(op.path_in_repo.encode() + data)
            elif isinstance(op, CommitOperationDelete):
                target = d / op.path_in_repo
                if target.is_dir():
                    shutil.rmtree(target)
                else:
                    target.unlink()
                digest.update(b"-" + op.path_in_repo.encode())
            else:
                raise TypeError(f"unexpected operation {op!r}")
        sha = digest.hexdigest()
        self.hub.heads[repo_id] = sha
        self.hub.commits.append({"repo_id": repo_id, "message": commit_message, "operations": list(operations),
                                 "revision": revision, "kwargs": kwargs})
        return SimpleNamespace(oid=sha, pr_revision=None, commit_url=f"fake://{repo_id}/commit/{sha}")

    def hf_hub_download(self, repo_id: str, filename: str, *, repo_type: str | None = None,
                        revision: str | None = None, **_: Any) -> str:
        self.hub.calls.append("hf_hub_download")
        path = self._require(repo_id) / filename
        if not path.is_file():
            raise _not_found(RemoteEntryNotFoundError, f"404: {filename} not in {repo_id}",
                             f"https://fake.hub/datasets/{repo_id}/resolve/main/{filename}")
        return str(path)


class FakeHfFileSystem(AbstractFileSystem):
    """``HfFileSystem`` over the fake repositories: paths look like ``datasets/<user>/<name>@<rev>/<path>``."""

    protocol = "hf"
    cachable = False
    hub: FakeHub

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        return str(path).removeprefix("hf://").rstrip("/")

    _RE = re.compile(r"^datasets/([^/@]+/[^/@]+)(@[^/]*)?(?:/(.*))?$")

    def _split(self, path: str) -> tuple[str, Path, str]:
        m = self._RE.match(self._strip_protocol(path))
        if not m:
            raise FileNotFoundError(path)
        repo_id, rev, rest = m.group(1), m.group(2) or "", m.group(3) or ""
        return f"datasets/{repo_id}{rev}", self.hub.repo_dir(repo_id), rest

    def glob(self, path: str, maxdepth: int | None = None, **kwargs: Any) -> Any:
        prefix, root, rest = self._split(path)
        hits = sorted(_glob.glob(str(root / rest)))
        names = [f"{prefix}/{Path(h).relative_to(root).as_posix()}" for h in hits]
        if kwargs.get("detail"):
            return {n: self.info(n) for n in names}
        return names

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        _, root, rest = self._split(path)
        p = root / rest
        if not p.exists():
            raise FileNotFoundError(path)
        return {"name": self._strip_protocol(path), "size": p.stat().st_size if p.is_file() else 0,
                "type": "file" if p.is_file() else "directory"}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        prefix, root, rest = self._split(path)
        base = root / rest
        if not base.exists():
            raise FileNotFoundError(path)
        names = [f"{prefix}/{c.relative_to(root).as_posix()}" for c in sorted(base.iterdir())]
        return [self.info(n) for n in names] if detail else names

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        _, root, rest = self._split(path)
        p = root / rest
        if "r" in mode:
            return io.BytesIO(p.read_bytes())  # raises FileNotFoundError when absent
        raise NotImplementedError("the fake Hub file system is read-only; write through create_commit")
