"""Packing over several resolution tiers (issue #27): :class:`TieredPackBatchSampler` draws each row's tier per epoch
(the ``random`` schedule, the same draw as the bucketed tiers), fits the row at that tier's token cap, and packs
the epoch over those sizes, so a pack mixes tiers; it resumes mid-epoch, refuses another plan's state, and
:class:`PackedImageDataset` renders each key at its tier's size."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
from _photos import PHOTOS, SKIMAGE_DATA
from PIL import Image
from torch.utils.data import DataLoader

from hf_arb import add_bucket_columns
from hf_arb.packing.dataset import PackedImageDataset
from hf_arb.packing.layout import fit_sizes
from hf_arb.packing.tier_sampler import TieredPackBatchSampler, tier_token_caps
from hf_arb.sampling import TieredBatchSampler
from hf_arb.sampling.tiered.plan import Tiers, tier_bucket_ids

TIERS = Tiers.preset("budget", [256, 512])


@pytest.fixture(scope="module")
def sizes():
    rng = np.random.default_rng(7)
    return rng.integers(150, 1400, 600), rng.integers(150, 1400, 600)


def test_every_row_trains_once_per_epoch_at_one_of_its_tiers_and_packs_mix_tiers(sizes):
    w, h = sizes
    s = TieredPackBatchSampler((w, h), TIERS, 2304, num_replicas=2, seed=3, log_report=False)
    eligible = tier_bucket_ids(w, h, TIERS) >= 0  # (T, n): the bucketed tiers' rule
    caps = tier_token_caps(TIERS, 2304)
    assert caps == [256, 1024] and s.max_image_tokens == 1024
    fits = [fit_sizes(w, h, c) for c in caps]
    seen_tiers: dict[int, set[int]] = {}
    for epoch in range(3):
        s.set_epoch(epoch)
        packs = list(s)
        assert len(packs) == 2 * s.steps_in(epoch)
        rows = [k[0] for p in packs for k in p]
        assert len(rows) == len(set(rows))  # once per epoch (leftover="drop")
        drawn = s.draw(epoch)
        mixed = 0
        for pack in packs:
            tiers_in_pack = set()
            for row, kw, kh, e in pack:
                t = int(drawn[row])
                assert e == epoch and eligible[t, row]
                assert (kw, kh) == (fits[t].width[row], fits[t].height[row])  # the row at its tier's cap
                assert (kw // 16) * (kh // 16) <= caps[t]
                tiers_in_pack.add(t)
                seen_tiers.setdefault(row, set()).add(t)
            assert sum((kw // 16) * (kh // 16) for _, kw, kh, _ in pack) <= 2304
            mixed += len(tiers_in_pack) > 1
        assert mixed > len(packs) // 4, mixed  # packs mix tiers (2 images at 512 leave room for one at 256)
        assert not eligible[:, drawn < 0].any() and (drawn[eligible.any(axis=0)] >= 0).all()
        # the same rule as the bucketed tiers' random schedule (which draws it per row group): the rows per tier of
        # the two independent draws differ by at most 5 standard deviations (sd² = rows eligible in both tiers / 2)
        bucketed = TieredBatchSampler(w, h, TIERS, "random", batch_size=1, num_replicas=1, seed=3)
        ours, theirs = np.array(s.tier_rows(epoch)), np.array([t["rows"] for t in bucketed.report(epoch).tiers])
        assert ours.sum() == theirs.sum() and np.abs(ours - theirs).max() <= 5 * np.sqrt(eligible.all(axis=0).sum() / 2)
    both = eligible.all(axis=0)
    assert np.mean([len(seen_tiers.get(r, ())) == 2 for r in np.flatnonzero(both)]) > 0.5  # draws change per epoch


def test_resume_mid_epoch_continues_the_same_packs_and_refuses_another_plan(sizes):
    w, h = sizes
    def make(**kw):
        return TieredPackBatchSampler((w, h), TIERS, 2048, num_replicas=2, seed=3, log_report=False, **kw)

    full = make()
    full.set_epoch(1)
    whole = list(full)
    part = make()
    part.set_epoch(1)
    it = iter(part)
    head = [next(it) for _ in range(2 * 5)]  # 5 steps of 2 ranks
    state = part.state_dict()
    assert state["tiers"] == [256, 512] and state["schedule"] == "random" and state["batches_consumed"] == 5
    again = make()
    again.load_state_dict(state)
    assert head + list(again) == whole
    other = TieredPackBatchSampler((w, h), Tiers.preset("budget", [256, 768]), 2048, num_replicas=2, seed=3,
                                   log_report=False)
    with pytest.raises(ValueError, match="`fingerprint` does not match"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="`steps_per_epoch` is set by the draw"):
        make(steps_per_epoch=10)
    with pytest.raises(ValueError, match="`config`|fingerprint"):  # a step schedule's state is another plan
        make(schedule="0-10:256,10-:512").load_state_dict(state)
    with pytest.raises(TypeError, match="takes no `max_image_tokens`"):
        make(max_image_tokens=100)


def test_dataset_renders_each_key_at_its_tiers_size(tmp_path):
    sizes = [(700, 500), (300, 600), (640, 640), (900, 300), (520, 520), (260, 200)]
    paths = []
    for i, (w, h) in enumerate(sizes):
        paths.append(str(tmp_path / f"img{i}.png"))
        Image.open(SKIMAGE_DATA / list(PHOTOS)[i]).convert("RGB").resize((w, h)).save(paths[-1])
    ds = datasets.Dataset.from_dict({"image": paths, "text": [f"photo {i}" for i in range(len(sizes))]})
    ds = add_bucket_columns(ds.cast_column("image", datasets.Image()), TIERS.bucket_sets[0], show_summary=False)
    s = TieredPackBatchSampler(ds, TIERS, 1024, num_replicas=1, seed=0, log_report=False)
    data = PackedImageDataset(ds, s.sizes, seed=0)
    seen = set()
    for epoch in range(4):
        s.set_epoch(epoch)
        for batch in DataLoader(data, batch_sampler=s, collate_fn=data.collate):
            for px, row in zip(batch["pixel_values"], batch["rows"].tolist()):
                t = int(s.draw(epoch)[row])
                assert (px.shape[2], px.shape[1]) == (s.sizes[t].width[row], s.sizes[t].height[row])
                seen.add((row, t))
    assert {(0, 0), (0, 1)} <= seen  # the 700x500 photo trained at both tiers, each at its own size
    assert {r for r, _ in seen} == {0, 1, 2, 3, 4}  # 260x200 is too small for a 256-tier bucket: in no tier
    with pytest.raises(ValueError, match="fits the row to"):
        data[(0, 16, 16, 0)]


# ------------------------------------------------------------------ step schedules: one pack stream per tier
STEP_SCHEDULES = ["0-7:512,7-19:256,19-:512", "mix:256:1,512:2", "progressive:11"]


@pytest.mark.parametrize("schedule", STEP_SCHEDULES)
def test_step_schedules_train_one_tier_per_step_from_each_tiers_own_pack_stream(sizes, schedule):
    """Under a step schedule every rank's pack at a step is of the step's tier (the bucketed sampler's tier for that
    step: the same stream_positions), each pack is exactly the pack of that tier's own stream (plan_packs over the
    tier's sizes, pass by pass, continuing where it stopped), keys carry the tier's size, and resume mid-epoch
    (also across the switch) continues the same packs."""
    from hf_arb.packing import plan_packs

    w, h = sizes
    W, L = 2, 23

    def make():
        return TieredPackBatchSampler((w, h), TIERS, 2048, num_replicas=W, seed=3, log_report=False,
                                      schedule=schedule, steps_per_epoch=L)

    s = make()
    bucketed = TieredBatchSampler(w, h, TIERS, schedule, batch_size=1, num_replicas=1, seed=3, steps_per_epoch=L)
    at = dict.fromkeys(range(TIERS.num_tiers), (0, 0))  # each tier stream's (pass, step)
    whole = []
    for epoch in range(2):
        s.set_epoch(epoch)
        batches = list(s)
        whole.append(batches)
        assert len(batches) == L * W
        want_tiers = bucketed.step_tiers(epoch)[0]
        for step in range(L):
            t = int(want_tiers[step])
            q, k = at[t]
            ref = plan_packs(s.sizes[t].tokens, 2048, W, seed=3, epoch=q * 3 + t, window=s.window, leftover="drop")
            for r in range(W):
                keys = batches[step * W + r]
                assert [row for row, *_ in keys] == ref.pack(k, r).tolist()
                assert all((a, b) == (int(s.sizes[t].width[row]), int(s.sizes[t].height[row]))
                           for row, a, b, _ in keys)
            at[t] = (q, k + 1) if k + 1 < ref.num_steps else (q + 1, 0)
    part = make()
    part.set_epoch(1)
    it = iter(part)
    head = [next(it) for _ in range(W * 9)]  # curriculum: across the switch at step 7
    again = make()
    again.load_state_dict(part.state_dict())
    assert head + list(again) == whole[1]
    assert sum(s.tier_rows(1)) > 0 and s.report(1).steps == L
