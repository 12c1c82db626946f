"""Real multi-process runs of BucketBatchSampler: ``torchrun --nproc_per_node 2`` and ``3`` on CPU (gloo).

The worker (tests/_sampler_worker.py) is a diffusers-style script (everything in one plain
``accelerator.prepare``); each rank records what it trained and these tests assert on the records. The
2-process run (batch 3) checkpoints exactly at the end of epoch 0 (a state saved at the end of a pass is the case
torchdata restores through a dropped pass) and mid-epoch 1, in every accelerate mode, and new processes (the next
stage of the launch) resume each checkpoint; 3 processes (batch 2) continue the 2-process run's sampler state (the
same global batch of 6): elastic resume across real restarts. World sizes 1-8 of every mode are simulated in-process in
tests/test_sampler.py and tests/test_sampler_stateful_resume.py.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hf_arb import plan_epoch
from hf_arb.sampling.planning.ragged import plan_epoch_ragged

WORKER = Path(__file__).resolve().parent / "_sampler_worker.py"
ROOT = WORKER.parent.parent


def _records(nproc: int, out: Path, phases: str) -> dict[str, list[dict]]:
    """``{phase: [rank 0's record, ...]}`` of the worker's ``phases`` (comma-separated) written to ``out``."""
    return {phase: [json.loads((out / f"result_{phase}_rank{r}.json").read_text()) for r in range(nproc)]
            for phase in phases.split(",")}


# The launches the tests below read, once per test run (shared_artifact), on one worker (xdist_group), as the stages
# of one launcher (tests/_fork_launch.py): it imports torch, accelerate and hf_arb once (LIGHT_PRELOAD), then forks
# fresh ranks for each stage, so a stage that loads the previous stage's checkpoints is a real restart in new
# processes. 2 processes: plain torch.distributed, then every accelerate mode (checkpoints at _saves(), the elastic
# sampler state), then the idiom tables; 2 new processes resume each checkpoint; 3 processes continue the elastic
# state, then run the idiom table and the dispatch_k phase; then the docs' recipe, run twice as written (the second
# run resumes the first's checkpoint).
GROUP = pytest.mark.xdist_group("sampler-distributed")
BATCH2, BATCH3 = 3, 2  # per-process batch of the 2- and 3-process runs (global batch 6 both)
PHASES2, PHASES3 = "plain,full,idioms,tiered_idioms", "elastic,idioms,dispatch_k"


def _saves() -> tuple[int, int]:
    """The steps the 2-process run checkpoints at: the end of epoch 0, and mid-epoch 1."""
    steps = len(_expected(2, BATCH2)[0])
    return steps // 2, steps // 2 + 9


def recipe_code() -> str:
    """The accelerate recipe of docs/sampler.md, as written."""
    doc = (ROOT / "docs" / "sampler.md").read_text()
    section = doc[doc.index("### The recipe"):]
    code = section[section.index("```python") + len("```python"):]
    return code[: code.index("```")]


def _launch(root: Path) -> dict[str, Any]:
    from _train_fixtures import LIGHT_PRELOAD, launch_stages

    l2, r2, l3, recipe = (root / d for d in ("launch-2", "resume-2", "launch-3", "recipe"))
    for d in (l2, r2, l3, recipe):
        d.mkdir()
    (recipe / "example_train.py").write_text(recipe_code())
    saves = [str(s) for s in _saves()]
    stages = [
        {"name": "launch-2", "script": WORKER, "nproc": 2, "args": [
            "--phases", PHASES2, "--out", str(l2), "--batch-size", str(BATCH2), "--plain-batch-size", "4",
            "--save-at", *saves, "--save-elastic", str(l2 / "elastic.json"), "--pixel", "--video", "--idiom-workers",
            "0", "2"]},
        {"name": "resume-2", "script": WORKER, "nproc": 2, "args": [
            "--phases", "resume", "--out", str(r2), "--checkpoints", str(l2), "--batch-size", str(BATCH2),
            "--save-at", *saves, "--pixel", "--video"]},
        # the dispatch_k phase runs beside a busy process: the launch's timeout is a limit, not the cost
        {"name": "launch-3", "script": WORKER, "nproc": 3, "args": [
            "--phases", PHASES3, "--out", str(l3), "--batch-size", str(BATCH3), "--load-elastic",
            str(l2 / "elastic.json"), "--idiom-workers", "0"]},
        *({"name": f"recipe-{i}", "script": recipe / "example_train.py", "nproc": 2, "cwd": str(recipe),
           "log": str(recipe / f"run{i}.log")} for i in (0, 1))]
    launch_stages(root, stages, LIGHT_PRELOAD, timeout=1200)
    return {"launch2": {"dir": str(l2), **_records(2, l2, PHASES2)}, "resumed2": _records(2, r2, "resume")["resume"],
            "launch3": _records(3, l3, PHASES3),
            # rank 0 prints "epoch N done: ..."; the log also has both ranks' stderr, so no line is assumed whole
            "recipe": [re.findall(r"epoch \d+ done", (recipe / f"run{i}.log").read_text()) for i in (0, 1)],
            "recipe_checkpoint": (recipe / "checkpoints" / "last" / "custom_checkpoint_0.pkl").exists()}


@pytest.fixture(scope="session")
def launches(shared_artifact) -> dict[str, Any]:
    """Every stage's per-rank records (:func:`_launch`)."""
    return shared_artifact("sampler-launches", _launch)


@pytest.fixture(scope="session")
def launch2(launches) -> dict[str, Any]:
    """``{"dir", "plain", "full", "idioms", "tiered_idioms"}``: each phase's per-rank records of the first 2-process
    stage."""
    return launches["launch2"]


@pytest.fixture(scope="session")
def resumed2(launches) -> list[dict]:
    """Each checkpoint of the 2-process stage resumed by 2 new processes: per-rank records."""
    return launches["resumed2"]


@pytest.fixture(scope="session")
def launch3(launches) -> dict[str, list[dict]]:
    """``{"elastic", "idioms", "dispatch_k"}``: 3 processes continue the 2-process elastic state, run the idiom table,
    then resume its dispatch_batches checkpoint at several k under a loaded CPU."""
    return launches["launch3"]


def _steps(results: list[dict], mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's record of one mode: rows (steps, world, batch) and epochs (steps,), equal on every rank."""
    recs = [res[mode]["record"] for res in results]
    assert len({len(r) for r in recs}) == 1, f"{mode}: ranks took {[len(r) for r in recs]} steps"
    epochs = np.array([[step["epoch"] for step in r] for r in recs])  # (world, steps)
    assert (epochs == epochs[:1]).all(), f"{mode}: ranks in different epochs at a step"
    rows = np.array([[step["rows"] for step in r] for r in recs]).transpose(1, 0, 2)  # (steps, world, batch)
    return rows, epochs[0]


def _expected(world: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The pure plan of both epochs, concatenated: rows (steps, world, batch) and epochs (steps,)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _sampler_worker import EPOCHS, SEED, bucket_ids

    ids = bucket_ids()
    plans = [plan_epoch(ids, batch, world, seed=SEED, epoch=e, leftover="fill") for e in range(EPOCHS)]
    return np.concatenate(plans), np.concatenate([np.full(len(p), e) for e, p in enumerate(plans)])


@pytest.mark.slow
@GROUP
def test_plain_accelerate_prepare_every_mode_2_and_3_processes(launch2, resumed2, launch3) -> None:
    """The diffusers-style script on 2 processes, in every accelerate mode: each rank trains exactly its planned
    batches, in the same bucket as every other rank, len() is right before and after prepare, and checkpoints taken
    exactly at the end of epoch 0 and mid-epoch 1 resume in a new process with identical remaining batches. Then 3
    processes continue the 2-process run's sampler state (elastic resume, same global batch of 6)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _sampler_worker import MODES, bucket_ids

    ids = bucket_ids()
    world, batch = 2, BATCH2
    exp_rows, exp_epochs = _expected(world, batch)
    saves = _saves()  # the end of epoch 0, and mid-epoch 1
    assert saves[0] == len(exp_rows) // 2 and 0 < saves[0] < saves[1] < len(exp_rows)
    full, resumed = launch2["full"], resumed2
    for mode in MODES:
        where = f"{mode}, {world} processes"
        rows, epochs = _steps(full, mode)
        np.testing.assert_array_equal(rows, exp_rows, err_msg=f"{where}: batches differ from the plan")
        np.testing.assert_array_equal(epochs, exp_epochs, err_msg=where)
        bucket = ids[rows]  # (steps, world, batch)
        assert (bucket == bucket[:, :1, :1]).all(), f"{where}: ranks in different buckets at a step"
        info = full[0][mode]
        assert info["len_before"] == info["len_after"] == info["steps_per_epoch"] == len(rows) // 2, where
        for e in (0, 1):  # leftover="fill": every row trained, repeats only to fill the last batches
            flat = rows[exp_epochs == e].reshape(-1)
            assert set(flat.tolist()) == set(np.flatnonzero(ids >= 0).tolist()), where
            assert flat.size - np.unique(flat).size == info["repeated_per_epoch"], where
        for save_at in saves:
            rest, rest_epochs = _steps([{mode: r[mode][str(save_at)]} for r in resumed], mode)
            assert resumed[0][mode][str(save_at)]["steps_done"] == save_at
            np.testing.assert_array_equal(rest, exp_rows[save_at:], err_msg=f"{where}: resume at {save_at} differs")
            np.testing.assert_array_equal(rest_epochs, exp_epochs[save_at:], err_msg=where)
    assert "num_replicas=1, but torch.distributed runs" in full[0]["default"]["wrong_world_error"]
    check_pixel_modes(full, resumed, saves)
    check_video_modes(full, resumed, saves)
    three = launch3["elastic"]
    el_rows, _ = _steps(three, "elastic")  # 3 ranks x 2 continuing 2 ranks x 3
    assert three[0]["elastic"]["saved_world"] == 2 and three[0]["elastic"]["global_batch"] == 6
    steps_done = three[0]["elastic"]["steps_done"]
    glob = plan_epoch(ids, 6, 1, seed=7, epoch=1, leftover="fill")[:, 0]  # (steps, 6); saved in epoch 1
    assert three[0]["elastic"]["epoch"] == 1 and steps_done == len(glob) + 9
    np.testing.assert_array_equal(el_rows.reshape(len(el_rows), -1), glob[steps_done - len(glob):])


def check_pixel_modes(full: list[dict], resumed: list[dict], saves: tuple[int, ...]) -> None:
    """Variable batch sizes (a pixel budget) through a plain prepare, dispatched: every rank trains
    its planned batch of every step, of the step's bucket and that bucket's size, and resumes exactly."""
    from _sampler_worker import EPOCHS, PIXEL_BUDGET, PIXEL_MODES, PIXEL_RES, SEED, bucket_ids

    from hf_arb.sampling.planning.batch_sizes import batch_sizes_for_pixels

    ids, world = bucket_ids(), len(full)
    sizes = batch_sizes_for_pixels(PIXEL_RES, PIXEL_BUDGET)
    plans = [plan_epoch_ragged(ids, sizes, world, seed=SEED, epoch=e, leftover="fill") for e in range(EPOCHS)]
    expected = [p.step(s).tolist() for p in plans for s in range(p.num_steps)]  # [step][rank] -> rows
    assert len(set(sizes.tolist())) > 1 and len({len(step[0]) for step in expected}) > 1  # really ragged
    for mode in PIXEL_MODES:
        runs = [([res[mode]["record"] for res in full], 0)]
        runs += [([res[mode][str(s)]["record"] for res in resumed], s) for s in saves]
        for recs, start in runs:
            assert all(len(r) == len(expected) - start for r in recs), f"{mode}: steps differ from the plan"
            for s, want in enumerate(expected[start:]):
                got = [recs[r][s]["rows"] for r in range(world)]
                assert got == want, f"{mode}: step {start + s} differs from the plan"
                bucket = ids[np.array(got)]  # (world, b)
                assert (bucket == bucket[0, 0]).all() and bucket.shape[1] == sizes[bucket[0, 0]], mode
        assert full[0][mode]["len_after"] == plans[0].num_steps


def check_video_modes(full: list[dict], resumed: list[dict], saves: tuple[int, ...]) -> None:
    """(W, H, F) buckets over stills and clips through a plain prepare on real processes (issue 37): every rank trains
    its planned batch of every step, all in one bucket, stills and clips never in one step, and each checkpoint (the
    end of epoch 0, mid-epoch 1 of the image plan; both mid-epoch here) resumes batch for batch."""
    from _sampler_worker import EPOCHS, SEED, VIDEO_MODES, VIDEO_SET, video_rows

    ids, clip = video_rows()
    world = len(full)
    plans = [plan_epoch(ids, BATCH2, world, seed=SEED, epoch=e, leftover="fill") for e in range(EPOCHS)]
    expected = np.concatenate(plans)  # (steps, world, batch)
    per_epoch = len(plans[0])
    assert all(0 < s % per_epoch for s in saves), "a video checkpoint should fall mid-epoch"
    assert VIDEO_SET.has_frames and set(VIDEO_SET.frames[ids[ids >= 0]].tolist()) == {1, 9, 17}
    for mode in VIDEO_MODES:
        rows, _ = _steps(full, mode)
        np.testing.assert_array_equal(rows, expected, err_msg=f"{mode}: batches differ from the plan")
        bucket = ids[rows]  # (steps, world, batch)
        assert (bucket == bucket[:, :1, :1]).all(), f"{mode}: ranks in different buckets at a step"
        kinds = clip[rows]
        assert (kinds == kinds[:, :1, :1]).all(), f"{mode}: stills and clips in one step"
        assert full[0][mode]["len_after"] == per_epoch
        for save_at in saves:
            rest, _ = _steps([{mode: r[mode][str(save_at)]} for r in resumed], mode)
            np.testing.assert_array_equal(rest, expected[save_at:], err_msg=f"{mode}: resume at {save_at} differs")


@pytest.mark.slow
@GROUP
def test_plain_torchrun_without_accelerate(launch2) -> None:
    """The launch's first phase, before accelerate touches the process group (tests/_sampler_worker.py)."""
    results = launch2["plain"]
    assert [(r["num_replicas"], r["rank"]) for r in results] == [(2, 0), (2, 1)]
    for r in results:  # DistributedSampler's habit (num_replicas=, rank=, iterate): refused before any batch
        assert r["habit_served"] == 0
        assert f"sampler.shard({r['rank']})" in r["habit_error"] and "without `rank=`" in r["habit_error"]
    rows, _ = _steps([{"x": r} for r in results], "x")
    sys.path.insert(0, str(ROOT / "tests"))
    from _sampler_worker import SEED, bucket_ids

    expected = np.concatenate([plan_epoch(bucket_ids(), 4, 2, seed=SEED, epoch=e, leftover="fill") for e in (0, 1)])
    np.testing.assert_array_equal(rows, expected)


@pytest.mark.slow
@GROUP
def test_docs_recipe_runs_and_resumes(launches) -> None:
    """The accelerate recipe in docs/sampler.md, run as written on 2 processes, twice (two stages of the launch: new
    processes): the second run loads the checkpoint taken at step 40 of epoch 2 and trains only the rest of that
    epoch."""
    outs = launches["recipe"]
    assert outs[0] == ["epoch 0 done", "epoch 1 done", "epoch 2 done"]
    assert outs[1] == ["epoch 2 done"]
    assert launches["recipe_checkpoint"]


def idiom_table(results: list[dict], tiered: bool = False) -> dict[tuple[str, str], str]:
    """Check every cell of the idiom launch (tests/_sampler_worker.py ``--phases idioms``) and return its outcome:
    ``{(mode/workers, idiom): "exact" | "refused"}``. A cell is exact when every rank trains the uninterrupted run's
    batches after the checkpoint (= the plan), batch for batch, in both epochs; refused when every rank raised
    the documented error before serving a batch. Anything else fails.

    ``tiered`` (``--phases tiered_idioms``: a TieredBatchSampler whose curriculum switches tiers after the
    checkpoint): the plan is the default mode's uninterrupted run, which every other mode must equal, with one
    (tier, bucket) on every rank at each step; a row may train in both tiers within an epoch, so the per-epoch
    repeat count is not checked."""
    from _sampler_worker import EPOCHS, IDIOM_BATCH, IDIOM_SAVE, IDIOMS, SEED, idiom_ids

    ids, world = idiom_ids(), len(results)
    if tiered:
        exp_rows, exp_epochs = _steps([{"x": r["default/w0"]["full"]} for r in results], "x")
        buckets = [[tuple(r["default/w0"]["full"]["record"][s]["buckets"]) for r in results]
                   for s in range(len(exp_rows))]  # (steps, world): the (tier, bucket) ids each rank trained
        assert all(len(set(b)) == 1 and len(b[0]) == 1 for b in buckets), "ranks in different (tier, bucket)s"
        tiers = np.array([b[0][0] // 1000 for b in buckets])  # (steps,)
        assert (tiers[:IDIOM_SAVE] == 0).all() and (tiers[IDIOM_SAVE:] == 1).any()  # resumes cross the switch
        steps = int(np.count_nonzero(exp_epochs == 0))
    else:
        plans = [plan_epoch(ids, IDIOM_BATCH, world, seed=SEED, epoch=e, leftover="fill") for e in range(EPOCHS)]
        exp_rows = np.concatenate(plans)  # (steps, world, batch)
        exp_epochs = np.concatenate([np.full(len(p), e) for e, p in enumerate(plans)])
        steps = len(plans[0])
    assert int(np.count_nonzero(exp_epochs == 1)) == steps and 0 < IDIOM_SAVE < steps
    table: dict[tuple[str, str], str] = {}
    for cell in results[0]:
        where = f"{cell}, {world} processes"
        split = cell.startswith("split_batches")
        full = results[0][cell]["full"]
        rows, epochs = _steps([{"x": r[cell]["full"]} for r in results], "x")
        np.testing.assert_array_equal(rows, exp_rows, err_msg=f"{where}: the uninterrupted run differs from the plan")
        np.testing.assert_array_equal(epochs, exp_epochs, err_msg=where)
        assert full["len_loader"] == full["len_before"] == full["steps_per_epoch"] == steps, where
        assert full["len_sampler"] == steps * (1 if split else world), where
        for e in range(EPOCHS if not tiered else 0):  # the report counts every repeat (leftover="fill" completes
            flat = rows[exp_epochs == e].reshape(-1)  # the last batches)
            assert flat.size - np.unique(flat).size == full["repeated_per_epoch"], where
        for idiom in IDIOMS:
            if idiom not in results[0][cell]:
                continue
            got = [r[cell][idiom] for r in results]
            info = got[0]
            assert info["len_loader"] == info["len_loader_after"] == steps, f"{where}, {idiom}: len(loader)"
            assert info["len_sampler"] == full["len_sampler"], f"{where}, {idiom}: len(sampler)"
            events = [[(ev["served"], bool(ev["error"])) for ev in g["events"]] for g in got]
            assert all(ev == events[0] for ev in events), f"{where}, {idiom}: ranks disagree {events}"
            events = info["events"]  # rank 0's (with dispatch_batches only rank 0 reads the sampler: its message)
            errors = [ev for ev in events if ev["error"]]
            assert all(ev["served"] == 0 for ev in errors), f"{where}, {idiom}: an error after serving batches"
            if idiom == "reiterate" and not cell.startswith("stateful"):
                assert len(errors) == 1 and not got[0]["record"], f"{where}: {idiom} must be refused"
                msg = errors[0]["error"]
                assert "resume_dataloader" in msg and "skip_first_batches" in msg, msg
                table[(cell, idiom)] = "refused"
                continue
            if idiom == "skip_first_batches":  # back on the prepared loader without set_epoch: refused, named
                assert [ev["error"] != "" for ev in events] == [False, True, False], f"{where}: {events}"
                assert "train_dataloader.set_epoch(epoch)" in errors[0]["error"]
                if not cell.startswith("dispatch"):  # accelerate's skip loader: its own length
                    assert info["len_first"] == steps - IDIOM_SAVE, f"{where}: len(skip_first_batches(...))"
            else:
                assert not errors, f"{where}, {idiom}: {errors}"
            rest, rest_epochs = _steps([{"x": g} for g in got], "x")
            np.testing.assert_array_equal(rest, exp_rows[IDIOM_SAVE:], err_msg=f"{where}, {idiom}: resume differs")
            np.testing.assert_array_equal(rest_epochs, exp_epochs[IDIOM_SAVE:], err_msg=f"{where}, {idiom}")
            table[(cell, idiom)] = "exact"
    return table


@pytest.mark.slow
@GROUP
@pytest.mark.parametrize("world,workers", [(2, (0, 2)), (3, (0,))], ids=["2-processes", "3-processes"])
def test_resume_idioms_every_mode_with_and_without_workers(request, world: int, workers: tuple) -> None:
    """Issue 23's table, on real processes: accelerate modes (default, dispatch_batches, split_batches,
    even_batches=False; and the stateful loader) x DataLoader workers {0, 2} (3 processes: 0, to keep the launch
    short) x the resume idioms (accelerate's ``skip_first_batches`` after ``load_state``, ``hf_arb.resume_dataloader``,
    iterating the prepared loader again), 300 rows, batch 4, checkpoint after 12 steps, all in one launch per world
    size (the 2- and 3-process launches' last phase). Every cell is exact (batch for batch the uninterrupted run) or
    refused before serving a batch."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _sampler_worker import IDIOM_MODES, IDIOMS

    results = request.getfixturevalue("launch2" if world == 2 else "launch3")["idioms"]
    assert len(results) == world
    table = idiom_table(results)
    cells = {(f"{m}/w{w}", i) for m in IDIOM_MODES for w in workers for i in IDIOMS if m != "stateful"}
    cells |= {(f"stateful/w{w}", "reiterate") for w in workers}
    assert set(table) == cells
    for (cell, idiom), outcome in table.items():
        want = "refused" if idiom == "reiterate" and not cell.startswith("stateful") else "exact"
        assert outcome == want, (cell, idiom, outcome)


@pytest.mark.slow
@GROUP
def test_dispatch_skip_first_batches_is_the_same_on_every_rank_and_run(launch3) -> None:
    """Issue 34, item 11: 3 processes, ``dispatch_batches=True``, accelerate's ``skip_first_batches(loader, k)`` after
    ``load_state`` (300 rows, batch 4, checkpoint after IDIOM_SAVE steps), each k resumed twice in a row while a busy
    process loads the CPU. Only rank 0 reads the sampler under dispatch, so a k past the count rank 0 had handed out
    (its read-ahead) used to be refused on rank 0 alone, inside accelerate's fetch: the other ranks waited in the
    broadcast (a hang, or gloo's SIGABRT). Now the pass starts at step k on every rank and every run, whatever rank 0
    had read ahead: the uninterrupted run's batches from step k, then the next epoch after ``set_epoch``."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _sampler_worker import DISPATCH_REPEATS, IDIOM_SAVE

    results = launch3["dispatch_k"]
    full = [r["dispatch_batches/w0"]["full"]["record"] for r in launch3["idioms"]]  # checked by the idiom table
    steps = launch3["idioms"][0]["dispatch_batches/w0"]["full"]["len_loader"]
    consumed = {run["consumed"] for r in results for runs in r.values() for run in runs}
    assert consumed == {IDIOM_SAVE + 1}  # rank 0's one-step read-ahead, loaded by every rank
    ks = sorted(map(int, results[0]))
    assert ks == [IDIOM_SAVE + 1, IDIOM_SAVE + 2, steps - 1]  # the last two past what rank 0 had handed out
    for k in ks:
        for rank, r in enumerate(results):
            runs = r[str(k)]
            assert len(runs) == DISPATCH_REPEATS
            want = [(step["epoch"], step["rows"]) for step in full[rank][k:]]  # rest of epoch 0, then epoch 1
            for i, run in enumerate(runs):
                assert [ev["error"] for ev in run["events"]] == ["", ""], (k, rank, i, run["events"])
                assert [(step["epoch"], step["rows"]) for step in run["record"]] == want, (k, rank, i)


@pytest.mark.slow
@GROUP
def test_tiered_sampler_resume_idioms_on_two_processes(launch2) -> None:
    """Issue 27: the same idiom table on a TieredBatchSampler (2 tiers, a curriculum switching at step 15, after the
    checkpoint at step 12) in the first 2-process launch, DataLoader workers 0: accelerate's ``skip_first_batches``
    after ``load_state`` and ``hf_arb.resume_dataloader`` continue exactly across the switch in every accelerate
    mode but split_batches (batch sizes vary by tier), the stateful loader restores itself, and iterating the
    prepared loader again after a mid-epoch restore is refused before its first batch."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _sampler_worker import IDIOM_MODES, IDIOMS

    table = idiom_table(launch2["tiered_idioms"], tiered=True)
    modes = [m for m, (_, split) in IDIOM_MODES.items() if not split]
    cells = {(f"{m}/w0", i) for m in modes for i in IDIOMS if m != "stateful"} | {("stateful/w0", "reiterate")}
    assert set(table) == cells
    for (cell, idiom), outcome in table.items():
        want = "refused" if idiom == "reiterate" and not cell.startswith("stateful") else "exact"
        assert outcome == want, (cell, idiom, outcome)
