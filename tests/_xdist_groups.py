"""``--dist loadgroup`` that keeps each ``xdist_group`` on one worker with pytest 9.2: the suite's one use of a
private name of another library, isolated here.

Why: pytest-xdist (3.8.0, the newest release) marks a test's group on the worker by appending ``@<group>`` to its
node id through pytest's private ``item._nodeid``, which pytest 9.2 no longer reads (node ids come from
``Node._id``). The controller then never sees a group, every test becomes its own work unit, and the tests that
need one process (the Ray and Spark clusters, module fixtures) ran on both workers.

How: the workers write each test's unit to a file at collection (tests/conftest.py,
``pytest_collection_modifyitems``, which also orders the units longest first). The controller's scheduler is
xdist's own :class:`~xdist.scheduler.LoadGroupScheduling`, made through xdist's public
``pytest_xdist_make_scheduler`` hook, with one override: ``_split_scope(nodeid)``, the private method that names a
test's unit, reads that file instead of the node id's suffix. Everything else (handing units to idle workers,
crash handling, restarts) stays xdist's.

When to drop it: once xdist marks groups through a public pytest API (or its ``@group`` suffix reaches the
controller again), delete this module and its registration in tests/conftest.py; ``xdist_group`` markers and
``--dist loadgroup`` (the Makefile's) then work unchanged. If a new xdist renames the method, :func:`check`
stops the run with one line instead of letting groups silently split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

#: the private method of xdist's scheduler this module overrides
SPLIT_SCOPE = "_split_scope"


def check() -> None:
    """Stop the run with one line if xdist's LoadGroupScheduling no longer has the method overridden here."""
    from xdist.scheduler import LoadGroupScheduling

    if not callable(getattr(LoadGroupScheduling, SPLIT_SCOPE, None)):
        raise pytest.UsageError(f"tests/_xdist_groups.py overrides xdist's LoadGroupScheduling.{SPLIT_SCOPE}, which "
                                "this pytest-xdist no longer has: check whether xdist_group now reaches the "
                                "controller by itself (then delete tests/_xdist_groups.py) or adapt the override.")


class GroupScheduling:
    """The plugin: hands the units folder to the workers and makes the controller's scheduler read it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput["hf_arb_units_dir"] = str(self.folder)

    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        from xdist.scheduler import LoadGroupScheduling

        check()
        folder = self.folder

        class Scheduling(LoadGroupScheduling):
            units: dict[str, str] | None = None

            def _split_scope(self, nodeid: str) -> str:  # see the module docstring
                if self.units is None:
                    files = sorted(folder.glob("*.json"))
                    self.units = json.loads(files[0].read_text()) if files else {}
                return self.units.get(nodeid) or super()._split_scope(nodeid)

        return Scheduling(config, log)
