"""``--encoded_dataset``: train from an encoded dataset (:mod:`hf_arb.train.encoded`): the sampler runs unchanged on
its ``rows`` table (the source rows' bucket columns), batches read the stored posteriors, and the loss's prompt
embeddings come from its ``prompts`` table instead of the text encoders."""

from __future__ import annotations

from typing import Any

import numpy as np

from hf_arb.checks import UsageError

from ..schedule import Schedule
from .bucketed import BucketedSource
from .dataset import check_plan, check_upscale


class EncodedSource(BucketedSource):
    """A map-style run over an encoded dataset: the same plan as on the source dataset (its bucket columns are
    stored), the same items as ``--cache_latents`` and the same prompt embeddings as ``--cache_text_embeddings``.

    Its fingerprint is checked against the run's flags and model before any model loads (the VAE's weights read
    from its files; the variant count and the entries the plan needs once the sampler exists): a mismatch is one line
    naming the field and both values. The run loads no VAE and no text encoder (:meth:`frozen_parts`)."""

    data: Any = None

    def load(self, accelerator: Any) -> None:
        from hf_arb.train.encoded.reader import open_encoded

        a = self.args
        self.data = open_encoded(a.encoded_dataset, getattr(a, "cache_dir", None))
        self.ds, self.buckets = self.data.rows, checked_buckets(a, self.data)
        check_plan(a, self.ds, 1 if accelerator is None else accelerator.num_processes)
        check_upscale(a, self.ds, self.buckets)

    def start(self, accelerator: Any) -> None:
        from hf_arb.train.cache.caches import planned_pairs, planned_variants
        from hf_arb.train.encoded.fingerprint import check_fingerprint
        from hf_arb.train.encoded.reader import EncodedLatents, LazyColumn

        super().start(accelerator)
        a = self.args
        schedule = self.schedule(accelerator.num_processes)
        variants = planned_variants(a, schedule)
        check_fingerprint(self.data.fingerprint, {"variants": variants}, a.encoded_dataset)
        self.latents = EncodedLatents(self.data, LazyColumn(self.ds, self.data.info["caption_column"]), seed=a.seed)
        ids = np.asarray(self.ds.with_format("numpy")["bucket"])
        pairs = np.array(sorted(planned_pairs(a, ids, self.sampler, schedule)), np.int64).reshape(-1, 2)
        want = np.concatenate([np.column_stack([pairs, np.full(len(pairs), v)]) for v in range(variants)])
        missing = want[self.latents.positions(want[:, 0], want[:, 1], want[:, 2]) < 0]
        if len(missing):
            rows = np.unique(missing[:, 0])
            raise UsageError(f"--encoded_dataset {a.encoded_dataset} covers only part of this run: {len(missing):,} of "
                             f"{len(want):,} (row, bucket, variant) entries are missing ({len(rows):,} rows, e.g. row "
                             f"{int(rows[0])}; NaN latents left out at encode: "
                             f"{len(self.data.info.get('bad_entries', []))}). Encode them: hf-arb encode OUT -- <this "
                             f"run's flags> (with --num_processes {accelerator.num_processes} for "
                             f"--bucket_leftover {a.bucket_leftover}).")

    def loader(self, accelerator: Any, models: Any, schedule: Schedule, weight_dtype: Any) -> Any:
        import torch

        from hf_arb.sampling.accelerate import fill_deepspeed_micro_batch
        from hf_arb.train.signals import ignore_stop_signals_in_worker

        check_vae_weights(self.args, self.data, models)
        loader = torch.utils.data.DataLoader(self.latents, batch_sampler=self.sampler,
                                             collate_fn=self.latents.collate,
                                             num_workers=self.args.dataloader_num_workers,
                                             worker_init_fn=ignore_stop_signals_in_worker)
        fill_deepspeed_micro_batch(accelerator, self.sampler)
        return loader

    def frozen_parts(self) -> frozenset[str]:
        """None: the dataset holds the latents and the prompt embeddings (the VAE only where its weights hash could
        not be read from its files, to fingerprint the loaded module)."""
        return frozenset() if self.data.info.get("vae_files") else frozenset({"vae"})

    def text_encoder(self, models: Any, device: Any, dtype: Any) -> Any:
        from hf_arb.train.encoded.reader import EncodedPrompts

        return EncodedPrompts(self.data.prompts, device, dtype)


def check_vae_files(info: dict[str, Any], args: Any) -> None:
    """Refuse (one line) a run whose VAE's weights files hash otherwise than the encoded dataset's ``vae_files``
    (:mod:`hf_arb.train.encoded.weights`); a dataset without it is checked on the loaded VAE instead."""
    from hf_arb.train.encoded.fingerprint import check_fingerprint
    from hf_arb.train.encoded.weights import run_vae_files_hash

    if info.get("vae_files"):
        check_fingerprint({"vae_files": info["vae_files"]}, {"vae_files": run_vae_files_hash(args)},
                          args.encoded_dataset)


def checked_buckets(args: Any, data: Any) -> Any:
    """The encoded dataset's bucket table, its fingerprint checked against the run's flags and model before any
    model loads (the VAE's weights from its files, :func:`check_vae_files`; the variant count is checked once the
    schedule is known)."""
    from hf_arb.buckets.sets import BucketSet
    from hf_arb.train.encoded.fingerprint import check_fingerprint, run_fingerprint

    from .dataset import bucket_table_from_args

    stored = BucketSet.from_dataset(data.rows)
    asked = bucket_table_from_args(args)[0] if args.bucket_flags_given else stored
    fp = {k: v for k, v in data.fingerprint.items() if k not in ("variants", "num_source_rows")}
    check_fingerprint(fp, run_fingerprint(args, asked), args.encoded_dataset)
    check_vae_files(data.info, args)  # the VAE's weights, from its files: no VAE loads
    return stored


def check_vae_weights(args: Any, data: Any, models: Any) -> None:
    """A dataset without ``vae_files`` (weights not in safetensors): the loaded VAE's weights must be those the
    dataset was encoded with (one line otherwise)."""
    from hf_arb.train.cache.cache_keys import vae_fingerprint
    from hf_arb.train.encoded.fingerprint import check_fingerprint

    if not data.info.get("vae_files"):
        check_fingerprint({"vae_weights": data.info["vae_weights"]}, {"vae_weights": vae_fingerprint(models.vae)},
                          args.encoded_dataset)


__all__ = ["EncodedSource", "check_vae_files", "check_vae_weights", "checked_buckets"]
