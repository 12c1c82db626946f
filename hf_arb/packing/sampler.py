"""``PackBatchSampler``: NaViT packs (:mod:`hf_arb.packing`) behind ``DataLoader(batch_sampler=...)`` and a plain
``accelerator.prepare``.

Every row gets its own training size (:func:`~hf_arb.packing.layout.fit_sizes` of its annotated size at
``max_tokens``); each epoch is planned by :func:`~hf_arb.packing.plan_packs` (a pure function of seed, epoch and
world size), and iterating the sampler yields the **global** plan step-major, rank-minor: at step ``s`` rank 0's
pack, rank 1's pack, …, like :class:`~hf_arb.sampling.sampler.BucketBatchSampler`. A pack is one batch: a list of
keys ``(row, width, height, epoch)`` (``width × height`` is the row's fitted size, the epoch fixes its crop), as
many as the pack holds.

**Variable-size batches and accelerate.** Packs hold different numbers of images. accelerate's
``BatchSamplerShard`` deals batch ``i`` to rank ``i % W`` and, when the batch sampler has a ``batch_size``, only
yields a round whose last batch has exactly that size; with ``batch_size = None`` it treats every batch as a list
of dynamic length and yields every complete round (its code and docstring: "If batch size is None, `batch` is
considered to be a list of indices with dynamic length"). This sampler therefore sets ``batch_size = None``: a
plain ``accelerator.prepare(DataLoader(ds, batch_sampler=sampler, collate_fn=...))`` hands every rank its planned
pack, ``skip_first_batches`` resumes it (:func:`~hf_arb.sampling.accelerate.resume_dataloader` works unchanged),
and ``len(prepared_loader)`` is the epoch's steps per rank (tested on 2 processes). Not supported:
``split_batches=True`` (needs a fixed ``batch_size``) and ``dispatch_batches=True`` (concatenates the ranks'
batches; accelerate only uses it by default for iterable datasets).

The number of packs, and so of steps, can differ a little from epoch to epoch (the packing depends on the
shuffle): :meth:`PackBatchSampler.steps_in` gives each epoch's, :meth:`~PackBatchSampler.locate` walks them.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from hf_arb.buckets.schema import read_original_sizes
from hf_arb.checks import check_nonneg, check_positive
from hf_arb.sampling.inputs import default_world, runtime_world
from hf_arb.sampling.resume.cursor import StepCursor, locate
from hf_arb.sampling.resume.state import ResumableBatchSampler, as_state_mapping

from .layout import FittedSizes, fit_sizes
from .plan import DEFAULT_WINDOW, PackLeftover, PackPlan, PackReport, plan_packs

__all__ = ["PACK_STATE_FORMAT", "PackBatchSampler", "pack_sizes"]

logger = logging.getLogger(__name__)

#: format of :meth:`PackBatchSampler.state_dict`; bump when the same inputs would give different packs
PACK_STATE_FORMAT = 1


def pack_sizes(source: Any, max_tokens: int, *, vae_scale_factor: int = 8, patch_size: int = 2,
               upscale: bool = False) -> FittedSizes:
    """Every row's own training size for packing: :func:`~hf_arb.packing.layout.fit_sizes` over all rows.

    Args:
        source: an annotated ``datasets.Dataset`` (its ``original_width``/``original_height`` columns; rows
            skipped at annotation, bucket ``-1``, get no size) or ``(widths, heights)`` arrays (``0`` = no size).
        max_tokens, vae_scale_factor, patch_size, upscale: as in :func:`~hf_arb.packing.layout.fit_sizes`.

    Returns:
        :class:`~hf_arb.packing.layout.FittedSizes` of shape ``(n,)``; rows without a size have all fields 0.
    """
    if hasattr(source, "column_names"):
        w, h = read_original_sizes(source)
    else:
        if not isinstance(source, (tuple, list)) or len(source) != 2:
            raise TypeError(f"`source` must be an annotated datasets.Dataset or a (widths, heights) pair, got "
                            f"{type(source).__name__}.")
        w, h = (np.asarray(a, dtype=np.int64).reshape(-1) for a in source)
        if w.shape != h.shape:
            raise ValueError(f"`widths` and `heights` must have the same shape, got {w.shape} and {h.shape}.")
    ok = (w > 0) & (h > 0)
    fit = fit_sizes(w[ok], h[ok], max_tokens, vae_scale_factor=vae_scale_factor, patch_size=patch_size,
                    upscale=upscale)

    def full(values: np.ndarray, dtype: Any) -> np.ndarray:
        out = np.zeros(w.size, dtype=dtype)
        out[ok] = values
        return out

    return FittedSizes(*(full(getattr(fit, f), np.float64 if f == "crop_fraction" else np.int64)
                         for f in ("resize_width", "resize_height", "width", "height", "tokens", "crop_fraction")))


class PackBatchSampler(ResumableBatchSampler):
    """Batch sampler of NaViT packs: every rank gets one pack of at most ``max_tokens`` latent tokens per step,
    every rank the same number of steps, every row once per epoch (or counted in :meth:`report`).

    Args:
        source: an annotated ``datasets.Dataset`` or ``(widths, heights)``, see :func:`pack_sizes`.
        max_tokens: latent tokens per pack (per rank per step); also each image's cap.
        num_replicas, rank: data-parallel world (defaults: ``torch.distributed``, else ``WORLD_SIZE``/``RANK``,
            else 1 and 0).
        seed: run seed (>= 0); with the epoch it fixes the packs and their order.
        shuffle: random row and pack order (``False``: rows in order, for evaluation).
        leftover: ``"drop"`` (default) the last packs that do not fill a step on every rank, or ``"fill"`` the
            step with copies of the epoch's first packs; see :func:`~hf_arb.packing.plan_packs`.
        window: rows packed together by first-fit-decreasing.
        vae_scale_factor, patch_size: the model's latent step (SD3 and Flux: 8 and 2).
        upscale: enlarge images with fewer tokens than ``max_tokens`` (default: never upscale).
        max_image_tokens: token cap per image (default ``max_tokens``: an image may fill a pack alone).
        return_keys: yield ``(row, width, height, epoch)`` keys (default) instead of row indices.
        log_report: log :meth:`report` when iteration first starts.

    Example:
        ```py
        >>> s = PackBatchSampler(([640, 1024, 512, 800], [480, 1024, 512, 600]), max_tokens=4096, num_replicas=1)
        >>> [[k[0] for k in pack] for pack in s]  # rows of each pack
        [[1], [0, 3, 2]]
        ```
    """

    def __init__(self, source: Any, max_tokens: int, *, num_replicas: int | None = None, rank: int | None = None,
                 seed: int = 0, shuffle: bool = True, leftover: PackLeftover = "drop", window: int = DEFAULT_WINDOW,
                 vae_scale_factor: int = 8, patch_size: int = 2, upscale: bool = False,
                 max_image_tokens: int | None = None, return_keys: bool = True, log_report: bool = True) -> None:
        w, r = default_world()
        self.num_replicas = check_positive("num_replicas", w if num_replicas is None else num_replicas)
        self.rank = check_nonneg("rank", (r if self.num_replicas == w else 0) if rank is None else rank)
        if self.rank >= self.num_replicas:
            raise ValueError(f"`rank` must be < num_replicas ({self.num_replicas}), got {self.rank}.")
        self.max_tokens = check_positive("max_tokens", max_tokens)
        self.max_image_tokens = self.max_tokens if max_image_tokens is None else check_positive(
            "max_image_tokens", max_image_tokens)
        if self.max_image_tokens > self.max_tokens:
            raise ValueError(f"`max_image_tokens` ({self.max_image_tokens}) must be <= `max_tokens` "
                             f"({self.max_tokens}): an image must fit a pack.")
        self.seed = check_nonneg("seed", seed)
        if leftover not in ("drop", "fill"):
            raise ValueError(f"`leftover` must be 'drop' or 'fill', got {leftover!r}.")
        self.shuffle, self.leftover, self.window = bool(shuffle), leftover, check_positive("window", window)
        self.vae_scale_factor = check_positive("vae_scale_factor", vae_scale_factor)
        self.patch_size = check_positive("patch_size", patch_size)
        self.upscale, self.return_keys, self.log_report = bool(upscale), bool(return_keys), bool(log_report)
        self.sizes = self._fit(source)
        #: ``None``: batches have variable length (accelerate's ``BatchSamplerShard`` then deals whole rounds)
        self.batch_size: int | None = None
        #: one pack per rank per step (what DeepSpeed's micro batch means here)
        self.per_rank_batch_size = 1
        self.split_batches = False
        self.drop_last = leftover == "drop"
        self._fingerprint = self._make_fingerprint()
        self._plans: dict[int, PackPlan] = {}
        self._steps_cache: dict[int, int] = {}
        # epoch, position, where passes start: the cursor every resumable sampler shares (sampling/resume/cursor.py)
        self.cursor = StepCursor(self, self.steps_in, state_name="Pack sampler")
        self._logged = False
        if self.steps_in(0) == 0:
            rep = self.report(0)
            n = rep.rows_total - rep.rows_skipped
            raise ValueError(f"The pack plan has zero steps: {n} packable rows make fewer packs of {self.max_tokens} "
                             f"tokens than num_replicas ({self.num_replicas}). Use a smaller `max_tokens`, fewer "
                             "processes, or more rows.")

    def _fit(self, source: Any) -> Any:
        """Every row's training size (a subclass with several size tables overrides this)."""
        return pack_sizes(source, self.max_image_tokens, vae_scale_factor=self.vae_scale_factor,
                          patch_size=self.patch_size, upscale=self.upscale)

    def _make_fingerprint(self) -> str:
        h = hashlib.sha256(np.ascontiguousarray(self.sizes.tokens, dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(np.stack([self.sizes.width, self.sizes.height]), dtype="<i8").tobytes())
        return h.hexdigest()[:16]

    # ---------------------------------------------------------------- plans
    def plan(self, epoch: int | None = None) -> PackPlan:
        """The :class:`~hf_arb.packing.PackPlan` of ``epoch`` (default: current), equal to ``plan_packs`` of
        ``self.sizes.tokens`` with this sampler's arguments."""
        e = self.epoch if epoch is None else check_nonneg("epoch", epoch)
        if e not in self._plans:
            if len(self._plans) >= 2:
                self._plans.pop(next(iter(self._plans)))
            self._plans[e] = plan_packs(self.sizes.tokens, self.max_tokens, self.num_replicas, seed=self.seed,
                                        epoch=e, window=self.window, shuffle=self.shuffle, leftover=self.leftover)
            self._steps_cache[e] = self._plans[e].num_steps
        return self._plans[e]

    def steps_in(self, epoch: int) -> int:
        """Steps per rank of ``epoch`` (packs differ a little from epoch to epoch)."""
        e = check_nonneg("epoch", epoch)
        if e not in self._steps_cache:
            self.plan(e)
        return self._steps_cache[e]

    @property
    def steps_per_epoch(self) -> int:
        """Steps per rank of the current epoch (``len(prepared_loader)``)."""
        return self.steps_in(self.epoch)

    def __len__(self) -> int:
        """Packs one pass yields: ``steps × num_replicas``."""
        return self.steps_per_epoch * self.num_replicas

    def total_steps(self, num_epochs: int) -> int:
        """Steps per rank in epochs ``0 … num_epochs - 1`` (plans each of them once)."""
        return sum(self.steps_in(e) for e in range(check_nonneg("num_epochs", num_epochs)))

    def locate(self, steps_done: int) -> tuple[int, int]:
        """``(epoch, step in that epoch)`` after ``steps_done`` steps per rank since epoch 0 (resume)."""
        return locate(steps_done, self.steps_in)

    # ---------------------------------------------------------------- iteration
    def keys(self, rows: np.ndarray, epoch: int) -> list:
        """The batch yielded for a pack's ``rows``: ``(row, width, height, epoch)`` keys or row indices."""
        if not self.return_keys:
            return rows.tolist()
        w, h = self.sizes.width[rows].tolist(), self.sizes.height[rows].tolist()
        return [(r, a, b, epoch) for r, a, b in zip(rows.tolist(), w, h)]

    def __iter__(self) -> Iterator[list]:
        """The rest of the epoch's global plan, step-major and rank-minor (see the module docstring)."""
        live = runtime_world()
        if live is not None and live[0] != self.num_replicas:
            raise RuntimeError(f"PackBatchSampler was built for num_replicas={self.num_replicas}, but "
                               f"torch.distributed runs {live[0]} processes. Build it after the Accelerator, or pass "
                               "num_replicas=accelerator.num_processes.")
        if self.log_report and not self._logged:
            self._logged = True
            logger.info("hf_arb PackBatchSampler: %s", self.report().text())
        skip = self.cursor.pass_skip(self.num_replicas)  # after a restore: where an accelerate pass starts
        e, first, start_id = self.cursor.begin()
        plan = self.plan(e)
        for s in range(first, plan.num_steps):
            self.cursor.handed_out(e, s, plan.num_steps, start_id)
            for r in range(skip, self.num_replicas):
                yield self.keys(plan.pack(s, r), e)
            skip = 0

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Small JSON-serialisable state: position (epoch, steps handed out) and the plan's inputs."""
        return {
            "format": PACK_STATE_FORMAT, "kind": "packs", "epoch": self.epoch,
            "batches_consumed": self.batches_consumed, "steps_per_epoch": self.steps_per_epoch, "seed": self.seed,
            "max_tokens": self.max_tokens, "num_replicas": self.num_replicas,
            "options": {"shuffle": self.shuffle, "leftover": self.leftover, "window": self.window,
                        "vae_scale_factor": self.vae_scale_factor, "patch_size": self.patch_size,
                        "upscale": self.upscale, "max_image_tokens": self.max_image_tokens},
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: Any) -> None:
        """Restore the position; rejects a state of another plan, naming the field, the values and the fix."""
        state = as_state_mapping(state)
        ours = self.state_dict()
        fixes = {
            "format": "Pass what `PackBatchSampler.state_dict()` returned (by this hf_arb version).",
            "kind": "This is not a pack sampler's state (a BucketBatchSampler's?): resume with the same sampler.",
            "fingerprint": "The image sizes differ from the checkpointed run: resume on the same annotated dataset "
                           "(same rows, same order) with the same `max_tokens`/`max_image_tokens`.",
            "seed": "Build the sampler with the checkpoint's seed.",
            "max_tokens": "Resume with the checkpoint's `max_tokens`.",
            "num_replicas": "Packs are dealt to ranks: resume with the same number of processes.",
        }
        for name, fix in fixes.items():
            if state.get(name) != ours[name]:
                raise ValueError(f"Pack sampler state field `{name}` does not match: saved {state.get(name)!r}, "
                                 f"this sampler has {ours[name]!r}. {fix}")
        saved = state.get("options")
        for name, value in ours["options"].items():
            got = saved.get(name) if isinstance(saved, dict) else None
            if got != value:
                raise ValueError(f"Pack sampler state field `options.{name}` does not match: saved {got!r}, this "
                                 f"sampler has {value!r}. Build the sampler with {name}={got!r}.")
        self.cursor.restore(check_nonneg("epoch", state.get("epoch")),
                            check_nonneg("batches_consumed", state.get("batches_consumed")))

    # ---------------------------------------------------------------- report
    def report(self, epoch: int | None = None) -> PackReport:
        """What ``epoch`` (default: current) trains and leaves out: padding fraction, rows skipped/left over."""
        return self.plan(epoch).report

    def mean_crop_fraction(self) -> float:
        """Mean share of the resized image's area cropped to the patch grid, over the packable rows."""
        ok = self.sizes.tokens > 0
        return float(self.sizes.crop_fraction[ok].mean()) if ok.any() else 0.0

    def __repr__(self) -> str:
        return (f"PackBatchSampler(rows={self.sizes.tokens.size}, max_tokens={self.max_tokens}, "
                f"num_replicas={self.num_replicas}, seed={self.seed}, epoch={self.epoch}, "
                f"batches_consumed={self.batches_consumed}, steps_per_epoch={self.steps_per_epoch}, "
                f"leftover={self.leftover!r})")
