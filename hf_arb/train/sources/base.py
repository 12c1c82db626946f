"""What the training loop asks of its data: :class:`Source`, one subclass per mode (map-style, stream, packed,
tiered, with references). The loop asks every source the same questions and never which mode it is."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

from ..schedule import Schedule, compute_schedule, image_loss_weights, pack_schedule


class Source:
    """A run's data, built once by :func:`hf_arb.train.sources.build_source`; subclasses answer for their mode.

    Attributes (after construction):
        args: the run's arguments.
        buckets: the bucket table the run trains (a ``BucketSet``, or a ``TierTable`` over several tiers): the loss
            per bucket, the family's bucket checks, the validation shapes, ``hf_arb_buckets.json`` and the card.
        sampler: after :meth:`start`, what plans the batches (a batch sampler, or the stream): its report and state.
    """

    #: epochs of their own length (packs, tiers' draws): the schedule and checkpoints count each epoch's steps
    varied_epochs = False
    #: a resume must repeat --train_batch_size x processes (False: the packs / the stream decide the batches)
    fixed_batches = True
    sampler: Any = None
    buckets: Any = None
    family_report: str | None = None  # after :meth:`check_model`: the family's start-up lines
    cache_index: Any = None  # --cache_latents: the latent cache's index (its counts go to the run statistics)

    def __init__(self, args: argparse.Namespace, accelerator: Any) -> None:
        self.args = args
        self.load(accelerator)

    @classmethod
    def accelerator_kwargs(cls) -> dict[str, Any]:
        """Extra ``Accelerator(...)`` arguments this mode needs (asked before the source is built)."""
        return {}

    @classmethod
    def checkpoint_files(cls, required: tuple[str, ...]) -> tuple[str, ...]:
        """The files a complete checkpoint of this mode holds, from accelerate's ``required`` ones."""
        return required

    # ------------------------------------------------------------------ before the models: the data and the plan
    def load(self, accelerator: Any) -> None:
        """Load the data and check what can be checked before any model loads (``accelerator`` None: one process,
        before torch and accelerate)."""
        raise NotImplementedError

    def start(self, accelerator: Any) -> None:
        """Build :attr:`sampler`, the global plan (accelerate deals it to the ranks) or this rank's stream."""
        raise NotImplementedError

    def steps_in(self, epoch: int) -> int:
        """Micro-batches of one rank in ``epoch``."""
        return int(self.sampler.steps_in(epoch) if self.varied_epochs else self.sampler.steps_per_epoch)

    def locate(self, micro_step: int) -> tuple[int, int]:
        """``(epoch, micro-batches into it)`` of a rank's ``micro_step`` (batches trained since the start)."""
        return self.sampler.locate(micro_step)

    def epoch_start(self, epoch: int) -> int:
        """Micro-batches of a rank before ``epoch``."""
        return sum(self.steps_in(e) for e in range(epoch))

    def schedule(self, num_processes: int) -> Schedule:
        """diffusers' step arithmetic (:func:`~hf_arb.train.schedule.compute_schedule`); epochs of their own length
        are counted one by one (:func:`~hf_arb.train.schedule.pack_schedule`)."""
        a = self.args
        schedule = compute_schedule(self.sampler.steps_per_epoch,
                                    gradient_accumulation_steps=a.gradient_accumulation_steps,
                                    num_train_epochs=a.num_train_epochs, max_train_steps=a.max_train_steps,
                                    lr_warmup_steps=a.lr_warmup_steps, num_processes=num_processes)
        return pack_schedule(a, self, num_processes) if self.varied_epochs else schedule

    # ------------------------------------------------------------------ with the models: the loader
    def frozen_parts(self) -> frozenset[str]:
        """The frozen model parts (of :data:`hf_arb.families.base.FROZEN_PARTS`) the run's batches need: the VAE
        encodes pixels, the text encoders captions. What the data already holds is left unloaded (validation and the
        saved pipeline load it when they run: :meth:`hf_arb.families.Family.complete_models`)."""
        from hf_arb.families.base import FROZEN_PARTS

        return FROZEN_PARTS

    def check_model(self, models: Any) -> str | None:
        """The bucket sizes the denoiser can take (refused in flags otherwise) and the family's start-up lines
        (flow models: each bucket's shift), which the model card repeats."""
        models.family.check_buckets(models, self.buckets)
        self.family_report = models.family.startup_lines(models, self.buckets)
        return self.family_report

    def model(self, models: Any) -> Any:
        """What ``accelerator.prepare`` wraps: the denoiser (packed sources: a module whose forward is the loss)."""
        return models.unet

    def loader(self, accelerator: Any, models: Any, schedule: Schedule, weight_dtype: Any) -> Any:
        """The DataLoader to hand ``accelerator.prepare`` (``--cache_latents``: the cache is filled first)."""
        raise NotImplementedError

    def register(self, accelerator: Any) -> None:
        """After ``accelerator.prepare``: what accelerate saves and restores with its checkpoints."""

    def report(self, accelerator: Any, schedule: Schedule, models: Any) -> None:
        """The start-up table users look at first (printed on the main process)."""
        raise NotImplementedError

    def text_encoder(self, models: Any, device: Any, dtype: Any) -> Any:
        """Captions → ``(hidden, pooled)`` for the loss: the family's encoders (memoised per caption with
        --cache_text_embeddings); an encoded dataset reads its stored embeddings."""
        from ..cache.caches import TextEncoder

        return TextEncoder(models, device, dtype, cache=self.args.cache_text_embeddings)

    # ------------------------------------------------------------------ the loop
    def restore(self, accelerator: Any, resume_dir: Path | None, progress: Any) -> None:
        """After ``accelerator.load_state``: restore what accelerate does not (a stream's per-rank state)."""

    def resume(self, accelerator: Any, dataloader: Any, micro_step: int) -> tuple[Any, int]:
        """``(loader of the first epoch, first epoch)``: a resumed run continues mid-epoch, with the same batches."""
        from hf_arb import resume_dataloader

        return resume_dataloader(accelerator, dataloader, micro_step)

    def epoch_begins(self, accelerator: Any, epoch: int) -> None:
        """Said at the start of every epoch (packs: the epoch's padding; a stream: its buffer)."""

    def epoch_ends(self, accelerator: Any, epoch: int) -> None:
        """Said at the end of every epoch."""

    def batch_bucket(self, batch: dict[str, Any]) -> int:
        """The batch's bucket id in :attr:`buckets` (-1: a pack, no one bucket)."""
        return int(batch["buckets"][0])

    def kind_losses(self, bucket_losses: dict[int, list[float]]) -> dict[str, float]:
        """Extra loss keys of an update from its ``{bucket: [loss of each rank's micro-batch]}`` (none by default;
        clips: the loss per kind, stills and clips)."""
        return {}

    def caption_augmenter(self, schedule: Schedule) -> Any:
        """``augment(batch, epoch)``: the run's caption flags (``--shuffle_caption``, ...) on each batch's captions,
        a pure function of (seed, epoch, row) (:mod:`hf_arb.train.captions`)."""
        from hf_arb.train.flags.caption_flags import caption_augmenter

        return caption_augmenter(self.args, schedule.num_train_epochs)

    def loss_weights(self) -> Callable[[int], float]:
        """``weight(micro_step)``: the factor on a micro-batch's loss (1 but with a pixel budget per batch)."""
        return image_loss_weights(self.args, self.sampler)

    def rank_files(self, accelerator: Any, micro_step: int, epoch: int) -> dict[str, Any]:
        """``{file name: JSON state}`` this rank writes into a checkpoint beside accelerate's (none by default)."""
        return {}

    def bucket_rows(self) -> Any:
        """Rows per bucket id of :attr:`buckets` (an int array; ids past its end have none), for the validation
        shapes (:func:`hf_arb.train.outputs.validation_shapes`); None where the mode does not count them."""
        return None

    def stats(self, micro_step: int) -> dict[str, Any]:
        """What the run statistics (``hf_arb_run.json``) report about the data: the latent cache's counts."""
        index = self.cache_index
        return {"latents_encoded": index.encoded if index else None, "latents_reused": index.reused if index else None,
                "latents_repaired": index.repaired if index else None}


__all__ = ["Source"]
