"""Caption augmentation and caption files (issue 36, item 4): kohya's ``--shuffle_caption``, ``--keep_tokens``,
``--caption_separator``, ``--caption_dropout_rate``, ``--caption_tag_dropout_rate`` as pure functions of
(seed, epoch, row); ``--caption_variants K`` (what ``--cache_text_embeddings`` caches); ``--caption_extension .txt``.

The pure functions are tested with hypothesis; the flags at parse level; the caption files on a tiny folder; one pair
of short training runs shows that cached prompt embeddings train exactly the captions and losses of on-the-fly ones.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_text_to_image_arb as script  # noqa: E402
from hf_arb.checks import UsageError  # noqa: E402
from hf_arb.train.captions import (  # noqa: E402
    CaptionAugmenter,
    CaptionOptions,
    augment_caption,
    caption_variants,
    read_sidecar_captions,
    sidecar_path,
    split_tags,
)
from hf_arb.train.flags.caption_flags import caption_augmenter, caption_variant_count  # noqa: E402

#: a tag: letters and spaces inside, never the separator, never blank at its ends
TAG = st.text(alphabet="abcdefghij xyz", min_size=1, max_size=8).map(str.strip).filter(bool)
TAGS = st.lists(TAG, min_size=1, max_size=12)
SEED, EPOCH, ROW = st.integers(0, 2**31), st.integers(0, 1000), st.integers(0, 10**6)


def caption_of(tags: list[str]) -> str:
    return ",".join(tags)  # kohya's captions: "a,b" or "a, b"; both split the same


# ------------------------------------------------------------------------------------- pure functions
@given(tags=TAGS, keep=st.integers(0, 14), seed=SEED, epoch=EPOCH, row=ROW, drop=st.sampled_from([0.0, 0.5, 1.0]))
@settings(max_examples=200, deadline=None)
def test_keep_tokens_stay_in_place_and_the_rest_is_a_permutation_or_a_subsequence(tags, keep, seed, epoch, row, drop):
    opts = CaptionOptions(shuffle_caption=True, keep_tokens=keep, caption_tag_dropout_rate=drop)
    out = split_tags(augment_caption(caption_of(tags), opts, seed=seed, epoch=epoch, row=row))
    assert out[:keep] == tags[:keep]  # the kept prefix: in place, never dropped
    rest = out[min(keep, len(tags)):]
    if drop == 0.0:
        assert sorted(rest) == sorted(tags[keep:])  # shuffled: a permutation of the other tags
    elif drop == 1.0:
        assert rest == []
    else:
        pool = list(tags[keep:])
        for t in rest:  # each kept tag comes from the others, no tag twice
            pool.remove(t)


@given(tags=TAGS, seed=SEED, epoch=EPOCH, row=ROW, k=st.integers(1, 6))
@settings(max_examples=150, deadline=None)
def test_a_pure_function_of_seed_epoch_and_row_with_variants_cycling(tags, seed, epoch, row, k):
    opts = CaptionOptions(shuffle_caption=True, keep_tokens=1, caption_tag_dropout_rate=0.3)
    one = augment_caption(caption_of(tags), opts, seed=seed, epoch=epoch, row=row)
    assert one == augment_caption(caption_of(tags), opts, seed=seed, epoch=epoch, row=row)
    with_k = [augment_caption(caption_of(tags), opts, seed=seed, epoch=e, row=row, variants=k)
              for e in (epoch, epoch + k, epoch + 7 * k)]
    assert with_k[0] == with_k[1] == with_k[2]  # epoch e trains variant e % K
    assert with_k[0] == augment_caption(caption_of(tags), opts, seed=seed, epoch=epoch % k, row=row)
    assert caption_variants(caption_of(tags), opts, seed=seed, row=row, variants=k)[epoch % k] == with_k[0]


def test_tags_vary_between_epochs_rows_and_seeds():
    opts = CaptionOptions(shuffle_caption=True)
    cap = "a, b, c, d, e, f"
    by_epoch = {augment_caption(cap, opts, seed=0, epoch=e, row=3) for e in range(20)}
    by_row = {augment_caption(cap, opts, seed=0, epoch=0, row=r) for r in range(20)}
    by_seed = {augment_caption(cap, opts, seed=s, epoch=0, row=3) for s in range(20)}
    assert min(len(by_epoch), len(by_row), len(by_seed)) >= 15  # 720 orders: 20 draws rarely collide
    assert len(set(caption_variants(cap, opts, seed=0, row=3, variants=4))) == 4


@given(caption=st.text(max_size=40), seed=SEED, epoch=EPOCH, row=ROW)
@settings(max_examples=100, deadline=None)
def test_without_options_a_caption_is_untouched(caption, seed, epoch, row):
    assert augment_caption(caption, CaptionOptions(), seed=seed, epoch=epoch, row=row) == caption
    batch = {"captions": [caption], "rows": np.array([row])}
    assert CaptionAugmenter(CaptionOptions(), seed=seed)(batch, epoch) is batch


def test_kohya_split_and_join():
    """Split at the separator, tags stripped, empty ones gone; joined with ", " whatever the separator (as kohya)."""
    assert split_tags(" sks ,  red hair,, blue eyes , ") == ["sks", "red hair", "blue eyes"]
    opts = CaptionOptions(shuffle_caption=True, keep_tokens=1, caption_separator=" ")
    out = augment_caption("sks red hair blue", opts, seed=0, epoch=0, row=0)
    assert out.startswith("sks, ") and sorted(out.split(", ")) == ["blue", "hair", "red", "sks"]
    assert augment_caption("photo", CaptionOptions(shuffle_caption=True), seed=0, epoch=0, row=0) == "photo"


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.7])
def test_dropout_rates_are_what_they_say(rate):
    """Whole-caption and tag dropout over 4,000 rows: the observed rates within 5 standard errors of the flags'."""
    n, tags = 4000, 10
    cap = ", ".join(f"t{i}" for i in range(tags))
    whole = CaptionOptions(caption_dropout_rate=rate)
    dropped = np.mean([augment_caption(cap, whole, seed=7, epoch=2, row=r) == "" for r in range(n)])
    assert abs(dropped - rate) < 5 * np.sqrt(rate * (1 - rate) / n)
    per_tag = CaptionOptions(caption_tag_dropout_rate=rate, keep_tokens=2)
    kept = [len(split_tags(augment_caption(cap, per_tag, seed=7, epoch=2, row=r))) - 2 for r in range(n)]
    left_out = 1 - np.mean(kept) / (tags - 2)
    assert abs(left_out - rate) < 5 * np.sqrt(rate * (1 - rate) / (n * (tags - 2)))


def test_whole_caption_dropout_is_drawn_per_epoch_even_with_variants_and_its_own_stream():
    """A dropped row is dropped in its epoch, whatever the tag flags (an independent stream), and ``K`` variants do
    not freeze the dropout (the empty prompt is one cache entry)."""
    cap = "a, b, c"
    plain = CaptionOptions(caption_dropout_rate=0.5)
    shuffled = CaptionOptions(caption_dropout_rate=0.5, shuffle_caption=True, caption_tag_dropout_rate=0.2)
    for epoch in range(3):
        drops = [augment_caption(cap, plain, seed=1, epoch=epoch, row=r) == "" for r in range(200)]
        assert drops == [augment_caption(cap, shuffled, seed=1, epoch=epoch, row=r, variants=1) == ""
                         for r in range(200)]
    per_epoch = [[augment_caption(cap, plain, seed=1, epoch=e, row=r) == "" for r in range(200)] for e in range(2)]
    assert per_epoch[0] != per_epoch[1]


def test_per_dataset_options_follow_each_row():
    """What ``--dataset_config`` subsets give: rows of dataset 1 shuffle, rows of dataset 0 keep their caption."""
    aug = CaptionAugmenter([CaptionOptions(), CaptionOptions(shuffle_caption=True, keep_tokens=1)], seed=0,
                           dataset_of_row=np.array([0, 0, 1, 1]))
    cap = "sks, a, b, c, d, e"
    out = [aug({"captions": [cap] * 4, "rows": np.arange(4)}, e)["captions"] for e in range(6)]
    assert all(o[0] == o[1] == cap for o in out)
    assert len({o[2] for o in out}) > 1 and all(o[2].startswith("sks, ") for o in out)
    with pytest.raises(ValueError, match="outside the 2 CaptionOptions"):
        CaptionAugmenter([CaptionOptions()] * 2, seed=0, dataset_of_row=np.array([0, 2]))
    with pytest.raises(ValueError, match="caption_dropout_rate must be in"):
        CaptionOptions(caption_dropout_rate=1.5)
    assert CaptionOptions.from_mapping({"shuffle_caption": True, "keep_tokens": 2, "num_repeats": 10}) == \
        CaptionOptions(shuffle_caption=True, keep_tokens=2)


# ------------------------------------------------------------------------------------- flags
def parse(*extra: str):
    return script.parse_args(["--pretrained_model_name_or_path", "m", "--train_data_dir", "d", "--report_to", "none",
                              "--full_finetune", "--learning_rate", "1e-5", *extra])


@pytest.mark.parametrize("extra, message", [
    (["--keep_tokens", "1"], "--keep_tokens 1 has no effect in this run: it configures --shuffle_caption"),
    (["--caption_separator", " "], "--caption_separator   has no effect in this run"),
    (["--caption_variants", "2"], "--caption_variants 2 has no effect in this run"),
    (["--caption_dropout_rate", "0.1", "--caption_dropout", "0.1"],
     "--caption_dropout_rate 0.1 and --proportion_empty_prompts 0.1 (upstream's --caption_dropout) both"),
    (["--caption_dropout_rate", "0.1", "--proportion_empty_prompts", "0.2"], "would drop twice: pass one of them"),
    (["--caption_tag_dropout_rate", "1.5"], "--caption_tag_dropout_rate must be in [0, 1], got 1.5"),
    (["--shuffle_caption", "--keep_tokens", "-1"], "--keep_tokens must be >= 0"),
    (["--shuffle_caption", "--caption_variants", "0"], "--caption_variants must be >= 1"),
    (["--caption_extension", "txt"], "pass it with its dot, e.g. --caption_extension .txt"),
    (["--caption_extension", ".txt", "--dataset_name", "org/data"],
     "--dataset_name org/data is a dataset: pass the folder as --train_data_dir"),
])
def test_caption_flag_mistakes_are_one_line(extra, message):
    with pytest.raises(UsageError) as err:
        parse(*extra)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_caption_variants_default_bounds_the_cache_only():
    assert caption_variant_count(parse("--shuffle_caption"), 100) is None  # on the fly: new tags every epoch
    assert caption_variant_count(parse("--shuffle_caption", "--cache_text_embeddings"), 100) == 8
    assert caption_variant_count(parse("--shuffle_caption", "--cache_text_embeddings"), 3) == 3
    assert caption_variant_count(parse("--caption_dropout_rate", "0.1", "--cache_text_embeddings"), 100) is None
    assert caption_variant_count(parse("--shuffle_caption", "--caption_variants", "5"), 100) == 5
    args = parse("--shuffle_caption", "--keep_tokens", "1", "--caption_separator", ";", "--seed", "3")
    aug = caption_augmenter(args, 10)
    assert aug.options[0] == CaptionOptions(shuffle_caption=True, keep_tokens=1, caption_separator=";")
    assert aug.seed == 3 and aug.variants is None
    # a kohya-style folder: caption files, no prompt, no metadata column named
    script.parse_args(["--pretrained_model_name_or_path", "m", "--instance_data_dir", "d", "--rank", "4",
                       "--caption_extension", ".txt", "--report_to", "none"])


# ------------------------------------------------------------------------------------- caption files
def folder_with_caption_files(root: Path, images: str, gaps: bool = True) -> Path:
    """The tiny photo folder (metadata.jsonl captions) with a tag caption file beside each image; with ``gaps``,
    none beside the first and an empty one beside the second."""
    folder = root / "tagged"
    shutil.copytree(images, folder)
    for i, image in enumerate(sorted(folder.glob("*.png"))):
        if gaps and i == 1:
            image.with_suffix(".txt").write_text("\n")
        elif i or not gaps:
            image.with_suffix(".txt").write_text(f"sks, tag{i}, red, blue, green\nignored second line\n")
    return folder


def test_sidecar_path_and_reading(tmp_path):
    assert sidecar_path("/d/a.b/photo.v2.png", ".txt") == "/d/a.b/photo.v2.txt"
    assert sidecar_path("/d/photo", ".caption") == "/d/photo.caption"
    (tmp_path / "a.txt").write_text("  first line  \nsecond\n")
    (tmp_path / "b.txt").write_text("")
    found = read_sidecar_captions([str(tmp_path / "a.png"), str(tmp_path / "b.jpg"), str(tmp_path / "c.png"), None],
                                  ".txt")
    assert found.captions == ["first line", "", None, None]
    assert found.missing == [str(tmp_path / "c.png"), "<image without a path>"] and found.empty == [
        str(tmp_path / "b.txt")]
    line = found.summary(".txt", "their metadata.jsonl caption", shown=1)
    assert line.startswith("--caption_extension .txt: 2 of 4 images have no caption file (c.png and 1 more)")
    assert "1 of 4 images have an empty caption file (b.txt)" in line and "\n" not in line


def test_caption_files_replace_metadata_captions_and_missing_ones_are_counted_and_named(tmp_path, caplog,
                                                                                         train_assets):
    from hf_arb.train.sources.dataset import load_raw_dataset

    folder = folder_with_caption_files(tmp_path, train_assets["images"])
    names = sorted(p.name for p in folder.glob("*.png"))
    meta = {json.loads(line)["file_name"]: json.loads(line)["text"]
            for line in (folder / "metadata.jsonl").read_text().splitlines()}
    base = ["--pretrained_model_name_or_path", "m", "--train_data_dir", str(folder), "--report_to", "none",
            "--full_finetune", "--learning_rate", "1e-5", "--caption_extension", ".txt",
            "--cache_dir", str(tmp_path / "cache")]
    with caplog.at_level(logging.WARNING, logger="train_text_to_image_arb"):
        ds = load_raw_dataset(script.parse_args(base))
    by_name = {Path(p["path"]).name: t for p, t in zip(ds.cast_column("image", _no_decode())["image"], ds["text"])}
    assert by_name[names[0]] == meta[names[0]] and by_name[names[1]] == ""
    assert by_name[names[5]] == "sks, tag5, red, blue, green"  # the first line only, as kohya reads it
    warned = [r.getMessage() for r in caplog.records if "--caption_extension" in r.getMessage()]
    assert warned == [f"--caption_extension .txt: 1 of 20 images have no caption file ({names[0]}) and train with "
                      "their metadata.jsonl caption (column 'text'); 1 of 20 images have an empty caption file "
                      f"({Path(names[1]).stem}.txt) and train with the empty caption \"\"."]
    # --instance_prompt fills the rows without a file (kohya's class tokens); --repeats repeats the read captions
    ds = load_raw_dataset(script.parse_args([*base, "--instance_prompt", "a photo of sks", "--repeats", "2"]))
    assert len(ds) == 40 and ds["text"].count("a photo of sks") == 2 and ds["text"].count("sks, tag5, red, blue, "
                                                                                           "green") == 2
    # kohya's DreamBooth layout (<repeats>_<class> subfolders): the repeats it does not read are named
    kohya_folder = tmp_path / "kohya" / "10_sks dog"
    shutil.copytree(folder, kohya_folder)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="train_text_to_image_arb"):
        ds = load_raw_dataset(script.parse_args([*base, "--train_data_dir", str(tmp_path / "kohya")]))
    assert len(ds) == 20 and ds["text"].count("sks, tag5, red, blue, green") == 1
    assert any("subfolders named as kohya's <repeats>_<class> (10_sks dog): their repeats are not read" in
               r.getMessage() for r in caplog.records)
    (folder / names[7]).with_suffix(".txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(UsageError, match="a caption file is not UTF-8 text"):
        load_raw_dataset(script.parse_args(base))


def _no_decode():
    import datasets

    return datasets.Image(decode=False)


# ------------------------------------------------------------------------------------- training
CAPTION_FLAGS = ["--caption_extension", ".txt", "--shuffle_caption", "--keep_tokens", "1",
                 "--caption_tag_dropout_rate", "0.25", "--caption_dropout_rate", "0.2", "--caption_variants", "2"]


@pytest.mark.slow
def test_cached_prompt_embeddings_train_the_captions_and_losses_of_on_the_fly_ones(tmp_path, train_assets):
    """Two rows, batch 1, 6 steps (3 epochs), K = 2 variants: with and without --cache_text_embeddings the run trains
    the same augmented captions (epoch 2 repeats epoch 0's tags), the trigger word first, and the same losses. The
    on-the-fly run resumed from its step-3 checkpoint (mid-epoch 1) trains the same captions and losses after it."""
    from test_train import read_trace, run_script, unet_weights

    folder = folder_with_caption_files(tmp_path, train_assets["images"], gaps=False)
    common = ["--pretrained_model_name_or_path", train_assets["sd"], "--train_data_dir", str(folder),
              "--resolution", "64", "--bucket_step", "16", "--train_batch_size", "1", "--report_to", "none",
              "--seed", "0", "--lr_warmup_steps", "0", "--log_batches", "--learning_rate", "1e-3", "--full_finetune",
              "--max_train_samples", "2", "--max_train_steps", "6", "--checkpointing_steps", "3",
              "--cache_dir", str(tmp_path / "cache"), *CAPTION_FLAGS]
    fly = run_script([*common, "--output_dir", str(tmp_path / "fly")])
    cached = run_script([*common, "--cache_text_embeddings", "--output_dir", str(tmp_path / "cached")])
    shutil.copytree(tmp_path / "fly" / "checkpoint-3", tmp_path / "resumed" / "checkpoint-3")
    run_script([*common, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", "latest"])
    a, b = read_trace(tmp_path / "fly", 0), read_trace(tmp_path / "cached", 0)
    assert [(t["epoch"], t["rows"], t["captions"]) for t in a] == [(t["epoch"], t["rows"], t["captions"]) for t in b]
    assert [t["epoch"] for t in a] == [0, 0, 1, 1, 2, 2]
    caption = {(t["epoch"], t["rows"][0]): t["captions"][0] for t in a}
    trained = [c for c in caption.values() if c]
    assert trained and all(c.startswith("sks, ") for c in trained)  # --keep_tokens 1: the trigger word first
    assert any(not c.endswith("red, blue, green") for c in trained)  # shuffled (or tags dropped)
    for (epoch, row), c in caption.items():  # K = 2: epoch 2 trains variant 0 (the whole-caption dropout aside)
        if epoch == 2 and c and caption[(0, row)]:
            assert c == caption[(0, row)]
    tail = [(t["epoch"], t["rows"], t["captions"], t["loss"]) for t in a if t["step"] >= 3]
    assert [(t["epoch"], t["rows"], t["captions"], t["loss"]) for t in read_trace(tmp_path / "resumed", 0)] == tail
    np.testing.assert_allclose(cached["losses"], fly["losses"], rtol=1e-5)
    wa, wb = unet_weights(tmp_path / "fly"), unet_weights(tmp_path / "cached")
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5
