"""The data sources (hf_arb.train.sources, issue #33): one class per mode, chosen once from the flags, and every one
answers the loop's questions the same way (the same tests run on each, like torchdata's ``Stateful`` protocol)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _train_fixtures import SD_BASE, stream_argv  # noqa: E402

from hf_arb.train.flags import args as train_args  # noqa: E402
from hf_arb.train.flags.dataset_config import DatasetSpec  # noqa: E402
from hf_arb.train.sources import build_source, source_class  # noqa: E402
from hf_arb.train.sources.base import Source  # noqa: E402
from hf_arb.train.sources.bucketed import BucketedSource, ReferenceSource, TieredSource  # noqa: E402
from hf_arb.train.sources.encoded import EncodedSource  # noqa: E402
from hf_arb.train.sources.encoded_stream import EncodedStreamSource  # noqa: E402
from hf_arb.train.sources.multi import MultiPriorSource, MultiSource  # noqa: E402
from hf_arb.train.sources.packed import PackedSource, TieredPackedSource  # noqa: E402
from hf_arb.train.sources.prior import PriorSource  # noqa: E402
from hf_arb.train.sources.streamed import StreamSource, TieredStreamSource  # noqa: E402

#: (mode flags, the source they get): every combination the argument checks allow
MODES = [
    (dict(), BucketedSource),
    (dict(reference_image_column=["before"]), ReferenceSource),
    (dict(with_prior_preservation=True), PriorSource),
    (dict(resolutions=[32, 64]), TieredSource),
    (dict(packing=True), PackedSource),
    (dict(packing=True, resolutions=[32, 64]), TieredPackedSource),
    (dict(streaming=True), StreamSource),
    (dict(streaming=True, resolutions=[32, 64]), TieredStreamSource),
    (dict(dataset_config="datasets.toml"), MultiSource),
    (dict(dataset_config="kohya.toml", dataset_specs=[DatasetSpec("a"), DatasetSpec("reg", regularization=True)]),
     MultiPriorSource),
    (dict(encoded_dataset="encoded"), EncodedSource),
    (dict(encoded_dataset="encoded", streaming=True), EncodedStreamSource),
]
#: what every concrete source must answer itself (the base class has no answer)
OWN_ANSWERS = ("load", "start", "loader", "report")


@pytest.mark.parametrize("flags, cls", MODES, ids=[c.__name__ for _, c in MODES])
def test_every_mode_gets_its_own_source(flags, cls):
    args = SimpleNamespace(**{"streaming": False, "packing": False, "resolutions": [64], "reference_image_column": None,
                              **flags})
    assert source_class(args) is cls and issubclass(cls, Source)
    missing = [q for q in OWN_ANSWERS if getattr(cls, q) is getattr(Source, q)]
    assert not missing, f"{cls.__name__} does not answer {missing}"


def test_only_a_stream_changes_the_checkpoint_and_the_accelerator():
    """accelerate's sampler state is replaced by the stream's per-rank file; a stream has every rank read its split."""
    required = ("model.safetensors", "custom_checkpoint_0.pkl")
    for _, cls in MODES:
        streamed = issubclass(cls, StreamSource)
        assert cls.checkpoint_files(required) == (("model.safetensors", "stream_rank0.json") if streamed else required)
        assert bool(cls.accelerator_kwargs()) == streamed
        assert cls.fixed_batches == (not streamed and not issubclass(cls, PackedSource))


ONE = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True, is_local_main_process=True)


def _map_args(train_assets, tmp_path, *extra):
    return train_args.parse_args(["--pretrained_model_name_or_path", train_assets["sd"], "--train_data_dir",
                                  train_assets["images"], "--output_dir", str(tmp_path), *SD_BASE, "--full_finetune",
                                  "--num_train_epochs", "3", *extra])


def _check_epochs(source, epochs=3):
    """The questions every source answers alike: where each epoch starts, where a micro step is, the schedule."""
    assert source.epoch_start(0) == 0
    for e in range(epochs):
        n = source.steps_in(e)
        assert n >= 1 and source.epoch_start(e + 1) == source.epoch_start(e) + n
        for k in (0, n - 1):
            assert source.locate(source.epoch_start(e) + k) == (e, k)
    a = source.args.gradient_accumulation_steps
    schedule = source.schedule(1)
    assert schedule.max_train_steps == sum(math.ceil(source.steps_in(e) / a) for e in range(epochs))
    assert source.loss_weights()(0) == 1.0


@pytest.mark.parametrize("extra, cls", [((), BucketedSource), (("--resolution", "32,64"), TieredSource)],
                         ids=["bucketed", "tiered"])
def test_map_style_sources_answer_alike(extra, cls, train_assets, tmp_path):
    args = _map_args(train_assets, tmp_path, *extra)
    source = build_source(args, None)  # one process: before accelerate (and its checks of the plan pass)
    assert type(source) is cls and source.sampler is None
    source.start(ONE)
    _check_epochs(source)
    assert source.rank_files(ONE, 3, 0) == {}  # accelerate checkpoints the sampler itself
    assert source.batch_bucket({"buckets": [4, 4]}) == 4
    assert set(source.stats(3)) == {"latents_encoded", "latents_reused", "latents_repaired"}


def test_a_stream_source_answers_alike_and_writes_its_rank_file(stream_assets, tmp_path):
    args = train_args.parse_args(stream_argv(stream_assets, "--output_dir", str(tmp_path), "--num_train_epochs", "3"))
    source = build_source(args, None)
    assert type(source) is StreamSource
    source.start(None)
    _check_epochs(source)
    files = source.rank_files(ONE, 0, 0)  # nothing read yet: the state at the start of epoch 0
    assert list(files) == ["stream_rank0.json"] and (files["stream_rank0.json"]["epoch"],
                                                     files["stream_rank0.json"]["step"]) == (0, 0)
    assert "stream_report" in source.stats(0)
