"""Fixtures shared by the whole test run.

``shared_artifact(name, build)`` builds an expensive artifact (tiny models, a training run, a dataset) once per
test run, even under ``pytest -n 2``: the first xdist worker that needs it builds it under a file lock in a
folder every worker of the run shares; the others wait and reuse it. ``build(folder)`` returns a
JSON-serialisable value (paths, statistics) that every caller receives.

Sharing a training run between test files
-----------------------------------------
A run that several files assert on (a 2-process DDP run, a LoRA run, ...) is a session fixture whose body calls
``shared_artifact("<name>", build)``: ``build(folder)`` trains into ``folder`` and returns the paths and the
``hf_arb_run.json`` statistics the tests read (JSON only: no tensors, no open objects). Another file reuses it by
importing the fixture (``from test_train import ddp_runs``, or ``ddp_runs = test_train.ddp_runs``); the run
happens once per ``pytest`` invocation whichever xdist worker asks first, the others wait on the lock. Tests
must treat the folder as read-only (copy a checkpoint out before resuming from it). The tests of one file that
read a run usually share an ``xdist_group``, so one worker builds it while the other runs other tests instead of
waiting on the lock; a group is required where a module fixture or one process is needed (a local Ray/Spark
cluster). Example: ``ddp_runs`` (test_train.py), ``sd_lora`` (test_train_lora.py) and ``ckpt_run``
(test_fault_train.py) also serve test_portable_outputs.py.

The 2-process runs that tests only read (SD3/Flux, packing, SDXL LoRA, streaming, broken images under DDP) go
further: ``ddp_batch`` (below) runs them all in one torchrun launch, since a launch costs each process ~7 s of
imports and a tiny run ~1 s (tests/_train_fixtures.py). Add a run there rather than launching torchrun per test.
Every such launch goes through tests/_fork_launch.py (``test_train.torchrun``): torchrun's worker environment, with
the imports paid once before the ranks fork; real torchrun only where the launcher is the subject (the docs'
commands, the signal tests).

The stock-diffusers checks ("the output loads and generates without hf_arb") send their code to one persistent
interpreter per test process where ``import hf_arb`` fails (tests/_stock.py ``run_job``; ``stock_generate`` in
tests/_family_runs.py for model-card snippets) rather than starting a fresh interpreter (~5 s of imports) each.

Scheduling (``pytest -n 3 --dist loadgroup``, ``make test``)
---------------------------------------------
xdist hands out work units (an ``xdist_group``, or one test) in collection order. The hooks below put the
longest units first, so both workers start on the multi-process runs and the short tests fill in at the end:
a unit's cost is the sum of its tests' seconds in the previous run (kept in pytest's cache,
``hf_arb/test_seconds``; time spent waiting for another worker's shared_artifact build is not counted), or, for
tests not yet timed, 60 s for a ``slow`` test and 1 s for another. Under pytest 9.2 xdist's own group marking no
longer reaches the controller; tests/_xdist_groups.py keeps each group on one worker (the suite's one override of
another library's private method, isolated there with its reason and when to drop it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _xdist_groups import GroupScheduling
from filelock import FileLock

# Two xdist workers share two cores: one intra-op thread each (torchrun already gives its processes one). With
# torch's default of one thread per core, every in-process tiny training run fought the other worker for both
# cores (tests/upstream measured 154 worker-seconds with the default, 25 with one thread). Set before torch loads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A folder all xdist workers of this run share (the run's base temp; a worker's own base temp alone)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if worker_id != "master" else base) / "shared"
    root.mkdir(parents=True, exist_ok=True)
    return root


#: Seconds each test of this process waited for another worker's shared_artifact build (node id -> seconds).
_WAITED: dict[str, float] = {}


@pytest.fixture(scope="session")
def shared_artifact(shared_root: Path) -> Callable[[str, Callable[[Path], Any]], Any]:
    def get(name: str, build: Callable[[Path], Any]) -> Any:
        folder = shared_root / name
        done = shared_root / f"{name}.done.json"
        asked = time.monotonic()
        with FileLock(str(shared_root / f"{name}.lock")):
            if done.exists():  # built by another worker, maybe while this one waited: not this test's cost
                test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
                _WAITED[test] = _WAITED.get(test, 0.0) + time.monotonic() - asked
                return json.loads(done.read_text())
            folder.mkdir(parents=True, exist_ok=True)
            value = build(folder)
            done.write_text(json.dumps(value))
            return value

    return get


# ------------------------------------------------------------------------------------- training fixtures
# Built once per test run (tests/_train_fixtures.py says what each holds).
@pytest.fixture(scope="session")
def train_assets(shared_artifact) -> dict[str, str]:
    """Tiny SD / SDXL pipelines and a photo imagefolder (5 aspect ratios x 4 photos)."""
    from _train_fixtures import build_train_assets

    return shared_artifact("train-assets", build_train_assets)


@pytest.fixture(scope="session")
def flow_assets(shared_artifact) -> dict[str, str]:
    """Tiny SD3 / Flux pipelines and the photo imagefolder."""
    from _train_fixtures import build_flow_assets

    return shared_artifact("flow-assets", build_flow_assets)


@pytest.fixture(scope="session")
def stream_assets(shared_artifact) -> dict[str, Any]:
    """Annotated parquet shards with an integer ``id`` column, and a tiny SD."""
    from _train_fixtures import build_stream_assets

    return shared_artifact("train-stream-assets", build_stream_assets)


@pytest.fixture(scope="session")
def family_assets(shared_artifact) -> dict[str, str]:
    """Tiny Qwen-Image, Z-Image, Flux.2 dev / klein pipelines and the photo imagefolder."""
    from _train_fixtures import build_family_assets

    return shared_artifact("family-assets", build_family_assets)


@pytest.fixture(scope="session")
def ddp_batch(shared_artifact, train_assets, flow_assets, stream_assets, family_assets) -> dict[str, Any]:
    """The 2-process runs of several test files, in one torchrun launch (read them with ``batch_result``)."""
    from _train_fixtures import build_batch

    return shared_artifact("ddp-batch", lambda root: build_batch(root, train_assets, flow_assets, stream_assets,
                                                                 family_assets))


# ------------------------------------------------------------------------------------------- local clusters
class _UntilLastUse:
    """Stops a session-wide cluster once the last selected test of this process that asks for it has torn down.

    A local Ray cluster's daemons cost ~11 CPU-s to start and ~1.2 CPU-s every 30 s while idle (measured
    2026-11-27); a session fixture alone kept them, and Spark's JVM, running to the end of the worker's session.
    The tests that use a cluster share one xdist group, so they all run on one worker and the count reaches 0 there.
    """

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.stops: dict[str, Callable[[], None]] = {}

    def start(self, request: pytest.FixtureRequest, name: str, stop: Callable[[], None]) -> None:
        self.left[name] = sum(name in item.fixturenames for item in request.session.items)
        self.stops[name] = stop

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Any:
        result = yield
        for name in [n for n in self.stops if n in item.fixturenames]:
            self.left[name] -= 1
            if self.left[name] <= 0:
                self.stops.pop(name)()
        return result


_CLUSTERS = _UntilLastUse()


@pytest.fixture(scope="session")
def ray_cluster(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """One local Ray cluster (``num_cpus=2``) for every test of this process that asks for it (test_engines.py,
    test_encoded.py: one xdist group), stopped after the last of them."""
    ray = pytest.importorskip("ray")
    # Two knobs that keep the Ray tests from starting dozens of worker processes (~2.5-6 CPU-s of imports each; one
    # test file started ~50, measured 2026-11-27): ray.data.read_parquet's footer reader starts a pool of actors per
    # read (RAY_DATA_PARQUET_FOOTER_NUM_ACTORS, the env override ray.data documents there; default 32, each a
    # process; one footer per test file here), and raylet killed idle task workers after 1 s, so every test re-started
    # them (kill_idle_workers_interval_ms 0: the pool of num_cpus workers stays warm until ray.shutdown).
    os.environ["RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"] = "1"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _system_config={"kill_idle_workers_interval_ms": 0})
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    # One hash-shuffle aggregator actor per groupby (the engine's summary) instead of Ray's default of 2 per CPU:
    # each is a fresh worker process. The same groupby and partitions, as local[2]'s 2 shuffle partitions for
    # Spark; measured on 20k rows, two summaries took 7.4 CPU-s / 47 s instead of 15.2 / 115 s (loaded machine).
    ctx.max_hash_shuffle_aggregators = 1
    _CLUSTERS.start(request, "ray_cluster", ray.shutdown)
    yield ray
    ray.shutdown()  # a no-op where the last test already stopped it


@pytest.fixture(scope="session")
def spark(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """One local Spark session (``local[2]``) for every test of this process that asks for it, stopped after the
    last of them."""
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable  # workers use this interpreter (and its hf_arb)
    # The JVM with HotSpot's quick compiler only and one GC thread (documented java options): the tests' jobs are
    # short, so the optimising JIT's threads cost more than they win. Start-up and a 20k-row mapInArrow job took
    # ~21 CPU-s instead of ~40 (2026-11-27, 3 runs). Local mode: the executors are in this driver JVM.
    session = (SparkSession.builder.master("local[2]").appName("hf_arb-tests").config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    _CLUSTERS.start(request, "spark", session.stop)
    yield session
    session.stop()  # a no-op where the last test already stopped it


# ------------------------------------------------------------------------------------------- scheduling
_SECONDS_KEY = "hf_arb/test_seconds"
_GROUP_SUFFIX = re.compile(r"@[^\]]*$")  # an ``@group`` suffix xdist's loadgroup may add to a node id


def _base_id(nodeid: str) -> str:
    return _GROUP_SUFFIX.sub("", nodeid)


def _unit(item: pytest.Item) -> str:
    """The item's work unit: ``@<group>`` for an ``xdist_group`` (names joined as xdist does), else its node id."""
    groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                     for m in item.iter_markers("xdist_group")})
    return "@" + "_".join(groups) if groups else _base_id(item.nodeid)


class _Timings:
    """Records each test's seconds (setup + call + teardown) where the cache is written (xdist: the controller)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        key = _base_id(report.nodeid)
        waited = sum(v for k, v in report.user_properties if k == "shared_artifact_wait_s")
        self.seconds[key] = self.seconds.get(key, 0.0) + max(0.0, report.duration - waited)

    def pytest_sessionfinish(self) -> None:
        if self.seconds and getattr(self.config, "cache", None) is not None:
            known = self.config.cache.get(_SECONDS_KEY, {})
            known.update({k: round(v, 2) for k, v in self.seconds.items()})
            self.config.cache.set(_SECONDS_KEY, known)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """Tell the timings how long this test only waited for another worker's build (ordering by own cost)."""
    report = yield
    waited = _WAITED.pop(item.nodeid, 0.0)
    if waited:
        report.user_properties.append(("shared_artifact_wait_s", round(waited, 2)))
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop this process's stock interpreter (tests/_stock.py), if a test started one."""
    stock = sys.modules.get("_stock")
    if stock is not None:
        stock.stop()


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_CLUSTERS, "hf_arb_clusters")  # in every process that runs tests
    if hasattr(config, "workerinput"):
        return
    config.pluginmanager.register(_Timings(config), "hf_arb_timings")
    if config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") == "loadgroup":
        # xdist's default re-sorts units by their number of tests; keep ours (longest first, below).
        config.option.loadscopereorder = False
        folder = Path(tempfile.mkdtemp(prefix="hf_arb_units_"))
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
        # xdist_group under pytest 9.2: tests/_xdist_groups.py says why this plugin exists and when to drop it
        config.pluginmanager.register(GroupScheduling(folder), "hf_arb_group_scheduling")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On xdist workers: order the work units longest first (every worker computes the same order) and, under
    loadgroup, tell the controller each test's unit."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    seconds: dict[str, float] = cache.get(_SECONDS_KEY, {}) if cache is not None else {}

    def cost(item: pytest.Item) -> float:
        known = seconds.get(_base_id(item.nodeid))
        return known if known is not None else (60.0 if item.get_closest_marker("slow") else 1.0)

    units = [_unit(item) for item in items]
    totals: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, (u, item) in enumerate(zip(units, items)):
        totals[u] = totals.get(u, 0.0) + cost(item)
        first.setdefault(u, i)
    ranked = sorted(range(len(items)), key=lambda i: (-totals[units[i]], first[units[i]], i))
    items[:] = [items[i] for i in ranked]
    if "hf_arb_units_dir" in workerinput:
        mapping = {items[j].nodeid: units[i] for j, i in enumerate(ranked)}
        out = Path(workerinput["hf_arb_units_dir"]) / f"{workerinput['workerid']}.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(mapping))
        tmp.replace(out)
