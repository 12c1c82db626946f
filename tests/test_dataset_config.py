"""``--dataset_config`` files (issue #36, item 1): hf_arb's TOML / YAML layout and kohya sd-scripts'
``dataset_config.toml`` (its docs' examples, tests/fixtures/kohya/), every key read or refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_arb.checks import UsageError
from hf_arb.train.flags.dataset_config import parse_dataset_config

KOHYA = Path(__file__).resolve().parent / "fixtures" / "kohya"


def write(tmp_path: Path, text: str, name: str = "data.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_kohya_overview_examples_is_reg_subset_is_a_regularization_dataset(tmp_path):
    text = (KOHYA / "config_readme_example.toml").read_text()
    text = "\n".join(line for line in text.splitlines() if "metadata_file" not in line)
    text = text.replace("batch_size = 2", "batch_size = 4")
    specs = parse_dataset_config(write(tmp_path, text))
    assert [(s.train_data_dir, s.regularization) for s in specs] == [
        ("C:\\hoge", False), ("C:\\fuga", False), ("C:\\reg", True), ("C:\\piyo", False)]
    reg = specs[2]
    assert reg.prompt == "human" and reg.caption_options == {"shuffle_caption": True, "keep_tokens": 1}


@pytest.mark.parametrize("line, match", [
    ("repeats = 2", "repeats = 2 on a regularization dataset: .*paired with the instance batches"),
    ("loss_weight = 0.5", "loss_weight = 0.5 on a regularization dataset: .*--prior_loss_weight"),
])
def test_a_regularization_dataset_refuses_what_pairing_ignores(tmp_path, line, match):
    path = write(tmp_path, f"[[datasets]]\ntrain_data_dir = 'x'\n[[datasets]]\ntrain_data_dir = 'reg'\n"
                           f"regularization = true\n{line}\n")
    with pytest.raises(UsageError, match=match):
        parse_dataset_config(path)
    only_reg = write(tmp_path, "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'reg'\nis_reg = true\n", "reg.toml")
    with pytest.raises(UsageError, match="every dataset is a regularization dataset"):
        parse_dataset_config(only_reg)


def test_kohya_overview_example_without_is_reg_refuses_metadata_file_naming_the_fix(tmp_path):
    text = (KOHYA / "config_readme_example.toml").read_text().replace("is_reg = true", "")
    text = text.replace("image_dir = 'C:\\reg'", "image_dir = 'C:\\reg2'")
    with pytest.raises(UsageError, match="\\[\\[datasets\\]\\] 2 \\[\\[datasets.subsets\\]\\] 1: metadata_file = .*"
                                         "metadata.jsonl"):
        parse_dataset_config(write(tmp_path, text))
    text = "\n".join(line for line in text.splitlines() if "metadata_file" not in line)
    with pytest.raises(UsageError, match="batch_size \\[2, 4\\]: one global plan trains one batch size per step"):
        parse_dataset_config(write(tmp_path, text))
    text = text.replace("batch_size = 2", "batch_size = 4")
    specs = parse_dataset_config(write(tmp_path, text))
    # general < dataset < subset, as kohya reads them: keep_tokens 2 (dataset), 3 (subset), 1 (subset), 1 (general)
    assert [s.caption_options.get("keep_tokens") for s in specs] == [2, 3, 1, 1]
    assert [s.resolution for s in specs] == [512, 512, 512, 768] and {s.batch_size for s in specs} == {4}
    assert [s.prompt for s in specs] == ["hoge girl", "fuga boy", "human", None]


def test_kohya_duplicate_folders_are_two_datasets_at_their_resolutions():
    specs = parse_dataset_config(KOHYA / "config_readme_duplicates.toml")
    assert [(s.train_data_dir, s.resolution, s.repeats) for s in specs] == [("C:\\hoge", 512, 1), ("C:\\hoge", 768, 1)]
    assert len({s.name for s in specs}) == 2  # one folder, two labels in the report
    assert all(s.caption_extension == ".caption" for s in specs)  # kohya's default caption file


def test_kohya_separator_example_refuses_bucket_no_upscale_and_keeps_the_caption_keys(tmp_path):
    with pytest.raises(UsageError, match="bucket_no_upscale = True: .*hf-arb annotate DIR --max-upscale 1"):
        parse_dataset_config(KOHYA / "config_readme_separators.toml")
    text = (KOHYA / "config_readme_separators.toml").read_text().replace("bucket_no_upscale = true", "")
    # the caption keys the augmentation does not implement: refused by name, not dropped
    with pytest.raises(UsageError, match="keep_tokens_separator = '[|]{3}': kohya's keep_tokens_separator is not "
                                         "implemented"):
        parse_dataset_config(write(tmp_path, text))
    kept = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(
        ("keep_tokens_separator", "secondary_separator", "enable_wildcard", "caption_prefix", "caption_suffix")))
    (spec,) = parse_dataset_config(write(tmp_path, kept))
    assert spec.random_flip is True and spec.resolution == 1024 and spec.batch_size == 6
    assert spec.caption_options == {"shuffle_caption": True, "caption_tag_dropout_rate": 0.1}


@pytest.mark.parametrize("line, match", [
    ("num_repeats = 0", "repeats = 0: expected an integer >= 1"),
    ("num_repeats = 1.5", "repeats = 1.5: expected an integer"),
    ("caption_extension = 'txt'", "caption_extension = 'txt': expected an extension with its dot"),
    ("face_crop_aug_range = [1.0, 2.0]", None),  # harmless: kohya's default crop
    ("color_aug = true", "color_aug = True: color augmentation is not implemented: drop color_aug"),
    ("alpha_mask = true", "alpha_mask = True: .*--masked_loss"),
    ("made_up_key = 1", "made_up_key = 1: not a key hf_arb reads: remove it"),
])
def test_every_kohya_subset_key_is_read_or_refused_in_one_line(tmp_path, line, match):
    path = write(tmp_path, f"[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'x'\n{line}\n")
    if match is None:
        assert len(parse_dataset_config(path)) == 1
        return
    with pytest.raises(UsageError, match=match) as err:
        parse_dataset_config(path)
    assert "\n" not in str(err.value)


def test_own_layout_in_toml_and_yaml_reads_the_same(tmp_path):
    toml = write(tmp_path, """
[[datasets]]
name = "dogs"
train_data_dir = "data/dogs"
caption_extension = ".txt"
prompt = "a photo of sks dog"
repeats = 3
resolution = 512
loss_weight = 2.0
shuffle_caption = true

[[datasets]]
dataset_name = "user/photos"
caption_column = "caption"
bucket_preset = "sdxl"
""")
    yaml = write(tmp_path, """
datasets:
  - {name: dogs, train_data_dir: data/dogs, caption_extension: .txt, prompt: a photo of sks dog, repeats: 3,
     resolution: 512, loss_weight: 2.0, shuffle_caption: true}
  - {dataset_name: user/photos, caption_column: caption, bucket_preset: sdxl}
""", "data.yaml")
    a, b = parse_dataset_config(toml), parse_dataset_config(yaml)
    assert [(s.name, s.train_data_dir, s.dataset_name, s.repeats, s.resolution, s.bucket_preset, s.loss_weight,
             s.caption_options) for s in a] == [(s.name, s.train_data_dir, s.dataset_name, s.repeats, s.resolution,
                                                 s.bucket_preset, s.loss_weight, s.caption_options) for s in b]
    assert a[0].prompt == "a photo of sks dog" and a[1].name == "dataset2" and a[1].repeats is None


@pytest.mark.parametrize("body, match", [
    ("[[datasets]]\ntrain_data_dir = 'a'\nregularization = true\n", "every dataset is a regularization dataset"),
    ("[[datasets]]\ntrain_data_dir = 'a'\ndataset_name = 'b'\n", "exactly one of dataset_name"),
    ("[[datasets]]\ntrain_data_dir = 'a'\nrepeats = 2\nweight = 0.5\n", "repeats and weight both given"),
    ("[[datasets]]\ntrain_data_dir = 'a'\nweight = 1\n[[datasets]]\ntrain_data_dir = 'b'\n",
     "some datasets give weight and others repeats"),
    ("[[datasets]]\ntrain_data_dir = 'a'\ncaption_column = 't'\ncaption_extension = '.txt'\n",
     "caption_column and caption_extension both given"),
    ("[[datasets]]\ntrain_data_dir = 'a'\nbucket_preset = 'nope'\n", "bucket_preset = 'nope' is not one of"),
    ("[[datasets]]\ntrain_data_dir = 'a'\nresolution = [512, 768]\n", "write resolution = "),
    ("[[datasets]]\ntrain_data_dir = 'a'\nbatch_size = 2\n[[datasets]]\ntrain_data_dir = 'b'\nbatch_size = 3\n",
     "one batch size per step"),
    ("[[datasets]]\ntrain_data_dir = 'a'\nresolutoin = 512\n", "resolutoin = 512: not a key hf_arb reads"),
    ("datasets = 3\n", "expected a list of datasets"),
    ("[[datasets]\n", "cannot parse it as toml"),
])
def test_own_layout_mistakes_are_one_line_naming_the_fix(tmp_path, body, match):
    with pytest.raises(UsageError, match=match) as err:
        parse_dataset_config(write(tmp_path, body))
    assert "\n" not in str(err.value)


def test_run_flags_that_name_one_dataset_are_refused_with_the_file(tmp_path):
    from hf_arb.train.flags.args import parse_args

    path = write(tmp_path, "[[datasets]]\ntrain_data_dir = 'a'\nbatch_size = 3\nflip_aug = true\n")
    base = ["--pretrained_model_name_or_path", "stabilityai/stable-diffusion-2-1", "--dataset_config", str(path)]
    args = parse_args(base)  # kohya's batch_size and flip_aug win over the flags' defaults, as in kohya
    assert (args.train_batch_size, args.random_flip, len(args.dataset_specs)) == (3, True, 1)
    for extra, match in [(["--train_data_dir", "x"], "with --train_data_dir: the datasets are the file's"),
                         (["--repeats", "2"], "give each dataset repeats = N in the file"),
                         (["--train_batch_size", "4"], "batch_size = 3 and --train_batch_size 4 disagree"),
                         (["--resolution", "256,512"], "several --resolution tiers")]:
        with pytest.raises(UsageError, match=match):
            parse_args(base + extra)
    with pytest.raises(UsageError, match="no such file"):
        parse_args(base[:-1] + [str(tmp_path / "missing.toml")])
