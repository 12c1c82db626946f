"""Every named random stream of ``hf_arb`` in one place.

The library never reads or writes a global RNG (``random``, ``np.random.*``, ``torch.manual_seed``). Each random
decision draws from its own ``numpy.random.Generator(PCG64(SeedSequence(entropy)))``, where ``entropy`` starts
with the run's seed and the epoch and ends with a *tag* from this module. Two streams with different tags are
independent, so adding a new kind of randomness never changes the existing ones (a resumed run, another worker
or another rank reproduces every draw).

Streams of the epoch plan: ``(seed, epoch, PLAN_*, ...)``. Streams of one dataset row: ``(seed, epoch, row, ROW_*)``.
"""

from __future__ import annotations

import numpy as np

# --- epoch plan: entropy (seed, epoch, tag, *extra) ---------------------------------------------------------
PLAN_ORDER = 0  #: order of the global batches of an epoch
PLAN_BUCKET = 1  #: row order inside one bucket (extra: bucket, [block])
PLAN_POOL = 2  #: order of the catch-all pool (extra: [rank] for independent plans)
PLAN_SHARD = 3  #: sharding of rows to ranks (independent per-rank plans)
PLAN_RANK = 4  #: batch order of one rank (independent per-rank plans; extra: rank)
PLAN_PACK = 5  #: row order before packing (hf_arb.packing)
PLAN_PACK_ORDER = 6  #: order of the packs of an epoch (hf_arb.packing)
STREAM_ORDER = 20  #: bucket schedule of a streaming epoch (hf_arb.sampling.streaming.stream)
STREAM_PICK = 21  #: rows picked from a rank's buffer (extra: rank, block of 1024 steps)

# --- one dataset row: entropy (seed, epoch, row, tag) -------------------------------------------------------
ROW_CROP = 0  #: random crop offset when fitting the image to its bucket
ROW_FLIP = 1  #: horizontal flip
ROW_CAPTION = 2  #: choice among several captions of a row
ROW_REPLACE = 3  #: which row replaces one whose image cannot be decoded (``on_bad_image="replace"``)
ROW_FRAMES = 4  #: the first frame of a clip's window when the clip is longer than its bucket (hf_arb.video.frames)
ROW_CAPTION_DROPOUT = 10  #: whether the whole caption trains as "" (``--caption_dropout_rate``, hf_arb.train.captions)
ROW_TAG_ORDER = 11  #: the order of a caption's tags (``--shuffle_caption``; epoch: the tag variant's)
ROW_TAG_DROPOUT = 12  #: which tags are left out (``--caption_tag_dropout_rate``; epoch: the tag variant's)


def generator(*entropy: int) -> np.random.Generator:
    """A private generator for one stream; never the global numpy RNG.

    Args:
        *entropy: non-negative integers, e.g. ``(seed, epoch, PLAN_ORDER)``.

    Returns:
        ``np.random.Generator(PCG64(SeedSequence(entropy)))``.
    """
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(e) for e in entropy])))


def row_rng(seed: int, epoch: int, row: int, stream: int = ROW_CROP) -> np.random.Generator:
    """The generator of one row's randomness in one epoch: ``generator(seed, epoch, row, stream)``.

    Args:
        seed: the run's seed (>= 0).
        epoch: the epoch (>= 0).
        row: the dataset row (>= 0).
        stream: one of the ``ROW_*`` tags of this module.

    Raises:
        ValueError: a negative argument (``SeedSequence`` needs non-negative entropy).
    """
    for name, v in (("seed", seed), ("epoch", epoch), ("row", row), ("stream", stream)):
        if int(v) < 0:
            raise ValueError(f"`{name}` must be a non-negative integer for the per-row RNG, got {v!r}.")
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), int(row), int(stream)]))
