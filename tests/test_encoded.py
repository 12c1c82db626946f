"""Encoded datasets (issue #39, hf_arb.train.encoded): training from one equals --cache_latents
--cache_text_embeddings bit for bit, an interrupted encode resumes to the same bytes, a fingerprint mismatch is one
line, the sampler's plan is the source dataset's, and the push / reload round trip through the fake Hub."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _fake_hub import FakeHub  # noqa: E402
from _train_fixtures import FLOW, GROUP, SD_BASE, batch_result  # noqa: E402

from hf_arb.checks import UsageError  # noqa: E402

#: 8 of the 20 photos; 4 steps span 2 epochs, so --random_flip encodes 2 variants per image
STEPS = ["--max_train_samples", "8", "--max_train_steps", "4", "--checkpointing_steps", "100", "--random_flip"]


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.parquet"))}


def _reset() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _train(argv: list[str]) -> dict[str, Any]:
    import train_text_to_image_arb as script

    _reset()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return script.main(argv)
    finally:
        _reset()


def _trace(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(out) / "batches" / "rank0.jsonl").read_text().splitlines()]


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The class names of every diffusers / transformers model ``from_pretrained`` builds while the test runs, and
    ``"pipeline"`` where a pipeline is built (the saved pipeline of a full fine-tune loads the base's frozen parts)."""
    from diffusers import DiffusionPipeline, ModelMixin
    from transformers import PreTrainedModel

    names: list[str] = []
    for base in (ModelMixin, PreTrainedModel, DiffusionPipeline):
        real = base.from_pretrained.__func__

        def counting(cls: Any, *a: Any, _real: Any = real, _base: Any = base, **kw: Any) -> Any:
            names.append("pipeline" if _base is DiffusionPipeline else cls.__name__)
            return _real(cls, *a, **kw)

        monkeypatch.setattr(base, "from_pretrained", classmethod(counting))
    return names


#: the frozen models a run from an encoded dataset does not build (the families' VAEs and text encoders)
FROZEN_CLASSES = ("AutoencoderKL", "CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel")


def _args(flags: list[str], out: Path) -> Any:
    from hf_arb.train.flags.args import parse_args

    return parse_args([*flags, "--output_dir", str(out)])


@pytest.fixture(scope="module")
def sd(train_assets: dict[str, str]) -> list[str]:
    return ["--pretrained_model_name_or_path", train_assets["sd"], "--train_data_dir", train_assets["images"],
            *SD_BASE, "--full_finetune", *STEPS]


@pytest.fixture(scope="module")
def encoded(sd: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny SD run encoded by two simulated ranks (each its share of 4-entry shards), then finished."""
    from hf_arb.train.encoded.encode import encode_share, finish, plan_encode

    out = tmp_path_factory.mktemp("encoded")
    args = _args(sd, out / "run")
    plan = plan_encode(args)
    counts = [encode_share(args, out / "ds", rank=r, world=2, shard_size=4, plan=plan, show_progress=False)
              for r in (0, 1)]
    info = finish(args, out / "ds", plan, shard_size=4)
    return {"args": args, "plan": plan, "root": out / "ds", "counts": counts, "info": info}


def test_encode_writes_every_entry_once_split_between_ranks(encoded: dict[str, Any]) -> None:
    plan, counts = encoded["plan"], encoded["counts"]
    assert plan.variants == 2 and len(plan.entries) == 16  # 8 images x 2 flip variants, each at its bucket
    assert [c["shards_written"] for c in counts] == [3, 2]  # 4 latents shards + 1 prompts shard, i % 2 == rank
    assert sum(c["entries_written"] for c in counts) == 16 and encoded["info"]["bad_entries"] == []
    files = _files(encoded["root"])
    assert len([f for f in files if f.startswith("data/latents/")]) == 4
    from hf_arb.train.encoded.reader import open_encoded

    data = open_encoded(str(encoded["root"]))
    assert len(data.latents) == 16 and len(data.rows) == 8 and "" in data.prompts["caption"]
    assert data.fingerprint["variants"] == 2 and data.fingerprint["fit"]["random_flip"] is True


@pytest.mark.slow
def test_training_from_the_encoded_dataset_equals_the_caches_bit_for_bit(sd: list[str], encoded: dict[str, Any],
                                                                          tmp_path: Path, built: list[str]) -> None:
    cached = _train([*sd, "--output_dir", str(tmp_path / "cached"), "--cache_latents", "--cache_text_embeddings"])
    assert {"AutoencoderKL", "CLIPTextModel"} <= set(built)  # the counter sees them where they load
    built.clear()
    # the same command, the dataset flags kept (a user's habit): the encoded dataset replaces them
    ours = _train([*sd, "--output_dir", str(tmp_path / "enc"), "--encoded_dataset", str(encoded["root"])])
    # no VAE, no text encoder while it trains (the dataset holds latents and embeddings); the saved pipeline takes
    # the base model's, as diffusers' script saves them
    assert built[:built.index("pipeline") + 1] == ["UNet2DConditionModel", "pipeline"]
    assert len(ours["losses"]) == 4
    assert ours["losses"] == cached["losses"]  # exactly: same posteriors (float16), same embeddings (float32)
    assert [t["rows"] for t in _trace(str(tmp_path / "enc"))] == [t["rows"] for t in _trace(str(tmp_path / "cached"))]
    assert ours["vae_encode_calls"] == 0


@pytest.mark.slow
def test_a_flow_family_trains_from_its_encoded_dataset_as_from_the_caches(flow_assets: dict[str, str],
                                                                           tmp_path: Path, built: list[str]) -> None:
    from hf_arb.cli import main as cli

    flags = ["--pretrained_model_name_or_path", flow_assets["flux"], "--train_data_dir", flow_assets["images"],
             *FLOW, "--full_finetune", "--learning_rate", "1e-3", "--max_train_steps", "3", "--checkpointing_steps",
             "100", "--center_crop"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["encode", str(tmp_path / "ds"), "--shard-size", "8", "--", *flags]) == 0
    cached = _train([*flags, "--output_dir", str(tmp_path / "cached"), "--cache_latents", "--cache_text_embeddings"])
    built.clear()
    ours = _train([*flags, "--output_dir", str(tmp_path / "enc"), "--encoded_dataset", str(tmp_path / "ds")])
    assert built[:built.index("pipeline") + 1] == ["FluxTransformer2DModel", "pipeline"]  # no VAE, CLIP or T5
    assert ours["losses"] == cached["losses"] and len(ours["losses"]) == 3


@pytest.mark.slow
def test_sdxl_trains_from_its_encoded_dataset_as_from_the_caches(train_assets: dict[str, str], tmp_path: Path,
                                                                  built: list[str]) -> None:
    """Two text encoders, the pooled embedding and per-row time ids (random crops and flips) from the dataset."""
    from hf_arb.cli import main as cli

    flags = ["--pretrained_model_name_or_path", train_assets["sdxl"], "--train_data_dir", train_assets["images"],
             *SD_BASE, "--rank", "4", "--max_train_samples", "8", "--max_train_steps", "3", "--checkpointing_steps",
             "100", "--random_flip"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["encode", str(tmp_path / "ds"), "--shard-size", "8", "--", *flags]) == 0
    cached = _train([*flags, "--output_dir", str(tmp_path / "cached"), "--cache_latents", "--cache_text_embeddings"])
    built.clear()
    ours = _train([*flags, "--output_dir", str(tmp_path / "enc"), "--encoded_dataset", str(tmp_path / "ds")])
    assert built == ["UNet2DConditionModel"]  # LoRA: no VAE, no text encoder, and no pipeline at the end
    assert ours["losses"] == cached["losses"] and len(ours["losses"]) == 3
    trace, theirs = _trace(str(tmp_path / "enc")), _trace(str(tmp_path / "cached"))
    assert [(t["rows"], t["time_ids_first"]) for t in trace] == [(t["rows"], t["time_ids_first"]) for t in theirs]
    assert any(t["time_ids_first"][2:4] != [0, 0] for t in trace)  # a random crop's offset reached the UNet


def test_an_interrupted_encode_resumes_to_the_same_bytes(sd: list[str], encoded: dict[str, Any],
                                                         tmp_path: Path) -> None:
    from hf_arb.train.encoded.encode import encode_share, finish

    root = tmp_path / "ds"
    shutil.copytree(encoded["root"], root)
    (root / "hf_arb_encoded.json").unlink()  # killed before the end: no fingerprint yet
    shards = sorted((root / "data" / "latents").glob("*.parquet"))
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])  # truncated (a copy cut short; a killed writer leaves a .tmp)
    shards[3].unlink()  # never written
    (shards[3].parent / f".{shards[3].name}.abc.tmp").write_bytes(data[:100])  # what a kill mid-write leaves
    from hf_arb.train.encoded.reader import open_encoded

    with pytest.raises(UsageError, match="the encode did not finish"):
        open_encoded(str(root))
    with pytest.raises(UsageError, match=r"2 shard\(s\) missing or damaged"):
        finish(encoded["args"], root, encoded["plan"], shard_size=4)
    counts = encode_share(encoded["args"], root, shard_size=4, plan=encoded["plan"], show_progress=False)
    assert (counts["shards_kept"], counts["shards_redone"], counts["shards_written"]) == (3, 1, 2)
    finish(encoded["args"], root, encoded["plan"], shard_size=4)
    assert _files(root) == _files(encoded["root"])  # row for row, bit for bit
    assert (root / "hf_arb_encoded.json").read_text() == (encoded["root"] / "hf_arb_encoded.json").read_text()


def test_every_rank_returns_from_encode_once_the_dataset_is_finished(encoded: dict[str, Any],
                                                                    tmp_path: Path) -> None:
    """encode_dataset on 2 ranks (threads, a real barrier): no rank returns before the main process has written the
    fingerprint, so a script that trains from the dataset next in the same processes finds it finished (rank 1 once
    left at the first barrier and opened it too early). The main process is held back after the barrier to make the
    old order fail every time."""
    import threading
    import time

    from hf_arb.train.encoded.encode import encode_dataset
    from hf_arb.train.encoded.fingerprint import INFO_FILE

    root = tmp_path / "ds"
    shutil.copytree(encoded["root"], root)
    (root / INFO_FILE).unlink()  # every shard is in; the main process has not finished yet
    barrier, seen, errors = threading.Barrier(2, timeout=60), {}, []

    def rank(r: int) -> None:
        def wait() -> None:
            barrier.wait()
            if r == 0:
                time.sleep(0.5)  # the main process is slow to write the fingerprint

        acc = SimpleNamespace(process_index=r, num_processes=2, device="cpu", is_local_main_process=r == 0,
                              is_main_process=r == 0, wait_for_everyone=wait)
        try:
            encode_dataset(encoded["args"], root, num_processes=1, shard_size=4, accelerator=acc,
                           show_progress=False)
            seen[r] = (root / INFO_FILE).exists()
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and seen == {0: True, 1: True}, (errors, seen)


@pytest.mark.parametrize(("change", "field"), [
    (["--center_crop"], "fit"),
    (["--resolution", "96"], "buckets"),
    (["--image_interpolation_mode", "bilinear"], "fit"),
    (["--seed", "1"], "fit"),
])
def test_a_fingerprint_mismatch_is_one_line_naming_the_field(sd: list[str], encoded: dict[str, Any], tmp_path: Path,
                                                             change: list[str], field: str) -> None:
    from hf_arb.train.sources import build_source

    flags = [*sd, *change, "--encoded_dataset", str(encoded["root"])]
    with pytest.raises(UsageError) as err:
        build_source(_args(flags, tmp_path), None)
    message = str(err.value)
    assert "\n" not in message and f"this run's {field} (" in message and "encoded " in message
    assert "hf-arb encode" in message


def test_another_model_or_vae_or_format_is_refused(sd: list[str], encoded: dict[str, Any], train_assets: dict[str, str],
                                                   tmp_path: Path) -> None:
    from hf_arb.train.sources import build_source

    sdxl = [*sd, "--encoded_dataset", str(encoded["root"])]
    sdxl[sdxl.index("--pretrained_model_name_or_path") + 1] = train_assets["sdxl"]
    with pytest.raises(UsageError, match=r"this run's family \(family: encoded \"sd\", this run \"sdxl\"\)"):
        build_source(_args(sdxl, tmp_path), None)
    other = tmp_path / "vae"
    shutil.copytree(Path(train_assets["sd"]) / "vae", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "scaling_factor": 0.5}))
    vae = [*sd, "--encoded_dataset", str(encoded["root"]), "--pretrained_vae_model_name_or_path", str(other)]
    with pytest.raises(UsageError, match=r"this run's vae \(vae: encoded"):
        build_source(_args(vae, tmp_path), None)
    old = tmp_path / "old"
    shutil.copytree(encoded["root"], old)
    info = json.loads((old / "hf_arb_encoded.json").read_text())
    info["fingerprint"]["format_version"] = 0
    (old / "hf_arb_encoded.json").write_text(json.dumps(info))
    with pytest.raises(UsageError, match="format_version: encoded 0, this hf_arb reads 1"):
        build_source(_args([*sd, "--encoded_dataset", str(old)], tmp_path), None)


def test_other_variants_and_a_partial_dataset_are_refused_before_the_models(sd: list[str], encoded: dict[str, Any],
                                                                            tmp_path: Path) -> None:
    from hf_arb.train.sources import build_source

    world = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True)
    more = [*sd, "--encoded_dataset", str(encoded["root"]), "--max_train_steps", "9"]  # 3 epochs: 3 variants
    source = build_source(_args(more, tmp_path), None)
    with pytest.raises(UsageError, match=r"this run.s variants \(variants: encoded 2, this run [3-8]\)"):
        source.start(world)
    catch = [*sd, "--encoded_dataset", str(encoded["root"]), "--bucket_leftover", "catch_all",
             "--train_batch_size", "3", "--latent_cache_variants", "2"]
    source = build_source(_args(catch, tmp_path), None)
    with pytest.raises(UsageError, match=r"covers only part of this run: \d+ of \d+ \(row, bucket, variant\) entries "
                                         r"are missing") as err:
        source.start(world)
    assert "\n" not in str(err.value)


def test_the_sampler_plans_the_encoded_dataset_as_the_source_dataset(sd: list[str], encoded: dict[str, Any],
                                                                    tmp_path: Path) -> None:
    from hf_arb.train.sources import build_source
    from hf_arb.train.sources.bucketed import BucketedSource
    from hf_arb.train.sources.encoded import EncodedSource

    world = SimpleNamespace(num_processes=2, process_index=0, is_main_process=True)
    plain = build_source(_args([*sd, "--train_batch_size", "1"], tmp_path), None)
    ours = build_source(_args([*sd, "--train_batch_size", "1", "--encoded_dataset", str(encoded["root"])], tmp_path),
                        None)
    assert type(plain) is BucketedSource and type(ours) is EncodedSource
    plain.start(world)
    ours.start(world)
    assert ours.buckets == plain.buckets
    for epoch in (0, 1):
        np.testing.assert_array_equal(ours.sampler.plan(epoch), plain.sampler.plan(epoch))


def test_encoded_flags_refuse_what_does_not_apply(sd: list[str], tmp_path: Path) -> None:
    for extra, said in ((["--cache_latents"], "the encoded dataset is the latent cache"),
                        (["--rank", "4", "--train_text_encoder"], "its prompt embeddings are fixed"),
                        (["--alpha_mask"], "--alpha_mask with --encoded_dataset somewhere: its entries hold no masks"),
                        (["--shuffle_caption"], "captions as written: drop --shuffle_caption"),
                        (["--with_prior_preservation", "--class_data_dir", "c", "--class_prompt", "p"],
                         "its batches hold no class images")):
        flags = [f for f in sd if f != "--full_finetune"] if "--rank" in extra else sd
        with pytest.raises(UsageError, match=said):
            _args([*flags, "--encoded_dataset", "somewhere", *extra], tmp_path)
    # a command without --train_data_dir / --dataset_name trains from the encoded dataset alone
    from hf_arb.train.environment import check_environment

    bare = [f for i, f in enumerate(sd) if "--train_data_dir" not in (f, sd[i - 1])]
    args = _args([*bare, "--encoded_dataset", "somewhere"], tmp_path)
    check_environment(args)  # no data folder to check: the source opens the encoded dataset
    assert args.encoded_dataset == "somewhere" and args.train_data_dir is None
    assert _args([*bare, "--latents_dataset", "there"], tmp_path).encoded_dataset == "there"  # the issue's name


def test_push_and_reload_through_the_hub(encoded: dict[str, Any], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    from hf_arb.train.encoded.encode import push_encoded
    from hf_arb.train.encoded.reader import open_encoded

    hub = FakeHub(tmp_path / "hub").install(monkeypatch)
    commit = push_encoded(encoded["root"], "me/encoded", api=hub.api())
    assert commit.oid == hub.heads["me/encoded"]
    repo = hub.repo_dir("me/encoded")
    assert _files(repo) == _files(encoded["root"])
    card = (repo / "README.md").read_text()
    assert "--encoded_dataset" in card and "hf_arb_encoded:" in card and "vae_weights" in card
    back = open_encoded(str(repo))
    assert back.info == json.loads((encoded["root"] / "hf_arb_encoded.json").read_text())
    latents = datasets.load_dataset(str(repo), "latents", split="train")  # the card's configs: a plain datasets load
    assert len(latents) == 16 and set(latents.column_names) >= {"row", "bucket", "variant", "latent_stats", "caption"}
    assert len(datasets.load_dataset(str(repo), "prompts", split="train")) == len(encoded["plan"].captions)


def test_a_vae_with_other_weights_is_refused_before_any_model_loads(sd: list[str], encoded: dict[str, Any],
                                                                    train_assets: dict[str, str], tmp_path: Path,
                                                                    built: list[str]) -> None:
    import torch
    from diffusers import AutoencoderKL

    from hf_arb.train.sources import build_source

    model = tmp_path / "tuned-vae"
    shutil.copytree(train_assets["sd"], model)
    vae = AutoencoderKL.from_pretrained(model / "vae")  # same config, a fine-tuned weight
    with torch.no_grad():
        next(iter(vae.parameters())).add_(1e-3)
    vae.save_pretrained(model / "vae")
    flags = [*sd, "--encoded_dataset", str(encoded["root"])]
    built.clear()
    with pytest.raises(UsageError, match=r"this run's vae_files \(vae_files: encoded \"[0-9a-f]{16}\", this run \""):
        build_source(_args([*flags, "--pretrained_model_name_or_path", str(model)], tmp_path), None)
    assert built == []  # read from the weights file: no VAE built
    source = build_source(_args(flags, tmp_path), None)
    assert source.frozen_parts() == frozenset()  # the same VAE's files: nothing to load


def test_a_dataset_without_the_vae_files_hash_checks_the_loaded_vae(sd: list[str], encoded: dict[str, Any],
                                                                    train_assets: dict[str, str],
                                                                    tmp_path: Path) -> None:
    import torch
    from diffusers import AutoencoderKL

    from hf_arb.train.sources import build_source

    old = tmp_path / "ds"  # as encoded before the files hash (or a VAE saved as a .bin pickle)
    shutil.copytree(encoded["root"], old)
    info = json.loads((old / "hf_arb_encoded.json").read_text())
    (old / "hf_arb_encoded.json").write_text(json.dumps({**info, "vae_files": None}))
    source = build_source(_args([*sd, "--encoded_dataset", str(old)], tmp_path), None)
    assert source.frozen_parts() == frozenset({"vae"})  # the run loads the VAE to fingerprint it
    source.start(SimpleNamespace(num_processes=1, process_index=0, is_main_process=True))
    vae = AutoencoderKL.from_pretrained(Path(train_assets["sd"]) / "vae")  # same config, a fine-tuned weight
    with torch.no_grad():
        next(iter(vae.parameters())).add_(1e-3)
    with pytest.raises(UsageError, match=r"this run's vae_weights \(vae_weights: encoded"):
        source.loader(SimpleNamespace(), SimpleNamespace(vae=vae), None, torch.float32)


def test_the_vae_files_hash_is_of_the_tensors_not_of_the_files(tmp_path: Path) -> None:
    """Same tensors (another order, other header metadata, split into an index's shards): the same hash; one value,
    dtype or name changed: another; a ``.bin`` VAE has none (the run then fingerprints the loaded module)."""
    import torch
    from safetensors.torch import save_file

    from hf_arb.train.encoded.weights import vae_files_hash

    a, b = torch.arange(12.0).reshape(3, 4), torch.ones(5, dtype=torch.float16)

    def folder(name: str, shards: list[dict[str, Any]], meta: dict[str, str] | None = None) -> Path:
        (tmp_path / name / "vae").mkdir(parents=True)
        if len(shards) == 1:
            save_file(shards[0], str(tmp_path / name / "vae" / "diffusion_pytorch_model.safetensors"), metadata=meta)
            return tmp_path / name
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"diffusion_pytorch_model-{i:05d}.safetensors"
            save_file(shard, str(tmp_path / name / "vae" / file))
            weight_map.update(dict.fromkeys(shard, file))
        (tmp_path / name / "vae" / "diffusion_pytorch_model.safetensors.index.json").write_text(
            json.dumps({"weight_map": weight_map}))
        return tmp_path / name

    base = vae_files_hash(str(folder("a", [{"a": a, "b": b}])), "vae")
    assert base == vae_files_hash(str(folder("b", [{"b": b, "a": a}], {"format": "pt"})), "vae")
    assert base == vae_files_hash(str(folder("c", [{"b": b}, {"a": a}])), "vae")
    assert base != vae_files_hash(str(folder("d", [{"a": a + 1e-3, "b": b}])), "vae")
    assert base != vae_files_hash(str(folder("e", [{"a": a.half(), "b": b}])), "vae")
    assert base != vae_files_hash(str(folder("f", [{"a2": a, "b": b}])), "vae")
    (tmp_path / "g" / "vae").mkdir(parents=True)
    (tmp_path / "g" / "vae" / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    assert vae_files_hash(str(tmp_path / "g"), "vae") is None


@pytest.mark.slow
def test_validation_loads_the_vae_and_text_encoder_when_it_runs(sd: list[str], encoded: dict[str, Any],
                                                                tmp_path: Path, built: list[str]) -> None:
    lora = [f for f in sd if f != "--full_finetune"] + ["--rank", "4"]
    stats = _train([*lora, "--output_dir", str(tmp_path / "out"), "--encoded_dataset", str(encoded["root"]),
                    "--validation_prompt", "a photo", "--num_validation_images", "1",
                    "--num_validation_inference_steps", "1", "--validation_epochs", "2"])
    assert len(stats["losses"]) == 4 and len(stats["validation_images"]) == 2  # epoch 2's and the final one
    assert all(Path(p).is_file() for p in stats["validation_images"])
    assert built[0] == "UNet2DConditionModel"  # trained without them; validation loaded them after the last step
    assert set(built[1:3]) == {"CLIPTextModel", "AutoencoderKL"} and built[3] == "pipeline"
    assert (tmp_path / "out" / "pytorch_lora_weights.safetensors").is_file()  # LoRA: only the adapter is saved


def test_nan_latents_are_counted_named_and_never_written(sd: list[str], encoded: dict[str, Any], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from hf_arb.train.cache import caches
    from hf_arb.train.encoded.encode import encode_share, finish
    from hf_arb.train.encoded.reader import open_encoded
    from hf_arb.train.sources import build_source

    real, calls = caches.posterior_stats, []

    def first_batch_nan(vae: Any, pixels: Any) -> Any:  # the VAE fails on the first batch it sees
        calls.append(len(pixels))
        stats = real(vae, pixels)
        return torch.full_like(stats, float("nan")) if len(calls) == 1 else stats

    monkeypatch.setattr(caches, "posterior_stats", first_batch_nan)
    counts = encode_share(encoded["args"], tmp_path / "ds", shard_size=4, plan=encoded["plan"], show_progress=False)
    assert len(counts["bad"]) == calls[0] and counts["entries_written"] == 16 - calls[0]
    info = finish(encoded["args"], tmp_path / "ds", encoded["plan"], shard_size=4)
    assert [tuple(b[:3]) for b in info["bad_entries"]] == [tuple(b[:3]) for b in counts["bad"]]
    assert all(b[3] == "non-finite latent" for b in info["bad_entries"])
    data = open_encoded(str(tmp_path / "ds"))
    stats = [np.frombuffer(b, np.float16) for b in data.latents["latent_stats"]]
    assert len(stats) == 16 - calls[0] and all(np.isfinite(s).all() for s in stats)
    # resuming keeps the shard with its bad entries (it is complete), and training says what is missing
    again = encode_share(encoded["args"], tmp_path / "ds", shard_size=4, plan=encoded["plan"], show_progress=False)
    assert again["shards_written"] == 0
    source = build_source(_args([*sd, "--encoded_dataset", str(tmp_path / "ds")], tmp_path), None)
    with pytest.raises(UsageError, match=rf"{calls[0]} of 16 \(row, bucket, variant\) entries are missing .*NaN "
                                         rf"latents left out at encode: {calls[0]}"):
        source.start(SimpleNamespace(num_processes=1, process_index=0, is_main_process=True))


@pytest.mark.slow
@pytest.mark.xdist_group("engines")  # the Ray cluster test_engines.py uses (tests/conftest.py): started once
def test_ray_data_writes_the_same_dataset_with_the_same_per_batch_function(ray_cluster, encoded: dict[str, Any],
                                                                           tmp_path: Path) -> None:
    import torch

    from hf_arb.train.encoded.encode import encode_with_ray

    # the actors with this process's threads: a CPU convolution's last bits depend on the count
    info = encode_with_ray(encoded["args"], tmp_path / "ds", shard_size=4, threads=torch.get_num_threads())
    assert info["entries"] == 16
    ours, local = _files(tmp_path / "ds"), _files(encoded["root"])
    prompts = "data/prompts/prompts-00000-of-00001.parquet"
    assert {k: v for k, v in ours.items() if k != prompts} == {k: v for k, v in local.items() if k != prompts}
    import pyarrow.parquet as pq  # the text encoder in an actor: the same captions, within float32 rounding

    a, b = (pq.read_table(root / prompts).to_pylist() for root in (tmp_path / "ds", encoded["root"]))
    assert [r["caption"] for r in a] == [r["caption"] for r in b]
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.frombuffer(x["prompt_embeds"], np.float32),
                                   np.frombuffer(y["prompt_embeds"], np.float32), rtol=0, atol=1e-6)


def test_another_text_encoder_is_refused(sd: list[str], encoded: dict[str, Any], train_assets: dict[str, str],
                                         tmp_path: Path) -> None:
    from hf_arb.train.sources import build_source

    other = tmp_path / "tiny-sd"
    shutil.copytree(train_assets["sd"], other)
    config = json.loads((other / "text_encoder" / "config.json").read_text())
    (other / "text_encoder" / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-6}))
    flags = [*sd, "--encoded_dataset", str(encoded["root"])]
    flags[flags.index("--pretrained_model_name_or_path") + 1] = str(other)
    with pytest.raises(UsageError, match=r"this run's model \(model: encoded \{\"text_encoder\": \""):
        build_source(_args(flags, tmp_path), None)


def test_the_encode_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from hf_arb.cli import main as cli

    with pytest.raises(SystemExit) as err:
        cli(["encode", "out"])
    assert err.value.code == 2 and "give the training flags after --" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # only encode takes another program's flags after "--"
        cli(["buckets", "--preset", "sdxl", "--", "--resolution", "64"])
    assert "unrecognized arguments: -- --resolution 64" in capsys.readouterr().err


@pytest.fixture(scope="module")
def latent_cache(sd: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The per-file latent cache that one 4-step --cache_latents run of the tiny SD fills."""
    out = tmp_path_factory.mktemp("cached")
    _train([*sd, "--output_dir", str(out / "run"), "--cache_latents", "--latent_cache_dir", str(out / "cache")])
    return out / "cache"


def test_from_cache_converts_the_latent_cache_to_the_encoded_bytes_without_the_vae(
        encoded: dict[str, Any], latent_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers import AutoencoderKL

    from hf_arb.train.encoded.from_cache import convert_cache

    calls = [0]
    real = AutoencoderKL.encode

    def counting(self: Any, *a: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(AutoencoderKL, "encode", counting)
    info = convert_cache(encoded["args"], tmp_path / "ds", latent_cache, shard_size=4, show_progress=False)
    assert calls[0] == 0  # no VAE call: every latent is read from the cache
    assert info["entries"] == 16 and info["shards_written"] == 5
    ours, theirs = _files(tmp_path / "ds"), _files(encoded["root"])
    assert [f for f in ours if f.startswith("data/latents/")] == [f for f in theirs if f.startswith("data/latents/")]
    assert ours == theirs  # latents (and prompts, rows) byte for byte what hf-arb encode writes
    info_file = "hf_arb_encoded.json"
    assert (tmp_path / "ds" / info_file).read_text() == (encoded["root"] / info_file).read_text()


def test_from_cache_refuses_missing_and_damaged_entries_in_one_line(
        sd: list[str], latent_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hf_arb.cli import main as cli

    cache = tmp_path / "cache"
    shutil.copytree(latent_cache, cache)
    entries = sorted(cache.glob("*/*.npy"))
    entries[0].unlink()  # never encoded
    entries[1].write_bytes(entries[1].read_bytes()[:40])  # truncated
    with pytest.raises(SystemExit) as err:
        cli(["encode", str(tmp_path / "ds"), "--from-cache", str(cache), "--shard-size", "4", "--",
             *sd, "--output_dir", str(tmp_path / "run")])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.value.code == 2
    assert "2 of the 16 planned entries are missing (1) or damaged (1)" in message and ": missing" in message
    assert "--cache_latents" in message and not list((tmp_path / "ds").glob("data/latents/*.parquet"))


# ------------------------------------------------------------------------- slow: 2 processes + resume (the batch)
@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_two_processes_train_from_the_encoded_dataset_as_from_the_caches_and_resume_exactly(ddp_batch) -> None:
    """tests/_train_fixtures.py ``encoded_runs``: encoded by the launch's 2 ranks, trained on 2 processes, resumed."""
    from test_train import read_trace, unet_weights

    from hf_arb.train.encoded.reader import open_encoded

    data = open_encoded(batch_result(ddp_batch, "encoded-sd-encode")["out"].as_posix())
    assert data.info["vae_files"] and len(data.latents) == data.info["entries"] > 8
    full, resumed, cached = (batch_result(ddp_batch, f"encoded-sd-{k}") for k in ("full", "resumed", "cached"))
    assert full["stats"]["num_processes"] == 2 and len(full["stats"]["losses"]) == 4
    assert full["stats"]["losses"] == cached["stats"]["losses"]  # exactly, on 2 ranks too
    for rank in (0, 1):
        ours, theirs = read_trace(full["out"], rank), read_trace(cached["out"], rank)
        assert [(t["rows"], t["loss"]) for t in ours] == [(t["rows"], t["loss"]) for t in theirs]
        tail = [t for t in ours if t["step"] >= 2]
        again = read_trace(resumed["out"], rank)
        assert [(t["step"], t["rows"], t["loss"]) for t in again] == [(t["step"], t["rows"], t["loss"]) for t in tail]
    assert set(read_trace(full["out"], 0)[0]["rows"]).isdisjoint(read_trace(full["out"], 1)[0]["rows"])
    a, b = unet_weights(full["out"]), unet_weights(resumed["out"])
    assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_two_processes_stream_the_encoded_dataset_in_step_and_resume_exactly(ddp_batch) -> None:
    """tests/_train_fixtures.py ``encoded_runs``: the batch's encoded dataset streamed on 2 processes
    (``--streaming``, each rank its split of the latents shards), checkpoint-2 mid-epoch, and its resume: both ranks
    train the same bucket at every step, each its own rows, and the resumed run equals the uninterrupted one."""
    from test_train import read_trace, unet_weights

    full, resumed = (batch_result(ddp_batch, f"encoded-sd-stream-{k}") for k in ("full", "resumed"))
    stats = full["stats"]
    assert stats["num_processes"] == 2 and len(stats["losses"]) == 4 and stats["vae_encode_calls"] == 0
    assert stats["schedule"]["batches_per_epoch"] > 2  # checkpoint-2 is mid-epoch
    assert stats["stream_report"]["num_replicas"] == 2
    r0, r1 = read_trace(full["out"], 0), read_trace(full["out"], 1)
    assert [t["step"] for t in r0] == [t["step"] for t in r1] == [0, 1, 2, 3]
    assert [t["bucket"] for t in r0] == [t["bucket"] for t in r1]  # the same bucket on both ranks at every step
    assert [t["shape"] for t in r0] == [t["shape"] for t in r1]
    assert len({t["bucket"] for t in r0}) > 1
    for a, b in zip(r0, r1):  # each rank its own rows
        assert not set(a["rows"]) & set(b["rows"])
    for rank in (0, 1):
        assert (full["out"] / "checkpoint-2" / f"stream_rank{rank}.json").exists()
        tail = [t for t in read_trace(full["out"], rank) if t["step"] >= 2]
        again = read_trace(resumed["out"], rank)
        assert [(t["step"], t["bucket"], t["rows"], t["captions"], t["loss"]) for t in again] == \
               [(t["step"], t["bucket"], t["rows"], t["captions"], t["loss"]) for t in tail]
    assert resumed["stats"]["losses"] == stats["losses"][2:]  # exactly
    a, b = unet_weights(full["out"]), unet_weights(resumed["out"])
    assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


# ------------------------------------------------------------------------------------- --encoded_dataset --streaming
#: the encoded run's flags streamed: no --stream_key_column (the `row` column keys the rows), --max_train_samples
#: kept (a habit: the encoded dataset holds the rows it chose); 2 variants as encoded
STREAMED = ["--streaming", "--latent_cache_variants", "2"]


def _stream_source(sd: list[str], encoded: dict[str, Any], tmp_path: Path, *extra: str) -> Any:
    from hf_arb.train.sources import build_source

    source = build_source(_args([*sd, "--encoded_dataset", str(encoded["root"]), *STREAMED, *extra], tmp_path), None)
    source.start(None)
    return source


def test_a_streamed_encoded_dataset_gives_the_map_style_items(sd: list[str], encoded: dict[str, Any],
                                                              tmp_path: Path) -> None:
    """Every streamed batch equals EncodedSource's items for the same (row, bucket, epoch) keys, tensor for tensor;
    each epoch reads its own variant and every row of a full batch once (no VAE, no text encoder, no model)."""
    import torch

    from hf_arb.train.encoded.reader import EncodedLatents, LazyColumn, open_encoded
    from hf_arb.train.sources.encoded_stream import EncodedStreamSource

    source = _stream_source(sd, encoded, tmp_path)
    assert type(source) is EncodedStreamSource
    data = open_encoded(str(encoded["root"]))
    latents = EncodedLatents(data, LazyColumn(data.rows, data.info["caption_column"]), seed=0)
    plan_rows = np.asarray(data.rows.with_format("numpy")["bucket"])
    for epoch in (0, 1):
        source.sampler.set_epoch(epoch)  # what the loop does through accelerate's prepared loader
        batches = list(source.dataloader)
        assert len(batches) == source.sampler.steps_per_epoch > 0
        rows = [int(r) for b in batches for r in b["rows"]]
        assert len(set(rows)) == len(rows)  # each row once an epoch (this stream has no repeats)
        for batch in batches:
            keys = [(int(r), int(b), epoch) for r, b in zip(batch["rows"], batch["buckets"])]
            assert all(plan_rows[r] == b for r, b, _ in keys)  # every row at its own bucket
            want = EncodedLatents.collate([latents[k] for k in keys])
            assert set(batch) == set(want)
            for name, value in want.items():
                got = batch[name]
                assert (torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value), name


@pytest.mark.slow
def test_streamed_encoded_training_resumes_mid_epoch_as_the_uninterrupted_run(sd: list[str], encoded: dict[str, Any],
                                                                               tmp_path: Path) -> None:
    """4 steps streamed from the encoded dataset (3 per epoch: a checkpoint at step 2 is mid-epoch), then the same
    command resumed from checkpoint-2: the same rows and the same loss at every step after it; no VAE call."""
    flags = [*sd, "--encoded_dataset", str(encoded["root"]), *STREAMED, "--checkpointing_steps", "2"]
    full = _train([*flags, "--output_dir", str(tmp_path / "full")])
    assert len(full["losses"]) == 4 and full["vae_encode_calls"] == 0
    trace = _trace(str(tmp_path / "full"))
    assert [t["epoch"] for t in trace] == [0, 0, 0, 1]
    assert (tmp_path / "full" / "checkpoint-2" / "stream_rank0.json").exists()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = _train([*flags, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", "latest"])
    assert resumed["losses"] == full["losses"][2:]  # exactly
    again = _trace(str(tmp_path / "resumed"))
    assert [(t["step"], t["rows"], t["captions"]) for t in again] == [(t["step"], t["rows"], t["captions"])
                                                                      for t in trace[2:]]


def test_streamed_encoded_flags_and_a_resume_across_sources(sd: list[str], tmp_path: Path) -> None:
    """The image stream's habits: --stream_key_column is not needed (kept if given), --stream_counts is refused;
    a stream checkpoint resumes only from the same kind of source (its state positions that source's shards)."""
    from hf_arb.train.flags.resume_flags import flag_differences, shaping_flags

    enc = _args([*sd, "--encoded_dataset", "somewhere", *STREAMED], tmp_path)
    assert enc.stream_key_column is None
    assert _args([*sd, "--encoded_dataset", "x", *STREAMED, "--stream_key_column", "id"], tmp_path).streaming
    counts = tmp_path / "counts.json"
    counts.write_text("{}")
    with pytest.raises(UsageError, match="--stream_counts with --encoded_dataset x: the stream counts the encoded"):
        _args([*sd, "--encoded_dataset", "x", *STREAMED, "--stream_counts", str(counts)], tmp_path)
    whole = [f for i, f in enumerate(sd) if "--max_train_samples" not in (f, sd[i - 1])]  # refused by image streams
    images = _args([*whole, "--streaming", "--stream_key_column", "id"], tmp_path)
    lines = flag_differences(shaping_flags(images), shaping_flags(enc))
    assert lines == ["it was saved with no --encoded_dataset, this run has --encoded_dataset: drop --encoded_dataset"]
    plain = _args([*sd, "--encoded_dataset", "somewhere"], tmp_path)  # map-style: cached latents and images mix
    assert flag_differences(shaping_flags(_args(sd, tmp_path)), shaping_flags(plain)) == []
